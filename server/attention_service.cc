#include "server/attention_service.h"

#include "absl/strings/str_cat.h"
#include "engine/decode_engine.h"
#include "rpc/convert.h"
#include "rpc/logging.h"

namespace kvsparse::server {

AttentionService::AttentionService(engine::DecodeEngine* engine, const RpcRunner* rpc,
                                   Metrics* metrics, StreamReaper* reaper)
    : engine_(engine),
      rpc_(rpc),
      reaper_(reaper),
      decode_metrics_(metrics->registry()),
      decode_(metrics->Rpc("Decode")),
      stream_(metrics->Rpc("DecodeStream")) {}

absl::Status AttentionService::Run(const v1::DecodeRequest& req, absl::string_view tenant,
                                   absl::Time start, absl::Time deadline,
                                   const grpc::ServerContext* ctx, v1::DecodeResponse* resp) {
  absl::StatusOr<engine::DecodeCall> call = rpc::FromProto(req);
  if (!call.ok()) return call.status();
  for (std::string& id : call->sequence_ids) id = rpc::ScopedId(tenant, id);
  call->deadline = deadline;
  call->cancelled = [ctx] { return ctx->IsCancelled(); };
  absl::StatusOr<engine::DecodeResult> result = engine_->Decode(*call);
  if (!result.ok()) return result.status();
  decode_metrics_.Record(call->method.kind, *result);
  if (!result->not_on_backend.empty()) {
    if (int64_t dropped = 0; on_cpu_log_.ShouldLog(&dropped)) {
      KVSPARSE_LOG(Info) << "a Decode ran on the CPU engine: " << result->not_on_backend << " ("
                         << dropped << " such lines held back)";
    }
  }
  rpc::ToProto(std::move(*result), *call, resp);
  resp->set_request_id(req.request_id());
  resp->mutable_timing()->set_server_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  return absl::OkStatus();
}

grpc::Status AttentionService::Decode(grpc::ServerContext* ctx, const v1::DecodeRequest* req,
                                      v1::DecodeResponse* resp) {
  const absl::Time start = absl::Now();
  return rpc_->Run(decode_, ctx, [&](absl::Time deadline, const rpc::Caller& caller) {
    return Run(*req, caller.tenant, start, deadline, ctx, resp);
  });
}

grpc::Status AttentionService::DecodeStream(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::DecodeResponse, v1::DecodeRequest>* stream) {
  const RpcRunner::OpenedStream open = rpc_->OpenStream(stream_, ctx);
  if (!open.status.ok()) return open.status;
  const std::unique_ptr<StreamReaper::Watch> watch =
      reaper_ == nullptr ? nullptr : reaper_->Add(ctx);
  v1::DecodeRequest req;
  v1::DecodeResponse resp;
  for (uint64_t index = 0; stream->Read(&req); ++index) {
    if (watch) watch->Touch();
    resp.Clear();
    // Each step gets the server's default deadline, bounded by the stream's own.
    const absl::Time start = absl::Now();
    grpc::Status st =
        rpc_->RunStep(stream_, ctx, [&](absl::Time deadline, const rpc::Caller& caller) {
          return Run(req, caller.tenant, start, deadline, ctx, &resp);
        });
    if (!st.ok()) {
      // The stream ends at its first failed message; the status says which one it was.
      return grpc::Status(st.error_code(),
                          absl::StrCat("DecodeStream message ", index, " (request_id ",
                                       req.request_id(), "): ", st.error_message()));
    }
    if (!stream->Write(resp)) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "client went away");
    }
    if (watch) watch->Touch();
  }
  if (watch && watch->reaped()) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "stream idle (--stream_idle_timeout)");
  }
  return grpc::Status::OK;
}

}  // namespace kvsparse::server
