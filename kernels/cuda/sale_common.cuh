// What SALE's kernels of sale.cu (the quantization and mma.sync kernels, the launchers) and
// sale_wg.cu (the warpgroup-MMA kernels of sm_90a builds) share: the geometry and its constants,
// the workspace's quantized operands, the exact regions' online max and sum, the computation
// pass's block walk and softmax, and the launchers of the warpgroup kernels that SaleSelect and
// SaleAttend dispatch to. Internal to those two files (namespace sale_internal).
#ifndef KVSPARSE_KERNELS_CUDA_SALE_COMMON_CUH_
#define KVSPARSE_KERNELS_CUDA_SALE_COMMON_CUH_

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/dtype.h"

namespace kvsparse::kernels::cuda::sale_internal {

// ---- The selection pass ------------------------------------------------------------------

constexpr int kSelectThreads = 256;
constexpr int kSelectWarps = kSelectThreads / 32;
constexpr int kMaxBlock = 64;  // block_q and block_k

// The quantized operands in the workspace (laid out by sale.cu's Carve).
struct Operands {
  double* mean_part = nullptr;  // [Hkv, mean chunks, d]: the key mean's partial sums
  float* mean = nullptr;        // [Hkv, d]
  float* k_scale = nullptr;     // [Hkv, k_blocks]
  float* q_scale = nullptr;     // [H, n]
  float* q_mean = nullptr;      // [H, n]: q_r . mean of its kv head
  float* thr = nullptr;         // [H, n]: each row's threshold m_r + ln(tau l_r)
  int8_t* k = nullptr;          // [Hkv, n, d], smoothed
  int8_t* q = nullptr;          // [H, n, d]
  size_t bytes = 0;
};

struct SelectGeometry {
  int32_t n, d, group, bq, bk, sink_blocks, local_blocks, k_blocks, score_cap;
  float scale;
  // SelectKernel (fp32) or ThresholdsKernel (bf16 / fp16) writes the thresholds; MiddleKernel
  // or MiddleKernelWg estimates the middle blocks.
  bool middle_apart;
};

// The key blocks of query block i that the exact regions cover: [0, sink_end) and
// [local_first, last] (the reference's RegionsOf).
struct Regions {
  int32_t sink_end, local_first, last;
};
__device__ __forceinline__ Regions RegionsOf(const SelectGeometry& g, int32_t i) {
  const int32_t row_end = min(g.n, (i + 1) * g.bq);
  Regions r;
  r.last = (row_end - 1) / g.bk;
  r.local_first = max(0, r.last + 1 - g.local_blocks);
  r.sink_end = min(g.sink_blocks, r.last + 1);
  return r;
}

// A row's threshold m + ln(tau l) over its exact regions (maximum m, sum l of exp(s - m)), in
// double as the reference; -inf at tau 0 (every middle block then taken).
__device__ __forceinline__ float RowThreshold(float m, double l, float tau) {
  return tau > 0.f ? static_cast<float>(static_cast<double>(m) + log(static_cast<double>(tau) * l))
                   : kNegInf;
}

constexpr int kExactTiles = kMaxBlock / 16;  // a warp's 8-key tiles per block, at most

// The exact regions' key blocks of a query block in the order the thresholds kernels walk them
// (the reference's): [0, sink_end), then [max(local_first, sink_end), last].
struct ExactBlocks {
  int32_t sink_end, b_first, count;
  __device__ __forceinline__ int32_t operator[](int32_t x) const {
    return x < sink_end ? x : b_first + (x - sink_end);
  }
};
__device__ __forceinline__ ExactBlocks ExactBlocksOf(const Regions& rg) {
  const int32_t b_first = max(rg.local_first, rg.sink_end);
  return {rg.sink_end, b_first, rg.sink_end + (rg.last + 1 - b_first)};
}

// The maxima of a thread's two row values (mma.m16n8's C layout: rows lane / 4 and + 8) over the
// lane quad that holds the rows' other keys.
__device__ __forceinline__ void QuadMax(float& a, float& b) {
#pragma unroll
  for (int off = 1; off <= 2; off *= 2) {
    a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, off));
    b = fmaxf(b, __shfl_xor_sync(0xffffffffu, b, off));
  }
}

