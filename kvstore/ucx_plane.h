// Reads of the store's arena over UCX (issue 16's data plane): the store registers its arena
// file's mapping with UCX and hands out its worker address and the region's remote key (over
// gRPC, the control plane); a reader connects and reads the rows it selects either with one
// batched gather per read (an active message the store's progress thread answers with every row)
// or with one-sided RMA gets (no work on the store's CPU per row where the transport is truly
// one-sided, RDMA). UCX picks the transport (UCX_TLS, or `transports` here).
//
// Reuse detection is the shared arena's (kvstore/shared_arena.h): the reader gets the rows,
// waits for them, then gets the generations of the pages it read, and throws the rows away if one
// changed. No gRPC here.
#ifndef KVSPARSE_KVSTORE_UCX_PLANE_H_
#define KVSPARSE_KVSTORE_UCX_PLANE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvstore/shared_arena.h"

namespace kvsparse::kvstore {

// What a reader needs to reach an exported arena (the store's answer to GetDataPlane).
struct UcxArenaAddress {
  uint64_t arena_id = 0;
  std::string worker_address;  // ucp_worker_get_address
  std::string rkey;            // ucp_rkey_pack of the arena's whole mapping
  uint64_t base_address = 0;   // the mapping's address in the store
  uint64_t arena_bytes = 0;    // the file's size
  uint64_t data_offset = 0;    // where pages start (the generations precede it)
  uint64_t granule = 0;        // bytes per generation
  // Random per export; a batched gather must carry it (UCX's own listener has no access control:
  // only callers GetDataPlane answered can read). One-sided gets are not checked by the store.
  uint64_t secret = 0;
};

// Whether this build has UCX.
bool UcxAvailable();

// The store's side. Thread-safe after Create; a progress thread serves transports that need the
// target's help (TCP).
class UcxExport {
 public:
  // Registers the arena's mapping. transports: UCX_TLS-style list ("" = UCX's choice, e.g.
  // "posix,sysv,cma,tcp"). FAILED_PRECONDITION if the arena is not exportable; UNAVAILABLE if UCX
  // cannot start (or the build has none).
  // copy_threads: threads besides the progress thread that copy a large gather's rows (scattered
  // rows are each a cache and TLB miss: the copy is latency-bound and parallelises); -1: a
  // quarter of the machine's cores, at most 3.
  static absl::StatusOr<std::unique_ptr<UcxExport>> Create(SharedArena* arena,
                                                           const std::string& transports = "",
                                                           int copy_threads = -1);
  virtual ~UcxExport() = default;
  virtual const UcxArenaAddress& address() const = 0;
};

// How a reader reads rows. kGather: one active message per read names every row; the store's
// progress thread copies them (and the pages' generations) into one reply: two messages a read
// on any transport, the store's CPU doing a memcpy per row (what pays over TCP and shared
// memory). kOneSided: an RMA get per row and per page generation, no store CPU where the transport
// is truly one-sided (RDMA); over TCP UCX emulates each get with messages (slow: docs/PERF.md).
enum class UcxReadMode { kGather, kOneSided };

// The reader's side: one UCX context and worker for every arena it reads. Thread-safe (calls are
// serialised on the worker: one read in flight at a time).
class UcxReader {
 public:
  static absl::StatusOr<std::unique_ptr<UcxReader>> Create(const std::string& transports = "",
                                                           UcxReadMode mode = UcxReadMode::kGather);
  virtual ~UcxReader() = default;
  // Connects to an exported arena. UNAVAILABLE if the store cannot be reached;
  // INVALID_ARGUMENT for an address that does not parse.
  virtual absl::StatusOr<std::shared_ptr<const ArenaReader>> Connect(const UcxArenaAddress& a,
                                                                     absl::Duration timeout) = 0;
};

}  // namespace kvsparse::kvstore

#endif  // KVSPARSE_KVSTORE_UCX_PLANE_H_
