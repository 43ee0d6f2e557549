// Fixed-size pages carved from large slabs, with a hard cap on pages in use.
#ifndef KVSPARSE_KVSTORE_PAGE_POOL_H_
#define KVSPARSE_KVSTORE_PAGE_POOL_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvstore/memory_resource.h"

namespace kvsparse::kvstore {

struct PagePoolOptions {
  size_t page_bytes = 64 << 10;        // bytes per page; a multiple of 4096
  size_t slab_bytes = 64 << 20;        // bytes asked of the MemoryResource at a time (whole pages)
  size_t capacity_bytes = 1ull << 30;  // most bytes of pages in use at once
};

// Thread-safe. Slabs are kept until the pool is destroyed; freed pages are reused first (LIFO),
// and fresh pages of a slab are handed out in address order, so a bulk allocation is contiguous.
// A slab none of whose pages is in use any more (e.g. after its sequences were dropped) is given
// back to the operating system (MemoryResource::Release, under the pool's lock) and faults in
// again as its pages are reused: memory the pool holds is at most the pages in use plus the
// slabs that still hold one.
// A page can have more than one holder (Share: a sequence forked from another holds the pages of
// their common prefix); Free gives it back only when its last holder frees it.
// Lock order: PagePool::mu_ is a leaf (taken with no other lock ordering constraint after it).
class PagePool {
 public:
  // REQUIRES: resource outlives the pool.
  PagePool(MemoryResource* resource, PagePoolOptions options);
  ~PagePool();
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  // Appends n pages to *out, or none: RESOURCE_EXHAUSTED if n more pages would pass the
  // capacity or the resource cannot supply a slab.
  [[nodiscard]] absl::Status Allocate(size_t n, std::vector<uint8_t*>* out);
  // Releases one holder of each page; a page goes back to the pool when its last holder releases
  // it. REQUIRES: every page came from this pool and is in use.
  void Free(const std::vector<uint8_t*>& pages);
  // Adds a holder to each page (counted once against the capacity, however many hold it).
  // REQUIRES: every page came from this pool and is in use.
  void Share(absl::Span<uint8_t* const> pages);
  // How many of the pages in `releases` would go back to the pool if each page p lost
  // releases[p] holders (a page whose holders are all in it).
  size_t PagesFreedBy(const absl::flat_hash_map<const uint8_t*, uint32_t>& releases) const;
  // Of `pages`, those held by more than one holder right now.
  template <typename Pages>
  size_t SharedAmong(const Pages& pages) const {
    std::lock_guard<std::mutex> lock(mu_);
    size_t n = 0;
    for (const uint8_t* p : pages) n += extra_holders_.contains(p);
    return n;
  }

  // Bytes counted against the capacity that are not pages (a sequence's bookkeeping, held from
  // its creation to its end): RESOURCE_EXHAUSTED when they do not fit beside the pages in use.
  [[nodiscard]] absl::Status Charge(size_t bytes);
  void Uncharge(size_t bytes);
  size_t charged_bytes() const;

  // Whether n more pages and `bytes` more charged bytes fit under the capacity right now.
  bool Fits(size_t n, size_t bytes = 0) const;
  size_t page_bytes() const { return options_.page_bytes; }
  size_t capacity_pages() const { return capacity_pages_; }
  size_t pages_in_use() const;

 private:
  MemoryResource* const resource_;
  const PagePoolOptions options_;
  const size_t capacity_pages_;

  mutable std::mutex mu_;
  size_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  size_t charged_ ABSL_GUARDED_BY(mu_) = 0;  // bytes (Charge)
  // Pages with more than one holder -> holders beyond the first.
  absl::flat_hash_map<const uint8_t*, uint32_t> extra_holders_ ABSL_GUARDED_BY(mu_);
  // Whether n more pages and `bytes` more charged bytes fit. REQUIRES: mu_ held.
  bool FitsLocked(size_t n, size_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<uint8_t*> free_ ABSL_GUARDED_BY(mu_);
  struct Slab {
    uint8_t* base;
    size_t bytes;
    size_t used = 0;        // its pages in use
    bool released = false;  // given back (Release) and not used since
  };
  std::vector<Slab> slabs_ ABSL_GUARDED_BY(mu_);
  std::map<const uint8_t*, size_t> slab_of_ ABSL_GUARDED_BY(mu_);  // base -> index in slabs_
  // The slab holding page p. REQUIRES: mu_ held, p from this pool.
  Slab& SlabOf(const uint8_t* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint8_t* fresh_next_ ABSL_GUARDED_BY(mu_) = nullptr;  // next never-used page of the last slab
  uint8_t* fresh_end_ ABSL_GUARDED_BY(mu_) = nullptr;
  size_t slab_total_pages_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvsparse::kvstore

#endif  // KVSPARSE_KVSTORE_PAGE_POOL_H_