// The running maximum and sum (fp32, natural units) of a warp's two rows of a 16-row tile: rows
// ra and rb = ra + 8 of the thread (lane / 4 and + 8), reduced over the lane quad's keys.
struct ExactRows {
  float ma = kNegInf, mb = kNegInf, la = 0.f, lb = 0.f;
};

// Folds one key block's raw scores into `st`: acc[t] is 8-key tile t's m16n8 accumulator (the
// thread's keys key0 + t * tile_stride + 2 (lane % 4) (+1) of rows row_a and row_b), the first
// `tiles` of them in the block; each score scaled, masked past the row (causal) and the prompt.
__device__ __forceinline__ void FoldExactTiles(const SelectGeometry& g,
                                               float (&acc)[kExactTiles][4], int tiles,
                                               int32_t key0, int tile_stride, int32_t row_a,
                                               int32_t row_b, ExactRows& st) {
  const int tq = threadIdx.x & 3;
  float ta = kNegInf, tb = kNegInf;
#pragma unroll
  for (int t = 0; t < kExactTiles; ++t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int32_t c = key0 + t * tile_stride + 2 * tq + (e & 1);
      const int32_t r = e < 2 ? row_a : row_b;
      acc[t][e] = t < tiles && c <= r && c < g.n ? __fmul_rn(g.scale, acc[t][e]) : kNegInf;
    }
    ta = fmaxf(ta, fmaxf(acc[t][0], acc[t][1]));
    tb = fmaxf(tb, fmaxf(acc[t][2], acc[t][3]));
  }
  QuadMax(ta, tb);
  const float na = fmaxf(st.ma, ta), nb = fmaxf(st.mb, tb);
  if (na != kNegInf) {
    st.la *= expf(st.ma - na);
#pragma unroll
    for (int t = 0; t < kExactTiles; ++t) st.la += expf(acc[t][0] - na) + expf(acc[t][1] - na);
    st.ma = na;
  }
  if (nb != kNegInf) {
    st.lb *= expf(st.mb - nb);
#pragma unroll
    for (int t = 0; t < kExactTiles; ++t) st.lb += expf(acc[t][2] - nb) + expf(acc[t][3] - nb);
    st.mb = nb;
  }
}

// The sums of `st` over the lane quad (each lane summed its own keys).
__device__ __forceinline__ void SumExactRows(ExactRows& st) {
#pragma unroll
  for (int off = 1; off <= 2; off *= 2) {
    st.la += __shfl_xor_sync(0xffffffffu, st.la, off);
    st.lb += __shfl_xor_sync(0xffffffffu, st.lb, off);
  }
}

// The thresholds m + ln(tau l) (in double, as the reference; -inf at tau 0) of a thread's rows
// ra and ra + 8 of a query block (`thr` its first row's), from `st` summed over the lane quad;
// rows past `rows` (the prompt's end) are not written.
__device__ __forceinline__ void StoreRowThresholds(float tau, float* thr, int32_t rows, int ra,
                                                   ExactRows st) {
  SumExactRows(st);
  if ((threadIdx.x & 3) != 0) return;
  if (ra < rows) thr[ra] = RowThreshold(st.ma, st.la, tau);
  if (ra + 8 < rows) thr[ra + 8] = RowThreshold(st.mb, st.lb, tau);
}

// The paper's geometry of the middle blocks (head_dim 64 or 128, block_k 32: MiddleKernel in
// sale.cu, MiddleKernelWg in sale_wg.cu).
constexpr int kFastKs = 4;  // 32-dim steps: head_dim 128 (64: 2 of them)
constexpr int kFastKt = 4;  // 8-key tiles: block_k 32

struct MiddleTile {
  int head_tile;  // query heads per CTA, a power of two dividing both the group and 8
  int q_blocks;   // query blocks of the prompt
};

