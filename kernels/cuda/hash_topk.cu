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
// Top-k over C chunks of the rest [sink_end, window_begin) of every (b, h), two kernels:
//   TopkHistKernel   (grid C x BH): histogram of the similarities of one chunk (a private
//                    16-bit counter column per thread, no atomics) -> hist [BH, C, bins];
//   TopkSelectKernel (grid C x BH): every block sums the C histograms, finds the threshold
//                    similarity and how many ties at it to take (lowest tokens first), the counts
//                    of the chunks before its own, then walks its chunk in token order (8 tokens
//                    per thread, a block scan per 2048 tokens) and writes the chosen tokens at
//                    their final positions, ascending. Block 0 also writes sink, window, counts.
constexpr int kTopkThreads = 256;
constexpr int kTopkWarps = kTopkThreads / 32;
constexpr int kPer = 8;
constexpr int kSub = kTopkThreads * kPer;  // tokens per scan step

template <int W>
__device__ __forceinline__ int Similarity(const uint32_t (&q)[W], const uint32_t* k) {
  int pc = 0;
#pragma unroll
  for (int w = 0; w < W; ++w) pc += __popc(q[w] ^ __ldg(k + w));
  return W * 32 - 2 * pc;
}

struct TopkGeom {
  int n, k, s_end, w_begin, rest, kk;
};

__device__ __forceinline__ TopkGeom MakeGeom(const HashTopKParams& p, int b) {
  TopkGeom g;
  g.n = p.seq_lens[b];
  g.k = p.top_k > 0 ? p.top_k
                    : static_cast<int>(floor(static_cast<double>(p.top_k_fraction) * g.n + 0.5));
  g.k = min(max(g.k, 0), g.n);
  g.s_end = min(max(p.sink_tokens, 0), g.n);
  g.w_begin = max(g.s_end, g.n - max(p.local_tokens, 0));
  g.rest = g.w_begin - g.s_end;
  g.kk = min(g.k, g.rest);
  return g;
}

template <int W>
__device__ __forceinline__ void LoadQuerySig(const HashTopKParams& p, int64_t bh,
                                             uint32_t (&q)[W]) {
#pragma unroll
  for (int w = 0; w < W; ++w) q[w] = p.q_sigs[bh * W + w];
}

__device__ __forceinline__ const uint32_t* KeySigs(const HashTopKParams& p, int b, int h) {
  const int j = p.key_heads == p.num_q_heads ? h : h / (p.num_q_heads / p.key_heads);
  if (p.k_sig_heads != nullptr) return p.k_sig_heads[static_cast<int64_t>(b) * p.key_heads + j];
  return p.k_sigs + b * p.k_batch_stride + j * p.k_head_stride;
}

// Histogram of the similarity bins (similarity + bits) / 2 of len consecutive key signatures
// starting at kb, into private 16-bit counter columns cols[kRows][kTopkThreads] (two bins per
// word; a thread zeroes and fills its own column, so no atomics). Ends with the block's column
// sums in out[0, kBins) (a barrier first).
template <int W>
__device__ __forceinline__ void BinHistogram(const uint32_t (&q)[W], const uint32_t* kb,
                                             int64_t kts, int len, uint32_t* cols, int* out) {
  constexpr int kBits = W * 32;
  constexpr int kBins = kBits + 1;
  constexpr int kRows = (kBins + 1) / 2;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  for (int r = 0; r < kRows; ++r) cols[r * kTopkThreads + tid] = 0u;
  constexpr int kIn = 8;  // independent signature loads in flight per thread
  for (int i0 = tid; i0 < len; i0 += kIn * kTopkThreads) {
    int bn[kIn];
#pragma unroll
    for (int k = 0; k < kIn; ++k) {
      const int i = i0 + k * kTopkThreads;
      bn[k] = i < len ? (Similarity<W>(q, kb + i * kts) + kBits) / 2 : -1;
    }
#pragma unroll
    for (int k = 0; k < kIn; ++k) {
      if (bn[k] >= 0) cols[(bn[k] >> 1) * kTopkThreads + tid] += 1u << (16 * (bn[k] & 1));
    }
  }
  __syncthreads();
  for (int r = warp; r < kRows; r += kTopkWarps) {
    uint32_t lo = 0, hi = 0;
    for (int t = lane; t < kTopkThreads; t += 32) {
      const uint32_t x = cols[r * kTopkThreads + t];
      lo += x & 0xffffu;
      hi += x >> 16;
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      lo += __shfl_xor_sync(0xffffffffu, lo, o);
      hi += __shfl_xor_sync(0xffffffffu, hi, o);
    }
    if (lane == 0) {
      out[2 * r] = static_cast<int>(lo);
      if (2 * r + 1 < kBins) out[2 * r + 1] = static_cast<int>(hi);
    }
  }
}

