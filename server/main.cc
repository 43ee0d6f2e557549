// kvsparse-server: the KV store service (and, in later versions, the decode worker).
// Flags are read here and nowhere else.
#include <signal.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/time/time.h"
#include "server/byte_size.h"
#include "server/logging.h"
#include "server/server.h"

using kvsparse::server::ByteSize;

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "gRPC address to serve on (host:port; 0.0.0.0:PORT for all interfaces)");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464",
          "Address of the Prometheus /metrics endpoint; empty disables it");
ABSL_FLAG(ByteSize, capacity, ByteSize{4ull << 30},
          "Most bytes of K/V pages the store holds (e.g. 512M, 64G)");
ABSL_FLAG(std::string, capacity_policy, "reject",
          "When full: 'reject' (appends get RESOURCE_EXHAUSTED) or 'evict-lru' (evict whole idle "
          "sequences, least recently used first)");
ABSL_FLAG(ByteSize, page_size, ByteSize{64 << 10},
          "Bytes per store page (multiple of 4K); a page holds one (layer, kv head)'s rows");
ABSL_FLAG(bool, huge_pages, true, "Ask for transparent huge pages on the host arena");
ABSL_FLAG(ByteSize, max_message_size, ByteSize{256 << 20},
          "Largest gRPC request or response; larger gathers/appends get RESOURCE_EXHAUSTED");
ABSL_FLAG(absl::Duration, default_deadline, absl::Seconds(30),
          "Deadline applied to calls that carry none");
ABSL_FLAG(absl::Duration, shutdown_grace, absl::Seconds(10),
          "On SIGTERM/SIGINT, how long in-flight calls may take before they are cancelled");
ABSL_FLAG(std::string, log_level, "info", "debug, info, warning or error");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "kvsparse-server: KV-offloaded sparse decoding service.\n"
      "  kvsparse-server --listen=127.0.0.1:50051 --metrics_listen=127.0.0.1:9464 "
      "--capacity=8G --capacity_policy=evict-lru");
  absl::ParseCommandLine(argc, argv);

  const std::string level = absl::GetFlag(FLAGS_log_level);
  using kvsparse::server::LogLevel;
  if (level == "debug") {
    kvsparse::server::SetMinLogLevel(LogLevel::kDebug);
  } else if (level == "warning") {
    kvsparse::server::SetMinLogLevel(LogLevel::kWarning);
  } else if (level == "error") {
    kvsparse::server::SetMinLogLevel(LogLevel::kError);
  } else if (level != "info") {
    std::fprintf(stderr, "--log_level must be debug, info, warning or error\n");
    return 2;
  }

  kvsparse::server::ServerOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_size).bytes;
  options.default_deadline = absl::GetFlag(FLAGS_default_deadline);
  options.shutdown_grace = absl::GetFlag(FLAGS_shutdown_grace);
  options.store.capacity_bytes = absl::GetFlag(FLAGS_capacity).bytes;
  options.store.page_bytes = absl::GetFlag(FLAGS_page_size).bytes;
  kvsparse::kvstore::HostMemoryOptions host;
  host.huge_pages = absl::GetFlag(FLAGS_huge_pages);
  std::unique_ptr<kvsparse::kvstore::MemoryResource> memory =
      kvsparse::kvstore::NewHostMemoryResource(host);
  options.store.memory = memory.get();
  auto policy = kvsparse::kvstore::ParseCapacityPolicy(absl::GetFlag(FLAGS_capacity_policy));
  if (!policy.ok()) {
    std::fprintf(stderr, "--capacity_policy: %s\n", std::string(policy.status().message()).c_str());
    return 2;
  }
  options.store.policy = *policy;

  // Signals are taken by sigwait below, so block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto server = kvsparse::server::Server::Start(options);
  if (!server.ok()) {
    KVSPARSE_LOG(Error) << "cannot start: " << server.status();
    return 1;
  }
  int sig = 0;
  sigwait(&signals, &sig);
  KVSPARSE_LOG(Info) << "received " << strsignal(sig);
  (*server)->Shutdown();
  (*server)->Wait();
  return 0;
}
