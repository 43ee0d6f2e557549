#include <algorithm>
#include <climits>
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/hash_topk.h"
#include "kernels/hash_topk.h"

namespace kvsparse::kernels::cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// SimHash: one warp per (vector, signature word); lane j evaluates plane 32 * word + j exactly as
// the CPU reference (fp32, ascending coordinates, separate multiply and add, augmentation last).
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
// Learned signatures: a block of kLearnedThreads threads takes kLearnedVecs vectors of one MLP
// (consecutive b, one j) through every linear: thread o computes output o of each vector, reading
// the transposed weight's row c (coalesced over o) once for all the block's vectors. The
// arithmetic is HashMlp::Sign's: fp32, inputs in ascending order with separate multiply and add,
// the bias last, SiLU(z) = z / (1 + exp(-z)) with exp taken in double and rounded to float.
constexpr int kLearnedThreads = 128;
constexpr int kLearnedVecs = 8;

__host__ __device__ inline int64_t MlpFloats(const int32_t* dims, int32_t num_linear) {
  int64_t n = 0;
  for (int32_t i = 0; i < num_linear; ++i) n += static_cast<int64_t>(dims[i] + 1) * dims[i + 1];
  return n;
}

__device__ __forceinline__ float LearnedSilu(float z) {
  const float e = static_cast<float>(exp(-static_cast<double>(z)));
  return __fdiv_rn(z, __fadd_rn(1.f, e));
}

template <typename T>
__global__ void __launch_bounds__(kLearnedThreads) LearnedSignKernel(LearnedSignParams p) {
  extern __shared__ float lsm[];  // [2][kLearnedVecs][max_dim]
  int max_dim = 0;
  for (int i = 0; i <= p.num_linear; ++i) max_dim = max(max_dim, p.dims[i]);
  float* cur = lsm;
  float* nxt = lsm + kLearnedVecs * max_dim;
  const int j = blockIdx.y;
  const int b0 = blockIdx.x * kLearnedVecs;
  const int nv = min(kLearnedVecs, p.num_seqs - b0);
  const int d = p.dims[0];
  for (int i = threadIdx.x; i < kLearnedVecs * d; i += blockDim.x) {
    const int v = i / d, c = i % d;  // a last block's missing vectors are zeros (never written)
    cur[v * max_dim + c] =
        v < nv ? LoadElem<T>(p.x, (static_cast<int64_t>(b0 + v) * p.heads + j) * d + c) : 0.f;
  }
  __syncthreads();
  const float* w = p.mlps + static_cast<int64_t>(j / p.group) * MlpFloats(p.dims, p.num_linear);
  for (int li = 0; li < p.num_linear; ++li) {
    const int in = p.dims[li], outd = p.dims[li + 1];
    const float* bias = w + static_cast<int64_t>(in) * outd;
    const bool last = li + 1 == p.num_linear;
    for (int o = threadIdx.x; o < outd; o += blockDim.x) {
      float acc[kLearnedVecs];
#pragma unroll
      for (int v = 0; v < kLearnedVecs; ++v) acc[v] = 0.f;
      for (int c = 0; c < in; ++c) {
        const float wc = w[static_cast<int64_t>(c) * outd + o];
#pragma unroll
        for (int v = 0; v < kLearnedVecs; ++v) {
          acc[v] = __fadd_rn(acc[v], __fmul_rn(wc, cur[v * max_dim + c]));
        }
      }
      const float bo = bias[o];
      for (int v = 0; v < kLearnedVecs; ++v) {  // every row: the next linear reads them all
        const float z = __fadd_rn(acc[v], bo);
        nxt[v * max_dim + o] = last ? z : LearnedSilu(z);
      }
    }
    w = bias + outd;
    float* t = cur;
    cur = nxt;
    nxt = t;
    __syncthreads();
  }
  const int words = p.dims[p.num_linear] / 32;
  for (int i = threadIdx.x; i < nv * words; i += blockDim.x) {
    const int v = i / words, wd = i % words;
    uint32_t word = 0;
    for (int k = 0; k < 32; ++k) word |= (cur[v * max_dim + wd * 32 + k] > 0.f ? 1u : 0u) << k;
    const int b = b0 + v;
    const int64_t pos = p.positions != nullptr ? p.positions[b] : 0;
    p.out[b * p.out_batch_stride + j * p.out_head_stride + pos * p.out_token_stride + wd] = word;
  }
}

