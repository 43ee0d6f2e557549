// The one wrapper every RPC handler runs through: it applies the server's default deadline to
// calls that carry none, refuses calls already cancelled or past their deadline, times the call,
// counts it by method and status code, logs failures, and maps the status to gRPC.
#ifndef KVSPARSE_SERVER_RPC_H_
#define KVSPARSE_SERVER_RPC_H_

#include <grpcpp/server_context.h>

#include <chrono>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/logging.h"
#include "server/metrics.h"
#include "server/status.h"

namespace kvsparse::server {

class RpcRunner {
 public:
  // default_deadline: applied to calls that carry no deadline of their own.
  explicit RpcRunner(absl::Duration default_deadline) : default_deadline_(default_deadline) {}

  // The deadline a call must finish by: its own, or now + the default, whichever is first.
  absl::Time Deadline(const grpc::ServerContextBase& ctx, absl::Time now) const {
    absl::Time deadline = now + default_deadline_;
    const auto client = ctx.deadline();
    if (client != std::chrono::system_clock::time_point::max()) {
      deadline = std::min(deadline, absl::FromChrono(client));
    }
    return deadline;
  }

  // Runs body(deadline) -> absl::Status for one unary call.
  template <typename Body>
  grpc::Status Run(RpcMetric* metric, grpc::ServerContext* ctx, Body&& body) const {
    const absl::Time start = absl::Now();
    const absl::Time deadline = Deadline(*ctx, start);
    absl::Status status;
    if (ctx->IsCancelled()) {
      status = absl::CancelledError("call cancelled before it started");
    } else if (deadline <= start) {
      status = absl::DeadlineExceededError("deadline passed before the call started");
    } else {
      status = std::forward<Body>(body)(deadline);
    }
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    metric->Record(status.code(), seconds);
    if (!status.ok()) {
      const bool server_fault = status.code() == absl::StatusCode::kInternal ||
                                status.code() == absl::StatusCode::kUnknown ||
                                status.code() == absl::StatusCode::kDataLoss;
      if (server_fault) {
        KVSPARSE_LOG(Error) << metric->method() << " from " << ctx->peer() << ": " << status;
      } else if (status.code() == absl::StatusCode::kResourceExhausted) {
        // Capacity is an operator's concern; bad requests are the client's (debug level).
        KVSPARSE_LOG(Warning) << metric->method() << " from " << ctx->peer() << ": " << status;
      } else {
        KVSPARSE_LOG(Debug) << metric->method() << " from " << ctx->peer() << ": " << status;
      }
    } else {
      KVSPARSE_LOG(Debug) << metric->method() << " OK in " << seconds * 1e6 << " us";
    }
    return ToGrpcStatus(status);
  }

 private:
  const absl::Duration default_deadline_;
};

}  // namespace kvsparse::server

#endif  // KVSPARSE_SERVER_RPC_H_
