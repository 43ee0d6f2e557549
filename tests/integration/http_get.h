// A minimal blocking HTTP/1.0 GET over a loopback TCP socket, for reading /metrics in tests.
#ifndef KVSPARSE_TESTS_INTEGRATION_HTTP_GET_H_
#define KVSPARSE_TESTS_INTEGRATION_HTTP_GET_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace kvsparse::testing {

// Returns the response body of GET http://127.0.0.1:port/path.
inline absl::StatusOr<std::string> HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("connect to port ", port));
  }
  const std::string req = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  if (write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return absl::InternalError("write");
  }
  std::string resp;
  char buf[8192];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) resp.append(buf, n);
  close(fd);
  const size_t body = resp.find("\r\n\r\n");
  if (resp.compare(0, 12, "HTTP/1.1 200") != 0 && resp.compare(0, 12, "HTTP/1.0 200") != 0) {
    return absl::InternalError(absl::StrCat("bad HTTP response: ", resp.substr(0, 64)));
  }
  return body == std::string::npos ? std::string() : resp.substr(body + 4);
}

// The value of the first sample line of `metric` whose labels contain `labels` (a substring
// such as `method="Gather",code="OK"`), or -1 if absent.
inline double MetricValue(const std::string& text, const std::string& metric,
                          const std::string& labels = "") {
  size_t pos = 0;
  while ((pos = text.find(metric, pos)) != std::string::npos) {
    const bool line_start = pos == 0 || text[pos - 1] == '\n';  // not a # HELP / # TYPE line
    const size_t eol = text.find('\n', pos);
    const std::string line = text.substr(pos, eol - pos);
    pos = eol;
    if (!line_start) continue;
    if (line.size() <= metric.size() || (line[metric.size()] != ' ' && line[metric.size()] != '{'))
      continue;
    if (!labels.empty() && line.find(labels) == std::string::npos) continue;
    return std::stod(line.substr(line.rfind(' ') + 1));
  }
  return -1;
}

}  // namespace kvsparse::testing

#endif  // KVSPARSE_TESTS_INTEGRATION_HTTP_GET_H_
