#include "kvstore/page_pool.h"

#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "kvstore/shared_arena.h"

namespace kvsparse::kvstore {

PagePool::PagePool(MemoryResource* resource, PagePoolOptions options)
    : resource_(resource),
      options_(options),
      capacity_pages_(options.page_bytes ? options.capacity_bytes / options.page_bytes : 0) {}

PagePool::~PagePool() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const Slab& s : slabs_) resource_->Deallocate(s.base, s.bytes);
}

bool PagePool::FitsLocked(size_t n, size_t bytes) const {
  if (in_use_ + n > capacity_pages_) return false;
  return (in_use_ + n) * options_.page_bytes + charged_ + bytes <= options_.capacity_bytes;
}

bool PagePool::Fits(size_t n, size_t bytes) const {
  std::lock_guard<std::mutex> lock(mu_);
  return FitsLocked(n, bytes);
}

absl::Status PagePool::Charge(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!FitsLocked(0, bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "store full: ", bytes, " more bytes needed, ",
        options_.capacity_bytes -
            std::min(options_.capacity_bytes, in_use_ * options_.page_bytes + charged_),
        " free"));
  }
  charged_ += bytes;
  return absl::OkStatus();
}

void PagePool::Uncharge(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  charged_ -= bytes;
}

size_t PagePool::charged_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return charged_;
}

size_t PagePool::pages_in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}

PagePool::Slab& PagePool::SlabOf(const uint8_t* p) {
  auto it = slab_of_.upper_bound(p);  // the first slab above p; p's is the one before
  return slabs_[std::prev(it)->second];
}

absl::Status PagePool::Allocate(size_t n, std::vector<uint8_t*>* out) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!FitsLocked(n, 0)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("store full: ", n, " more pages of ", options_.page_bytes, " bytes needed, ",
                     capacity_pages_ - in_use_, " of ", capacity_pages_, " free (", charged_,
                     " bytes of sequences' bookkeeping beside them)"));
  }
  const size_t first = out->size();
  out->reserve(first + n);
  for (size_t need = n; need > 0; --need) {
    // Fresh pages first (consecutive addresses keep a bulk append's rows together), then
    // freed pages, then a new slab.
    if (fresh_next_ != fresh_end_) {
      out->push_back(fresh_next_);
      fresh_next_ += options_.page_bytes;
      continue;
    }
    if (!free_.empty()) {
      out->push_back(free_.back());
      free_.pop_back();
      continue;
    }
    // Here every mapped page is in use or taken by this call, so need <= pages_left: the
    // capacity check above guarantees it, and no more than the capacity is ever mapped.
    const size_t pages_left = capacity_pages_ - slab_total_pages_;
    const size_t slab_pages = std::min(options_.slab_bytes / options_.page_bytes, pages_left);
    const size_t bytes = std::max(slab_pages, need) * options_.page_bytes;
    absl::StatusOr<void*> slab = resource_->Allocate(bytes);
    if (!slab.ok()) {
      // Keep the pages this call already took for later calls; hand none out.
      free_.insert(free_.end(), out->begin() + first, out->end());
      out->resize(first);
      return slab.status();
    }
    slab_of_[static_cast<uint8_t*>(*slab)] = slabs_.size();
    slabs_.push_back({static_cast<uint8_t*>(*slab), bytes});
    slab_total_pages_ += bytes / options_.page_bytes;
    fresh_next_ = static_cast<uint8_t*>(*slab);
    fresh_end_ = fresh_next_ + bytes;
    ++need;  // this iteration took no page
  }
  for (size_t i = first; i < out->size(); ++i) {
    Slab& slab = SlabOf((*out)[i]);
    ++slab.used;
    slab.released = false;
  }
  in_use_ += n;
  return absl::OkStatus();
}

void PagePool::Free(const std::vector<uint8_t*>& pages) {
  std::vector<uint8_t*> gone;  // pages whose last holder this was
  gone.reserve(pages.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (uint8_t* p : pages) {
      auto it = extra_holders_.find(p);
      if (it == extra_holders_.end()) {
        gone.push_back(p);
      } else if (--it->second == 0) {
        extra_holders_.erase(it);
      }
    }
  }
  // Readers in other processes must learn that these pages' rows are going away before anyone
  // can write them again (kvstore/shared_arena.h). They are still counted in use, so nobody is
  // handed one of them meanwhile.
  if (SharedArena* arena = resource_->shared_arena(); arena != nullptr) {
    for (const uint8_t* p : gone) arena->Retire(p);
  }
  std::lock_guard<std::mutex> lock(mu_);
  free_.insert(free_.end(), gone.rbegin(), gone.rend());
  in_use_ -= gone.size();
  for (const uint8_t* p : gone) {
    Slab& slab = SlabOf(p);
    // The last page of a slab going: nothing on it is read any more, so its memory can go back
    // (its pages stay in the free list and fault in again when reused). Under the lock, so no
    // Allocate hands one of them out while they are being released.
    if (--slab.used == 0 && !slab.released) {
      resource_->Release(slab.base, slab.bytes);
      slab.released = true;
    }
  }
}

void PagePool::Share(absl::Span<uint8_t* const> pages) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const uint8_t* p : pages) ++extra_holders_[p];
}

size_t PagePool::PagesFreedBy(const absl::flat_hash_map<const uint8_t*, uint32_t>& releases) const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const auto& [p, count] : releases) {
    auto it = extra_holders_.find(p);
    n += count >= (it == extra_holders_.end() ? 1 : it->second + 1);
  }
  return n;
}

}  // namespace kvsparse::kvstore
