#include <algorithm>
#include <climits>
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/hash_topk.h"

namespace kvsparse::kernels::cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// SimHash: one warp per (vector, signature word); lane j evaluates plane 32 * word + j exactly as
// the CPU reference (fp32, ascending coordinates, separate multiply and add, augmentation last).
template <typename T>
__device__ __forceinline__ float LoadElem(const void* x, int64_t i) {
  if constexpr (std::is_same_v<T, float>) {
    return static_cast<const float*>(x)[i];
  } else if constexpr (std::is_same_v<T, Bf16>) {
    return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(x)[i]) << 16);
  } else {
    return __half2float(__ushort_as_half(static_cast<const uint16_t*>(x)[i]));
  }
}

template <typename T>
__global__ void __launch_bounds__(256) SimHashKernel(SimHashSignParams p) {
  const int words = p.bits / 32;
  const int64_t warp_id = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const int64_t vecs = static_cast<int64_t>(p.num_seqs) * p.heads;
  if (warp_id >= vecs * words) return;  // uniform over the warp
  const int64_t v = warp_id / words;
  const int w = static_cast<int>(warp_id % words);
  const int b = static_cast<int>(v / p.heads);
  const int j = static_cast<int>(v % p.heads);
  const int sig_head = j / p.group;
  const int64_t xoff = v * p.dim;
  float aug = 0.f;
  if (p.max_norm != nullptr) {
    float n2 = 0.f;
    for (int c = 0; c < p.dim; ++c) {
      const float xc = LoadElem<T>(p.x, xoff + c);
      n2 = __fadd_rn(n2, __fmul_rn(xc, xc));
    }
    const float m = p.max_norm[sig_head];
    const float rest = __fadd_rn(__fmul_rn(m, m), -n2);
    aug = rest > 0.f ? __fsqrt_rn(rest) : 0.f;
  }
  const int plane = w * 32 + lane;
  const float* row = p.planes + (static_cast<int64_t>(sig_head) * p.bits + plane) * (p.dim + 1);
  float dot = 0.f;
  for (int c = 0; c < p.dim; ++c)
    dot = __fadd_rn(dot, __fmul_rn(row[c], LoadElem<T>(p.x, xoff + c)));
  dot = __fadd_rn(dot, __fmul_rn(row[p.dim], aug));
  const uint32_t word = __ballot_sync(0xffffffffu, dot > 0.f);
  if (lane == 0) {
    const int64_t pos = p.positions != nullptr ? p.positions[b] : 0;
    p.out[b * p.out_batch_stride + j * p.out_head_stride + pos * p.out_token_stride + w] = word;
  }
}

// ---------------------------------------------------------------------------------------------
// Top-k: one 1024-thread block per (b, h). Pass 1 histograms the similarities of the rest
// [sink_end, window_begin); the threshold bin and the number of ties to take follow; pass 2
// walks the rest in token order (8 consecutive tokens per thread, a block scan per chunk) and
// writes the chosen tokens ascending.
constexpr int kTopkThreads = 1024;
constexpr int kTopkWarps = kTopkThreads / 32;
constexpr int kPer = 8;

template <int W>
__device__ __forceinline__ int Similarity(const uint32_t (&q)[W], const uint32_t* k) {
  int pc = 0;
#pragma unroll
  for (int w = 0; w < W; ++w) pc += __popc(q[w] ^ __ldg(k + w));
  return W * 32 - 2 * pc;
}

// Exclusive scan over the block; *total gets the block sum. Ends with a barrier.
__device__ __forceinline__ int BlockExclusiveScan(int v, int* ws, int* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) ws[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int y = ws[lane];
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int z = __shfl_up_sync(0xffffffffu, y, o);
      if (lane >= o) y += z;
    }
    ws[lane] = y;
  }
  __syncthreads();
  const int excl = (warp > 0 ? ws[warp - 1] : 0) + x - v;
  *total = ws[kTopkWarps - 1];
  __syncthreads();
  return excl;
}

