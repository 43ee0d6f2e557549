// The one wrapper every RPC handler runs through: it identifies the caller by its bearer token
// and checks its role against the method's (with --auth_tokens: UNAUTHENTICATED /
// PERMISSION_DENIED), applies the server's default deadline to calls that carry none, refuses
// calls already cancelled or past their deadline and calls beyond the server's or the token's
// concurrency limits (RESOURCE_EXHAUSTED), times the call, counts it by method and status code,
// logs failures (refused credentials at most once per kRefusalLogPeriod), and maps the status to
// gRPC.
#ifndef KVSPARSE_SERVER_RPC_H_
#define KVSPARSE_SERVER_RPC_H_

#include <grpcpp/server_context.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "rpc/logging.h"
#include "rpc/security.h"
#include "rpc/status.h"
#include "server/metrics.h"

namespace kvsparse::server {

struct RpcLimits {
  size_t max_calls = 0;    // calls (and stream steps) being served at once; 0: no bound
  size_t max_streams = 0;  // DecodeStreams open at once; 0: no bound
  // Unary calls plus open DecodeStreams held at once by one token (Caller::in_flight; a stream's
  // steps run under its slot); 0 or no tokens: no bound.
  size_t max_per_token = 0;
};

class RpcRunner {
 public:
  // Refused credentials are logged at most once per this period (the lines between are counted
  // in the next one).
  static constexpr absl::Duration kRefusalLogPeriod = absl::Seconds(5);

  // default_deadline: applied to calls that carry no deadline of their own.
  // auth: the tokens every call must carry (null: none needed); must outlive the runner.
  explicit RpcRunner(absl::Duration default_deadline, RpcLimits limits = RpcLimits(),
                     const rpc::TokenAuth* auth = nullptr)
      : default_deadline_(default_deadline), limits_(limits), auth_(auth) {}

  // One of `max` slots of a counter, held until destroyed; empty (false) when all were taken.
  // max == 0: always granted (and counted); no counter: always granted, nothing held.
  class Slot {
   public:
    Slot() = default;
    Slot(std::atomic<size_t>* count, size_t max) { Take(count, max); }
    // A token's slot keeps the token's counter alive (a reload may drop the token meanwhile).
    Slot(std::shared_ptr<std::atomic<size_t>> count, size_t max) : keep_(std::move(count)) {
      Take(keep_.get(), max);
      if (count_ == nullptr) keep_.reset();
    }
    Slot(Slot&& o) noexcept
        : count_(std::exchange(o.count_, nullptr)), keep_(std::move(o.keep_)), full_(o.full_) {}
    Slot& operator=(Slot&&) = delete;
    ~Slot() {
      if (count_ != nullptr) count_->fetch_sub(1);
    }
    explicit operator bool() const { return !full_; }

   private:
    void Take(std::atomic<size_t>* count, size_t max) {
      if (count == nullptr) return;
      // Counted even without a bound (max 0): kvsparse_rpc_in_flight reads the counter.
      if (count->fetch_add(1) >= max && max != 0) {
        count->fetch_sub(1);
        full_ = true;
        return;
      }
      count_ = count;
    }
    std::atomic<size_t>* count_ = nullptr;
    std::shared_ptr<std::atomic<size_t>> keep_;
    bool full_ = false;
  };

