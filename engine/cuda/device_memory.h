// The GPU backend's residency and accounting: what it keeps on the device per (sequence, layer),
// the bytes each sequence holds against one capacity, and eviction of idle sequences, least
// recently used first. What fills the buffers is elsewhere: the rows and page lists
// (engine/cuda/device_state.h), the key signatures (engine/cuda/key_signing.h), HashAttention's
// row cache (engine/cuda/row_cache.h), the compressed keys (engine/cuda/compressed_key_sync.h).
//
// Not thread-safe: the backend serialises calls. Every allocation, copy and free is ordered on
// one CUDA stream, so a free is ordered after every use.
#ifndef KVSPARSE_ENGINE_CUDA_DEVICE_MEMORY_H_
#define KVSPARSE_ENGINE_CUDA_DEVICE_MEMORY_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/node_hash_map.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/cuda/cuda_util.h"
#include "engine/row_source.h"
#include "kvstore/store.h"

namespace kvsparse::engine::gpu {

// One layer of one sequence on the device.
struct DeviceLayer {
  uint64_t length = 0, capacity = 0;  // tokens synced; rows allocated per kv head
  DevBuf k, v, sig;                   // [Hkv][capacity][d] rows; [Hkv][capacity][words]
  DevBuf norms;                       // SimHash M per kv head, fixed at the first sync
  DevBuf pages;                       // [Hkv][page_cap] device-visible page addresses
  uint64_t page_cap = 0, pages_known = 0;
  // HashAttention's row cache: cache_cap slots per kv head, laid out as RowsLayout (with slots)
  // says.
  DevBuf cache;
  int32_t cache_cap = 0;
  // Compressed keys (placement.compressed_key_bits > 0): the closed groups' blocks per kv head,
  // [Hkv][ck_cap][KeyGroupBytes] (kernels/compressed_keys.h's layout; every group of tokens
  // [0, ck_length) that is full is closed), and the open group's exact rows [Hkv][group][d].
  DevBuf ck, ck_tail;
  uint64_t ck_cap = 0;  // blocks allocated per kv head
  // Tokens whose compressed keys are held: `length` after a sync, ahead of it after captured
  // steps appended on the device (a later sync of those rows leaves them be).
  uint64_t ck_length = 0;
};

struct DeviceSequence {
  uint64_t incarnation = 0;
  kvstore::ModelShape shape;
  kvstore::Placement placement;
  std::vector<DeviceLayer> layers;
  uint64_t last_use = 0;
  size_t bytes = 0;
  // Captured steps' plans holding it (never evicted; a Forget waits for the last release).
  int32_t held = 0;
  bool forgotten = false;
};

// Sequences of the running call: never evicted while it runs.
using BusySequences = absl::Span<const DeviceSequence* const>;

// A Regrow copy that keeps nothing of the old buffer.
inline cudaError_t NoCopy(const DevBuf&, const DevBuf&) { return cudaSuccess; }

class DeviceMemory {
 public:
  // REQUIRES: stream stays valid (the backend owns it).
  DeviceMemory(size_t capacity_bytes, cudaStream_t stream)
      : capacity_(capacity_bytes), stream_(stream) {}
  // Frees every sequence and waits for the stream.
  ~DeviceMemory();
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  // The entry of a sequence as the store describes it now: emptied when its incarnation or
  // layer count changed, marked as used last.
  DeviceSequence& Use(const SequenceDesc& desc);
  // A buffer that no sequence is charged for (tables, scratch). Free releases it.
  absl::Status Alloc(DevBuf* b, size_t bytes);
  void Free(DevBuf* b);
  // Replaces *b, a buffer of e's, by one of `bytes` charged to e (contents copied by
  // copy(new, old), which may copy nothing), evicting idle sequences to make room;
  // RESOURCE_EXHAUSTED when it does not fit beside the sequences in `busy`.
  template <typename Copy>
  absl::Status Regrow(DeviceSequence* e, DevBuf* b, size_t bytes, BusySequences busy, Copy&& copy);

  // A captured step's plan holds a sequence: not evicted, a Forget waits for the release.
  void Hold(DeviceSequence* e) { ++e->held; }
  void Release(const std::string& sequence_id);
  // Frees what it holds of a sequence (after the last hold is released, if held).
  void Forget(const std::string& sequence_id);

  size_t bytes() const { return bytes_; }
  size_t capacity() const { return capacity_; }
  uint64_t evictions() const { return evictions_; }
  cudaStream_t stream() const { return stream_; }

 private:
  // Accounts `delta` more bytes to `self`, evicting idle sequences (least recently used first).
  absl::Status Charge(DeviceSequence* self, size_t delta, BusySequences busy);
  void Uncharge(DeviceSequence* e, size_t delta) {
    bytes_ -= delta;
    e->bytes -= delta;
  }
  void FreeSequence(DeviceSequence* e);

  const size_t capacity_;
  const cudaStream_t stream_;
  absl::node_hash_map<std::string, DeviceSequence> entries_;  // node map: pointers stay valid
  size_t bytes_ = 0;
  uint64_t tick_ = 0, evictions_ = 0;
};

template <typename Copy>
absl::Status DeviceMemory::Regrow(DeviceSequence* e, DevBuf* b, size_t bytes, BusySequences busy,
                                  Copy&& copy) {
  if (absl::Status s = Charge(e, bytes, busy); !s.ok()) return s;
  DevBuf next;
  if (absl::Status s = Alloc(&next, bytes); !s.ok()) {
    Uncharge(e, bytes);
    return s;
  }
  if (b->ptr != nullptr) {
    if (cudaError_t err = copy(next, *b); err != cudaSuccess) {
      Free(&next);
      Uncharge(e, bytes);
      return CudaStatus(err, "growing device state");
    }
    Uncharge(e, b->bytes);
    Free(b);
  }
  *b = next;
  return absl::OkStatus();
}

}  // namespace kvsparse::engine::gpu

#endif  // KVSPARSE_ENGINE_CUDA_DEVICE_MEMORY_H_
