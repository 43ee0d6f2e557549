#include "server/request_budget.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvsparse::server {

RequestBudget::Share::~Share() {
  if (budget_ != nullptr) budget_->Give(bytes_);
}

absl::StatusOr<RequestBudget::Share> RequestBudget::Take(size_t bytes, absl::Time deadline,
                                                         const std::function<bool()>& cancelled) {
  if (limit_ != 0 && bytes > limit_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("a request of ", bytes, " bytes is over the bytes the server reads at once (",
                     limit_, ", --max_append_bytes_in_flight): send it in smaller appends"));
  }
  absl::MutexLock lock(&mu_);
  auto fits = [&] { return limit_ == 0 || in_use_->load() + bytes <= limit_; };
  while (!fits()) {
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "server busy: ", in_use_->load(), " bytes of requests in flight of ", limit_,
          " (--max_append_bytes_in_flight); no room for ", bytes, " before the call's deadline"));
    }
    if (cancelled && cancelled()) return absl::CancelledError("cancelled while waiting for room");
    mu_.AwaitWithDeadline(absl::Condition(&fits), std::min(deadline, now + kPoll));
  }
  in_use_->fetch_add(bytes);
  return Share(this, bytes);
}

void RequestBudget::Give(size_t bytes) {
  absl::MutexLock lock(&mu_);  // wakes the waiters (their conditions are re-evaluated)
  in_use_->fetch_sub(bytes);
}

}  // namespace kvsparse::server
