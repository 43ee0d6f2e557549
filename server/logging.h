// A small leveled logger to stderr: "I1121 12:41:07.123456 tid file:line] message".
// Abseil 20220623 (Debian 12) predates absl/log; this is the minimum the server needs.
#ifndef KVSPARSE_SERVER_LOGGING_H_
#define KVSPARSE_SERVER_LOGGING_H_

#include <sstream>

namespace kvsparse::server {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Messages below this level are dropped. Thread-safe.
void SetMinLogLevel(LogLevel level);
bool LogEnabled(LogLevel level);

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
  std::ostringstream stream_;
};

}  // namespace kvsparse::server

#define KVSPARSE_LOG(level)                                                                    \
  if (!::kvsparse::server::LogEnabled(::kvsparse::server::LogLevel::k##level)) {               \
  } else                                                                                       \
    ::kvsparse::server::LogMessage(::kvsparse::server::LogLevel::k##level, __FILE__, __LINE__) \
        .stream()

#endif  // KVSPARSE_SERVER_LOGGING_H_
