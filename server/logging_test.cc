#include "server/logging.h"

#include <cstdint>

#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace kvsparse::server {
namespace {

TEST(LoggingTest, LogEveryLetsOneLineThroughPerPeriodAndCountsTheRest) {
  LogEvery every(absl::Seconds(5));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  int64_t dropped = -1;
  EXPECT_TRUE(every.ShouldLogAt(t0, &dropped));  // the first line passes
  EXPECT_EQ(dropped, 0);
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(every.ShouldLogAt(t0 + absl::Seconds(i + 1), &dropped));
  EXPECT_FALSE(every.ShouldLogAt(t0 + absl::Milliseconds(4999), &dropped));
  EXPECT_TRUE(every.ShouldLogAt(t0 + absl::Seconds(5), &dropped));
  EXPECT_EQ(dropped, 4);  // the lines held back since the last one
  EXPECT_FALSE(every.ShouldLogAt(t0 + absl::Seconds(6), &dropped));
  EXPECT_TRUE(every.ShouldLogAt(t0 + absl::Seconds(60), &dropped));
  EXPECT_EQ(dropped, 1);
}

}  // namespace
}  // namespace kvsparse::server
