#include "server/remote_row_source.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvsparse/v1/kvstore.grpc.pb.h"
#include "server/convert.h"
#include "server/security.h"
#include "server/status.h"

namespace kvsparse::server {
namespace {

class RemoteRowSource final : public engine::RowSource {
 public:
  RemoteRowSource(std::shared_ptr<grpc::Channel> channel, std::string token)
      : stub_(v1::KvStore::NewStub(channel)), token_(std::move(token)) {}

  kvstore::Tier tier() const override { return kvstore::Tier::kRemote; }

  absl::StatusOr<engine::SequenceDesc> Describe(absl::string_view id,
                                                absl::Time deadline) override {
    grpc::ClientContext ctx;
    Prepare(&ctx, deadline);
    v1::GetSequenceInfoRequest req;
    req.set_sequence_id(std::string(id));
    v1::SequenceInfo info;
    if (absl::Status s = Remote(stub_->GetSequenceInfo(&ctx, req, &info)); !s.ok()) return s;
    engine::SequenceDesc d;
    d.sequence_id = info.sequence_id();
    absl::StatusOr<kvstore::ModelShape> shape = FromProto(info.shape());
    if (!shape.ok()) return shape.status();
    absl::StatusOr<kvstore::Placement> placement = FromProto(info.placement());
    if (!placement.ok()) return placement.status();
    d.shape = *shape;
    d.placement = *placement;
    d.layer_lengths.assign(info.layer_lengths().begin(), info.layer_lengths().end());
    d.incarnation = info.incarnation();
    if (d.layer_lengths.size() != d.shape.num_layers) {
      return absl::DataLossError("store returned lengths for a different number of layers");
    }
    return d;
  }

  absl::Status Append(absl::string_view id, const kvstore::ModelShape& shape, uint32_t layer,
                      uint64_t expected_length, uint64_t num_tokens, absl::Span<const uint8_t> k,
                      absl::Span<const uint8_t> v, absl::Time deadline) override {
    grpc::ClientContext ctx;
    Prepare(&ctx, deadline);
    v1::AppendRequest req;
    req.set_sequence_id(std::string(id));
    req.set_first_layer(layer);
    req.set_num_layers(1);
    req.set_expected_length(expected_length);
    for (auto [t, data] : {std::pair{req.mutable_k(), k}, std::pair{req.mutable_v(), v}}) {
      t->set_dtype(ToProto(shape.dtype));
      for (int64_t dim :
           {int64_t{1}, static_cast<int64_t>(num_tokens), static_cast<int64_t>(shape.num_kv_heads),
            static_cast<int64_t>(shape.head_dim)}) {
        t->add_shape(dim);
      }
      t->set_data(data.data(), data.size());
    }
    v1::AppendResponse resp;
    return Remote(stub_->Append(&ctx, req, &resp));
  }

  absl::StatusOr<uint64_t> Gather(absl::string_view id, uint32_t layer, kvstore::RowKind kind,
                                  absl::Span<const engine::RowRequest> heads, uint8_t* k_out,
                                  uint8_t* v_out, absl::Time deadline) override {
    grpc::ClientContext ctx;
    Prepare(&ctx, deadline);
    v1::GatherRequest req;
    req.set_sequence_id(std::string(id));
    req.set_layer(layer);
    req.set_kind(kind == kvstore::RowKind::kK   ? v1::ROW_KIND_K
                 : kind == kvstore::RowKind::kV ? v1::ROW_KIND_V
                                                : v1::ROW_KIND_KV);
    size_t rows = 0;
    for (const engine::RowRequest& h : heads) {
      v1::HeadSelection* sel = req.add_heads();
      sel->set_kv_head(h.kv_head);
      sel->mutable_token_indices()->Add(h.tokens.begin(), h.tokens.end());
      rows += h.tokens.size();
    }
    v1::GatherResponse resp;
    if (absl::Status s = Remote(stub_->Gather(&ctx, req, &resp)); !s.ok()) return s;
    const bool want_k = kind != kvstore::RowKind::kV;
    const bool want_v = kind != kvstore::RowKind::kK;
    const size_t per =
        rows > 0 ? (want_k ? resp.k().data().size() : resp.v().data().size()) / rows : 0;
    if ((want_k && resp.k().data().size() != rows * per) ||
        (want_v && resp.v().data().size() != rows * per)) {
      return absl::DataLossError("store returned a gather of the wrong size");
    }
    if (want_k) std::memcpy(k_out, resp.k().data().data(), resp.k().data().size());
    if (want_v) std::memcpy(v_out, resp.v().data().data(), resp.v().data().size());
    return resp.layer_length();
  }

 private:
  void Prepare(grpc::ClientContext* ctx, absl::Time deadline) const {
    ctx->set_deadline(absl::ToChronoTime(deadline));
    if (!token_.empty()) ctx->AddMetadata(kAuthMetadataKey, absl::StrCat(kBearerPrefix, token_));
  }
  // A store-side failure keeps its code; an unreachable store says so; a store that refuses
  // this worker's credentials is the deployment's fault, not the caller's (INTERNAL, logged).
  static absl::Status Remote(const grpc::Status& s) {
    absl::Status st = FromGrpcStatus(s);
    if (st.code() == absl::StatusCode::kUnavailable) {
      return absl::UnavailableError(absl::StrCat("store unavailable: ", st.message()));
    }
    if (st.code() == absl::StatusCode::kUnauthenticated ||
        st.code() == absl::StatusCode::kPermissionDenied) {
      return absl::InternalError(absl::StrCat(
          "the store refused this worker (--store_token_file, --store_tls_*): ", st.message()));
    }
    return st;
  }

  std::unique_ptr<v1::KvStore::Stub> stub_;
  const std::string token_;
};

}  // namespace

std::unique_ptr<engine::RowSource> NewRemoteRowSource(std::shared_ptr<grpc::Channel> channel,
                                                      std::string token) {
  return std::make_unique<RemoteRowSource>(std::move(channel), std::move(token));
}

}  // namespace kvsparse::server
