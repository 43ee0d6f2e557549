#include "kernels/cuda/common.cuh"
#include "kernels/cuda/step_append.h"
#include "kernels/philox.h"

namespace kvsparse::kernels::cuda {
namespace {

constexpr int kThreads = 128;

// Whether sequence b's position is one a step may write.
__device__ __forceinline__ bool Writable(const StepAppendParams& p, int32_t b, int64_t pos) {
  const int64_t limit = p.limits != nullptr ? min(p.limits[b], p.max_tokens) : p.max_tokens;
  return pos >= p.floor[b] && pos == p.top[b] && pos < limit;
}

// Chunk c (16 bytes) of row i's (i = b * Hkv + j) K and V of token pos, to where they are kept.
__device__ __forceinline__ void CopyChunk(const StepAppendParams& p, int32_t i, int64_t pos,
                                          int c) {
  const size_t off = static_cast<size_t>(i) * p.row_bytes + static_cast<size_t>(c) * 16;
  const uint4 k = *reinterpret_cast<const uint4*>(static_cast<const char*>(p.new_k) + off);
  const uint4 v = *reinterpret_cast<const uint4*>(static_cast<const char*>(p.new_v) + off);
  const void* const* lane = p.pages.tables[i];
  char* slot = static_cast<char*>(const_cast<void*>(lane[pos >> p.pages.page_shift])) +
               (pos & ((int64_t{1} << p.pages.page_shift) - 1)) * p.pages.slot_bytes;
  reinterpret_cast<uint4*>(slot)[c] = k;
  reinterpret_cast<uint4*>(slot + p.row_bytes)[c] = v;
  const int64_t row = pos * p.row_bytes;
  if (p.k_heads != nullptr) reinterpret_cast<uint4*>(static_cast<char*>(p.k_heads[i]) + row)[c] = k;
  if (p.v_heads != nullptr) reinterpret_cast<uint4*>(static_cast<char*>(p.v_heads[i]) + row)[c] = v;
}

// One block per sequence: its kv heads' rows, then (after every thread read the old top) the
// step's length, seed and top, or length 0 and the error word. Block 0 also sets the progress
// word and clears the caller's counters.
__global__ void StepAppendKernel(StepAppendParams p) {
  GridDependencyWait();  // LaunchDependent: the earlier kernels' writes first
  const int32_t b = blockIdx.x;
  if (b == 0 && threadIdx.x == 0 && p.progress != nullptr) *p.progress = p.layer;
  for (int32_t x = b * kThreads + threadIdx.x; x < p.zero_words; x += gridDim.x * kThreads) {
    p.zero[x] = 0;
  }
  const int64_t pos = p.positions[b];
  const bool ok = Writable(p, b, pos);
  if (ok) {  // every kv head's chunks side by side, then the signature words
    const int chunks = p.row_bytes / 16;
    for (int x = threadIdx.x; x < p.num_kv_heads * chunks; x += kThreads) {
      CopyChunk(p, b * p.num_kv_heads + x / chunks, pos, x % chunks);
    }
    for (int x = threadIdx.x; p.new_sigs != nullptr && x < p.num_kv_heads * p.sig_words;
         x += kThreads) {
      const int32_t i = b * p.num_kv_heads + x / p.sig_words;
      p.sig_heads[i][pos * p.sig_words + x % p.sig_words] =
          p.new_sigs[static_cast<size_t>(i) * p.sig_words + x % p.sig_words];
    }
  }
  __syncthreads();  // every thread has read top before it moves
  if (threadIdx.x != 0) return;
  p.seq_lens[b] = ok ? static_cast<int32_t>(pos + 1) : 0;
  if (p.seeds != nullptr) {
    p.seeds[b] =
        SequenceSeed(p.seed + static_cast<uint64_t>(ok ? pos : 0), static_cast<uint32_t>(b));
  }
  if (ok) {
    p.top[b] = pos + 1;
  } else if (pos >= 0) {  // a negative position is an inactive slot, not an error
    atomicExch(p.error, 1);
  }
}

}  // namespace

cudaError_t StepAppend(const StepAppendParams& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.num_kv_heads <= 0 || p.row_bytes <= 0 || p.row_bytes % 16 != 0 ||
      p.positions == nullptr || p.new_k == nullptr || p.new_v == nullptr || !p.pages.enabled() ||
      p.floor == nullptr || p.top == nullptr || p.error == nullptr || p.seq_lens == nullptr ||
      p.max_tokens <= 0 || p.max_tokens > (int64_t{1} << 30) ||
      p.pages.slot_bytes < 2 * p.row_bytes || p.zero_words < 0 ||
      (p.zero_words > 0 && p.zero == nullptr) ||
      (p.new_sigs != nullptr && (p.sig_heads == nullptr || p.sig_words <= 0))) {
    return cudaErrorInvalidValue;
  }
  return LaunchDependent(&StepAppendKernel, dim3(p.batch), dim3(kThreads), 0, stream, p);
}

}  // namespace kvsparse::kernels::cuda
