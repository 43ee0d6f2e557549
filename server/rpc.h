// The one wrapper every RPC handler runs through: it checks the caller's bearer token against
// the method's role (with --auth_tokens: UNAUTHENTICATED / PERMISSION_DENIED), applies the
// server's default deadline to calls that carry none, refuses calls already cancelled or past
// their deadline and calls beyond the server's concurrency limits (RESOURCE_EXHAUSTED), times
// the call, counts it by method and status code, logs failures, and maps the status to gRPC.
#ifndef KVSPARSE_SERVER_RPC_H_
#define KVSPARSE_SERVER_RPC_H_

#include <grpcpp/server_context.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/logging.h"
#include "server/metrics.h"
#include "server/security.h"
#include "server/status.h"

namespace kvsparse::server {

struct RpcLimits {
  size_t max_calls = 0;    // calls (and stream steps) being served at once; 0: no bound
  size_t max_streams = 0;  // DecodeStreams open at once; 0: no bound
};

class RpcRunner {
 public:
  // default_deadline: applied to calls that carry no deadline of their own.
  // auth: the tokens every call must carry (null: none needed); must outlive the runner.
  explicit RpcRunner(absl::Duration default_deadline, RpcLimits limits = RpcLimits(),
                     const TokenAuth* auth = nullptr)
      : default_deadline_(default_deadline), limits_(limits), auth_(auth) {}

  // One of `max` slots of a counter, held until destroyed; empty (false) when all were taken.
  class Slot {
   public:
    Slot() = default;
    Slot(std::atomic<size_t>* count, size_t max) {
      if (max == 0) return;
      if (count->fetch_add(1) >= max) {
        count->fetch_sub(1);
        full_ = true;
        return;
      }
      count_ = count;
    }
    Slot(Slot&& o) noexcept : count_(std::exchange(o.count_, nullptr)), full_(o.full_) {}
    Slot& operator=(Slot&&) = delete;
    ~Slot() {
      if (count_ != nullptr) count_->fetch_sub(1);
    }
    explicit operator bool() const { return !full_; }

   private:
    std::atomic<size_t>* count_ = nullptr;
    bool full_ = false;
  };
  // A stream's slot for its lifetime (Limits::max_streams).
  Slot OpenStream() const { return Slot(&streams_, limits_.max_streams); }
  size_t max_streams() const { return limits_.max_streams; }

  // The tenant whose sequences the call sees (server/security.h ScopedId): its token's, or
  // empty (no tokens, or a token without a tenant). Call it inside Run's body (the token is
  // known good there).
  std::string Tenant(const grpc::ServerContextBase& ctx) const {
    if (auth_ == nullptr) return std::string();
    absl::StatusOr<Caller> c = auth_->Identify(ctx);
    return c.ok() ? c->tenant : std::string();
  }

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
    absl::Status status =
        auth_ == nullptr ? absl::OkStatus() : auth_->Check(*ctx, metric->method());
    const Slot slot(&calls_, limits_.max_calls);
    if (!status.ok()) {
      // refused before any work (the token is checked first)
    } else if (!slot) {
      status = absl::ResourceExhaustedError(absl::StrCat(
          "server busy: ", limits_.max_calls, " calls in flight (--max_concurrent_calls)"));
    } else if (ctx->IsCancelled()) {
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
      } else if (status.code() == absl::StatusCode::kResourceExhausted ||
                 status.code() == absl::StatusCode::kUnauthenticated ||
                 status.code() == absl::StatusCode::kPermissionDenied) {
        // Capacity and refused credentials are an operator's concern; bad requests are the
        // client's (debug level).
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
  const RpcLimits limits_;
  const TokenAuth* const auth_;
  mutable std::atomic<size_t> calls_{0}, streams_{0};
};

}  // namespace kvsparse::server

#endif  // KVSPARSE_SERVER_RPC_H_
