// WorkerPool: every part runs exactly once, callers of several threads share the helpers, and a
// pool without helpers runs the parts on the caller.
#include "kvstore/worker_pool.h"

#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace kvsparse::kvstore {
namespace {

TEST(WorkerPoolTest, RunsEveryPartOnceForSeveralCallers) {
  for (int helpers : {0, 1, 3}) {
    WorkerPool pool(helpers);
    EXPECT_EQ(pool.helpers(), helpers);
    constexpr int kCallers = 4, kRuns = 50;
    std::vector<std::thread> callers;
    std::atomic<int> wrong{0};
    for (int c = 0; c < kCallers; ++c) {
      callers.emplace_back([&, c] {
        for (int r = 0; r < kRuns; ++r) {
          const size_t parts = static_cast<size_t>((c + r) % 9);  // 0 .. 8 parts
          std::vector<int> hits(parts, 0);                        // written by the parts
          pool.Run(parts, [&](size_t p) { ++hits[p]; });
          for (int h : hits) wrong += h != 1;  // read after Run: its writes are visible
        }
      });
    }
    for (std::thread& t : callers) t.join();
    EXPECT_EQ(wrong.load(), 0) << helpers << " helpers";
  }
}

TEST(WorkerPoolTest, PartsRunBesideTheCaller) {
  WorkerPool pool(3);
  std::atomic<int> inside{0}, most{0};
  pool.Run(4, [&](size_t) {
    const int now = ++inside;
    int m = most.load();
    while (now > m && !most.compare_exchange_weak(m, now)) {
    }
    // Wait (bounded) until all four are inside at once: they run on four threads.
    for (int i = 0; i < 2000 && most.load() < 4; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    --inside;
  });
  EXPECT_EQ(most.load(), 4);
}

}  // namespace
}  // namespace kvsparse::kvstore
