// Compressed keys on the device (placement.compressed_key_bits > 0), kept up to the synced
// length as rows are synced (DeviceState::Sync): each group of tokens quantized on the device as
// it closes (kernels::cuda::CompressKeyGroups: the CPU engine's bits, CompressKeyGroup's) into
// DeviceLayer::ck (at the deployment's per-channel widths where they apply: DeviceKeyWidths),
// the open group's rows exact in DeviceLayer::ck_tail, so top-k scores every token without K on the
// device (engine/cuda/compressed_scoring.h reads them). A captured step appends its token on
// the device (kernels::cuda::AppendCompressedKeyStep, the same bits) into room reserved here.
#ifndef KVSPARSE_ENGINE_CUDA_COMPRESSED_KEY_SYNC_H_
#define KVSPARSE_ENGINE_CUDA_COMPRESSED_KEY_SYNC_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/cuda/device_memory.h"
#include "kernels/key_widths.h"

namespace kvsparse::engine::gpu {

// One layer's channel maps on the device (kernels/key_widths.h; the kernels' map_channel and
// map_part, [Hkv, d] each); null: uniform widths.
struct DeviceKeyMap {
  const uint8_t* channel = nullptr;
  const uint8_t* part = nullptr;
};

// The deployment's key widths (EngineOptions::key_widths) on the device: every layer's maps,
// uploaded at the first sequence they apply to and kept for the state's life (a few KB, not
// charged to a sequence). The groups of such a sequence are quantized with them
// (AppendCompressedKeys, a captured step's AppendCompressedKeyStep) and scored through them
// (engine/cuda/compressed_scoring.h), the CPU engine's arithmetic (ResidentCache).
class DeviceKeyWidths {
 public:
  // REQUIRES: memory outlives it. widths: null for none.
  DeviceKeyWidths(std::shared_ptr<const kernels::KeyWidths> widths, DeviceMemory* memory)
      : widths_(std::move(widths)), memory_(memory) {}
  ~DeviceKeyWidths();
  DeviceKeyWidths(const DeviceKeyWidths&) = delete;
  DeviceKeyWidths& operator=(const DeviceKeyWidths&) = delete;

  // Layer `layer`'s maps for a sequence they apply to (KeyWidthsApply), else null ones.
  absl::StatusOr<DeviceKeyMap> Maps(const SequenceDesc& desc, uint32_t layer);

 private:
  const std::shared_ptr<const kernels::KeyWidths> widths_;
  DeviceMemory* const memory_;
  DevBuf maps_;  // per layer: [Hkv, d] channels, then [Hkv, d] parts
};

// Room for the compressed keys of `tokens` tokens of a layer: the open group's rows and the
// blocks of every group they close (what a captured step's appends write into).
absl::Status ReserveCompressedKeys(DeviceMemory* memory, DeviceSequence* e, DeviceLayer* l,
                                   const SequenceDesc& desc, uint64_t tokens, BusySequences busy);

// Compresses the keys of tokens [t0, t0 + cnt) of a layer (K rows in k_host, pinned host
// memory, head-major, cnt rows per kv head): the groups that close are quantized on the device
// (their rows gathered in `scratch`, grown as needed), the open group's rows kept exact; tokens
// below l->ck_length (held already) are left as they are; `map`: the layer's channel maps where
// the deployment's key widths apply (DeviceKeyWidths::Maps). Asynchronous on the memory's stream:
// k_host and scratch are read until it has run. REQUIRES: tokens [0, t0) were appended before.
absl::Status AppendCompressedKeys(DeviceMemory* memory, DevBuf* scratch, DeviceSequence* e,
                                  DeviceLayer* l, const SequenceDesc& desc, uint64_t t0,
                                  uint64_t cnt, const uint8_t* k_host, DeviceKeyMap map,
                                  BusySequences busy);

}  // namespace kvsparse::engine::gpu

#endif  // KVSPARSE_ENGINE_CUDA_COMPRESSED_KEY_SYNC_H_
