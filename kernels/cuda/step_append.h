// The new token of a decode step, written by the device: a step captured in a CUDA graph has no
// host copy, so its token's K and V rows go from the caller's tensors straight to where the
// engine keeps them (the store's reserved host pages over the mapped link, the resident K / V
// rows on the device), and the step's lengths and seeds are derived on the device from the
// caller's positions. Plain C++ header (decode_params.h's conventions: raw device pointers,
// no allocation, no synchronisation, capturable).
#ifndef KVSPARSE_KERNELS_CUDA_STEP_APPEND_H_
#define KVSPARSE_KERNELS_CUDA_STEP_APPEND_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/decode_params.h"

namespace kvsparse::kernels::cuda {

struct StepAppendParams {
  int32_t batch = 0;         // B
  int32_t num_kv_heads = 0;  // Hkv
  int32_t row_bytes = 0;     // d * element size; a multiple of 16
  // device, shape: [B]: where each sequence's new token goes (its length before the step).
  const int64_t* positions = nullptr;
  // device, shape: [B, Hkv, d] each, rows of row_bytes, 16-byte aligned.
  const void* new_k = nullptr;
  const void* new_v = nullptr;
  // Where the token's rows go; null: not kept there. Rows (b, j, t) at
  // k_heads[b * Hkv + j] + t * row_bytes (resident rows), and the store's slot of token t in
  // pages (a slot is the K row, then the V row: slot_bytes apart; PagedRows's addressing,
  // offset_bytes ignored), which every sequence has.
  void* const* k_heads = nullptr;
  void* const* v_heads = nullptr;
  PagedRows pages;
  // Optional key signatures: the new keys' words ([B * Hkv][sig_words], signed by the caller
  // before this launch) copied to sig_heads[b * Hkv + j] + t * sig_words.
  const uint32_t* new_sigs = nullptr;
  uint32_t* const* sig_heads = nullptr;
  int32_t sig_words = 0;
  // device, shape: [B]: the store's committed length (floor) and the next row a step may write
  // (top: one past the last written). A step writes exactly at top: any other position, or one
  // at or past max_tokens, writes nothing: the sequence's length becomes 0 for the step (its
  // output zeros) and *error gets 1. A negative position marks an inactive slot (a batch slot no
  // request holds this step): nothing written, length 0, no error. (Rows are never rewritten, so
  // nothing a row cache holds goes stale.)
  const int64_t* floor = nullptr;
  int64_t* top = nullptr;
  int64_t max_tokens = 0;  // host: rows every destination holds per (b, j)
  // Optional device [B]: each sequence's own bound (at most max_tokens; its reservation's rows):
  // a position at or past it writes nothing, as one past max_tokens.
  const int64_t* limits = nullptr;
  int32_t* error = nullptr;
  // Written per sequence: the step's length (position + 1) and the seed its random numbers come
  // from, SequenceSeed(seed + position, b) (a step's draws equal an eager call's with that seed).
  int32_t* seq_lens = nullptr;
  uint64_t* seeds = nullptr;  // may be null
  uint64_t seed = 0;
  // Optional device word set to `layer` as the step's launch begins: where a side stream's
  // WarmPagedRows of this layer stops (its stop word).
  int32_t* progress = nullptr;
  int32_t layer = 0;
  // Optional device words set to 0 by the step (the caller's per-step counters: one kernel
  // instead of a memset node before it).
  int32_t* zero = nullptr;
  int32_t zero_words = 0;
};

cudaError_t StepAppend(const StepAppendParams& p, cudaStream_t stream);

}  // namespace kvsparse::kernels::cuda

#endif  // KVSPARSE_KERNELS_CUDA_STEP_APPEND_H_
