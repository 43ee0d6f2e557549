// The one wrapper every RPC handler runs through: it identifies the caller by its bearer token
// and checks its role against the method's (with --auth_tokens: UNAUTHENTICATED /
// PERMISSION_DENIED), applies the server's default deadline to calls that carry none, refuses
// calls already cancelled or past their deadline and calls beyond the server's concurrency
// limits (RESOURCE_EXHAUSTED), times the call, counts it by method and status code, logs
// failures (refused credentials at most once per kRefusalLogPeriod), and maps the status to
// gRPC.
#ifndef KVSPARSE_SERVER_RPC_H_
#define KVSPARSE_SERVER_RPC_H_

#include <grpcpp/server_context.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
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
  // Refused credentials are logged at most once per this period (the lines between are counted
  // in the next one).
  static constexpr absl::Duration kRefusalLogPeriod = absl::Seconds(5);

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

  // The deadline a call must finish by: its own, or now + the default, whichever is first.
  absl::Time Deadline(const grpc::ServerContextBase& ctx, absl::Time now) const {
    absl::Time deadline = now + default_deadline_;
    const auto client = ctx.deadline();
    if (client != std::chrono::system_clock::time_point::max()) {
      deadline = std::min(deadline, absl::FromChrono(client));
    }
    return deadline;
  }

  // Runs body(deadline, caller) -> absl::Status for one unary call (or one stream step).
  // caller: whom the token names, its role covering the method; its tenant scopes the sequence
  // ids the call sees (server/security.h ScopedId). Without tokens: Caller() (admin, no
  // tenant: the whole namespace).
  template <typename Body>
  grpc::Status Run(RpcMetric* metric, grpc::ServerContext* ctx, Body&& body) const {
    const absl::Time start = absl::Now();
    const absl::Time deadline = Deadline(*ctx, start);
    Caller caller;
    absl::Status status;
    if (auth_ != nullptr) {
      absl::StatusOr<Caller> checked = auth_->Check(*ctx, metric->method());
      if (checked.ok()) {
        caller = *std::move(checked);
      } else {
        status = checked.status();
      }
    }
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
      status = std::forward<Body>(body)(deadline, std::as_const(caller));
    }
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    metric->Record(status.code(), seconds);
    if (!status.ok()) {
      const bool server_fault = status.code() == absl::StatusCode::kInternal ||
                                status.code() == absl::StatusCode::kUnknown ||
                                status.code() == absl::StatusCode::kDataLoss;
      if (server_fault) {
        KVSPARSE_LOG(Error) << metric->method() << " from " << ctx->peer() << ": " << status;
      } else if (status.code() == absl::StatusCode::kUnauthenticated ||
                 status.code() == absl::StatusCode::kPermissionDenied) {
        // Refused credentials are an operator's concern, but anyone can send them on every
        // call: one line per period, each refusal still counted in kvsparse_rpc_requests_total.
        int64_t dropped = 0;
        if (LogEnabled(LogLevel::kWarning) && refusal_log_.ShouldLog(&dropped)) {
          KVSPARSE_LOG(Warning) << metric->method() << " from " << ctx->peer() << ": " << status
                                << (dropped > 0 ? absl::StrCat(" (and ", dropped,
                                                               " refusals since the last line)")
                                                : std::string());
        }
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
  const RpcLimits limits_;
  const TokenAuth* const auth_;
  mutable std::atomic<size_t> calls_{0}, streams_{0};
  mutable LogEvery refusal_log_{kRefusalLogPeriod};
};

}  // namespace kvsparse::server

#endif  // KVSPARSE_SERVER_RPC_H_
