// Compressed keys on the device (placement.compressed_key_bits > 0), kept up to the synced
// length as rows are synced (DeviceState::Sync): each group of tokens quantized on the device as
// it closes (kernels::cuda::CompressKeyGroups: the CPU engine's bits, CompressKeyGroup's) into
// DeviceLayer::ck, the open
// group's rows exact in DeviceLayer::ck_tail, so top-k scores every token without K on the
// device (engine/cuda/compressed_scoring.h reads them). A captured step appends its token on
// the device (kernels::cuda::AppendCompressedKeyStep, the same bits) into room reserved here.
#ifndef KVSPARSE_ENGINE_CUDA_COMPRESSED_KEY_SYNC_H_
#define KVSPARSE_ENGINE_CUDA_COMPRESSED_KEY_SYNC_H_

#include <cstdint>

#include "absl/status/status.h"
#include "engine/cuda/device_memory.h"

namespace kvsparse::engine::gpu {

// Room for the compressed keys of `tokens` tokens of a layer: the open group's rows and the
// blocks of every group they close (what a captured step's appends write into).
absl::Status ReserveCompressedKeys(DeviceMemory* memory, DeviceSequence* e, DeviceLayer* l,
                                   const SequenceDesc& desc, uint64_t tokens, BusySequences busy);

// Compresses the keys of tokens [t0, t0 + cnt) of a layer (K rows in k_host, pinned host
// memory, head-major, cnt rows per kv head): the groups that close are quantized on the device
// (their rows gathered in `scratch`, grown as needed), the open group's rows kept exact; tokens
// below l->ck_length (held already) are left as they are. Asynchronous on the memory's stream:
// k_host and scratch are read until it has run. REQUIRES: tokens [0, t0) were appended before.
absl::Status AppendCompressedKeys(DeviceMemory* memory, DevBuf* scratch, DeviceSequence* e,
                                  DeviceLayer* l, const SequenceDesc& desc, uint64_t t0,
                                  uint64_t cnt, const uint8_t* k_host, BusySequences busy);

}  // namespace kvsparse::engine::gpu

#endif  // KVSPARSE_ENGINE_CUDA_COMPRESSED_KEY_SYNC_H_