// Query block i's mask rows of heads [h0, h0 + heads): every exact block 1, every other 0 (the
// middle kernel then sets the middle blocks it takes). Every thread of the CTA a share, 16 bytes
// a store between the row's unaligned ends.
__device__ __forceinline__ void WriteExactMaskRows(const SelectGeometry& g, const Regions& rg,
                                                   int h0, int heads, int32_t i, uint8_t* mask) {
  auto flag = [&](int32_t blk) -> uint32_t {
    return blk <= rg.last && (blk < rg.sink_end || blk >= rg.local_first) ? 1u : 0u;
  };
  for (int hh = 0; hh < heads; ++hh) {
    uint8_t* row = mask + (static_cast<int64_t>(h0 + hh) * gridDim.x + i) * g.k_blocks;
    const int32_t lead =
        min(g.k_blocks, static_cast<int32_t>((16 - (reinterpret_cast<uintptr_t>(row) & 15)) & 15));
    const int32_t vecs = (g.k_blocks - lead) / 16, tail = lead + 16 * vecs;
    for (int32_t x = threadIdx.x; x < lead; x += blockDim.x) row[x] = flag(x);
    for (int32_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      const int32_t b0 = lead + 16 * v;
      uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int e = 0; e < 16; ++e) w[e / 4] |= flag(b0 + e) << (8 * (e % 4));
      *reinterpret_cast<uint4*>(row + b0) = make_uint4(w[0], w[1], w[2], w[3]);
    }
    for (int32_t x = tail + threadIdx.x; x < g.k_blocks; x += blockDim.x) row[x] = flag(x);
  }
}

// Step 1 for the paper's geometry on bf16 / fp16 prompts (ThresholdsKernel in sale.cu,
// ThresholdsKernelWg in sale_wg.cu): key blocks in flight and query heads a CTA.
constexpr int kThrStages = 3;
constexpr int kThrHeads = 2;  // query heads a CTA where the GQA group is even

// ---- The computation pass ----------------------------------------------------------------

constexpr int kAttendWarps = 4;  // 16 query rows each: a 64-row query block
constexpr int kAttendBq = 64, kAttendBk = 32;

template <typename T>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi) {
  return static_cast<uint32_t>(FloatToBits<T>(lo)) |
         (static_cast<uint32_t>(FloatToBits<T>(hi)) << 16);
}

struct AttendGeometry {
  int32_t n, group, k_blocks, q_blocks;
  float scale_log2;  // scale * log2(e)
};

// The selected blocks of one mask row in ascending order, compacted into shared memory
// kListChunk mask bytes at a time: every thread reads 16 bytes of the row at once (one memory
// latency per 2048 blocks, where a walk of 32-byte votes waited on one per 32 blocks), and a
// scan over the CTA places each selected block. Every thread of the CTA walks the same row (the
// walk is uniform: Next() synchronizes the CTA when it refills the list).
constexpr int kAttendThreads = kAttendWarps * 32;
constexpr int kListChunk = kAttendThreads * 16;

struct BlockList {
  uint16_t blocks[kListChunk];  // positions in the chunk
  int32_t warp_total[kAttendWarps];
};

// The nonzero bytes of 16 as bits 0-15.
__device__ __forceinline__ uint32_t NonzeroBytes(const uint4& w) {
  const uint32_t x[4] = {w.x, w.y, w.z, w.w};
  uint32_t bits = 0;
#pragma unroll
  for (int e = 0; e < 16; ++e) bits |= ((x[e / 4] >> (8 * (e % 4))) & 0xffu) != 0 ? 1u << e : 0u;
  return bits;
}

struct SelectedBlocks {
  BlockList* list;
  const uint8_t* row;
  int32_t len;  // the row's causal blocks
  int32_t at;   // the next chunk's first position (negative: the row's 16-byte-aligned start)
  int32_t pos = 0, count = 0;
  __device__ __forceinline__ SelectedBlocks(BlockList* l, const uint8_t* r, int32_t n)
      : list(l), row(r), len(n), at(-static_cast<int32_t>(reinterpret_cast<uintptr_t>(r) & 15)) {}
  // The next selected block, or -1 past the last.
  __device__ __forceinline__ int32_t Next() {
    while (pos == count) {
      if (at >= len) return -1;
      Fill();
    }
    return at - kListChunk + list->blocks[pos++];
  }
  // Positions [at, at + kListChunk) of the row into the list.
  __device__ void Fill() {
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int32_t p0 = at + 16 * t;
    uint32_t bits = 0;
    if (p0 >= 0 && p0 + 16 <= len) {
      bits = NonzeroBytes(__ldg(reinterpret_cast<const uint4*>(row + p0)));
    } else {
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        if (p0 + e >= 0 && p0 + e < len && row[p0 + e] != 0) bits |= 1u << e;
      }
    }
    const int n = __popc(bits);
    int incl = n;  // inclusive scan over the warp
#pragma unroll
    for (int off = 1; off < 32; off *= 2) {
      const int y = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += y;
    }
    __syncthreads();  // every thread has read the previous chunk's list
    if (lane == 31) list->warp_total[warp] = incl;
    __syncthreads();
    int base = incl - n;
    count = 0;
#pragma unroll
    for (int w = 0; w < kAttendWarps; ++w) {
      const int tw = list->warp_total[w];
      base += w < warp ? tw : 0;
      count += tw;
    }
    for (; bits != 0; bits &= bits - 1) list->blocks[base++] = 16 * t + __ffs(bits) - 1;
    __syncthreads();
    pos = 0;
    at += kListChunk;
  }
};

