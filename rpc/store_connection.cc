#include "rpc/store_connection.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/row_source.h"
#include "kvstore/placement.h"
#include "rpc/data_plane.h"
#include "rpc/logging.h"

namespace kvsparse::rpc {

absl::StatusOr<std::shared_ptr<grpc::Channel>> OpenStoreChannel(
    const std::string& target, const StoreConnectionOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  // Reads of the store are safe to retry: gRPC retries them on UNAVAILABLE (a dropped
  // connection, a store restarting) within each call's deadline. Appends are not retried
  // here (their expected_length makes a retry safe, but a lost acknowledgement would turn
  // into FAILED_PRECONDITION); the model server retries a failed Decode.
  args.SetServiceConfigJSON(R"({"methodConfig": [{
      "name": [{"service": "kvsparse.v1.KvStore", "method": "Gather"},
               {"service": "kvsparse.v1.KvStore", "method": "GetPageTable"},
               {"service": "kvsparse.v1.KvStore", "method": "GetDataPlane"},
               {"service": "kvsparse.v1.KvStore", "method": "GetSequenceInfo"}],
      "retryPolicy": {"maxAttempts": 4, "initialBackoff": "0.05s", "maxBackoff": "1s",
                      "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]})");
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> creds =
      ChannelCredentialsFor(options.tls);
  if (!creds.ok())
    return absl::InvalidArgumentError(absl::StrCat("tls: ", creds.status().message()));
  return grpc::CreateCustomChannel(target, *creds, args);
}

absl::StatusOr<StoreConnection> ConnectStore(const StoreConnectionOptions& options) {
  if (absl::StatusOr<StoreDataPlane> plane = ParseStoreDataPlane(options.rows.data_plane);
      !plane.ok()) {
    return plane.status();
  }
  absl::StatusOr<std::vector<std::string>> shards = kvstore::ExpandShardList(options.target);
  if (!shards.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("target: ", shards.status().message()));
  }
  if (shards->size() > 1 && !options.rows.arena_file.empty()) {
    return absl::InvalidArgumentError(
        "arena_file maps one store's arena; a worker of several store shards reads through the "
        "ucx data plane or gather");
  }
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (const std::string& target : *shards) {
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = OpenStoreChannel(target, options);
    if (!channel.ok()) return channel.status();
    (*channel)->GetState(/*try_to_connect=*/true);
    channels.push_back(*std::move(channel));
  }
  const absl::Time connect_by = absl::Now() + options.connect_wait;
  StoreConnection c;
  std::vector<std::unique_ptr<engine::RowSource>> sources;
  for (size_t i = 0; i < shards->size(); ++i) {
    if (!channels[i]->WaitForConnected(absl::ToChronoTime(connect_by))) {
      KVSPARSE_LOG(Warning) << "store " << (*shards)[i]
                            << " not reachable yet; reads of its sequences fail with "
                               "UNAVAILABLE until it is";
    }
    std::unique_ptr<RemoteRowSource> remote =
        NewRemoteRowSource(std::move(channels[i]), options.rows);
    c.targets.push_back((*shards)[i]);
    c.shards.push_back(remote.get());
    sources.push_back(std::move(remote));
  }
  c.source = engine::NewShardedRowSource(std::move(sources));
  return c;
}

}  // namespace kvsparse::rpc
