#include <algorithm>
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/score_topk.h"
#include "kernels/hash_topk.h"

namespace kvsparse::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// An unsigned key ordered as the float (higher score, higher key); -0 is taken as +0 (equal
// scores tie, as on the CPU).
__device__ __forceinline__ uint32_t OrderedKey(float f) {
  const uint32_t u = __float_as_uint(f + 0.f);
  return (u >> 31) != 0 ? ~u : (u | 0x80000000u);
}

__global__ void __launch_bounds__(kThreads)
    ScoreTopKKernel(ScoreTopKLaunchParams p, int32_t max_out) {
  __shared__ int hist[256];
  __shared__ int wcount[kWarps];
  __shared__ uint32_t s_prefix;
  __shared__ int s_remaining;
  const int32_t b = blockIdx.y, h = blockIdx.x;
  const SinkLocalTopK g = MakeSinkLocalTopK(p.seq_lens[b], p.fixed);
  const int32_t n = g.n, s_end = g.s_end, w_begin = g.w_begin, rest = g.rest, chosen = g.kk;
  const float* scores = p.scores + (static_cast<int64_t>(b) * p.num_q_heads + h) * p.score_stride;
  int32_t* out = p.indices + (static_cast<int64_t>(b) * p.num_q_heads + h) * max_out;
  for (int32_t t = threadIdx.x; t < s_end; t += kThreads) out[t] = t;
  int written = s_end;
  if (chosen == rest) {
    for (int32_t i = threadIdx.x; i < rest; i += kThreads) out[written + i] = s_end + i;
    written += rest;
  } else if (chosen > 0) {
    // The k-th largest key, 8 bits at a time from the top: among the keys that share the
    // digits found so far, the digit where the count from the top reaches the k still wanted.
    if (threadIdx.x == 0) {
      s_prefix = 0;
      s_remaining = chosen;
    }
    uint32_t mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int i = threadIdx.x; i < 256; i += kThreads) hist[i] = 0;
      __syncthreads();
      const uint32_t prefix = s_prefix;
      for (int32_t t = s_end + threadIdx.x; t < w_begin; t += kThreads) {
        const uint32_t key = OrderedKey(scores[t]);
        if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        int cum = 0;
        for (int d = 255; d >= 0; --d) {
          if (cum + hist[d] >= s_remaining) {
            s_prefix = prefix | (static_cast<uint32_t>(d) << shift);
            s_remaining -= cum;
            break;
          }
          cum += hist[d];
        }
      }
      mask |= 255u << shift;
      __syncthreads();
    }
    const uint32_t threshold = s_prefix;
    const int need = s_remaining;  // keys equal to the threshold to take, lowest indices first
    int eq_taken = 0;
    for (int32_t base = s_end; base < w_begin; base += kThreads) {
      const int32_t t = base + threadIdx.x;
      const bool valid = t < w_begin;
      const uint32_t key = valid ? OrderedKey(scores[t]) : 0u;
      const bool eq = valid && key == threshold;
      int eq_total = 0;
      const int eq_before = BlockPrefixCount<kWarps>(eq, wcount, &eq_total);
      const bool keep = (valid && key > threshold) || (eq && eq_taken + eq_before < need);
      written += BlockCompactRound<kWarps>(keep, t, out, written, wcount);
      eq_taken += eq_total;
    }
  }
  const int32_t window = n - w_begin;
  for (int32_t i = threadIdx.x; i < window; i += kThreads) out[written + i] = w_begin + i;
  if (threadIdx.x == 0) {
    p.counts[static_cast<int64_t>(b) * p.num_q_heads + h] = written + window;
    if (p.budgets != nullptr) p.budgets[static_cast<int64_t>(b) * p.num_q_heads + h] = chosen;
  }
}

}  // namespace

int32_t ScoreTopKLaunchParams::MaxSelected() const { return MaxFixedSetRows(fixed, max_seq_len); }

cudaError_t ScoreTopK(const ScoreTopKLaunchParams& p, cudaStream_t stream) {
  if (p.batch < 0 || p.num_q_heads <= 0 || p.max_seq_len < 0 || p.fixed.top_k < 0 ||
      !(p.fixed.top_k_fraction >= 0.f && p.fixed.top_k_fraction <= 1.f) ||
      p.score_stride < p.max_seq_len) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0) return cudaSuccess;
  const int32_t max_out = std::max(1, p.MaxSelected());
  ScoreTopKKernel<<<dim3(p.num_q_heads, p.batch), kThreads, 0, stream>>>(p, max_out);
  return cudaGetLastError();
}

}  // namespace kvsparse::kernels::cuda