// ---------------------------------------------------------------------------------------------
// Top-k over C chunks of the rest [sink_end, window_begin) of every (b, h), three kernels, each
// block of the first and last taking one chunk of one signature head (b, j) for all GS query
// heads that share it (the signatures are read once per group, not once per head):
//   TopkHistKernel   (grid C x B*key_heads): similarity histograms of the chunk for its GS heads
//                    (shared-memory atomics), as suffix sums (tokens at or above each bin) ->
//                    hist [BH, C, bins];
//   TopkThreshKernel (grid BH): sums the C histograms of (b, h), finds the threshold similarity,
//                    how many ties at it to take (lowest tokens first), and for every chunk the
//                    tokens above the threshold and the ties in the chunks before it -> info, offs;
//   TopkSelectKernel (grid C x B*key_heads): walks its chunk in token order (8 tokens per thread,
//                    a block scan per 2048 tokens and head) and writes the chosen tokens at their
//                    final positions, ascending. Chunk 0 also writes sink, window and counts.
constexpr int kTopkThreads = 256;
constexpr int kTopkWarps = kTopkThreads / 32;
constexpr int kPer = 8;
constexpr int kSub = kTopkThreads * kPer;  // tokens per scan step

template <int W>
__device__ __forceinline__ int Similarity(const uint32_t (&q)[W], const uint32_t (&k)[W]) {
  int pc = 0;
#pragma unroll
  for (int w = 0; w < W; ++w) pc += __popc(q[w] ^ k[w]);
  return W * 32 - 2 * pc;
}

template <int W>
__device__ __forceinline__ void LoadSig(const uint32_t* k, uint32_t (&out)[W]) {
#pragma unroll
  for (int w = 0; w < W; ++w) out[w] = __ldg(k + w);
}

using TopkGeom = SinkLocalTopK;

__device__ __forceinline__ TopkGeom MakeGeom(const HashTopKLaunchParams& p, int b) {
  return MakeSinkLocalTopK(p.seq_lens[b], p.fixed);
}

template <int W>
__device__ __forceinline__ void LoadQuerySig(const HashTopKLaunchParams& p, int64_t bh,
                                             uint32_t (&q)[W]) {
#pragma unroll
  for (int w = 0; w < W; ++w) q[w] = p.q_sigs[bh * W + w];
}

