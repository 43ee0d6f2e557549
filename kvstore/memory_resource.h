// The seam between the store and the memory it lives in. The store asks a MemoryResource for
// large slabs and carves pages out of them; swapping the resource moves the host tier to pinned,
// huge-page or shared memory without touching the store, and lets tests inject failures.
#ifndef KVSPARSE_KVSTORE_MEMORY_RESOURCE_H_
#define KVSPARSE_KVSTORE_MEMORY_RESOURCE_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvsparse::kvstore {

// Thread-safe: Allocate and Deallocate may be called concurrently.
class MemoryResource {
 public:
  virtual ~MemoryResource() = default;
  // Returns `bytes` bytes aligned to at least 4096, or RESOURCE_EXHAUSTED.
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  // REQUIRES: p came from Allocate(bytes) on this resource and was not yet freed.
  virtual void Deallocate(void* p, size_t bytes) = 0;
  virtual absl::string_view name() const = 0;
};

struct HostMemoryOptions {
  // Ask the kernel for transparent huge pages on each slab (madvise MADV_HUGEPAGE): fewer TLB
  // misses for random row gathers over gigabytes.
  bool huge_pages = true;
};

// Anonymous private mmap'd host memory (pageable). Pinned memory: kvstore/cuda_host_memory.h.
std::unique_ptr<MemoryResource> NewHostMemoryResource(HostMemoryOptions options = {});

// The store's arena in a file (--arena_file): `bytes` of it, created or truncated to that size
// and mapped shared, carved into slabs in order (a slab's space is reused only once every slab is
// back). Put it on a memory-backed filesystem (tmpfs, a Kubernetes emptyDir of medium Memory) so
// that another process (a worker container of the same pod) can map the same pages.
// INVALID_ARGUMENT when the file cannot be created, sized or mapped (naming the path).
absl::StatusOr<std::unique_ptr<MemoryResource>> NewFileMemoryResource(const std::string& path,
                                                                      size_t bytes);

}  // namespace kvsparse::kvstore

#endif  // KVSPARSE_KVSTORE_MEMORY_RESOURCE_H_