// The two query rows a thread holds in the computation pass (row0 and row1 = row0 + 8 of its
// warp's 16: mma.m16n8's C layout) and their online-softmax state.
struct AttendRows {
  int32_t row0, row1;
  float m0 = kNegInf, m1 = kNegInf, l0 = 0.f, l1 = 0.f;
};

// One key block's scores `sc` (keys c0 + 8 nt + 2 tq (+1), the C layout) into unnormalized
// probabilities: scaled (log2 units), keys past the row (causal) or past the prompt masked, the
// rows' maxima raised over the quad, l rescaled to them and l += the rows' probabilities. Returns
// the factors o must be rescaled by (RescaleRows) before this block's P V is added to it.
__device__ __forceinline__ float2 ScoresToProbabilities(const AttendGeometry& g, int32_t c0, int tq,
                                                        float (&sc)[kAttendBk / 8][4],
                                                        AttendRows& st) {
  float mx0 = kNegInf, mx1 = kNegInf;
#pragma unroll
  for (int nt = 0; nt < kAttendBk / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int32_t c = c0 + nt * 8 + 2 * tq + (e & 1);
      const int32_t r = e < 2 ? st.row0 : st.row1;
      sc[nt][e] = c <= r && c < g.n ? sc[nt][e] * g.scale_log2 : kNegInf;
    }
    mx0 = fmaxf(mx0, fmaxf(sc[nt][0], sc[nt][1]));
    mx1 = fmaxf(mx1, fmaxf(sc[nt][2], sc[nt][3]));
  }
  QuadMax(mx0, mx1);
  const float n0 = fmaxf(st.m0, mx0), n1 = fmaxf(st.m1, mx1);
  // A row with no key yet keeps a zero state (its exponent base is then 0, not -inf).
  const float b0 = n0 == kNegInf ? 0.f : n0, b1 = n1 == kNegInf ? 0.f : n1;
  const float f0 = exp2f(st.m0 - b0), f1 = exp2f(st.m1 - b1);
  st.m0 = n0;
  st.m1 = n1;
  st.l0 *= f0;
  st.l1 *= f1;
#pragma unroll
  for (int nt = 0; nt < kAttendBk / 8; ++nt) {
    sc[nt][0] = exp2f(sc[nt][0] - b0);
    sc[nt][1] = exp2f(sc[nt][1] - b0);
    sc[nt][2] = exp2f(sc[nt][2] - b1);
    sc[nt][3] = exp2f(sc[nt][3] - b1);
    st.l0 += sc[nt][0] + sc[nt][1];
    st.l1 += sc[nt][2] + sc[nt][3];
  }
  return make_float2(f0, f1);
}

// o's rows (row0 in [.][0..1], row1 in [.][2..3]) times f.x and f.y.
template <int DT>
__device__ __forceinline__ void RescaleRows(float (&o)[DT][4], float2 f) {
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) {
    o[dt][0] *= f.x;
    o[dt][1] *= f.x;
    o[dt][2] *= f.y;
    o[dt][3] *= f.y;
  }
}

