#include "rpc/logging.h"

#include <cstdint>
#include <string>

#include "absl/strings/match.h"
#include "absl/time/time.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"

namespace kvsparse::rpc {
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

// --log_format=json: one JSON object a line that a log collector parses back to the message as
// written (quotes, backslashes, newlines and non-ASCII included), with an RFC 3339 UTC time.
TEST(LoggingTest, JsonLinesParseBackToTheMessage) {
  SetLogFormat(LogFormat::kJson);
  testing::internal::CaptureStderr();
  const std::string message = "a \"quoted\" path C:\\x, two\nlines, \xc3\xa9t\xc3\xa9";
  KVSPARSE_LOG(Warning) << message;
  std::string out = testing::internal::GetCapturedStderr();
  SetLogFormat(LogFormat::kText);
  ASSERT_FALSE(out.empty());
  ASSERT_EQ(out.back(), '\n');
  out.pop_back();
  ASSERT_EQ(out.find('\n'), std::string::npos) << "one line: " << out;
  google::protobuf::Struct line;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(out, &line).ok()) << out;
  const auto& f = line.fields();
  EXPECT_EQ(f.at("message").string_value(), message);
  EXPECT_EQ(f.at("level").string_value(), "warning");
  EXPECT_TRUE(absl::StartsWith(f.at("source").string_value(), "logging_test.cc:"));
  absl::Time t;
  std::string err;
  EXPECT_TRUE(absl::ParseTime(absl::RFC3339_full, f.at("time").string_value(), &t, &err)) << err;
  EXPECT_LT(absl::AbsDuration(absl::Now() - t), absl::Minutes(5));
  EXPECT_GT(f.at("thread").number_value(), 0);
}

}  // namespace
}  // namespace kvsparse::rpc
