#include "engine/cuda/row_cache.h"

#include <algorithm>
#include <cmath>
#include <tuple>

namespace kvsparse::engine::gpu {

RowsLayout RowsLayout::Of(int32_t hkv, int32_t cap, size_t row, bool with_slots) {
  RowsLayout l;
  Carver c(nullptr);
  l.tokens = c.used();
  c.Take<int32_t>(static_cast<size_t>(hkv) * cap);
  l.slots = c.used();
  c.Take<int32_t>(with_slots ? static_cast<size_t>(hkv) * cap : 0);
  l.count = c.used();
  c.Take<int32_t>(hkv);
  l.k = c.used();
  c.Take<uint8_t>(row * hkv * cap);
  l.v = c.used();
  c.Take<uint8_t>(row * hkv * cap);
  l.total = c.used();
  return l;
}

int32_t RowCacheSlots(double fraction, int32_t n, int32_t rows_cap) {
  if (fraction <= 0.0 || n <= 0) return 0;
  const double want = std::ceil(std::min(fraction, 1.0) * n);
  const int64_t rounded = (static_cast<int64_t>(want) + 63) / 64 * 64;
  return static_cast<int32_t>(std::min<int64_t>(rounded, rows_cap));
}

absl::Status GrowRowCache(DeviceMemory* memory, DeviceSequence* e, DeviceLayer* l, int32_t hkv,
                          int32_t cap, size_t row, BusySequences busy) {
  const RowsLayout to = RowsLayout::Of(hkv, cap, row, true);
  const RowsLayout from = RowsLayout::Of(hkv, l->cache_cap, row, true);
  const int32_t old_cap = l->cache_cap;
  const cudaStream_t stream = memory->stream();
  auto copy = [&](DevBuf& next, const DevBuf& prev) {
    char* dst = next.as<char>();
    const char* src = prev.as<char>();
    const size_t ints = sizeof(int32_t);
    cudaError_t err = cudaSuccess;
    // Per kv head: tokens and slots (old_cap each), the count, K and V rows (old_cap each).
    for (const auto& [t, f, w] :
         {std::tuple{to.tokens, from.tokens, ints}, std::tuple{to.slots, from.slots, ints},
          std::tuple{to.k, from.k, row}, std::tuple{to.v, from.v, row}}) {
      if (err == cudaSuccess) {
        err = cudaMemcpy2DAsync(dst + t, w * cap, src + f, w * old_cap, w * old_cap, hkv,
                                cudaMemcpyDeviceToDevice, stream);
      }
    }
    if (err == cudaSuccess) {
      err = cudaMemcpyAsync(dst + to.count, src + from.count, ints * hkv, cudaMemcpyDeviceToDevice,
                            stream);
    }
    return err;
  };
  const bool fresh = l->cache.ptr == nullptr;
  if (absl::Status s = memory->Regrow(e, &l->cache, to.total, busy, copy); !s.ok()) return s;
  if (fresh) {  // empty
    KVS_CUDA_OK(cudaMemsetAsync(l->cache.as<char>() + to.count, 0, sizeof(int32_t) * hkv, stream),
                "row cache");
  }
  l->cache_cap = cap;
  return absl::OkStatus();
}

}  // namespace kvsparse::engine::gpu