// Warp 0 only: the bin holding the kk-th largest similarity (*thr) and how many tokens lie in
// the bins above it (*above), from the totals per bin.
template <int kBins>
__device__ __forceinline__ void FindThreshold(const int* total, int kk, int lane, int* thr,
                                              int* above) {
  constexpr int kChunk = (kBins + 31) / 32;  // bins from the top down, kChunk per lane
  int local = 0;
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    const int r = lane * kChunk + i;
    if (r < kBins) local += total[kBins - 1 - r];
  }
  int x = local;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  int cum = x - local;
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    const int r = lane * kChunk + i;
    if (r < kBins) {
      const int cnt = total[kBins - 1 - r];
      if (cum < kk && cum + cnt >= kk) {
        *thr = kBins - 1 - r;
        *above = cum;
      }
      cum += cnt;
    }
  }
}

// Sink and window tokens of (b, h) at their output positions, the count and the budget (one
// block per (b, h) calls it).
__device__ __forceinline__ void WriteSinkAndWindow(const HashTopKParams& p, const TopkGeom& g,
                                                   int64_t bh, int32_t* out) {
  const int tid = threadIdx.x;
  for (int i = tid; i < g.s_end; i += kTopkThreads) out[i] = i;
  for (int i = tid; i < g.n - g.w_begin; i += kTopkThreads) out[g.s_end + g.kk + i] = g.w_begin + i;
  if (tid == 0) {
    p.counts[bh] = g.s_end + g.kk + (g.n - g.w_begin);
    if (p.budgets != nullptr) p.budgets[bh] = g.kk;
  }
}

template <int W>
__global__ void __launch_bounds__(kTopkThreads)
    TopkHistKernel(HashTopKParams p, int chunk, int* __restrict__ hist) {
  constexpr int kBins = W * 32 + 1;
  extern __shared__ uint32_t cols[];  // [(kBins + 1) / 2][kTopkThreads]
  AllowDependents();                  // the select kernel waits for this grid
  const int c = blockIdx.x;
  const int64_t bh = blockIdx.y;
  const int b = static_cast<int>(bh / p.num_q_heads), h = static_cast<int>(bh % p.num_q_heads);
  const TopkGeom g = MakeGeom(p, b);
  int* out = hist + (bh * gridDim.x + c) * kBins;
  if (g.kk == 0 || g.kk == g.rest) return;  // no threshold needed
  const int c0 = g.s_end + c * chunk;
  const int c1 = min(g.w_begin, c0 + chunk);
  uint32_t q[W];
  LoadQuerySig<W>(p, bh, q);
  BinHistogram<W>(q, KeySigs(p, b, h) + static_cast<int64_t>(c0) * p.k_token_stride,
                  p.k_token_stride, max(0, c1 - c0), cols, out);
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
  int before = 0, all = 0;
#pragma unroll
  for (int w = 0; w < kTopkWarps; ++w) {
    const int y = ws[w];
    before += w < warp ? y : 0;
    all += y;
  }
  *total = all;
  __syncthreads();
  return before + x - v;
}

