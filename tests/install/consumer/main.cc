// Uses the installed kvsparse client: connects to a port nothing listens on and expects a clean
// UNAVAILABLE, which proves headers, libraries and dependencies resolve.
#include <cstdio>

#include "client/kvstore_client.h"

int main(int argc, char** argv) {
  kvsparse::client::ClientOptions options;
  options.target = argc > 1 ? argv[1] : "127.0.0.1:1";
  options.timeout = absl::Seconds(2);
  auto client = kvsparse::client::KvStoreClient::Connect(options);
  if (!client.ok()) return 1;
  absl::Status s = (*client)->GetStats().status();
  std::printf("consumer: GetStats -> %s\n", s.ToString().c_str());
  return s.code() == absl::StatusCode::kUnavailable ? 0 : 1;
}
