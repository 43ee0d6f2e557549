// A small leveled logger to stderr, one line per message: text, "I1121 12:41:07.123456 tid
// file:line] message", or JSON (--log_format=json), {"time": RFC 3339 UTC with microseconds,
// "level", "thread", "source": "file:line", "message"}, written by protobuf's JSON printer (a
// google.protobuf.Struct) for log collectors. Abseil 20220623 (Debian 12) predates absl/log;
// this is the minimum the server needs.
#ifndef KVSPARSE_RPC_LOGGING_H_
#define KVSPARSE_RPC_LOGGING_H_

#include <atomic>
#include <cstdint>
#include <sstream>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvsparse::rpc {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Messages below this level are dropped. Thread-safe.
void SetMinLogLevel(LogLevel level);
bool LogEnabled(LogLevel level);

enum class LogFormat { kText = 0, kJson = 1 };
// How every following line is written (text by default). Thread-safe.
void SetLogFormat(LogFormat format);

// Collects one message and writes it, whole, when destroyed.
class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line);
  ~LogMessage();
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  const char* file_;  // the base name
  int line_;
  absl::Time time_;
  std::ostringstream stream_;
};

// Lets one log site through at most once per `period` and counts the lines it held back (what
// absl/log's LOG_EVERY_N_SEC does): for lines a client can cause on every call, e.g. refused
// credentials, which would otherwise let anyone fill the log. Thread-safe.
class LogEvery {
 public:
  // period: finite.
  explicit LogEvery(absl::Duration period) : period_ns_(absl::ToInt64Nanoseconds(period)) {}
  LogEvery(const LogEvery&) = delete;
  LogEvery& operator=(const LogEvery&) = delete;

  // True when a line may be written now; *dropped: the lines held back since the last one.
  bool ShouldLog(int64_t* dropped) { return ShouldLogAt(absl::Now(), dropped); }
  bool ShouldLogAt(absl::Time now, int64_t* dropped);

 private:
  const int64_t period_ns_;
  std::atomic<int64_t> next_ns_{INT64_MIN};  // the first line always passes
  std::atomic<int64_t> dropped_{0};
};

}  // namespace kvsparse::rpc

#define KVSPARSE_LOG(level)                                                \
  if (!::kvsparse::rpc::LogEnabled(::kvsparse::rpc::LogLevel::k##level)) { \
  } else                                                                   \
    ::kvsparse::rpc::LogMessage(::kvsparse::rpc::LogLevel::k##level, __FILE__, __LINE__).stream()

#endif  // KVSPARSE_RPC_LOGGING_H_