// Key signatures of signature head j of sequence b.
__device__ __forceinline__ const uint32_t* KeySigs(const HashTopKLaunchParams& p, int b, int j) {
  if (p.k_sig_heads != nullptr) return p.k_sig_heads[static_cast<int64_t>(b) * p.key_heads + j];
  return p.k_sigs + b * p.k_batch_stride + j * p.k_head_stride;
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

// Sink and window tokens of (b, h) at their output positions, the count and the budget.
__device__ __forceinline__ void WriteSinkAndWindow(const HashTopKLaunchParams& p, const TopkGeom& g,
                                                   int64_t bh, int32_t* out) {
  const int tid = threadIdx.x;
  for (int i = tid; i < g.s_end; i += kTopkThreads) out[i] = i;
  for (int i = tid; i < g.n - g.w_begin; i += kTopkThreads) out[g.s_end + g.kk + i] = g.w_begin + i;
  if (tid == 0) {
    p.counts[bh] = g.s_end + g.kk + (g.n - g.w_begin);
    if (p.budgets != nullptr) p.budgets[bh] = g.kk;
  }
}

template <int W, int GS>
__global__ void __launch_bounds__(kTopkThreads)
    TopkHistKernel(HashTopKLaunchParams p, int chunk, int* __restrict__ hist) {
  constexpr int kBits = W * 32;
  constexpr int kBins = kBits + 1;
  __shared__ int sh[GS][kBins];
  AllowDependents();  // the threshold kernel waits for this grid
  const int c = blockIdx.x, num_chunks = gridDim.x;
  const int b = static_cast<int>(blockIdx.y) / p.key_heads;
  const int j = static_cast<int>(blockIdx.y) % p.key_heads;
  const int tid = threadIdx.x;
  const TopkGeom g = MakeGeom(p, b);
  if (g.kk == 0 || g.kk == g.rest) return;  // no threshold needed
  for (int i = tid; i < GS * kBins; i += kTopkThreads) (&sh[0][0])[i] = 0;
  const int c0 = g.s_end + c * chunk;
  const int c1 = min(g.w_begin, c0 + chunk);
  const int64_t bh0 = static_cast<int64_t>(b) * p.num_q_heads + j * GS;
  uint32_t q[GS][W];
#pragma unroll
  for (int h = 0; h < GS; ++h) LoadQuerySig<W>(p, bh0 + h, q[h]);
  const uint32_t* kb = KeySigs(p, b, j);
  const int64_t kts = p.k_token_stride;
  __syncthreads();
  constexpr int kIn = 8;  // independent signature loads in flight per thread
  for (int t0 = c0 + tid; t0 < c1; t0 += kIn * kTopkThreads) {
    uint32_t k[kIn][W];
#pragma unroll
    for (int i = 0; i < kIn; ++i) {
      const int t = t0 + i * kTopkThreads;
      if (t < c1) LoadSig<W>(kb + t * kts, k[i]);
    }
#pragma unroll
    for (int i = 0; i < kIn; ++i) {
      if (t0 + i * kTopkThreads < c1) {
#pragma unroll
        for (int h = 0; h < GS; ++h) atomicAdd(&sh[h][(Similarity<W>(q[h], k[i]) + kBits) / 2], 1);
      }
    }
  }
  __syncthreads();
  if (tid < GS) {  // suffix sums: tokens at or above each bin
    int run = 0;
    for (int bin = kBins - 1; bin >= 0; --bin) {
      run += sh[tid][bin];
      sh[tid][bin] = run;
    }
  }
  __syncthreads();
  for (int i = tid; i < GS * kBins; i += kTopkThreads) {
    const int h = i / kBins, bin = i % kBins;
    hist[((bh0 + h) * num_chunks + c) * kBins + bin] = sh[h][bin];
  }
}

// Per (b, h): threshold similarity, ties to take, tokens above the threshold and ties at it.
struct TopkInfo {
  int thr, need, above, ties;
};

template <int W>
__global__ void __launch_bounds__(kTopkThreads)
    TopkThreshKernel(HashTopKLaunchParams p, int num_chunks, const int* __restrict__ hist,
                     TopkInfo* __restrict__ info, int2* __restrict__ offs) {
  constexpr int kBits = W * 32;
  constexpr int kBins = kBits + 1;
  __shared__ int suffix[kBins + 1], total[kBins];
  __shared__ int sm_thr, sm_above;
  AllowDependents();  // the select kernel waits for this grid
  const int64_t bh = blockIdx.x;
  const int b = static_cast<int>(bh / p.num_q_heads);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const TopkGeom g = MakeGeom(p, b);
  if (g.kk == 0 || g.kk == g.rest) return;
  for (int i = tid; i <= kBins; i += kTopkThreads) suffix[i] = 0;
  __syncthreads();
  GridDependencyWait();                            // the histogram kernel wrote hist
  const int* hb = hist + bh * num_chunks * kBins;  // per chunk: suffix sums over the bins
  // Totals per bin: kParts threads per bin each sum every kParts-th chunk (a few shared-memory
  // atomics per bin instead of one per chunk, which serialised on the bins).
  constexpr int kParts = kTopkThreads / kBins > 0 ? kTopkThreads / kBins : 1;
  for (int e = tid; e < kParts * kBins; e += kTopkThreads) {
    const int bin = e % kBins, part = e / kBins;
    int v = 0;
#pragma unroll 8
    for (int c = part; c < num_chunks; c += kParts) v += hb[c * kBins + bin];
    if (v != 0) atomicAdd(&suffix[bin], v);
  }
  __syncthreads();
  for (int i = tid; i < kBins; i += kTopkThreads) total[i] = suffix[i] - suffix[i + 1];
  __syncthreads();
  if (warp == 0) FindThreshold<kBins>(total, g.kk, lane, &sm_thr, &sm_above);
  __syncthreads();
  const int thr_bin = sm_thr;
  if (warp == 0) {  // per chunk: tokens above the threshold and ties before it (a warp scan)
    int gt_run = 0, tie_run = 0;
    for (int c0 = 0; c0 < num_chunks; c0 += 32) {
      const int c = c0 + lane;
      int gt = 0, tie = 0;
      if (c < num_chunks) {
        const int* hc = hb + c * kBins;
        gt = thr_bin + 1 < kBins ? hc[thr_bin + 1] : 0;
        tie = hc[thr_bin] - gt;
      }
      int xg = gt, xt = tie;
#pragma unroll
      for (int o = 1; o < 32; o *= 2) {
        const int yg = __shfl_up_sync(0xffffffffu, xg, o);
        const int yt = __shfl_up_sync(0xffffffffu, xt, o);
        if (lane >= o) {
          xg += yg;
          xt += yt;
        }
      }
      if (c < num_chunks)
        offs[bh * num_chunks + c] = make_int2(gt_run + xg - gt, tie_run + xt - tie);
      gt_run += __shfl_sync(0xffffffffu, xg, 31);
      tie_run += __shfl_sync(0xffffffffu, xt, 31);
    }
    if (lane == 0) {
      info[bh] = TopkInfo{2 * thr_bin - kBits, g.kk - sm_above, sm_above, total[thr_bin]};
    }
  }
}

// Four blocks per SM for one-word signatures and groups up to 4 (the common case: every block of
// a B = 1, 128k, Hkv = 8 call resident in one wave); two otherwise (registers for the words).
constexpr int TopkSelectMinBlocks(int w, int gs) { return w == 1 && gs <= 4 ? 4 : 2; }

template <int W, int GS>
__global__ void __launch_bounds__(kTopkThreads, TopkSelectMinBlocks(W, GS))
    TopkSelectKernel(HashTopKLaunchParams p, int chunk, int max_out,
                     const TopkInfo* __restrict__ info, const int2* __restrict__ offs) {
  __shared__ int ws[kTopkWarps];
  __shared__ uint32_t sq[GS][W];  // query signatures of the group's heads
  const int c = blockIdx.x, num_chunks = gridDim.x;
  const int b = static_cast<int>(blockIdx.y) / p.key_heads;
  const int j = static_cast<int>(blockIdx.y) % p.key_heads;
  const int tid = threadIdx.x;
  const TopkGeom g = MakeGeom(p, b);
  const int64_t bh0 = static_cast<int64_t>(b) * p.num_q_heads + j * GS;
  if (c == 0) {
#pragma unroll 1
    for (int h = 0; h < GS; ++h) {
      WriteSinkAndWindow(p, g, bh0 + h, p.indices + (bh0 + h) * max_out);
    }
  }
  if (g.kk == 0) return;
  const int c0 = g.s_end + c * chunk;
  const int c1 = min(g.w_begin, c0 + chunk);
  if (g.kk == g.rest) {
#pragma unroll 1
    for (int h = 0; h < GS; ++h) {
      int32_t* topk_out = p.indices + (bh0 + h) * max_out + g.s_end;
      for (int t = c0 + tid; t < c1; t += kTopkThreads) topk_out[t - g.s_end] = t;
    }
    return;
  }
  if (c0 >= c1) return;
  GridDependencyWait();  // the threshold kernel wrote info and offs
  int thr[GS], need[GS], carry_gt[GS], carry_tie[GS];
  bool busy = false;  // any head with tokens to write in this chunk
#pragma unroll
  for (int h = 0; h < GS; ++h) {
    const TopkInfo in = info[bh0 + h];
    const int2 o = offs[(bh0 + h) * num_chunks + c];
    const int2 next =
        c + 1 < num_chunks ? offs[(bh0 + h) * num_chunks + c + 1] : make_int2(in.above, in.ties);
    thr[h] = in.thr;
    need[h] = in.need;
    carry_gt[h] = o.x;
    carry_tie[h] = o.y;
    busy |= next.x > o.x || (next.y > o.y && o.y < in.need);
  }
  if (!busy) return;  // uniform
  if (tid < GS * W) sq[tid / W][tid % W] = p.q_sigs[(bh0 + tid / W) * W + tid % W];
  __syncthreads();
  const uint32_t* kb = KeySigs(p, b, j);
  const int64_t kts = p.k_token_stride;
  for (int s0 = c0; s0 < c1; s0 += kSub) {
    const int t0 = s0 + tid * kPer;
    uint32_t k[kPer][W];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      if (t0 + i < c1) LoadSig<W>(kb + (t0 + i) * kts, k[i]);
    }
#pragma unroll
    for (int h = 0; h < GS; ++h) {
      uint32_t q[W];
#pragma unroll
      for (int w = 0; w < W; ++w) q[w] = sq[h][w];
      int sims[kPer];
      int gt = 0, tie = 0;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        sims[i] = t0 + i < c1 ? Similarity<W>(q, k[i]) : INT_MIN;
        gt += sims[i] > thr[h] ? 1 : 0;
        tie += sims[i] == thr[h] ? 1 : 0;
      }
      int tot = 0;
      const int excl = BlockExclusiveSum<kTopkWarps>((gt << 16) | tie, ws, &tot);
      int seen_tie = carry_tie[h] + (excl & 0xffff);
      int pos = carry_gt[h] + (excl >> 16) + min(seen_tie, need[h]);
      int32_t* topk_out = p.indices + (bh0 + h) * max_out + g.s_end;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        if (sims[i] > thr[h]) {
          topk_out[pos++] = t0 + i;
        } else if (sims[i] == thr[h]) {
          if (seen_tie < need[h]) topk_out[pos++] = t0 + i;
          ++seen_tie;
        }
      }
      carry_gt[h] += tot >> 16;
      carry_tie[h] += tot & 0xffff;
    }
  }
}