template <int W>
__global__ void __launch_bounds__(kTopkThreads, 4)
    TopkSelectKernel(HashTopKParams p, int chunk, int max_out, const int* __restrict__ hist) {
  constexpr int kBits = W * 32;
  constexpr int kBins = kBits + 1;
  __shared__ int total[kBins];
  __shared__ int ws[kTopkWarps];
  __shared__ int sm_thr, sm_above, sm_gt_before, sm_tie_before, sm_chunk_gt, sm_chunk_tie;
  const int c = blockIdx.x, num_chunks = gridDim.x;
  const int64_t bh = blockIdx.y;
  const int b = static_cast<int>(bh / p.num_q_heads), h = static_cast<int>(bh % p.num_q_heads);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const TopkGeom g = MakeGeom(p, b);
  int32_t* out = p.indices + bh * max_out;
  if (c == 0) WriteSinkAndWindow(p, g, bh, out);
  if (g.kk == 0) return;
  const int c0 = g.s_end + c * chunk;
  const int c1 = min(g.w_begin, c0 + chunk);
  int32_t* topk_out = out + g.s_end;
  if (g.kk == g.rest) {
    for (int t = c0 + tid; t < c1; t += kTopkThreads) topk_out[t - g.s_end] = t;
    return;
  }
  GridDependencyWait();  // the histogram kernel wrote hist
  if (c0 >= c1) return;
  const int* hb = hist + bh * num_chunks * kBins;
  for (int i = tid; i < kBins; i += kTopkThreads) {
    int t = 0;
    for (int cc = 0; cc < num_chunks; ++cc) t += hb[cc * kBins + i];
    total[i] = t;
  }
  __syncthreads();
  if (warp == 0) FindThreshold<kBins>(total, g.kk, lane, &sm_thr, &sm_above);
  __syncthreads();
  if (warp == 0) {
    // Tokens above the threshold and ties in the chunks before this one, and in this one.
    const int thr_bin = sm_thr;
    int gt = 0, tie = 0;  // lane-partial sums over the chunks before this one
    for (int cc = 0; cc < c; ++cc) {
      const int* hc = hb + cc * kBins;
      for (int i = thr_bin + 1 + lane; i < kBins; i += 32) gt += hc[i];
      if (lane == 0) tie += hc[thr_bin];
    }
    int cgt = 0;
    for (int i = thr_bin + 1 + lane; i < kBins; i += 32) cgt += hb[c * kBins + i];
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      gt += __shfl_xor_sync(0xffffffffu, gt, o);
      cgt += __shfl_xor_sync(0xffffffffu, cgt, o);
    }
    if (lane == 0) {
      sm_gt_before = gt;
      sm_tie_before = tie;
      sm_chunk_gt = cgt;
      sm_chunk_tie = hb[c * kBins + thr_bin];
    }
  }
  __syncthreads();
  const int thr = 2 * sm_thr - kBits;  // threshold similarity
  const int need = g.kk - sm_above;    // ties at the threshold to take, lowest tokens first
  const int gt_before = sm_gt_before, tie_before = sm_tie_before;
  const int chunk_gt = sm_chunk_gt, chunk_tie = sm_chunk_tie;
  __syncthreads();  // every thread has its copy before the scans reuse shared memory
  if (chunk_gt == 0 && (chunk_tie == 0 || tie_before >= need)) return;  // uniform
  uint32_t q[W];
  LoadQuerySig<W>(p, bh, q);
  const uint32_t* kb = KeySigs(p, b, h);
  const int64_t kts = p.k_token_stride;
  int carry_gt = gt_before, carry_tie = tie_before;
  const int end_gt = gt_before + chunk_gt;
  for (int s0 = c0; s0 < c1; s0 += kSub) {
    if (carry_gt == end_gt && carry_tie >= need) break;  // uniform: this chunk is done
    const int t0 = s0 + tid * kPer;
    int sims[kPer];
    int gt = 0, tie = 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int t = t0 + i;
      sims[i] = t < c1 ? Similarity<W>(q, kb + t * kts) : INT_MIN;
      gt += sims[i] > thr ? 1 : 0;
      tie += sims[i] == thr ? 1 : 0;
    }
    int tot = 0;
    const int excl = BlockExclusiveScan((gt << 16) | tie, ws, &tot);
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
    carry_gt += tot >> 16;
    carry_tie += tot & 0xffff;
  }
}

