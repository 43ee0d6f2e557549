// C++ client of the kvsparse KvStore service. Every call carries a deadline (the client's
// timeout unless one is given), and every result is an absl::Status(Or) with the server's code
// and message.
//
//   kvsparse::client::ClientOptions options;
//   options.target = "127.0.0.1:50051";
//   auto client = kvsparse::client::KvStoreClient::Connect(options);
//   auto info = (*client)->CreateSequence("s1", shape);
//
// Thread-safe: one client may be shared by many threads (gRPC channels multiplex calls).
#ifndef KVSPARSE_CLIENT_KVSTORE_CLIENT_H_
#define KVSPARSE_CLIENT_KVSTORE_CLIENT_H_

#include <grpcpp/channel.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kvsparse/v1/kvstore.grpc.pb.h"
#include "rpc/security.h"

namespace kvsparse::client {

struct ClientOptions {
  std::string target = "127.0.0.1:50051";      // host:port of kvsparse-server
  absl::Duration timeout = absl::Seconds(30);  // deadline of each call
  // Largest message accepted or sent; match the server's --max_message_size.
  int max_message_bytes = 256 << 20;
  // TLS towards a server with --tls_cert (ca: the server's CA; cert + key: this client's
  // certificate for --tls_client_ca); all empty: plaintext.
  rpc::TlsFiles tls;
  std::string token;  // bearer token for a server with --auth_tokens; empty: none
};

// The channel of these options (TLS when tls.ca is set), and a call's context: deadline
// `timeout` from now and the bearer token.
absl::StatusOr<std::shared_ptr<grpc::Channel>> OpenChannel(const ClientOptions& options);
void PrepareContext(const ClientOptions& options, grpc::ClientContext* ctx);

class KvStoreClient {
 public:
  // Creates the channel (connection is lazy; see WaitForReady).
  static absl::StatusOr<std::unique_ptr<KvStoreClient>> Connect(ClientOptions options);

  // Blocks until the channel is connected or `timeout` passes (UNAVAILABLE).
  absl::Status WaitForReady(absl::Duration timeout);
  // grpc.health.v1 Check: OK if SERVING, UNAVAILABLE if NOT_SERVING, else the call's status.
  absl::Status CheckHealth(const std::string& service = "");

  absl::StatusOr<v1::SequenceInfo> CreateSequence(const std::string& sequence_id,
                                                  const v1::ModelShape& shape,
                                                  const v1::Placement& placement = {});
  // A new sequence holding the first num_tokens tokens of source_id, sharing its whole pages
  // (KvStore.ForkSequence); placement null: the source's.
  absl::StatusOr<v1::SequenceInfo> ForkSequence(const std::string& source_id,
                                                const std::string& sequence_id, uint64_t num_tokens,
                                                const v1::Placement* placement = nullptr);
  absl::StatusOr<v1::DropSequenceResponse> DropSequence(const std::string& sequence_id);
  absl::StatusOr<v1::AppendResponse> Append(const v1::AppendRequest& request);
  absl::StatusOr<v1::GatherResponse> Gather(const v1::GatherRequest& request);
  // Like Gather, into a caller-owned response (lets a loop reuse its buffers).
  absl::Status Gather(const v1::GatherRequest& request, v1::GatherResponse* response);
  absl::StatusOr<v1::SequenceInfo> GetSequenceInfo(const std::string& sequence_id);
  absl::StatusOr<std::vector<v1::SequenceInfo>> ListSequences();
  absl::StatusOr<v1::StoreStats> GetStats();

  const ClientOptions& options() const { return options_; }
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }

 private:
  explicit KvStoreClient(ClientOptions options);
  void PrepareCall(grpc::ClientContext* ctx) const;  // PrepareContext with this client's options

  const ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvStore::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
};

// A sharded fleet of stores (kvsparse-server --shard_index/--shard_count): one client per shard,
// in shard order, and each sequence's shard by kvstore::ShardOf, as the workers place it.
class StoreShards {
 public:
  // options.target: one address, or the shards' (kvstore::ExpandShardList: "a:1,b:2",
  // "kvsparse-store-{0..3}.kvsparse-store:50051"); the other options hold for every shard.
  static absl::StatusOr<std::unique_ptr<StoreShards>> Connect(const ClientOptions& options);

  size_t size() const { return shards_.size(); }
  KvStoreClient& shard(size_t i) { return *shards_[i]; }
  // The shard holding (or to hold) sequence_id.
  KvStoreClient& For(absl::string_view sequence_id);
  // Every shard's GetStats: FAILED_PRECONDITION unless shard i of the list says it is shard i of
  // size() (a list out of order, or stores run without --shard_index/--shard_count, would place
  // sequences where workers with the right list do not look); the call's error otherwise.
  // A single, unsharded store passes.
  absl::Status CheckPlacement();

 private:
  std::vector<std::unique_ptr<KvStoreClient>> shards_;
};

}  // namespace kvsparse::client

#endif  // KVSPARSE_CLIENT_KVSTORE_CLIENT_H_
