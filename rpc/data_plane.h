// The planes a worker reads a store's rows over besides the Gather RPC (to which every read falls
// back while a plane cannot serve it): a mapping of the store's arena file (a pod that shares
// it), or UCX from the store's exported arena (any host). One implementation a file
// (data_plane_mapped_file.cc, data_plane_ucx.cc); the remote row source (remote_row_source.h)
// holds at most one and asks it for a reader of the store's current arena.
#ifndef KVSPARSE_RPC_DATA_PLANE_H_
#define KVSPARSE_RPC_DATA_PLANE_H_

#include <grpcpp/client_context.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kvsparse/v1/kvstore.grpc.pb.h"
#include "kvstore/shared_arena.h"

namespace kvsparse::rpc {

// A worker's --store_data_plane (RemoteRowSourceOptions::data_plane): "gather" (or empty), "ucx"
// (one batched gather message per read) or "ucx-rma" (one-sided gets per row, for RDMA).
enum class StoreDataPlane { kGather, kUcx, kUcxRma };
// INVALID_ARGUMENT naming the values for anything else.
absl::StatusOr<StoreDataPlane> ParseStoreDataPlane(absl::string_view name);

class DataPlane {
 public:
  virtual ~DataPlane() = default;
  // How the logs name it (the flag that chose it).
  virtual const char* name() const = 0;
  // A reader of the store's current arena. `stub` reaches the store, with `prepare` setting a
  // call's deadline and credentials, for a plane that needs the arena's address from it.
  virtual absl::StatusOr<std::shared_ptr<const kvstore::ArenaReader>> Open(
      v1::KvStore::StubInterface& stub, const std::function<void(grpc::ClientContext*)>& prepare,
      absl::Time deadline) = 0;
};

// The store's --arena_file as mounted here.
std::unique_ptr<DataPlane> NewMappedFilePlane(std::string path);
// UCX over `transports` (UCX_TLS-style; empty: UCX's choice); one_sided: ucx-rma.
absl::StatusOr<std::unique_ptr<DataPlane>> NewUcxPlane(const std::string& transports,
                                                       bool one_sided);

}  // namespace kvsparse::rpc

#endif  // KVSPARSE_RPC_DATA_PLANE_H_
