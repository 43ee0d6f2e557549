#include "engine/cuda/compressed_key_sync.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "engine/resident_cache.h"
#include "kernels/compressed_keys.h"

namespace kvsparse::engine::gpu {
namespace {

kernels::KeyCompression CompressionOf(const SequenceDesc& desc) {
  return {static_cast<int32_t>(desc.placement.compressed_key_bits), kernels::kKeyGroupTokens};
}

}  // namespace

absl::Status ReserveCompressedKeys(DeviceMemory* memory, DeviceSequence* e, DeviceLayer* l,
                                   const SequenceDesc& desc, uint64_t tokens, BusySequences busy) {
  const kernels::KeyCompression c = CompressionOf(desc);
  const uint64_t G = static_cast<uint64_t>(c.group_tokens);
  const size_t hkv = desc.shape.num_kv_heads, row = desc.shape.row_bytes();
  const size_t block = kernels::KeyGroupBytes(c, static_cast<int32_t>(desc.shape.head_dim));
  if (l->ck_tail.ptr == nullptr) {
    if (absl::Status s = memory->Regrow(e, &l->ck_tail, hkv * G * row, busy, NoCopy); !s.ok()) {
      return s;
    }
  }
  const uint64_t groups = tokens / G;  // the groups `tokens` tokens close
  if (groups <= l->ck_cap) return absl::OkStatus();
  const uint64_t cap = GrowRows(groups, l->ck_cap, 8), old_cap = l->ck_cap;
  const uint64_t kept = l->ck_length / G;
  auto keep = [&](const DevBuf& to, const DevBuf& from) {
    return kept == 0 ? cudaSuccess
                     : cudaMemcpy2DAsync(to.ptr, cap * block, from.ptr, old_cap * block,
                                         kept * block, hkv, cudaMemcpyDeviceToDevice,
                                         memory->stream());
  };
  if (absl::Status s = memory->Regrow(e, &l->ck, hkv * cap * block, busy, keep); !s.ok()) {
    return s;
  }
  l->ck_cap = cap;
  return absl::OkStatus();
}

absl::Status AppendCompressedKeys(DeviceMemory* memory, kvstore::WorkerPool* workers,
                                  DeviceSequence* e, DeviceLayer* l, const SequenceDesc& desc,
                                  uint64_t t0, uint64_t cnt, const uint8_t* k_host,
                                  BusySequences busy) {
  const kernels::KeyCompression c = CompressionOf(desc);
  const int32_t d = static_cast<int32_t>(desc.shape.head_dim);
  const uint64_t G = static_cast<uint64_t>(c.group_tokens);
  const size_t hkv = desc.shape.num_kv_heads, row = desc.shape.row_bytes();
  const size_t block = kernels::KeyGroupBytes(c, d);
  const cudaStream_t stream = memory->stream();
  const uint64_t end = t0 + cnt;
  // Tokens captured steps already appended on the device are held: start after them.
  const uint64_t start = std::max(t0, l->ck_length);
  if (start >= end) return absl::OkStatus();
  if (absl::Status s = ReserveCompressedKeys(memory, e, l, desc, end, busy); !s.ok()) return s;
  const uint64_t g0 = start / G, g1 = end / G;  // groups [g0, g1) close with this chunk
  if (g1 > g0) {
    // The open group's rows before this chunk are on the device only: read them back.
    const uint64_t before = start - g0 * G;
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
        const uint8_t* src = t < start ? head.data() + (j * before + (t - g0 * G)) * row
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
  const uint64_t open = g1 * G, from = std::max(start, open);
  if (end > from) {
    KVS_CUDA_OK(cudaMemcpy2DAsync(l->ck_tail.as<uint8_t>() + (from - open) * row, G * row,
                                  k_host + (from - t0) * row, cnt * row, (end - from) * row, hkv,
                                  cudaMemcpyHostToDevice, stream),
                "open group upload");
  }
  l->ck_length = end;
  return absl::OkStatus();
}

}  // namespace kvsparse::engine::gpu
