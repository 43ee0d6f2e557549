#include "server/kvstore_service.h"

#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "rpc/convert.h"
#include "rpc/request_size.h"
#include "rpc/security.h"

namespace kvsparse::server {
namespace {

// The request size the call declares (rpc::kRequestBytesHeader), or none.
absl::StatusOr<std::optional<size_t>> DeclaredBytes(const grpc::ServerContext& ctx) {
  const auto& md = ctx.client_metadata();
  auto it = md.find(rpc::kRequestBytesHeader);
  if (it == md.end()) return std::nullopt;
  size_t n = 0;
  if (!absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()), &n)) {
    return absl::InvalidArgumentError(
        absl::StrCat(rpc::kRequestBytesHeader, " must be the request's size in bytes"));
  }
  return n;
}

}  // namespace

KvStoreService::KvStoreService(kvstore::Store* store, const RpcRunner* rpc, Metrics* metrics,
                               RequestBudget* appends, size_t max_message_bytes)
    : store_(store),
      rpc_(rpc),
      appends_(appends),
      max_message_bytes_(max_message_bytes),
      create_(metrics->Rpc("CreateSequence")),
      fork_(metrics->Rpc("ForkSequence")),
      drop_(metrics->Rpc("DropSequence")),
      append_(metrics->Rpc("Append")),
      gather_(metrics->Rpc("Gather")),
      info_(metrics->Rpc("GetSequenceInfo")),
      page_table_(metrics->Rpc("GetPageTable")),
      data_plane_rpc_(metrics->Rpc("GetDataPlane")),
      list_(metrics->Rpc("ListSequences")),
      stats_(metrics->Rpc("GetStats")) {}

grpc::Status KvStoreService::CreateSequence(grpc::ServerContext* ctx,
                                            const v1::CreateSequenceRequest* req,
                                            v1::SequenceInfo* resp) {
  return rpc_->Run(create_, ctx, [&](absl::Time, const rpc::Caller& caller) -> absl::Status {
    absl::StatusOr<kvstore::ModelShape> shape = rpc::FromProto(req->shape());
    if (!shape.ok()) return shape.status();
    absl::StatusOr<kvstore::Placement> placement = rpc::FromProto(req->placement());
    if (!placement.ok()) return placement.status();
    absl::StatusOr<kvstore::SequenceInfo> info = store_->CreateSequence(
        rpc::ScopedId(caller.tenant, req->sequence_id()), *shape, *placement);
    if (!info.ok()) return info.status();
    rpc::ToProto(*info, resp);
    resp->set_sequence_id(req->sequence_id());
    return absl::OkStatus();
  });
}

grpc::Status KvStoreService::ForkSequence(grpc::ServerContext* ctx,
                                          const v1::ForkSequenceRequest* req,
                                          v1::SequenceInfo* resp) {
  return rpc_->Run(fork_, ctx, [&](absl::Time, const rpc::Caller& caller) -> absl::Status {
    std::optional<kvstore::Placement> placement;
    if (req->has_placement()) {
      absl::StatusOr<kvstore::Placement> p = rpc::FromProto(req->placement());
      if (!p.ok()) return p.status();
      placement = *p;
    }
    // Both ids in the caller's scope: a tenant forks its own sequences only.
    absl::StatusOr<kvstore::SequenceInfo> info = store_->ForkSequence(
        rpc::ScopedId(caller.tenant, req->source_id()),
        rpc::ScopedId(caller.tenant, req->sequence_id()), req->num_tokens(), placement);
    if (!info.ok()) return info.status();
    rpc::ToProto(*info, resp);
    resp->set_sequence_id(req->sequence_id());
    return absl::OkStatus();
  });
}

grpc::Status KvStoreService::DropSequence(grpc::ServerContext* ctx,
                                          const v1::DropSequenceRequest* req,
                                          v1::DropSequenceResponse* resp) {
  return rpc_->Run(drop_, ctx, [&](absl::Time, const rpc::Caller& caller) -> absl::Status {
    const std::string id = rpc::ScopedId(caller.tenant, req->sequence_id());
    absl::StatusOr<uint64_t> freed = store_->DropSequence(id);
    if (!freed.ok()) return freed.status();
    if (on_drop_) on_drop_(id);
    resp->set_bytes_freed(*freed);
    return absl::OkStatus();
  });
}