template <int W>
__global__ void __launch_bounds__(kTopkThreads) HashTopKKernel(HashTopKParams p, int max_out) {
  constexpr int kBits = W * 32;
  constexpr int kBins = kBits + 1;
  __shared__ int hist[kTopkWarps][kBins];
  __shared__ int ws[kTopkWarps];
  __shared__ int sm_thr, sm_above;
  const int64_t bh = blockIdx.x;
  const int b = static_cast<int>(bh / p.num_q_heads);
  const int h = static_cast<int>(bh % p.num_q_heads);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int n = p.seq_lens[b];
  int k =
      p.top_k > 0 ? p.top_k : static_cast<int>(floor(static_cast<double>(p.top_k_fraction) * n));
  k = min(max(k, 0), n);
  const int s_end = min(max(p.sink_tokens, 0), n);
  const int w_begin = max(s_end, n - max(p.local_tokens, 0));
  const int rest = w_begin - s_end;
  const int kk = min(k, rest);
  int32_t* out = p.indices + bh * max_out;
  for (int i = tid; i < s_end; i += kTopkThreads) out[i] = i;
  for (int i = tid; i < n - w_begin; i += kTopkThreads) out[s_end + kk + i] = w_begin + i;
  if (tid == 0) {
    p.counts[bh] = s_end + kk + (n - w_begin);
    if (p.budgets != nullptr) p.budgets[bh] = kk;
  }
  if (kk == 0) return;
  if (kk == rest) {
    for (int i = tid; i < rest; i += kTopkThreads) out[s_end + i] = s_end + i;
    return;
  }
  const int j = p.key_heads == p.num_q_heads ? h : h / (p.num_q_heads / p.key_heads);
  const uint32_t* kb = p.k_sigs + b * p.k_batch_stride + j * p.k_head_stride;
  const int64_t kts = p.k_token_stride;
  uint32_t q[W];
#pragma unroll
  for (int w = 0; w < W; ++w) q[w] = p.q_sigs[bh * W + w];

  for (int i = tid; i < kTopkWarps * kBins; i += kTopkThreads) (&hist[0][0])[i] = 0;
  __syncthreads();
  for (int t = s_end + tid; t < w_begin; t += kTopkThreads) {
    const int bin = (Similarity<W>(q, kb + t * kts) + kBits) / 2;
    const unsigned peers = __match_any_sync(__activemask(), bin);
    if (lane == __ffs(peers) - 1) atomicAdd(&hist[warp][bin], __popc(peers));
  }
  __syncthreads();
  for (int i = tid; i < kBins; i += kTopkThreads) {
    int t = 0;
    for (int w = 0; w < kTopkWarps; ++w) t += hist[w][i];
    hist[0][i] = t;
  }
  __syncthreads();
  if (warp == 0) {
    // Bins from the top (highest similarity) down, kChunk per lane.
    constexpr int kChunk = (kBins + 31) / 32;
    int local = 0;
#pragma unroll
    for (int c = 0; c < kChunk; ++c) {
      const int r = lane * kChunk + c;
      if (r < kBins) local += hist[0][kBins - 1 - r];
    }
    int x = local;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    int cum = x - local;
#pragma unroll
    for (int c = 0; c < kChunk; ++c) {
      const int r = lane * kChunk + c;
      if (r < kBins) {
        const int cnt = hist[0][kBins - 1 - r];
        if (cum < kk && cum + cnt >= kk) {
          sm_thr = kBins - 1 - r;
          sm_above = cum;
        }
        cum += cnt;
      }
    }
  }
  __syncthreads();
  const int thr = 2 * sm_thr - kBits;  // threshold similarity
  const int above = sm_above;          // tokens strictly above it (all chosen)
  const int need = kk - above;         // ties at the threshold to take, lowest index first
  int carry_gt = 0, carry_tie = 0;
  int32_t* topk_out = out + s_end;
  for (int c0 = s_end; c0 < w_begin; c0 += kTopkThreads * kPer) {
    if (carry_gt == above && carry_tie >= need) break;  // uniform: every choice is made
    const int t0 = c0 + tid * kPer;
    int sims[kPer];
    int gt = 0, tie = 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int t = t0 + i;
      sims[i] = t < w_begin ? Similarity<W>(q, kb + t * kts) : INT_MIN;
      gt += sims[i] > thr ? 1 : 0;
      tie += sims[i] == thr ? 1 : 0;
    }
    int total = 0;
    const int excl = BlockExclusiveScan((gt << 16) | tie, ws, &total);
    int seen_tie = carry_tie + (excl & 0xffff);
    int pos = carry_gt + (excl >> 16) + min(seen_tie, need);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      if (sims[i] > thr) {
        topk_out[pos++] = t0 + i;
      } else if (sims[i] == thr) {
        if (seen_tie < need) topk_out[pos++] = t0 + i;
        ++seen_tie;
      }
    }
    carry_gt += total >> 16;
    carry_tie += total & 0xffff;
  }
}