struct TopkPlan {
  int chunks = 1;
  int chunk = kSub;
};

TopkPlan MakeTopkPlan(const HashTopKLaunchParams& p) {
  TopkPlan plan;
  const int64_t sets = std::max<int64_t>(1, static_cast<int64_t>(p.batch) * p.key_heads);
  const int64_t slots = static_cast<int64_t>(NumSms()) * 4;
  const int64_t max_rest = std::max(1, p.max_seq_len);
  int64_t chunks = std::max<int64_t>(1, slots / sets);
  chunks = std::min<int64_t>(chunks, (max_rest + kSub - 1) / kSub);
  int64_t chunk = (max_rest + chunks - 1) / chunks;
  chunk = (chunk + kSub - 1) / kSub * kSub;
  plan.chunk = static_cast<int>(chunk);
  plan.chunks = static_cast<int>((max_rest + chunk - 1) / chunk);
  return plan;
}

// Workspace layout: hist [BH, C, bins] ints, offs [BH, C] int2, info [BH].
struct TopkWorkspace {
  size_t hist = 0, offs = 0, info = 0, total = 0;
  static TopkWorkspace Of(const HashTopKLaunchParams& p, const TopkPlan& plan) {
    TopkWorkspace w;
    const size_t bh = static_cast<size_t>(std::max(p.batch, 0)) * std::max(p.num_q_heads, 0);
    w.offs = AlignUp(bh * plan.chunks * (std::max(p.bits, 32) + 1) * sizeof(int), 256);
    w.info = w.offs + AlignUp(bh * plan.chunks * sizeof(int2), 256);
    w.total = w.info + AlignUp(bh * sizeof(TopkInfo), 256);
    return w;
  }
};

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

