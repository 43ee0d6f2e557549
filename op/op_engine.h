// What torch.ops.kvsparse holds per engine handle: a decode engine and where its sequences live,
// the store in this process (engine::Embedded) or a kvsparse-server store in another process.
// Kept apart from torch_ops.cc: the remote store's gRPC and protobuf headers must not meet
// torch's (it ships its own, older protobuf headers), so this header shows neither.
#ifndef KVSPARSE_OP_OP_ENGINE_H_
#define KVSPARSE_OP_OP_ENGINE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "engine/decode_engine.h"
#include "engine/embedded.h"
#include "kvstore/store.h"
#include "rpc/store_connection.h"

namespace kvsparse::torch_ops {

class OpEngine {
 public:
  virtual ~OpEngine() = default;
  virtual engine::DecodeEngine& engine() = 0;
  // The store's rows as the engine reads them (Describe, Gather).
  virtual engine::RowSource& source() = 0;
  // The GPU backend's device, -1 without one.
  virtual int device() const = 0;
  virtual absl::Status Create(const std::string& id, const kvstore::ModelShape& shape,
                              const kvstore::Placement& placement) = 0;
  // A new sequence `id` holding the first num_tokens tokens of `source`, their whole pages shared
  // in the store (kvstore::Store::ForkSequence); placement: the source's when none.
  virtual absl::Status Fork(const std::string& source, const std::string& id, uint64_t num_tokens,
                            const std::optional<kvstore::Placement>& placement) = 0;
  virtual absl::Status Drop(const std::string& id) = 0;
  virtual absl::StatusOr<std::vector<uint64_t>> Lengths(const std::string& id) = 0;
  // One layer's new tokens (r.num_layers = 1), k and v in host memory; without
  // r.expected_length the layer's current length is expected. A remote store takes a long
  // prefill in several Append messages: a failure part-way leaves the ones before it appended
  // (a prefix; the layer's length says how far) and returns the error.
  virtual absl::Status Append(const kvstore::AppendRequest& r) = 0;
  // The store's bytes used and capacity.
  virtual absl::StatusOr<std::pair<uint64_t, uint64_t>> StoreBytes() = 0;

  // Notes that the GPU backend refused a call for `why` (it runs on the CPU engine, q and the
  // output through host memory): the first time for each reason, the reason waits in
  // TakeRefusals, which the Python package turns into one warning per engine and reason (a
  // TORCH_WARN from an op reaches Python's warnings only as text on stderr).
  void NoteRefusal(absl::string_view why) ABSL_LOCKS_EXCLUDED(warned_mu_) {
    absl::MutexLock lock(&warned_mu_);
    if (warned_.emplace(why).second) pending_.emplace_back(why);
  }
  // The reasons noted since the last call, each once.
  std::vector<std::string> TakeRefusals() ABSL_LOCKS_EXCLUDED(warned_mu_) {
    absl::MutexLock lock(&warned_mu_);
    std::vector<std::string> out;
    out.swap(pending_);
    return out;
  }

 private:
  absl::Mutex warned_mu_;
  absl::flat_hash_set<std::string> warned_ ABSL_GUARDED_BY(warned_mu_);
  std::vector<std::string> pending_ ABSL_GUARDED_BY(warned_mu_);
};

// The engine's method from the op's method string: a serialized kvsparse.v1.Method, base64 (the
// Python package's kvsparse.torch.ops.method_wire), decoded and defaulted by the server's codec
// (rpc::FromProto), so the op and the gRPC service read a method the same way. INVALID_ARGUMENT
// for anything else, or for what the codec refuses (naming the field).
absl::StatusOr<engine::Method> MethodFromWire(const std::string& base64);

// The store and the engine in this process.
absl::StatusOr<std::unique_ptr<OpEngine>> NewLocalOpEngine(engine::EmbeddedOptions options);

// The engine in this process over the kvsparse-server store at store.target (host:port, one
// store), reached as store says (TLS, bearer token; rpc/store_connection.h, as the server's
// workers reach theirs): sequences through the C++ client, rows through the store's Gather RPC
// (which the GPU backend stages for its kernels). options: the engine's and the GPU backend's
// (its store fields are not used).
absl::StatusOr<std::unique_ptr<OpEngine>> NewRemoteOpEngine(
    const rpc::StoreConnectionOptions& store, const engine::EmbeddedOptions& options);

}  // namespace kvsparse::torch_ops

#endif  // KVSPARSE_OP_OP_ENGINE_H_
