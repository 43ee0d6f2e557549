// gRPC Attention service: a thin layer over engine::DecodeEngine. Decode is one layer of one step
// for B sequences; DecodeStream carries a model server's step loop (one request per layer per step,
// answered in order; an error ends the stream with its status).
#ifndef KVSPARSE_SERVER_ATTENTION_SERVICE_H_
#define KVSPARSE_SERVER_ATTENTION_SERVICE_H_

#include "absl/time/time.h"
#include "kvsparse/v1/attention.grpc.pb.h"
#include "rpc/logging.h"
#include "server/metrics.h"
#include "server/rpc.h"
#include "server/stream_reaper.h"

namespace kvsparse::engine {
class DecodeEngine;
}  // namespace kvsparse::engine

namespace kvsparse::server {

class AttentionService final : public v1::Attention::Service {
 public:
  // REQUIRES: engine, rpc, metrics and reaper outlive the service. reaper: cancels idle
  // DecodeStreams (null: none).
  AttentionService(engine::DecodeEngine* engine, const RpcRunner* rpc, Metrics* metrics,
                   StreamReaper* reaper = nullptr);

  grpc::Status Decode(grpc::ServerContext* ctx, const v1::DecodeRequest* req,
                      v1::DecodeResponse* resp) override;
  // Counts and latency in kvsparse_rpc_* are per step (method "DecodeStream"), and a refused open
  // counts once.
  grpc::Status DecodeStream(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::DecodeResponse, v1::DecodeRequest>* stream) override;

 private:
  // tenant: the caller's (its sequence ids are scoped to it); start: when the handler was
  // entered (reported as timing.server_seconds); ctx: the call's (or stream's), whose
  // cancellation stops the engine's work (engine::DecodeCall::cancelled).
  absl::Status Run(const v1::DecodeRequest& req, absl::string_view tenant, absl::Time start,
                   absl::Time deadline, const grpc::ServerContext* ctx, v1::DecodeResponse* resp);

  engine::DecodeEngine* const engine_;
  const RpcRunner* const rpc_;
  StreamReaper* const reaper_;
  DecodeMetrics decode_metrics_;
  RpcMetric* const decode_;
  RpcMetric* const stream_;
  // "a Decode ran on the CPU engine: <why>" where the server has a GPU backend: once a minute at
  // most (a client's every call may cause it).
  rpc::LogEvery on_cpu_log_{absl::Minutes(1)};
};

}  // namespace kvsparse::server

#endif  // KVSPARSE_SERVER_ATTENTION_SERVICE_H_