int32_t HashTopKLaunchParams::MaxSelected() const { return MaxFixedSetRows(fixed, max_seq_len); }

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

int64_t LearnedMlpFloats(const int32_t* dims, int32_t num_linear) {
  return MlpFloats(dims, num_linear);
}

void AppendPackedMlp(const HashMlp& m, std::vector<float>* out) {
  for (size_t i = 0; i + 1 < m.dims.size(); ++i) {
    const int32_t in = m.dims[i], o = m.dims[i + 1];
    for (int32_t c = 0; c < in; ++c) {
      for (int32_t r = 0; r < o; ++r) out->push_back(m.weights[i][static_cast<size_t>(r) * in + c]);
    }
    out->insert(out->end(), m.biases[i].begin(), m.biases[i].end());
  }
}

bool LearnedSignSupports(const std::vector<int32_t>& dims) {
  if (dims.size() < 2 || dims.size() > kLearnedMaxLinear + 1) return false;
  for (int32_t x : dims) {
    if (x < 1 || x > kLearnedMaxDim) return false;
  }
  return true;
}

cudaError_t LearnedSign(const LearnedSignParams& p, cudaStream_t stream) {
  if (p.num_seqs < 0 || p.heads <= 0 || p.group <= 0 || p.heads % p.group != 0 ||
      p.num_linear < 1 || p.num_linear > kLearnedMaxLinear) {
    return cudaErrorInvalidValue;
  }
  int max_dim = 0;
  for (int i = 0; i <= p.num_linear; ++i) {
    if (p.dims[i] < 1 || p.dims[i] > kLearnedMaxDim) return cudaErrorInvalidValue;
    max_dim = std::max(max_dim, p.dims[i]);
  }
  const int bits = p.dims[p.num_linear];
  if (bits < 32 || bits > 256 || bits % 32 != 0) return cudaErrorInvalidValue;
  if (p.num_seqs == 0) return cudaSuccess;
  if (p.x == nullptr || p.mlps == nullptr || p.out == nullptr) return cudaErrorInvalidValue;
  const dim3 grid((p.num_seqs + kLearnedVecs - 1) / kLearnedVecs, p.heads);
  const size_t smem = sizeof(float) * 2 * kLearnedVecs * max_dim;  // <= 32 KB
  switch (p.dtype) {
    case DType::kBf16:
      LearnedSignKernel<Bf16><<<grid, kLearnedThreads, smem, stream>>>(p);
      break;
    case DType::kFp16:
      LearnedSignKernel<Fp16><<<grid, kLearnedThreads, smem, stream>>>(p);
      break;
    case DType::kFp32:
      LearnedSignKernel<float><<<grid, kLearnedThreads, smem, stream>>>(p);
      break;
  }
  return cudaGetLastError();
}