template <typename Body>
cudaError_t DispatchWords(int bits, Body&& body) {
  switch (bits) {
    case 32:
      return body(std::integral_constant<int, 1>{});
    case 64:
      return body(std::integral_constant<int, 2>{});
    case 128:
      return body(std::integral_constant<int, 4>{});
    case 256:
      return body(std::integral_constant<int, 8>{});
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

int32_t HashTopKParams::MaxSelected() const {
  const int64_t k =
      top_k > 0
          ? top_k
          : static_cast<int64_t>(std::floor(static_cast<double>(top_k_fraction) * max_seq_len));
  const int64_t total = static_cast<int64_t>(std::max(sink_tokens, 0)) + std::max(local_tokens, 0) +
                        std::max<int64_t>(k, 0);
  return static_cast<int32_t>(std::min<int64_t>(total, max_seq_len));
}

cudaError_t SimHashSign(const SimHashSignParams& p, cudaStream_t stream) {
  if (p.num_seqs < 0 || p.heads <= 0 || p.group <= 0 || p.heads % p.group != 0 || p.dim <= 0 ||
      p.bits < 32 || p.bits > 256 || p.bits % 32 != 0) {
    return cudaErrorInvalidValue;
  }
  if (p.num_seqs == 0) return cudaSuccess;
  if (p.x == nullptr || p.planes == nullptr || p.out == nullptr) return cudaErrorInvalidValue;
  const int64_t warps = static_cast<int64_t>(p.num_seqs) * p.heads * (p.bits / 32);
  const int64_t blocks = (warps * 32 + 255) / 256;
  switch (p.dtype) {
    case DType::kBf16:
      SimHashKernel<Bf16><<<blocks, 256, 0, stream>>>(p);
      break;
    case DType::kFp16:
      SimHashKernel<Fp16><<<blocks, 256, 0, stream>>>(p);
      break;
    case DType::kFp32:
      SimHashKernel<float><<<blocks, 256, 0, stream>>>(p);
      break;
  }
  return cudaGetLastError();
}

cudaError_t HashTopK(const HashTopKParams& p, cudaStream_t stream) {
  if (p.batch < 0 || p.num_q_heads <= 0 || p.key_heads <= 0 ||
      (p.key_heads != p.num_q_heads && p.num_q_heads % p.key_heads != 0) || p.top_k < 0 ||
      !(p.top_k_fraction >= 0.f && p.top_k_fraction <= 1.f)) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0) return cudaSuccess;
  if (p.q_sigs == nullptr || p.k_sigs == nullptr || p.seq_lens == nullptr || p.indices == nullptr ||
      p.counts == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int max_out = std::max(1, p.MaxSelected());
  return DispatchWords(p.bits, [&](auto w_tag) -> cudaError_t {
    constexpr int W = decltype(w_tag)::value;
    HashTopKKernel<W><<<p.batch * p.num_q_heads, kTopkThreads, 0, stream>>>(p, max_out);
    return cudaGetLastError();
  });
}

}  // namespace kvsparse::kernels::cuda