struct TopkPlan {
  int chunks = 1;
  int chunk = kSub;
};

TopkPlan MakeTopkPlan(const HashTopKParams& p) {
  TopkPlan plan;
  const int64_t bh = std::max<int64_t>(1, static_cast<int64_t>(p.batch) * p.num_q_heads);
  const int64_t slots = static_cast<int64_t>(NumSms()) * 4;
  const int64_t max_rest = std::max(1, p.max_seq_len);
  int64_t chunks = std::max<int64_t>(1, slots / bh);
  chunks = std::min<int64_t>(chunks, (max_rest + kSub - 1) / kSub);
  int64_t chunk = (max_rest + chunks - 1) / chunks;
  chunk = (chunk + kSub - 1) / kSub * kSub;
  chunk = std::min<int64_t>(chunk, int64_t{kTopkThreads} * 65535);  // 16-bit counters
  plan.chunk = static_cast<int>(chunk);
  plan.chunks = static_cast<int>((max_rest + chunk - 1) / chunk);
  return plan;
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
  const int64_t k = top_k > 0 ? top_k
                              : static_cast<int64_t>(std::floor(
                                    static_cast<double>(top_k_fraction) * max_seq_len + 0.5));
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

size_t HashTopKWorkspaceBytes(const HashTopKParams& p) {
  const TopkPlan plan = MakeTopkPlan(p);
  return AlignUp(static_cast<size_t>(std::max(p.batch, 0)) * std::max(p.num_q_heads, 0) *
                     plan.chunks * (std::max(p.bits, 32) + 1) * sizeof(int),
                 256);
}

cudaError_t HashTopK(const HashTopKParams& p, void* workspace, size_t workspace_bytes,
                     cudaStream_t stream) {
  if (p.batch < 0 || p.num_q_heads <= 0 || p.key_heads <= 0 ||
      (p.key_heads != p.num_q_heads && p.num_q_heads % p.key_heads != 0) || p.top_k < 0 ||
      !(p.top_k_fraction >= 0.f && p.top_k_fraction <= 1.f)) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0) return cudaSuccess;
  if (p.q_sigs == nullptr || (p.k_sigs == nullptr && p.k_sig_heads == nullptr) ||
      p.seq_lens == nullptr || p.indices == nullptr || p.counts == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (workspace == nullptr || workspace_bytes < HashTopKWorkspaceBytes(p)) {
    return cudaErrorInvalidValue;
  }
  const TopkPlan plan = MakeTopkPlan(p);
  const int max_out = std::max(1, p.MaxSelected());
  int* hist = static_cast<int*>(workspace);
  return DispatchWords(p.bits, [&](auto w_tag) -> cudaError_t {
    constexpr int W = decltype(w_tag)::value;
    const dim3 grid(plan.chunks, p.batch * p.num_q_heads);
    const size_t smem = static_cast<size_t>((W * 32 + 2) / 2) * kTopkThreads * sizeof(uint32_t);
    if (smem > 48 * 1024) {
      KVSPARSE_CUDA_RETURN_IF_ERROR(SetMaxDynamicSmem(
          reinterpret_cast<const void*>(&TopkHistKernel<W>), static_cast<int>(smem)));
    }
    TopkHistKernel<W><<<grid, kTopkThreads, smem, stream>>>(p, plan.chunk, hist);
    KVSPARSE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return LaunchDependent(&TopkSelectKernel<W>, grid, dim3(kTopkThreads), 0, stream, p,
                           int{plan.chunk}, max_out, static_cast<const int*>(hist));
  });
}

}  // namespace kvsparse::kernels::cuda
