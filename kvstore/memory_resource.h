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

class SharedArena;

// Thread-safe: Allocate and Deallocate may be called concurrently.
class MemoryResource {
 public:
  virtual ~MemoryResource() = default;
  // Returns `bytes` bytes aligned to at least 4096, or RESOURCE_EXHAUSTED.
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  // REQUIRES: p came from Allocate(bytes) on this resource and was not yet freed.
  virtual void Deallocate(void* p, size_t bytes) = 0;
  // Gives the physical memory of [p, p + bytes), which lies inside an allocation and holds
  // nothing anyone reads, back to the operating system while the range stays allocated: the next
  // write there faults in zeroed pages. Resources whose pages must stay (pinned, shared with
  // other processes) keep them: the default does nothing.
  virtual void Release(void* p, size_t bytes) {}
  virtual absl::string_view name() const = 0;
  // The resource's pages as other processes see them (kvstore/shared_arena.h), or null when
  // they live in this process only.
  virtual SharedArena* shared_arena() { return nullptr; }
};

struct HostMemoryOptions {
  // Ask the kernel for transparent huge pages on each slab (madvise MADV_HUGEPAGE): fewer TLB
  // misses for random row gathers over gigabytes.
  bool huge_pages = true;
};

// Anonymous private mmap'd host memory (pageable). Pinned memory: kvstore/cuda_host_memory.h.
std::unique_ptr<MemoryResource> NewHostMemoryResource(HostMemoryOptions options = {});

}  // namespace kvsparse::kvstore

#endif  // KVSPARSE_KVSTORE_MEMORY_RESOURCE_H_
