#include "server/request_budget.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace kvsparse::server {
namespace {

const auto kNever = [] { return false; };

TEST(RequestBudgetTest, SharesAreHeldUntilDestroyedAndOversizedOnesRefusedAtOnce) {
  RequestBudget budget(100);
  {
    absl::StatusOr<RequestBudget::Share> a = budget.Take(60, absl::InfiniteFuture(), kNever);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->bytes(), 60u);
    EXPECT_EQ(budget.in_use(), 60u);
    absl::StatusOr<RequestBudget::Share> b = budget.Take(40, absl::InfiniteFuture(), kNever);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(budget.in_use(), 100u);
  }
  EXPECT_EQ(budget.in_use(), 0u);
  // More than the whole budget can never fit: refused without waiting, naming the flag.
  absl::StatusOr<RequestBudget::Share> big = budget.Take(101, absl::InfiniteFuture(), kNever);
  ASSERT_TRUE(absl::IsResourceExhausted(big.status())) << big.status();
  EXPECT_TRUE(absl::StrContains(big.status().message(), "--max_append_bytes_in_flight"));
  EXPECT_EQ(budget.in_use(), 0u);
}

TEST(RequestBudgetTest, AShareThatDoesNotFitWaitsUntilRoomOrItsDeadlineOrItsCancellation) {
  RequestBudget budget(100);
  auto held =
      std::make_unique<RequestBudget::Share>(*budget.Take(80, absl::InfiniteFuture(), kNever));
  // The deadline passes first: refused, nothing taken.
  absl::StatusOr<RequestBudget::Share> late =
      budget.Take(30, absl::Now() + absl::Milliseconds(50), kNever);
  ASSERT_TRUE(absl::IsResourceExhausted(late.status())) << late.status();
  EXPECT_TRUE(absl::StrContains(late.status().message(), "server busy")) << late.status();
  // Cancelled while waiting.
  std::atomic<bool> cancel{false};
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(30));
    cancel = true;
  });
  absl::StatusOr<RequestBudget::Share> gone =
      budget.Take(30, absl::InfiniteFuture(), [&] { return cancel.load(); });
  canceller.join();
  ASSERT_TRUE(absl::IsCancelled(gone.status())) << gone.status();
  EXPECT_EQ(budget.in_use(), 80u);
  // Room made while waiting: granted.
  std::thread release([&] {
    absl::SleepFor(absl::Milliseconds(30));
    held.reset();
  });
  absl::StatusOr<RequestBudget::Share> next = budget.Take(30, absl::InfiniteFuture(), kNever);
  release.join();
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(budget.in_use(), 30u);
}

TEST(RequestBudgetTest, ConcurrentSharesNeverExceedTheBudget) {
  RequestBudget budget(100);
  std::atomic<size_t> peak{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        absl::StatusOr<RequestBudget::Share> s =
            budget.Take(10 + 10 * (t % 4), absl::InfiniteFuture(), kNever);
        ASSERT_TRUE(s.ok()) << s.status();
        size_t now = budget.in_use(), seen = peak.load();
        while (now > seen && !peak.compare_exchange_weak(seen, now)) {
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_LE(peak.load(), 100u);
  EXPECT_EQ(budget.in_use(), 0u);
}

TEST(RequestBudgetTest, NoBoundStillCounts) {
  RequestBudget budget(0);
  absl::StatusOr<RequestBudget::Share> a = budget.Take(size_t{1} << 40, absl::Now(), kNever);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(budget.in_use(), size_t{1} << 40);
}

}  // namespace
}  // namespace kvsparse::server
