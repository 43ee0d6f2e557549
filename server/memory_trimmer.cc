#include "server/memory_trimmer.h"

#include <malloc.h>

namespace kvsparse::server {

MemoryTrimmer::MemoryTrimmer(absl::Duration interval) : interval_(interval) {
  if (interval_ <= absl::ZeroDuration()) return;
  mallopt(M_MMAP_THRESHOLD, static_cast<int>(kMmapThreshold));
  thread_ = std::thread([this] {
    while (!stop_.WaitForNotificationWithTimeout(interval_)) malloc_trim(0);
  });
}

MemoryTrimmer::~MemoryTrimmer() {
  stop_.Notify();
  if (thread_.joinable()) thread_.join();
}

}  // namespace kvsparse::server
