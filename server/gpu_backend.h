// The decode engine's GPU backend: one decode call, batched over its sequences, on a CUDA device
// with the kernels of kernels/cuda/. Built only with CUDA (target kvsparse_engine_cuda).
//
// What lives on the GPU, per (sequence, layer), as the sequence's placement asks:
//   - K rows (k_tier = device) and V rows (v_tier = device), [Hkv][capacity][d];
//   - key signatures (signature_bits > 0), [Hkv][capacity][words], made on the host by the same
//     SignatureMaker code as the CPU engine (so the two agree bit for bit);
//   - for a half kept in host memory, the device-visible addresses of the store's pages of each
//     kv head: kernels read the selected rows in place over the host link (zero-copy), no
//     staging copy (the store's memory must be pinned and mapped: NewLocalRowSource(...,
//     pages_device_visible = true));
//   - HashAttention: a row cache of the rows selected at the last step, row_cache_fraction of the
//     tokens per kv head (consecutive steps select mostly the same rows, which then stay on
//     the device; only the new ones cross: PlaceRows / FetchRows).
// All of it is a cache of the store, brought up to the store's length on demand (a prefill
// written straight to the store, or the engine's appended token) and rebuilt when the
// sequence's incarnation changes; idle sequences are evicted, least recently used first, to stay
// under the capacity.
//
// A call: sync, then one batched launch sequence per method (dense: DenseDecode; S2ANTA:
// S2antaProp / S2antaFlash / SantaIid; HashAttention: SimHashSign, HashTopK, UnionSelected,
// PlaceRows, FetchRows, SelectedRowsDecode; vAttention: VAttentionDecode), one upload of q and the
// per-sequence tables, one download of the output. Sequence i draws with SequenceSeed(seed, i),
// as on the CPU. Calls are serialised on one CUDA stream.
#ifndef KVSPARSE_SERVER_GPU_BACKEND_H_
#define KVSPARSE_SERVER_GPU_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "server/decode_engine.h"
#include "server/resident_cache.h"
#include "server/row_source.h"

namespace kvsparse::server {

struct GpuBackendOptions {
  int device = 0;                      // CUDA device ordinal
  size_t capacity_bytes = 4ull << 30;  // per-sequence state on the device (rows, signatures,
                                       // page lists, row caches)
  size_t max_fetch_bytes = 32 << 20;   // largest single read from the row source while syncing
  int32_t default_tile_size = 256;     // S2ANTA tile of a request that gives 0 (GPU: 256 only)
  // HashAttention's row cache, in rows per kv head as a fraction of the sequence's tokens (0: no
  // cache, every selected row crosses each step).
  double row_cache_fraction = 0.04;
  // Selection / gather / compute times from CUDA events on one call in this many (1: every
  // call; 0: never). Recording the events costs a few us of host time per call.
  int stage_timing_every = 16;
  SignatureConfig signatures;  // as the engine's (same seed and margin); SimHash only
};

// FAILED_PRECONDITION without a usable CUDA device. REQUIRES: source outlives the backend.
absl::StatusOr<std::unique_ptr<DecodeBackend>> NewGpuBackend(GpuBackendOptions options,
                                                             RowSource* source);

}  // namespace kvsparse::server

#endif  // KVSPARSE_SERVER_GPU_BACKEND_H_
