#include "engine/cuda/compressed_key_sync.h"

#include <algorithm>
#include <vector>

#include "engine/resident_cache.h"
#include "engine/row_source.h"
#include "kernels/compressed_keys.h"
#include "kernels/cuda/compressed_keys.h"

namespace kvsparse::engine::gpu {
namespace {

kernels::KeyCompression CompressionOf(const SequenceDesc& desc) {
  return {static_cast<int32_t>(desc.placement.compressed_key_bits), kernels::kKeyGroupTokens};
}

}  // namespace

DeviceKeyWidths::~DeviceKeyWidths() { memory_->Free(&maps_); }

absl::StatusOr<DeviceKeyMap> DeviceKeyWidths::Maps(const SequenceDesc& desc, uint32_t layer) {
  const kernels::KeyWidths* w = widths_.get();
  if (!KeyWidthsApply(w, desc)) return DeviceKeyMap{};
  const size_t per = static_cast<size_t>(w->num_kv_heads) * w->head_dim;  // one table
  if (maps_.ptr == nullptr) {
    std::vector<uint8_t> host;
    host.reserve(2 * per * w->num_layers);
    for (int32_t l = 0; l < w->num_layers; ++l) {
      for (int32_t j = 0; j < w->num_kv_heads; ++j) {
        const kernels::KeyChannelMap& m = w->map(l, j);
        host.insert(host.end(), m.channel.begin(), m.channel.end());
      }
      for (int32_t j = 0; j < w->num_kv_heads; ++j) {
        for (kernels::StoredPart x : w->map(l, j).part) host.push_back(static_cast<uint8_t>(x));
      }
    }
    if (absl::Status s = memory_->Alloc(&maps_, host.size()); !s.ok()) return s;
    KVS_CUDA_OK(cudaMemcpyAsync(maps_.ptr, host.data(), host.size(), cudaMemcpyHostToDevice,
                                memory_->stream()),
                "key widths' maps upload");
    KVS_CUDA_OK(cudaStreamSynchronize(memory_->stream()), "key widths' maps upload");
  }
  const uint8_t* at = maps_.as<const uint8_t>() + 2 * per * layer;
  return DeviceKeyMap{at, at + per};
}

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
  const uint64_t cap = GrowRows(groups, l->ck_cap, 8, kMostHeadroomTokens / G);
  const uint64_t old_cap = l->ck_cap;
  const uint64_t kept = l->ck_length / G;
  auto keep = [&](const DevBuf& to, const DevBuf& from) {
    return kept == 0
               ? cudaSuccess
               : cudaMemcpy2DAsync(to.ptr, cap * block, from.ptr, old_cap * block, kept * block,
                                   hkv, cudaMemcpyDeviceToDevice, memory->stream());
  };
  if (absl::Status s = memory->Regrow(e, &l->ck, hkv * cap * block, busy, keep); !s.ok()) {
    return s;
  }
  l->ck_cap = cap;
  return absl::OkStatus();
}

absl::Status AppendCompressedKeys(DeviceMemory* memory, DevBuf* scratch, DeviceSequence* e,
                                  DeviceLayer* l, const SequenceDesc& desc, uint64_t t0,
                                  uint64_t cnt, const uint8_t* k_host, DeviceKeyMap map,
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
    // The closing groups' rows side by side on the device, per kv head: the open group's rows
    // before this chunk (on the device only) and the chunk's, then quantized there.
    const uint64_t groups = g1 - g0, before = start - g0 * G;
    const size_t span = groups * G * row;  // a kv head's rows
    if (scratch->bytes < hkv * span) {
      memory->Free(scratch);
      if (absl::Status s = memory->Alloc(scratch, hkv * span); !s.ok()) return s;
    }
    if (before > 0) {
      KVS_CUDA_OK(cudaMemcpy2DAsync(scratch->ptr, span, l->ck_tail.ptr, G * row, before * row, hkv,
                                    cudaMemcpyDeviceToDevice, stream),
                  "open group rows");
    }
    KVS_CUDA_OK(
        cudaMemcpy2DAsync(scratch->as<uint8_t>() + before * row, span, k_host + (start - t0) * row,
                          cnt * row, (g1 * G - start) * row, hkv, cudaMemcpyHostToDevice, stream),
        "closing groups' rows");
    kernels::cuda::CompressKeyGroupsParams p;
    p.num_kv_heads = static_cast<int32_t>(hkv);
    p.groups = static_cast<int32_t>(groups);
    p.head_dim = d;
    p.bits = c.bits;
    p.group = c.group_tokens;
    p.dtype = desc.shape.dtype;
    p.rows = scratch->ptr;
    p.head_stride = static_cast<int64_t>(span);
    p.blocks = l->ck.as<uint8_t>() + g0 * block;
    p.block_head_stride = static_cast<int64_t>(l->ck_cap * block);
    p.block_bytes = static_cast<int64_t>(block);
    p.map_channel = map.channel;
    p.map_part = map.part;
    KVS_CUDA_OK(kernels::cuda::CompressKeyGroups(p, stream), "key groups' quantization");
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