size_t HashTopKWorkspaceBytes(const HashTopKLaunchParams& p) {
  return TopkWorkspace::Of(p, MakeTopkPlan(p)).total;
}

cudaError_t HashTopK(const HashTopKLaunchParams& p, void* workspace, size_t workspace_bytes,
                     cudaStream_t stream) {
  if (p.batch < 0 || p.num_q_heads <= 0 || p.key_heads <= 0 ||
      (p.key_heads != p.num_q_heads && p.num_q_heads % p.key_heads != 0) || p.fixed.top_k < 0 ||
      !(p.fixed.top_k_fraction >= 0.f && p.fixed.top_k_fraction <= 1.f)) {
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
  const TopkWorkspace w = TopkWorkspace::Of(p, plan);
  const int max_out = std::max(1, p.MaxSelected());
  char* base = static_cast<char*>(workspace);
  int* hist = reinterpret_cast<int*>(base + w.hist);
  auto* offs = reinterpret_cast<int2*>(base + w.offs);
  auto* info = reinterpret_cast<TopkInfo*>(base + w.info);
  const int gs = p.num_q_heads / p.key_heads;
  return DispatchWords(p.bits, [&](auto w_tag) -> cudaError_t {
    constexpr int W = decltype(w_tag)::value;
    auto run = [&](auto gs_tag) -> cudaError_t {
      constexpr int GS = decltype(gs_tag)::value;
      const dim3 grid(plan.chunks, p.batch * p.key_heads);
      TopkHistKernel<W, GS><<<grid, kTopkThreads, 0, stream>>>(p, plan.chunk, hist);
      KVSPARSE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
      KVSPARSE_CUDA_RETURN_IF_ERROR(LaunchDependent(
          &TopkThreshKernel<W>, dim3(p.batch * p.num_q_heads), dim3(kTopkThreads), 0, stream, p,
          int{plan.chunks}, static_cast<const int*>(hist), info, offs));
      return LaunchDependent(&TopkSelectKernel<W, GS>, grid, dim3(kTopkThreads), 0, stream, p,
                             int{plan.chunk}, max_out, static_cast<const TopkInfo*>(info),
                             static_cast<const int2*>(offs));
    };
    switch (gs) {
      case 1:
        return run(std::integral_constant<int, 1>{});
      case 2:
        return run(std::integral_constant<int, 2>{});
      case 4:
        return run(std::integral_constant<int, 4>{});
      case 8:
        return run(std::integral_constant<int, 8>{});
      default:
        return cudaErrorInvalidValue;
    }
  });
}

}  // namespace kvsparse::kernels::cuda
