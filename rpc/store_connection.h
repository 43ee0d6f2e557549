// A decode engine's connection to a kvsparse store in other processes: the server's
// --role=worker (--store, --store_tls_*, --store_token, --store_data_plane, ...) and the PyTorch
// op's store_target (store_tls_*, store_token). One place for the channel (TLS, message limits,
// reads retried on UNAVAILABLE within a call's deadline), the bearer token and the data plane,
// over every shard of a shard list.
#ifndef KVSPARSE_RPC_STORE_CONNECTION_H_
#define KVSPARSE_RPC_STORE_CONNECTION_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/row_source.h"
#include "rpc/remote_row_source.h"
#include "rpc/security.h"

namespace kvsparse::rpc {

struct StoreConnectionOptions {
  // host:port of one store, or a shard list (kvstore::ExpandShardList: every shard's address).
  std::string target;
  // TLS towards stores with --tls_cert: ca verifies them, cert + key are this side's certificate
  // for a store with --tls_client_ca; all empty: plaintext.
  TlsFiles tls;
  // Token, mapped arena file, data plane (RemoteRowSourceOptions) of every shard's row source.
  RemoteRowSourceOptions rows;
  // Largest message either way: at least the largest gather a decode reads (the store's
  // --max_message_size).
  int max_message_bytes = 256 << 20;
  // How long to wait for the shards to connect, all together; a shard not up by then is logged
  // and its sequences' reads fail with UNAVAILABLE until it is.
  absl::Duration connect_wait = absl::Seconds(5);
};

// The channel to one store of these options: TLS (or plaintext), the message limits, and the
// store's reads (Gather, GetPageTable, GetDataPlane, GetSequenceInfo) retried on UNAVAILABLE.
// INVALID_ARGUMENT naming the TLS file that does not read.
absl::StatusOr<std::shared_ptr<grpc::Channel>> OpenStoreChannel(
    const std::string& target, const StoreConnectionOptions& options);

struct StoreConnection {
  std::unique_ptr<engine::RowSource> source;  // one row source over every shard
  // Each shard's address and row source (owned by `source`), in the shard list's order.
  std::vector<std::string> targets;
  std::vector<RemoteRowSource*> shards;
};

// Row sources over every shard of options.target behind one source. INVALID_ARGUMENT for a bad
// shard list, data plane or TLS file (the message names the setting as this header does), or an
// arena file with several shards (a mapped arena is one store's).
absl::StatusOr<StoreConnection> ConnectStore(const StoreConnectionOptions& options);

}  // namespace kvsparse::rpc

#endif  // KVSPARSE_RPC_STORE_CONNECTION_H_