grpc::Status KvStoreService::StreamedAppend(
    grpc::ServerContext* ctx,
    grpc::ServerUnaryStreamer<v1::AppendRequest, v1::AppendResponse>* stream) {
  return rpc_->Run(
      append_, ctx, [&](absl::Time deadline, const rpc::Caller& caller) -> absl::Status {
        // The body's share of the request budget, taken before gRPC reads it.
        absl::StatusOr<std::optional<size_t>> declared = DeclaredBytes(*ctx);
        if (!declared.ok()) return declared.status();
        if (declared->value_or(0) > max_message_bytes_) {
          return absl::ResourceExhaustedError(
              absl::StrCat("an append of ", **declared, " bytes is over --max_message_size (",
                           max_message_bytes_, "): send it in smaller appends"));
        }
        absl::StatusOr<RequestBudget::Share> share = appends_->Take(
            declared->value_or(max_message_bytes_), deadline, [ctx] { return ctx->IsCancelled(); });
        if (!share.ok()) {
          if (absl::IsResourceExhausted(share.status())) {
            append_->RecordRefusal("max_append_bytes_in_flight");
          }
          return share.status();
        }
        v1::AppendRequest req;
        if (!stream->Read(&req)) return absl::CancelledError("the append's message did not arrive");
        // The server's default deadline runs from here, as for calls whose body gRPC reads
        // before their handler (the caller's own deadline still bounds the whole call).
        deadline = rpc_->Deadline(*ctx, absl::Now());
        if (declared->has_value() && req.ByteSizeLong() > **declared) {
          return absl::InvalidArgumentError(absl::StrCat("the append declared ", **declared,
                                                         " bytes (", rpc::kRequestBytesHeader,
                                                         ") and sent ", req.ByteSizeLong()));
        }
        absl::StatusOr<kvstore::AppendRequest> r = rpc::FromProto(req);
        if (!r.ok()) return r.status();
        const std::string id = rpc::ScopedId(caller.tenant, r->sequence_id);  // r holds a view
        r->sequence_id = id;
        r->deadline = deadline;
        absl::StatusOr<kvstore::AppendResult> res = store_->Append(*r);
        if (!res.ok()) return res.status();
        v1::AppendResponse resp;
        resp.set_first_token(res->first_token);
        resp.set_num_tokens(res->num_tokens);
        resp.set_bytes_appended(res->bytes_appended);
        if (!stream->Write(resp)) {  // the rows are appended: a retry is told so (stale retry)
          return absl::CancelledError("the caller left before the append's answer");
        }
        return absl::OkStatus();
      });
}

grpc::Status KvStoreService::Gather(grpc::ServerContext* ctx, const v1::GatherRequest* req,
                                    v1::GatherResponse* resp) {
  return rpc_->Run(
      gather_, ctx, [&](absl::Time deadline, const rpc::Caller& caller) -> absl::Status {
        absl::StatusOr<rpc::GatherArgs> args = rpc::FromProto(*req);
        if (!args.ok()) return args.status();
        const std::string id = rpc::ScopedId(caller.tenant, args->request.sequence_id);  // a view
        args->request.sequence_id = id;
        args->request.deadline = deadline;
        const bool want_k = args->request.kind != kvstore::RowKind::kV;
        const bool want_v = args->request.kind != kvstore::RowKind::kK;
        // Rows are copied straight into the response's byte fields.
        auto alloc = [&](uint64_t rows,
                         size_t row_bytes) -> absl::StatusOr<kvstore::GatherBuffers> {
          kvstore::GatherBuffers b;
          if (want_k) {
            std::string* k = resp->mutable_k()->mutable_data();
            k->resize(rows * row_bytes);
            b.k = reinterpret_cast<uint8_t*>(k->data());
          }
          if (want_v) {
            std::string* v = resp->mutable_v()->mutable_data();
            v->resize(rows * row_bytes);
            b.v = reinterpret_cast<uint8_t*>(v->data());
          }
          return b;
        };
        absl::StatusOr<kvstore::GatherResult> res = store_->Gather(args->request, alloc);
        if (!res.ok()) return res.status();
        for (v1::Tensor* t :
             {want_k ? resp->mutable_k() : nullptr, want_v ? resp->mutable_v() : nullptr}) {
          if (t == nullptr) continue;
          t->set_dtype(rpc::ToProto(res->dtype));
          t->add_shape(static_cast<int64_t>(res->rows));
          t->add_shape(res->head_dim);
        }
        for (kvstore::HeadRows& h : res->heads) {
          v1::HeadRows* out = resp->add_heads();
          out->set_kv_head(h.kv_head);
          out->set_row_offset(h.row_offset);
          out->set_row_count(h.row_count);
          out->mutable_token_indices()->Add(h.token_indices.begin(), h.token_indices.end());
          out->mutable_counts()->Add(h.counts.begin(), h.counts.end());
        }
        resp->set_layer_length(res->layer_length);
        return absl::OkStatus();
      });
}

grpc::Status KvStoreService::GetSequenceInfo(grpc::ServerContext* ctx,
                                             const v1::GetSequenceInfoRequest* req,
                                             v1::SequenceInfo* resp) {
  return rpc_->Run(info_, ctx, [&](absl::Time, const rpc::Caller& caller) -> absl::Status {
    absl::StatusOr<kvstore::SequenceInfo> info =
        store_->GetSequenceInfo(rpc::ScopedId(caller.tenant, req->sequence_id()));
    if (!info.ok()) return info.status();
    rpc::ToProto(*info, resp);
    resp->set_sequence_id(req->sequence_id());
    return absl::OkStatus();
  });
}

