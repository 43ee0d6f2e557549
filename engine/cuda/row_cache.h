// HashAttention's row cache on the device (the hash top-k runner's per-sequence state): the rows
// selected at the last step, a fraction of the tokens per kv head, kept in DeviceLayer::cache
// (consecutive steps select mostly the same rows, which then stay on the device). Also the
// layout of a set of rows in one buffer, which the cache and the dense runner's staged rows
// share.
#ifndef KVSPARSE_ENGINE_CUDA_ROW_CACHE_H_
#define KVSPARSE_ENGINE_CUDA_ROW_CACHE_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "engine/cuda/device_memory.h"

namespace kvsparse::engine::gpu {

// Rows of Hkv heads, cap per head, in one allocation: ascending tokens, (a row cache's) the slot
// of each, the counts, then the K and V rows. A row cache has slots; a plain row set not.
struct RowsLayout {
  size_t tokens = 0, slots = 0, count = 0, k = 0, v = 0, total = 0;
  static RowsLayout Of(int32_t hkv, int32_t cap, size_t row, bool with_slots);
};

// Row-cache slots per kv head for a sequence of n tokens: `fraction` of n rounded up to 64, at
// most rows_cap (the longest union); 0 without a cache (fraction <= 0).
int32_t RowCacheSlots(double fraction, int32_t n, int32_t rows_cap);

// Grows a layer's row cache to `cap` slots per kv head (charged to e), keeping what it holds.
absl::Status GrowRowCache(DeviceMemory* memory, DeviceSequence* e, DeviceLayer* l, int32_t hkv,
                          int32_t cap, size_t row, BusySequences busy);

}  // namespace kvsparse::engine::gpu

#endif  // KVSPARSE_ENGINE_CUDA_ROW_CACHE_H_
