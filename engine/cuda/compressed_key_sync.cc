#include "engine/cuda/compressed_key_sync.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "engine/resident_cache.h"
#include "kernels/compressed_keys.h"

namespace kvsparse::engine::gpu {

absl::Status AppendCompressedKeys(DeviceMemory* memory, kvstore::WorkerPool* workers,
                                  DeviceSequence* e, DeviceLayer* l, const SequenceDesc& desc,
                                  uint64_t t0, uint64_t cnt, const uint8_t* k_host,
                                  BusySequences busy) {
  const kernels::KeyCompression c{static_cast<int32_t>(desc.placement.compressed_key_bits),
                                  kernels::kKeyGroupTokens};
  const int32_t d = static_cast<int32_t>(desc.shape.head_dim);
  const uint64_t G = static_cast<uint64_t>(c.group_tokens);
  const size_t hkv = desc.shape.num_kv_heads, row = desc.shape.row_bytes();
  const size_t block = kernels::KeyGroupBytes(c, d);
  const cudaStream_t stream = memory->stream();
  const uint64_t end = t0 + cnt;
  const uint64_t g0 = t0 / G, g1 = end / G;  // groups [g0, g1) close with this chunk
  if (l->ck_tail.ptr == nullptr) {
    if (absl::Status s = memory->Regrow(e, &l->ck_tail, hkv * G * row, busy, NoCopy); !s.ok()) {
      return s;
    }
  }
  if (g1 > l->ck_cap) {
    const uint64_t cap = GrowRows(g1, l->ck_cap, 8), old_cap = l->ck_cap;
    auto keep = [&](const DevBuf& to, const DevBuf& from) {
      return g0 == 0 ? cudaSuccess
                     : cudaMemcpy2DAsync(to.ptr, cap * block, from.ptr, old_cap * block, g0 * block,
                                         hkv, cudaMemcpyDeviceToDevice, stream);
    };
    if (absl::Status s = memory->Regrow(e, &l->ck, hkv * cap * block, busy, keep); !s.ok()) {
      return s;
    }
    l->ck_cap = cap;
  }
  if (g1 > g0) {
    // The open group's rows before this chunk are on the device only: read them back.
    const uint64_t before = t0 - g0 * G;
    std::vector<uint8_t> head(hkv * before * row);
    if (before > 0) {
      KVS_CUDA_OK(cudaMemcpy2DAsync(head.data(), before * row, l->ck_tail.ptr, G * row,
                                    before * row, hkv, cudaMemcpyDeviceToHost, stream),
                  "open group read-back");
      KVS_CUDA_OK(cudaStreamSynchronize(stream), "open group read-back");
    }
    // Each closing group quantized as the CPU engine's CompressedKeys does, heads and groups
    // side by side.
    const uint64_t groups = g1 - g0;
    std::vector<uint8_t> blocks(hkv * groups * block);
    workers->Run(hkv * groups, [&](size_t i) {
      const size_t j = i / groups;
      const uint64_t g = g0 + i % groups;
      std::vector<uint8_t> rows(G * row);
      for (uint64_t t = g * G; t < (g + 1) * G; ++t) {
        const uint8_t* src = t < t0 ? head.data() + (j * before + (t - g0 * G)) * row
                                    : k_host + (j * cnt + (t - t0)) * row;
        std::memcpy(rows.data() + (t - g * G) * row, src, row);
      }
      kernels::CompressKeyGroup(c, d, desc.shape.dtype, rows.data(), blocks.data() + i * block);
    });
    // From pageable memory: the copy has read `blocks` when it returns.
    KVS_CUDA_OK(
        cudaMemcpy2DAsync(l->ck.as<uint8_t>() + g0 * block, l->ck_cap * block, blocks.data(),
                          groups * block, groups * block, hkv, cudaMemcpyHostToDevice, stream),
        "compressed keys upload");
  }
  // The chunk's tokens of the (new) open group, exact.
  const uint64_t open = g1 * G, from = std::max(t0, open);
  if (end > from) {
    KVS_CUDA_OK(cudaMemcpy2DAsync(l->ck_tail.as<uint8_t>() + (from - open) * row, G * row,
                                  k_host + (from - t0) * row, cnt * row, (end - from) * row, hkv,
                                  cudaMemcpyHostToDevice, stream),
                "open group upload");
  }
  return absl::OkStatus();
}

}  // namespace kvsparse::engine::gpu
