#include "server/logging.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvsparse::server {
namespace {
std::atomic<int> min_level{static_cast<int>(LogLevel::kInfo)};
}  // namespace

void SetMinLogLevel(LogLevel level) { min_level.store(static_cast<int>(level)); }
bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= min_level.load(); }

LogMessage::LogMessage(LogLevel level, const char* file, int line) : level_(level) {
  const char* base = std::strrchr(file, '/');
  stream_ << "DIWE"[static_cast<int>(level)]
          << absl::FormatTime("%m%d %H:%M:%E6S", absl::Now(), absl::LocalTimeZone()) << ' '
          << static_cast<long>(syscall(SYS_gettid)) << ' ' << (base ? base + 1 : file) << ':'
          << line << "] ";
}

LogMessage::~LogMessage() {
  stream_ << '\n';
  const std::string s = stream_.str();
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

}  // namespace kvsparse::server
