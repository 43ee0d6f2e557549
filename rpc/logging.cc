#include "rpc/logging.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace kvsparse::rpc {
namespace {
std::atomic<int> min_level{static_cast<int>(LogLevel::kInfo)};
std::atomic<int> format{static_cast<int>(LogFormat::kText)};
constexpr const char* kLevelNames[] = {"debug", "info", "warning", "error"};
}  // namespace

void SetMinLogLevel(LogLevel level) { min_level.store(static_cast<int>(level)); }
bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= min_level.load(); }
void SetLogFormat(LogFormat f) { format.store(static_cast<int>(f)); }

LogMessage::LogMessage(LogLevel level, const char* file, int line)
    : level_(level), file_(file), line_(line), time_(absl::Now()) {
  if (const char* base = std::strrchr(file, '/'); base != nullptr) file_ = base + 1;
}

LogMessage::~LogMessage() {
  const long tid = static_cast<long>(syscall(SYS_gettid));
  std::string s;
  if (format.load() == static_cast<int>(LogFormat::kJson)) {
    google::protobuf::Struct line;
    auto& f = *line.mutable_fields();
    f["time"].set_string_value(
        absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", time_, absl::UTCTimeZone()));
    f["level"].set_string_value(kLevelNames[static_cast<int>(level_)]);
    f["thread"].set_number_value(static_cast<double>(tid));
    f["source"].set_string_value(absl::StrCat(file_, ":", line_));
    f["message"].set_string_value(stream_.str());
    if (!google::protobuf::util::MessageToJsonString(line, &s).ok()) {
      s = R"({"level":"error","message":"a log line could not be written as JSON"})";
    }
  } else {
    s = absl::StrCat(std::string(1, "DIWE"[static_cast<int>(level_)]),
                     absl::FormatTime("%m%d %H:%M:%E6S", time_, absl::LocalTimeZone()), " ", tid,
                     " ", file_, ":", line_, "] ", stream_.str());
  }
  s += '\n';
  std::fwrite(s.data(), 1, s.size(), stderr);  // one write: lines from threads don't interleave
  if (level_ >= LogLevel::kWarning) std::fflush(stderr);
}

bool LogEvery::ShouldLogAt(absl::Time now, int64_t* dropped) {
  const int64_t now_ns = absl::ToUnixNanos(now);
  int64_t next = next_ns_.load(std::memory_order_relaxed);
  // One caller per period wins the exchange; the others count themselves as held back.
  if (now_ns < next ||
      !next_ns_.compare_exchange_strong(next, now_ns + period_ns_, std::memory_order_relaxed)) {
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  *dropped = dropped_.exchange(0, std::memory_order_relaxed);
  return true;
}

}  // namespace kvsparse::rpc