grpc::Status KvStoreService::GetPageTable(grpc::ServerContext* ctx,
                                          const v1::GetPageTableRequest* req, v1::PageTable* resp) {
  return rpc_->Run(page_table_, ctx, [&](absl::Time, const rpc::Caller& caller) -> absl::Status {
    absl::StatusOr<kvstore::LayerPageTable> t = store_->PageTable(
        rpc::ScopedId(caller.tenant, req->sequence_id()), req->layer(), req->first_page());
    if (!t.ok()) return t.status();
    resp->set_arena_id(t->arena_id);
    resp->set_incarnation(t->incarnation);
    resp->set_layer_length(t->layer_length);
    resp->set_page_tokens(t->page_tokens);
    resp->set_page_bytes(t->page_bytes);
    resp->set_row_bytes(t->row_bytes);
    resp->set_first_page(t->first_page);
    for (const std::vector<kvstore::PageRef>& lane : t->lanes) {
      v1::PageTable::Lane* out = resp->add_lanes();
      out->mutable_offsets()->Reserve(static_cast<int>(lane.size()));
      out->mutable_generations()->Reserve(static_cast<int>(lane.size()));
      for (const kvstore::PageRef& p : lane) {
        out->add_offsets(p.offset);
        out->add_generations(p.generation);
      }
    }
    return absl::OkStatus();
  });
}

grpc::Status KvStoreService::GetDataPlane(grpc::ServerContext* ctx, const v1::GetDataPlaneRequest*,
                                          v1::DataPlane* resp) {
  return rpc_->Run(
      data_plane_rpc_, ctx, [&](absl::Time, const rpc::Caller& caller) -> absl::Status {
        if (!caller.tenant.empty()) {
          return absl::PermissionDeniedError(
              "the data plane reads every tenant's rows: it needs a token without a tenant");
        }
        if (data_plane_ == nullptr) {
          return absl::FailedPreconditionError(
              "this store exports no data plane (start it with --arena_file and --data_plane=ucx)");
        }
        const kvstore::UcxArenaAddress& a = data_plane_->address();
        resp->set_transport("ucx");
        resp->set_arena_id(a.arena_id);
        resp->set_worker_address(a.worker_address);
        resp->set_rkey(a.rkey);
        resp->set_base_address(a.base_address);
        resp->set_arena_bytes(a.arena_bytes);
        resp->set_data_offset(a.data_offset);
        resp->set_granule(a.granule);
        resp->set_secret(a.secret);
        return absl::OkStatus();
      });
}

grpc::Status KvStoreService::ListSequences(grpc::ServerContext* ctx,
                                           const v1::ListSequencesRequest*,
                                           v1::ListSequencesResponse* resp) {
  return rpc_->Run(list_, ctx, [&](absl::Time, const rpc::Caller& caller) -> absl::Status {
    std::string id;
    for (const kvstore::SequenceInfo& info : store_->ListSequences()) {
      if (!rpc::UnscopedId(caller.tenant, info.sequence_id, &id)) continue;  // another tenant's
      v1::SequenceInfo* out = resp->add_sequences();
      rpc::ToProto(info, out);
      out->set_sequence_id(id);
    }
    return absl::OkStatus();
  });
}

grpc::Status KvStoreService::GetStats(grpc::ServerContext* ctx, const v1::GetStatsRequest*,
                                      v1::StoreStats* resp) {
  return rpc_->Run(stats_, ctx, [&](absl::Time, const rpc::Caller& caller) -> absl::Status {
    rpc::ToProto(store_->Stats(), resp);
    if (!caller.tenant.empty()) {
      // A tenant's token sees its own sequences and bytes; the whole store's traffic counters
      // (another tenant's activity) stay 0. Capacity, policy, page size and shard stay: they
      // are the deployment's, not another tenant's.
      // A page its sequences share (a fork's prefix) counted once.
      std::string id;
      const kvstore::Store::Holding held = store_->HeldBy(
          [&](absl::string_view scoped) { return rpc::UnscopedId(caller.tenant, scoped, &id); });
      resp->set_num_sequences(held.sequences);
      resp->set_bytes_used(held.bytes);
      resp->set_pages_used(resp->page_bytes() > 0 ? held.bytes / resp->page_bytes() : 0);
      resp->set_evictions(0);
      resp->set_rejections(0);
      resp->set_rows_appended(0);
      resp->set_rows_gathered(0);
      resp->set_bytes_gathered(0);
    }
    return absl::OkStatus();
  });
}

}  // namespace kvsparse::server