  // What an open DecodeStream holds until it ends: one of the server's stream slots and one of
  // its token's. status not OK: refused (counted and logged); the handler returns it.
  struct OpenedStream {
    grpc::Status status;
    Slot stream;
    Slot token;
  };
  // Identifies a DecodeStream's caller when it opens and takes its slots (RESOURCE_EXHAUSTED
  // beyond --max_concurrent_streams or --max_calls_per_token). Its steps then go through RunStep.
  OpenedStream OpenStream(RpcMetric* metric, grpc::ServerContext* ctx) const {
    const absl::Time start = absl::Now();
    rpc::Caller caller;
    absl::Status status = Identify(*ctx, metric->method(), &caller);
    OpenedStream open{grpc::Status::OK, Slot(streams_, limits_.max_streams),
                      status.ok() ? TokenSlot(caller) : Slot()};
    if (!status.ok()) {
      // refused before any slot matters
    } else if (!open.stream) {
      metric->RecordRefusal("max_concurrent_streams");
      status = absl::ResourceExhaustedError(absl::StrCat(
          "server busy: ", limits_.max_streams, " decode streams open (--max_concurrent_streams)"));
    } else if (!open.token) {
      metric->RecordRefusal("max_calls_per_token");
      status = TokenBusy();
    }
    if (!status.ok()) open.status = Finish(metric, *ctx, start, status);
    return open;
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

  // The counters of unary calls holding a slot and of open decode streams
  // (Metrics::WatchInFlight reads them at scrape time).
  std::shared_ptr<const std::atomic<size_t>> calls_in_flight() const { return calls_; }
  std::shared_ptr<const std::atomic<size_t>> streams_open() const { return streams_; }

  // Runs body(deadline, caller) -> absl::Status for one unary call, which holds one of the
  // server's call slots and one of its token's.
  // caller: whom the token names, its role covering the method; its tenant scopes the sequence
  // ids the call sees (rpc/security.h ScopedId). Without tokens: Caller() (admin, no
  // tenant: the whole namespace).
  template <typename Body>
  grpc::Status Run(RpcMetric* metric, grpc::ServerContext* ctx, Body&& body) const {
    return Serve(metric, ctx, /*token_slot=*/true, std::forward<Body>(body));
  }
  // The same for one step of a stream opened with OpenStream: a call slot, but not another of
  // the token's (the stream holds one).
  template <typename Body>
  grpc::Status RunStep(RpcMetric* metric, grpc::ServerContext* ctx, Body&& body) const {
    return Serve(metric, ctx, /*token_slot=*/false, std::forward<Body>(body));
  }

 private:
  // The caller the call's token names, its role checked against the method (no tokens: admin).
  absl::Status Identify(const grpc::ServerContextBase& ctx, absl::string_view method,
                        rpc::Caller* caller) const {
    if (auth_ == nullptr) return absl::OkStatus();
    absl::StatusOr<rpc::Caller> checked = auth_->Check(ctx, method);
    if (!checked.ok()) return checked.status();
    *caller = *std::move(checked);
    return absl::OkStatus();
  }
  Slot TokenSlot(const rpc::Caller& caller) const {
    return Slot(caller.in_flight, limits_.max_per_token);
  }
  absl::Status TokenBusy() const {
    return absl::ResourceExhaustedError(
        absl::StrCat("this token has ", limits_.max_per_token,
                     " calls and decode streams in flight (--max_calls_per_token)"));
  }

  template <typename Body>
  grpc::Status Serve(RpcMetric* metric, grpc::ServerContext* ctx, bool token_slot,
                     Body&& body) const {
    const absl::Time start = absl::Now();
    const absl::Time deadline = Deadline(*ctx, start);
    rpc::Caller caller;
    absl::Status status = Identify(*ctx, metric->method(), &caller);
    const Slot slot(calls_, limits_.max_calls);
    const Slot token = status.ok() && token_slot ? TokenSlot(caller) : Slot();
    if (!status.ok()) {
      // refused before any work (the token is checked first)
    } else if (!slot) {
      metric->RecordRefusal("max_concurrent_calls");
      status = absl::ResourceExhaustedError(absl::StrCat(
          "server busy: ", limits_.max_calls, " calls in flight (--max_concurrent_calls)"));
    } else if (!token) {
      metric->RecordRefusal("max_calls_per_token");
      status = TokenBusy();
    } else if (ctx->IsCancelled()) {
      status = absl::CancelledError("call cancelled before it started");
    } else if (deadline <= start) {
      status = absl::DeadlineExceededError("deadline passed before the call started");
    } else {
      // A tenant reads its ids as it named them, never the store's scoped form.
      status = rpc::UnscopedStatus(caller.tenant,
                                   std::forward<Body>(body)(deadline, std::as_const(caller)));
    }
    return Finish(metric, *ctx, start, status);
  }

  // Times, counts and logs a call's outcome and maps it to gRPC.
  grpc::Status Finish(RpcMetric* metric, const grpc::ServerContextBase& ctx, absl::Time start,
                      const absl::Status& status) const {
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    metric->Record(status.code(), seconds);
    if (!status.ok()) {
      const bool server_fault = status.code() == absl::StatusCode::kInternal ||
                                status.code() == absl::StatusCode::kUnknown ||
                                status.code() == absl::StatusCode::kDataLoss;
      if (server_fault) {
        KVSPARSE_LOG(Error) << metric->method() << " from " << ctx.peer() << ": " << status;
      } else if (status.code() == absl::StatusCode::kUnauthenticated ||
                 status.code() == absl::StatusCode::kPermissionDenied) {
        // Refused credentials are an operator's concern, but anyone can send them on every
        // call: one line per period, each refusal still counted in kvsparse_rpc_requests_total.
        int64_t dropped = 0;
        if (rpc::LogEnabled(rpc::LogLevel::kWarning) && refusal_log_.ShouldLog(&dropped)) {
          KVSPARSE_LOG(Warning) << metric->method() << " from " << ctx.peer() << ": " << status
                                << (dropped > 0 ? absl::StrCat(" (and ", dropped,
                                                               " refusals since the last line)")
                                                : std::string());
        }
      } else if (status.code() == absl::StatusCode::kResourceExhausted) {
        // Capacity is an operator's concern; bad requests are the client's (debug level).
        KVSPARSE_LOG(Warning) << metric->method() << " from " << ctx.peer() << ": " << status;
      } else {
        KVSPARSE_LOG(Debug) << metric->method() << " from " << ctx.peer() << ": " << status;
      }
    } else {
      KVSPARSE_LOG(Debug) << metric->method() << " OK in " << seconds * 1e6 << " us";
    }
    return rpc::ToGrpcStatus(status);
  }

  const absl::Duration default_deadline_;
  const RpcLimits limits_;
  const rpc::TokenAuth* const auth_;
  // Shared with the in-flight gauge's collector, which may outlive the runner.
  const std::shared_ptr<std::atomic<size_t>> calls_ = std::make_shared<std::atomic<size_t>>(0);
  const std::shared_ptr<std::atomic<size_t>> streams_ = std::make_shared<std::atomic<size_t>>(0);
  mutable rpc::LogEvery refusal_log_{kRefusalLogPeriod};
};

}  // namespace kvsparse::server

#endif  // KVSPARSE_SERVER_RPC_H_
