// The server process's heap, given back to the operating system: request and reply buffers
// (an append's rows, a gather's reply: up to --max_message_size each), gRPC's read buffers and
// the bookkeeping of dropped or evicted sequences are malloc'd; glibc keeps what they free in
// its arenas, so a burst of large calls or sequence churn would leave the RSS above the store's
// capacity for good. MemoryTrimmer makes allocations of 1 MiB and more come from their own
// mappings (returned at once when freed: M_MMAP_THRESHOLD, which also stops glibc from raising
// that threshold after such a free) and every `interval` hands the arenas' free memory back
// (malloc_trim). The store's own pages are bounded by --capacity and given back per slab
// (kvstore/page_pool.h). docs/RELIABILITY.md states the resulting bound.
#ifndef KVSPARSE_SERVER_MEMORY_TRIMMER_H_
#define KVSPARSE_SERVER_MEMORY_TRIMMER_H_

#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace kvsparse::server {

class MemoryTrimmer {
 public:
  // interval <= 0: neither the threshold nor the thread (glibc's defaults).
  explicit MemoryTrimmer(absl::Duration interval);
  ~MemoryTrimmer();
  MemoryTrimmer(const MemoryTrimmer&) = delete;
  MemoryTrimmer& operator=(const MemoryTrimmer&) = delete;

  // Allocations at least this large get their own mapping.
  static constexpr size_t kMmapThreshold = 1 << 20;

 private:
  const absl::Duration interval_;
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace kvsparse::server

#endif  // KVSPARSE_SERVER_MEMORY_TRIMMER_H_
