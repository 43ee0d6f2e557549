// A budget of request bytes the server reads at once (--max_append_bytes_in_flight): a call
// takes its share before its body is read and gives it back when it is done, so that the
// messages being received and parsed are bounded in memory as the store's pages are by
// --capacity. A share that does not fit waits (until the call's deadline or its cancellation);
// one larger than the whole budget is refused at once.
//
// KvStore.Append is served as a streamed unary method (kvstore_service.h): gRPC reads its body
// only when the handler asks, after the share is taken. Until then a waiting call holds at most
// its HTTP/2 stream's flow-control window of the body.
#ifndef KVSPARSE_SERVER_REQUEST_BUDGET_H_
#define KVSPARSE_SERVER_REQUEST_BUDGET_H_

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvsparse::server {

class RequestBudget {
 public:
  // limit: bytes held at once; 0: no bound (shares are still counted for the gauge).
  explicit RequestBudget(size_t limit) : limit_(limit) {}
  RequestBudget(const RequestBudget&) = delete;
  RequestBudget& operator=(const RequestBudget&) = delete;

  // Bytes of the budget, given back when destroyed (to the budget, which must outlive it).
  class Share {
   public:
    Share() = default;
    Share(Share&& o) noexcept : budget_(std::exchange(o.budget_, nullptr)), bytes_(o.bytes_) {}
    Share& operator=(Share&&) = delete;
    ~Share();
    size_t bytes() const { return bytes_; }

   private:
    friend class RequestBudget;
    Share(RequestBudget* budget, size_t bytes) : budget_(budget), bytes_(bytes) {}
    RequestBudget* budget_ = nullptr;
    size_t bytes_ = 0;
  };

  // `bytes` of the budget, waiting for room until `deadline` or until `cancelled()` (checked at
  // least every kPoll) returns true. RESOURCE_EXHAUSTED when bytes exceed the whole budget (at
  // once) or the deadline passes first; CANCELLED when the call is cancelled first.
  absl::StatusOr<Share> Take(size_t bytes, absl::Time deadline,
                             const std::function<bool()>& cancelled);

  size_t limit() const { return limit_; }
  // Bytes held now (the kvsparse_rpc_in_flight gauge reads the counter at scrape time).
  size_t in_use() const { return in_use_->load(std::memory_order_relaxed); }
  std::shared_ptr<const std::atomic<size_t>> in_use_counter() const { return in_use_; }

  static constexpr absl::Duration kPoll = absl::Milliseconds(20);

 private:
  void Give(size_t bytes);

  const size_t limit_;
  absl::Mutex mu_;
  // Shared with the gauge's collector, which may outlive the budget.
  const std::shared_ptr<std::atomic<size_t>> in_use_ = std::make_shared<std::atomic<size_t>>(0);
};

}  // namespace kvsparse::server

#endif  // KVSPARSE_SERVER_REQUEST_BUDGET_H_