// P's A fragments (mma.m16n8k16's) for the block's 16-key step `kstep`.
template <typename T>
__device__ __forceinline__ void ProbabilityFragments(const float (&sc)[kAttendBk / 8][4], int kstep,
                                                     uint32_t (&a)[4]) {
  const float* p0 = sc[2 * kstep];
  const float* p1 = sc[2 * kstep + 1];
  a[0] = PackPair<T>(p0[0], p0[1]);
  a[1] = PackPair<T>(p0[2], p0[3]);
  a[2] = PackPair<T>(p1[0], p1[1]);
  a[3] = PackPair<T>(p1[2], p1[3]);
}

// The rows' sums over the quad, then o / l into head h's output rows (rows past the prompt
// skipped; a row with no key writes zeros).
template <typename T, int D>
__device__ __forceinline__ void StoreAttendRows(const AttendGeometry& g, int h, int tq,
                                                const float (&o)[D / 8][4], AttendRows st,
                                                void* out) {
#pragma unroll
  for (int off = 1; off <= 2; off *= 2) {
    st.l0 += __shfl_xor_sync(0xffffffffu, st.l0, off);
    st.l1 += __shfl_xor_sync(0xffffffffu, st.l1, off);
  }
  const float inv0 = st.l0 > 0.f ? 1.f / st.l0 : 0.f, inv1 = st.l1 > 0.f ? 1.f / st.l1 : 0.f;
  uint16_t* oh = static_cast<uint16_t*>(out) + static_cast<int64_t>(h) * g.n * D;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    const int col = dt * 8 + 2 * tq;
    if (st.row0 < g.n) {
      *reinterpret_cast<uint32_t*>(oh + static_cast<int64_t>(st.row0) * D + col) =
          PackPair<T>(o[dt][0] * inv0, o[dt][1] * inv0);
    }
    if (st.row1 < g.n) {
      *reinterpret_cast<uint32_t*>(oh + static_cast<int64_t>(st.row1) * D + col) =
          PackPair<T>(o[dt][2] * inv1, o[dt][3] * inv1);
    }
  }
}

// ---- The warpgroup-MMA kernels (sale_wg.cu) ------------------------------------------------

// The head dim of the 16-bit rows that ThresholdsKernelWg and AttendKernelWg stage in the
// 128-byte swizzle: SaleSelect and SaleAttend dispatch to them for it in sm_90a builds.
constexpr int kSwizzledDim = 128;

#if defined(KVSPARSE_CUDA_SM90A)
// The launchers of sale_wg.cu's kernels (SaleSelect and SaleAttend call them in sm_90a builds);
// each returns the launch's error and neither allocates nor synchronises.

// MiddleKernelWg over `grid` (SaleSelect's middle grid: (ceil(q_blocks / (8 / head_tile)),
// H / head_tile)): the middle blocks of head_dim 128, block_k 32, from ops.k as QuantizeKeysKernel
// writes it with swizzle128; mask [H, q_blocks, k_blocks].
cudaError_t LaunchMiddleKernelWg(const SelectGeometry& g, const MiddleTile& mt, const Operands& ops,
                                 uint8_t* mask, dim3 grid, cudaStream_t stream);

// ThresholdsKernelWg<T, kThrHeads> (two_heads) or <T, 1> for T bf16 or fp16 (dtype), grid
// (q_blocks, num_q_heads / heads): the thresholds of head_dim 128 into ops.thr, the exact blocks
// of mask [H, q_blocks, k_blocks]; q [H, n, 128], k [Hkv, n, 128]; tau [H].
cudaError_t LaunchThresholdsKernelWg(DType dtype, const SelectGeometry& g, int32_t q_blocks,
                                     int32_t num_q_heads, bool two_heads, const void* q,
                                     const void* k, const float* tau, const Operands& ops,
                                     uint8_t* mask, cudaStream_t stream);

// AttendKernelWg<T> for T bf16 or fp16 (dtype) over `grid` (q_blocks, H), kAttendThreads a
// block: q and out [H, n, 128], k and v [Hkv, n, 128], mask [H, q_blocks, k_blocks].
cudaError_t LaunchAttendKernelWg(DType dtype, const AttendGeometry& g, dim3 grid, const void* q,
                                 const void* k, const void* v, void* out, const uint8_t* mask,
                                 cudaStream_t stream);
#endif  // KVSPARSE_CUDA_SM90A

}  // namespace kvsparse::kernels::cuda::sale_internal

#endif  // KVSPARSE_KERNELS_CUDA_SALE_COMMON_CUH_
