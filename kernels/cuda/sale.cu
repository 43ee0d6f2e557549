#include <algorithm>
#include <climits>
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/sale.h"

namespace kvsparse::kernels::cuda {
namespace {

constexpr int kSelectThreads = 256;
constexpr int kSelectWarps = kSelectThreads / 32;
constexpr int kMaxBlock = 64;  // block_q and block_k
constexpr int kMaxHeadDim = 256;

// c[16 x 8] += a[16 x 32] b[32 x 8], int8 operands, exact int32 sums (mma.m16n8k32; with
// g = lane / 4 and t = lane % 4: a0 row g, columns 4t .. 4t + 3, a1 row g + 8, a2 and a3 the same
// rows at columns 16 + 4t; b0 rows 4t .. 4t + 3 of column g, b1 rows 16 + 4t; c as Mma16816's).
__device__ __forceinline__ void MmaInt8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

int32_t Blocks(int32_t n, int32_t b) { return (n + b - 1) / b; }

// The quantized operands in the workspace.
struct Operands {
  float* mean = nullptr;     // [Hkv, d]
  float* k_scale = nullptr;  // [Hkv, k_blocks]
  float* q_scale = nullptr;  // [H, n]
  float* q_mean = nullptr;   // [H, n]: q_r . mean of its kv head
  int8_t* k = nullptr;       // [Hkv, n, d], smoothed
  int8_t* q = nullptr;       // [H, n, d]
  size_t bytes = 0;
};

Operands Carve(const SaleSelectParams& p, void* base) {
  const SalePrefill& pr = p.prompt;
  const size_t n = std::max(pr.tokens, 0), d = std::max(pr.head_dim, 0);
  const size_t H = std::max(pr.num_q_heads, 0), hkv = std::max(pr.num_kv_heads, 0);
  const size_t kb = p.blocks.block_k > 0 ? Blocks(static_cast<int32_t>(n), p.blocks.block_k) : 0;
  Operands o;
  size_t at = 0;
  auto take = [&](size_t bytes) {
    void* ptr = base == nullptr ? nullptr : static_cast<char*>(base) + at;
    at += AlignUp(bytes, 256);
    return ptr;
  };
  o.mean = static_cast<float*>(take(hkv * d * sizeof(float)));
  o.k_scale = static_cast<float*>(take(hkv * kb * sizeof(float)));
  o.q_scale = static_cast<float*>(take(H * n * sizeof(float)));
  o.q_mean = static_cast<float*>(take(H * n * sizeof(float)));
  o.k = static_cast<int8_t*>(take(hkv * n * d));
  o.q = static_cast<int8_t*>(take(H * n * d));
  o.bytes = at;
  return o;
}

// The reference's Round8: round to nearest even, clamped to [-127, 127].
__device__ __forceinline__ int8_t Round8(float x) {
  return static_cast<int8_t>(fminf(fmaxf(rintf(x), -127.f), 127.f));
}

// mean[j, e] = (sum over tokens, in order, in double) / n, as the reference. Grid Hkv, block d.
template <typename T>
__global__ void KeyMeanKernel(const void* k, int32_t n, int32_t d, float* mean) {
  const int j = blockIdx.x, e = threadIdx.x;
  if (e >= d) return;
  double sum = 0.0;
  for (int32_t t = 0; t < n; ++t) sum += LoadElem<T>(k, (static_cast<int64_t>(j) * n + t) * d + e);
  mean[j * d + e] = static_cast<float>(sum / n);
}

// Per (kv head, key block): the block's scale max |k - mean| / 127 and its int8 keys. Grid
// (k_blocks, Hkv).
template <typename T>
__global__ void QuantizeKeysKernel(const void* k, const float* mean, int32_t n, int32_t d,
                                   int32_t bk, int8_t* kq, float* k_scale) {
  __shared__ float red[32];
  const int blk = blockIdx.x, j = blockIdx.y;
  const int32_t t0 = blk * bk, t1 = min(n, t0 + bk);
  const int64_t base = (static_cast<int64_t>(j) * n + t0) * d;
  const int32_t count = (t1 - t0) * d;
  const float* m = mean + static_cast<int64_t>(j) * d;
  float amax = 0.f;
  for (int32_t x = threadIdx.x; x < count; x += blockDim.x) {
    amax = fmaxf(amax, fabsf(__fsub_rn(LoadElem<T>(k, base + x), m[x % d])));
  }
  amax = BlockMax(amax, red);
  const float s = amax > 0.f ? amax / 127.f : 1.f;
  if (threadIdx.x == 0) k_scale[static_cast<int64_t>(j) * gridDim.x + blk] = s;
  for (int32_t x = threadIdx.x; x < count; x += blockDim.x) {
    kq[base + x] = Round8(__fsub_rn(LoadElem<T>(k, base + x), m[x % d]) / s);
  }
}

// Per (query head, token), one warp: the scale max |q| / 127, the int8 query and q . mean (a
// sequential fp32 dot product, as the reference's). Grid (ceil(n / 8), H), block 256.
template <typename T>
__global__ void QuantizeQueriesKernel(const void* q, const float* mean, int32_t n, int32_t d,
                                      int32_t group, int8_t* qq, float* q_scale, float* q_mean) {
  const int lane = threadIdx.x & 31;
  const int32_t t = blockIdx.x * kSelectWarps + (threadIdx.x >> 5);
  const int h = blockIdx.y;
  if (t >= n) return;
  const int64_t row = static_cast<int64_t>(h) * n + t;
  float amax = 0.f;
  for (int e = lane; e < d; e += 32) amax = fmaxf(amax, fabsf(LoadElem<T>(q, row * d + e)));
  amax = WarpMax(amax);
  const float s = amax > 0.f ? amax / 127.f : 1.f;
  for (int e = lane; e < d; e += 32) qq[row * d + e] = Round8(LoadElem<T>(q, row * d + e) / s);
  if (lane == 0) {
    const float* m = mean + static_cast<int64_t>(h / group) * d;
    float acc = 0.f;
    for (int e = 0; e < d; ++e) acc = __fadd_rn(acc, __fmul_rn(LoadElem<T>(q, row * d + e), m[e]));
    q_scale[row] = s;
    q_mean[row] = acc;
  }
}

struct SelectGeometry {
  int32_t n, d, group, bq, bk, sink_blocks, local_blocks, k_blocks, score_cap;
  float scale;
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

// Step 1 for one row (one warp): m_r and the threshold m_r + ln(tau l_r) over the exact
// regions' keys c <= r, the scores sequential fp32 dot products (no fused multiply-adds).
template <typename T>
__device__ void ExactRowThreshold(const SelectGeometry& g, const Regions& rg, const void* q,
                                  const void* k, int h, int32_t r, float tau, float* qrow,
                                  float* sc, float* thr_out) {
  const int lane = threadIdx.x & 31;
  const int j = h / g.group;
  const int64_t qbase = (static_cast<int64_t>(h) * g.n + r) * g.d;
  for (int e = lane; e < g.d; e += 32) qrow[e] = LoadElem<T>(q, qbase + e);
  __syncwarp();
  // Keys: [0, a_end) then [b_begin, b_end), each clipped to c <= r (the union of the regions,
  // ascending, as the reference walks the blocks).
  const int32_t a_end = min(rg.sink_end * g.bk, r + 1);
  const int32_t b_begin = max(rg.local_first, rg.sink_end) * g.bk;
  const int32_t b_end = min((rg.last + 1) * g.bk, r + 1);
  const int32_t count = a_end + max(0, b_end - b_begin);
  float mr = kNegInf;
  for (int32_t x = lane; x < count; x += 32) {
    const int32_t c = x < a_end ? x : b_begin + (x - a_end);
    const int64_t kbase = (static_cast<int64_t>(j) * g.n + c) * g.d;
    float acc = 0.f;
    for (int e = 0; e < g.d; ++e)
      acc = __fadd_rn(acc, __fmul_rn(qrow[e], LoadElem<T>(k, kbase + e)));
    const float s = __fmul_rn(g.scale, acc);
    sc[x] = s;
    mr = fmaxf(mr, s);
  }
  mr = WarpMax(mr);
  double lr = 0.0;
  for (int32_t x = lane; x < count; x += 32) lr += exp(static_cast<double>(sc[x]) - mr);
  lr = WarpSum(lr);
  if (lane == 0) {
    *thr_out =
        tau > 0.f ? static_cast<float>(static_cast<double>(mr) + log(static_cast<double>(tau) * lr))
                  : kNegInf;
  }
  __syncwarp();
}

// Step 1 on the tensor cores (T bf16 or fp16): warp w scores row tile w % 4 (16 rows of the
// query block, staged as `qb`, row stride qb_stride halves) against every other exact key block
// (from w / 4: the two halves of the warps split the blocks), S = Q K^T with mma.m16n8k16 and K's
// fragments read from global memory, an online max and sum per row (fp32, natural units, the
// reference's scale), written as partials pm / pl [2][kMaxBlock] for the kernel to merge. The
// sums run in another order than the reference's sequential dots: a threshold may move by an
// ulp.
template <typename T>
__device__ void ExactPartialsMma(const SelectGeometry& g, const Regions& rg, const void* k, int j,
                                 int32_t r0, int rows, const uint16_t* qb, int qb_stride, float* pm,
                                 float* pl) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3;
  const int rt = warp & 3, parity = warp >> 2;
  if (rt * 16 >= rows) return;  // the whole warp: a row tile past the prompt
  const int ra = rt * 16 + gr, rb = ra + 8;
  const int32_t tile_last_row = r0 + rt * 16 + 15;
  const uint16_t* kh = static_cast<const uint16_t*>(k) + static_cast<int64_t>(j) * g.n * g.d;
  const uint16_t* qa = qb + ra * qb_stride + 2 * tq;
  float ma = kNegInf, mb = kNegInf, la = 0.f, lb = 0.f;
  const int32_t b_first = max(rg.local_first, rg.sink_end);
  const int32_t nx = rg.sink_end + (rg.last + 1 - b_first);
  for (int32_t x = parity; x < nx; x += 2) {
    const int32_t blk = x < rg.sink_end ? x : b_first + (x - rg.sink_end);
    for (int kt = 0; kt < g.bk / 8; ++kt) {
      const int32_t c0 = blk * g.bk + kt * 8;
      if (c0 > tile_last_row || c0 >= g.n) break;  // causal: no row of the tile reaches it
      const int32_t key = min(c0 + gr, g.n - 1);   // loads stay in the prompt; masked below
      const uint16_t* kr = kh + static_cast<int64_t>(key) * g.d + 2 * tq;
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      for (int ks = 0; ks < g.d / 16; ++ks) {
        const int e = 16 * ks;
        Mma16816<T>(acc, *reinterpret_cast<const uint32_t*>(qa + e),
                    *reinterpret_cast<const uint32_t*>(qa + 8 * qb_stride + e),
                    *reinterpret_cast<const uint32_t*>(qa + e + 8),
                    *reinterpret_cast<const uint32_t*>(qa + 8 * qb_stride + e + 8),
                    *reinterpret_cast<const uint32_t*>(kr + e),
                    *reinterpret_cast<const uint32_t*>(kr + e + 8));
      }
      float sv[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int32_t c = c0 + 2 * tq + (e & 1);
        const int32_t r = r0 + (e < 2 ? ra : rb);
        sv[e] = c <= r && c < g.n ? __fmul_rn(g.scale, acc[e]) : kNegInf;
      }
      float ta = fmaxf(sv[0], sv[1]), tb = fmaxf(sv[2], sv[3]);
#pragma unroll
      for (int off = 1; off <= 2; off *= 2) {
        ta = fmaxf(ta, __shfl_xor_sync(0xffffffffu, ta, off));
        tb = fmaxf(tb, __shfl_xor_sync(0xffffffffu, tb, off));
      }
      const float na = fmaxf(ma, ta), nb = fmaxf(mb, tb);
      if (na != kNegInf) {
        la = la * expf(ma - na) + expf(sv[0] - na) + expf(sv[1] - na);
        ma = na;
      }
      if (nb != kNegInf) {
        lb = lb * expf(mb - nb) + expf(sv[2] - nb) + expf(sv[3] - nb);
        mb = nb;
      }
    }
  }
#pragma unroll
  for (int off = 1; off <= 2; off *= 2) {
    la += __shfl_xor_sync(0xffffffffu, la, off);
    lb += __shfl_xor_sync(0xffffffffu, lb, off);
  }
  if (tq == 0) {
    pm[parity * kMaxBlock + ra] = ma;
    pl[parity * kMaxBlock + ra] = la;
    pm[parity * kMaxBlock + rb] = mb;
    pl[parity * kMaxBlock + rb] = lb;
  }
}

// The middle blocks with the warp's operands in registers, for the paper's geometry (head_dim
// at most 128, block_k at most 32): A (the query block's int8 rows) loaded once from the staged
// rows, each block's B (its int8 keys, every 8-key tile) loaded whole, the warp's next block
// loaded before the current one is estimated (its loads overlap the tensor-core work), and each
// row's scale, mean term and threshold held per thread. The arithmetic of the test is the
// general loop's (the same products, in the same order), applied to each row's largest sum in
// the block (the test is monotone in it, the launcher having checked scale > 0): the same mask.
constexpr int kFastKs = 4;               // 32-dim steps: head_dim <= 128
constexpr int kFastKt = 4;               // 8-key tiles: block_k <= 32
constexpr int kFastRt = kMaxBlock / 16;  // 16-row tiles of the query block
using KeyFrags = uint32_t[kFastKt][kFastKs][2];

__device__ __forceinline__ void LoadKeyFrags(const int8_t* kb, int d, int tiles, int ksteps, int gr,
                                             int tq, KeyFrags& b) {
#pragma unroll
  for (int kt = 0; kt < kFastKt; ++kt) {
    const int8_t* kr = kb + static_cast<int64_t>(kt * 8 + gr) * d + 4 * tq;
#pragma unroll
    for (int x = 0; x < kFastKs; ++x) {
      if (kt < tiles && x < ksteps) {
        b[kt][x][0] = __ldg(reinterpret_cast<const uint32_t*>(kr + 32 * x));
        b[kt][x][1] = __ldg(reinterpret_cast<const uint32_t*>(kr + 32 * x + 16));
      }
    }
  }
}

__device__ void MiddleBlocksInRegisters(const SelectGeometry& g, const Regions& rg,
                                        const Operands& ops, int j, int rows, const int* q8,
                                        int qstride, const float* thr, const float* qs,
                                        const float* qm, uint8_t* out) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3;
  const int ksteps = g.d / 32, tiles = g.bk / 8;
  uint32_t qa[kFastRt][kFastKs][4];
  float rthr[2 * kFastRt], rqs[2 * kFastRt], rqm[2 * kFastRt];
#pragma unroll
  for (int rt = 0; rt < kFastRt; ++rt) {
    const int* pa = q8 + (rt * 16 + gr) * qstride + tq;
#pragma unroll
    for (int x = 0; x < kFastKs; ++x) {
      if (x < ksteps) {
        qa[rt][x][0] = pa[8 * x];
        qa[rt][x][1] = pa[8 * qstride + 8 * x];
        qa[rt][x][2] = pa[8 * x + 4];
        qa[rt][x][3] = pa[8 * qstride + 8 * x + 4];
      }
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = rt * 16 + gr + 8 * hf;
      const bool ok = r < rows;  // rows past the prompt never pass
      rthr[2 * rt + hf] = ok ? thr[r] : -kNegInf;
      rqs[2 * rt + hf] = ok ? qs[r] : 0.f;
      rqm[2 * rt + hf] = ok ? qm[r] : 0.f;
    }
  }
  const int8_t* kh = ops.k + static_cast<int64_t>(j) * g.n * g.d;
  const int64_t block_bytes = static_cast<int64_t>(g.bk) * g.d;
  KeyFrags cur, next;
  int32_t blk = rg.sink_end + warp;
  if (blk < rg.local_first) LoadKeyFrags(kh + blk * block_bytes, g.d, tiles, ksteps, gr, tq, cur);
  for (; blk < rg.local_first; blk += kSelectWarps) {
    const int32_t nb = blk + kSelectWarps;
    if (nb < rg.local_first) LoadKeyFrags(kh + nb * block_bytes, g.d, tiles, ksteps, gr, tq, next);
    const float ks = ops.k_scale[static_cast<int64_t>(j) * g.k_blocks + blk];
    float a[2 * kFastRt];
#pragma unroll
    for (int x = 0; x < 2 * kFastRt; ++x) a[x] = __fmul_rn(rqs[x], ks);
    // The test is monotone in the integer sum (every step a correctly rounded product or sum
    // with non-negative factors: a = q_scale k_scale >= 0, scale > 0), so a row passes somewhere
    // in the block if and only if it passes at its largest sum: each thread keeps its rows'
    // maxima and tests them after every two 8-key tiles (a block stops there once it hit).
    int mx[2 * kFastRt];
#pragma unroll
    for (int x = 0; x < 2 * kFastRt; ++x) mx[x] = INT_MIN;
    bool hit = false;
#pragma unroll
    for (int kt = 0; kt < kFastKt; ++kt) {
      if (kt < tiles && !hit) {
#pragma unroll
        for (int rt = 0; rt < kFastRt; ++rt) {
          if (rt * 16 < rows) {
            int acc[4] = {0, 0, 0, 0};
#pragma unroll
            for (int x = 0; x < kFastKs; ++x) {
              if (x < ksteps) {
                MmaInt8(acc, qa[rt][x][0], qa[rt][x][1], qa[rt][x][2], qa[rt][x][3], cur[kt][x][0],
                        cur[kt][x][1]);
              }
            }
            mx[2 * rt] = max(mx[2 * rt], max(acc[0], acc[1]));
            mx[2 * rt + 1] = max(mx[2 * rt + 1], max(acc[2], acc[3]));
          }
        }
        if (kt % 2 == 1 || kt == tiles - 1) {
          bool any = false;
#pragma unroll
          for (int x = 0; x < 2 * kFastRt; ++x) {
            const float est =
                __fmul_rn(g.scale, __fadd_rn(__fmul_rn(a[x], static_cast<float>(mx[x])), rqm[x]));
            any |= est >= rthr[x];
          }
          hit = __any_sync(0xffffffffu, any);
        }
      }
    }
    if (hit && lane == 0) out[blk] = 1;
#pragma unroll
    for (int kt = 0; kt < kFastKt; ++kt) {
#pragma unroll
      for (int x = 0; x < kFastKs; ++x) {
        cur[kt][x][0] = next[kt][x][0];
        cur[kt][x][1] = next[kt][x][1];
      }
    }
  }
}

// One (query block, query head) per block: the exact regions' thresholds per row, then each
// middle key block estimated from int8 Q and K (one comparison per element), the block's row of
// the mask written whole.
template <typename T>
__global__ void __launch_bounds__(kSelectThreads)
    SelectKernel(SelectGeometry g, const void* q, const void* k, const float* tau, Operands ops,
                 uint8_t* mask) {
  extern __shared__ __align__(16) char smem[];
  const int i = blockIdx.x, h = blockIdx.y, j = h / g.group;
  const int warp = threadIdx.x >> 5;
  const Regions rg = RegionsOf(g, i);
  const int32_t r0 = i * g.bq, rows = min(g.n, r0 + g.bq) - r0;
  const int words = g.d / 4;
  const int qstride = words + 1;           // words per staged int8 row (+1 against conflicts)
  int* q8 = reinterpret_cast<int*>(smem);  // [bq][qstride]
  float* thr = reinterpret_cast<float*>(q8 + kMaxBlock * qstride);  // [bq]
  float* qs = thr + kMaxBlock;                                      // [bq]
  float* qm = qs + kMaxBlock;                                       // [bq]
  // Step 1's staging (a union): fp32 prompts, the rows and scores of the sequential dots;
  // bf16 / fp16, the query block's rows for the tensor cores and the two halves' partials.
  float* qrow = qm + kMaxBlock;                                    // [warps][d]
  float* sc = qrow + kSelectWarps * g.d;                           // [warps][score_cap]
  float* pm = qm + kMaxBlock;                                      // [2][bq]
  float* pl = pm + 2 * kMaxBlock;                                  // [2][bq]
  uint16_t* qb = reinterpret_cast<uint16_t*>(pl + 2 * kMaxBlock);  // [bq][d + 8]
  const int qb_stride = g.d + 8;
  uint8_t* out = mask + (static_cast<int64_t>(h) * gridDim.x + i) * g.k_blocks;
  for (int32_t blk = threadIdx.x; blk < g.k_blocks; blk += blockDim.x) {
    const bool exact = blk <= rg.last && (blk < rg.sink_end || blk >= rg.local_first);
    out[blk] = exact ? 1 : 0;  // the middle blocks are written below
  }
  if constexpr (std::is_same_v<T, float>) {
    for (int32_t r = warp; r < rows; r += kSelectWarps) {
      ExactRowThreshold<T>(g, rg, q, k, h, r0 + r, tau[h], qrow + warp * g.d,
                           sc + warp * g.score_cap, &thr[r]);
    }
  } else {
    const uint16_t* qsrc16 =
        static_cast<const uint16_t*>(q) + (static_cast<int64_t>(h) * g.n + r0) * g.d;
    for (int x = threadIdx.x; x < kMaxBlock * (g.d / 8); x += blockDim.x) {
      const int r = x / (g.d / 8), e = (x % (g.d / 8)) * 8;
      *reinterpret_cast<uint4*>(qb + r * qb_stride + e) =
          r < rows ? *reinterpret_cast<const uint4*>(qsrc16 + static_cast<int64_t>(r) * g.d + e)
                   : make_uint4(0, 0, 0, 0);
    }
    __syncthreads();
    ExactPartialsMma<T>(g, rg, k, j, r0, rows, qb, qb_stride, pm, pl);
    __syncthreads();
    const float t = tau[h];
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
      const float m0 = pm[r], m1 = pm[kMaxBlock + r], m = fmaxf(m0, m1);
      const float l = pl[r] * expf(m0 - m) + pl[kMaxBlock + r] * expf(m1 - m);
      thr[r] = t > 0.f ? static_cast<float>(static_cast<double>(m) +
                                            log(static_cast<double>(t) * static_cast<double>(l)))
                       : kNegInf;
    }
  }
  const int* qsrc =
      reinterpret_cast<const int*>(ops.q + (static_cast<int64_t>(h) * g.n + r0) * g.d);
  for (int x = threadIdx.x; x < rows * words; x += blockDim.x) {
    q8[(x / words) * qstride + x % words] = qsrc[x];
  }
  for (int x = threadIdx.x; x < rows; x += blockDim.x) {
    qs[x] = ops.q_scale[static_cast<int64_t>(h) * g.n + r0 + x];
    qm[x] = ops.q_mean[static_cast<int64_t>(h) * g.n + r0 + x];
  }
  __syncthreads();  // q8, qs, qm and thr ready
  // Each warp estimates whole middle blocks on its own (blocks sink_end + warp, + 8, ...):
  // S~ tiles of 16 rows x 8 keys with mma.m16n8k32 (int8, exact int32 sums), A from the staged
  // rows, B straight from the block's int8 keys; a block stops at its first element over the
  // threshold. The paper's geometry keeps the operands in registers (MiddleBlocksInRegisters).
  if (g.d <= 32 * kFastKs && g.bk <= 8 * kFastKt) {
    MiddleBlocksInRegisters(g, rg, ops, j, rows, q8, qstride, thr, qs, qm, out);
    return;
  }
  const int lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3;
  const int row_tiles = (rows + 15) / 16, ksteps = g.d / 32;
  for (int32_t blk = rg.sink_end + warp; blk < rg.local_first; blk += kSelectWarps) {
    const int8_t* kb = ops.k + (static_cast<int64_t>(j) * g.n + blk * g.bk) * g.d;
    const float ks = ops.k_scale[static_cast<int64_t>(j) * g.k_blocks + blk];
    bool hit = false;
    for (int kt = 0; kt < g.bk / 8 && !hit; ++kt) {
      uint32_t bf[kMaxHeadDim / 32][2];
      const int8_t* kr = kb + static_cast<int64_t>(kt * 8 + gr) * g.d + 4 * tq;
#pragma unroll
      for (int x = 0; x < kMaxHeadDim / 32; ++x) {
        if (x < ksteps) {
          bf[x][0] = *reinterpret_cast<const uint32_t*>(kr + 32 * x);
          bf[x][1] = *reinterpret_cast<const uint32_t*>(kr + 32 * x + 16);
        }
      }
      for (int rt = 0; rt < row_tiles && !hit; ++rt) {
        int acc[4] = {0, 0, 0, 0};
        const int* qa = q8 + (rt * 16 + gr) * qstride + tq;
#pragma unroll
        for (int x = 0; x < kMaxHeadDim / 32; ++x) {
          if (x < ksteps) {
            MmaInt8(acc, qa[8 * x], qa[8 * qstride + 8 * x], qa[8 * x + 4],
                    qa[8 * qstride + 8 * x + 4], bf[x][0], bf[x][1]);
          }
        }
        bool any = false;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = rt * 16 + gr + (e >= 2 ? 8 : 0);
          if (r < rows) {
            const float a = __fmul_rn(qs[r], ks);
            const float est =
                __fmul_rn(g.scale, __fadd_rn(__fmul_rn(a, static_cast<float>(acc[e])), qm[r]));
            any |= est >= thr[r];
          }
        }
        hit = __any_sync(0xffffffffu, any);
      }
    }
    if (hit && lane == 0) out[blk] = 1;
  }
}

size_t SelectSmem(const SelectGeometry& g) {
  const size_t words = g.d / 4;
  const size_t sequential = static_cast<size_t>(kSelectWarps) * (g.d + g.score_cap) * sizeof(float);
  const size_t mma = 4 * kMaxBlock * sizeof(float) + kMaxBlock * (g.d + 8) * sizeof(uint16_t);
  return kMaxBlock * (words + 1) * sizeof(int) + 3 * kMaxBlock * sizeof(float) +
         std::max(sequential, mma);
}

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

// One (query block i, query head h) per block: Q's fragments in registers, each selected key
// block's K and V rows staged in shared memory (zero past the prompt), S = Q K^T and O += P V on
// the tensor cores with an online softmax per row.
template <typename T, int D>
__global__ void __launch_bounds__(kAttendWarps * 32)
    AttendKernel(AttendGeometry g, const void* q, const void* k, const void* v, void* out,
                 const uint8_t* mask) {
  constexpr int kStride = D + 8;  // halves per staged row (padding against bank conflicts)
  __shared__ __align__(16) uint16_t ks[kAttendBk * kStride];
  __shared__ __align__(16) uint16_t vs[kAttendBk * kStride];
  const int i = blockIdx.x, h = blockIdx.y, j = h / g.group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3;
  const int32_t row0 = i * kAttendBq + warp * 16 + gr, row1 = row0 + 8;
  const uint16_t* qh = static_cast<const uint16_t*>(q) + static_cast<int64_t>(h) * g.n * D;
  const uint16_t* kh = static_cast<const uint16_t*>(k) + static_cast<int64_t>(j) * g.n * D;
  const uint16_t* vh = static_cast<const uint16_t*>(v) + static_cast<int64_t>(j) * g.n * D;
  // Q's A fragments: rows row0 / row1, dims 16 kk + 2 tq (+1) and + 8.
  uint32_t qa[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int c = kk * 16 + 2 * tq;
    auto word = [&](int32_t r, int col) -> uint32_t {
      return r < g.n ? *reinterpret_cast<const uint32_t*>(qh + static_cast<int64_t>(r) * D + col)
                     : 0u;
    };
    qa[kk][0] = word(row0, c);
    qa[kk][1] = word(row1, c);
    qa[kk][2] = word(row0, c + 8);
    qa[kk][3] = word(row1, c + 8);
  }
  float o[D / 8][4];
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float m0 = kNegInf, m1 = kNegInf, l0 = 0.f, l1 = 0.f;
  const int32_t last = (min(g.n, (i + 1) * kAttendBq) - 1) / kAttendBk;
  const uint8_t* mrow = mask + (static_cast<int64_t>(h) * g.q_blocks + i) * g.k_blocks;
  for (int32_t blk = 0; blk <= last; ++blk) {
    if (mrow[blk] == 0) continue;  // uniform over the block
    __syncthreads();               // the previous block's K and V are read
    const int32_t c0 = blk * kAttendBk;
    for (int x = threadIdx.x; x < kAttendBk * D / 8; x += blockDim.x) {
      const int r = x / (D / 8), e = (x % (D / 8)) * 8;
      const bool in = c0 + r < g.n;
      const int64_t at = static_cast<int64_t>(c0 + r) * D + e;
      *reinterpret_cast<uint4*>(ks + r * kStride + e) =
          in ? *reinterpret_cast<const uint4*>(kh + at) : make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(vs + r * kStride + e) =
          in ? *reinterpret_cast<const uint4*>(vh + at) : make_uint4(0, 0, 0, 0);
    }
    __syncthreads();
    // S = Q K^T: four 8-key tiles.
    float sc[kAttendBk / 8][4];
#pragma unroll
    for (int nt = 0; nt < kAttendBk / 8; ++nt) {
      sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
      const uint16_t* kr = ks + (nt * 8 + gr) * kStride + 2 * tq;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(kr + kk * 16);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(kr + kk * 16 + 8);
        Mma16816<T>(sc[nt], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b0, b1);
      }
    }
    // Scale (log2 units) and mask: keys past the row (causal) or past the prompt.
    float mx0 = kNegInf, mx1 = kNegInf;
#pragma unroll
    for (int nt = 0; nt < kAttendBk / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int32_t c = c0 + nt * 8 + 2 * tq + (e & 1);
        const int32_t r = e < 2 ? row0 : row1;
        sc[nt][e] = c <= r && c < g.n ? sc[nt][e] * g.scale_log2 : kNegInf;
      }
      mx0 = fmaxf(mx0, fmaxf(sc[nt][0], sc[nt][1]));
      mx1 = fmaxf(mx1, fmaxf(sc[nt][2], sc[nt][3]));
    }
#pragma unroll
    for (int off = 1; off <= 2; off *= 2) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
    }
    const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
    // A row with no key yet keeps a zero state (its exponent base is then 0, not -inf).
    const float b0 = n0 == kNegInf ? 0.f : n0, b1 = n1 == kNegInf ? 0.f : n1;
    const float f0 = exp2f(m0 - b0), f1 = exp2f(m1 - b1);
    m0 = n0;
    m1 = n1;
    l0 *= f0;
    l1 *= f1;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      o[dt][0] *= f0;
      o[dt][1] *= f0;
      o[dt][2] *= f1;
      o[dt][3] *= f1;
    }
#pragma unroll
    for (int nt = 0; nt < kAttendBk / 8; ++nt) {
      sc[nt][0] = exp2f(sc[nt][0] - b0);
      sc[nt][1] = exp2f(sc[nt][1] - b0);
      sc[nt][2] = exp2f(sc[nt][2] - b1);
      sc[nt][3] = exp2f(sc[nt][3] - b1);
      l0 += sc[nt][0] + sc[nt][1];
      l1 += sc[nt][2] + sc[nt][3];
    }
    // O += P V: two 16-key steps; P's A fragments from the score tiles, V's B fragments from
    // the staged rows (keys 2 tq, 2 tq + 1 of column gr).
#pragma unroll
    for (int kstep = 0; kstep < kAttendBk / 16; ++kstep) {
      const float* p0 = sc[2 * kstep];
      const float* p1 = sc[2 * kstep + 1];
      const uint32_t a0 = PackPair<T>(p0[0], p0[1]), a1 = PackPair<T>(p0[2], p0[3]);
      const uint32_t a2 = PackPair<T>(p1[0], p1[1]), a3 = PackPair<T>(p1[2], p1[3]);
      const uint16_t* v0 = vs + (kstep * 16 + 2 * tq) * kStride + gr;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        const uint16_t* vc = v0 + dt * 8;
        const uint32_t vb0 =
            static_cast<uint32_t>(vc[0]) | (static_cast<uint32_t>(vc[kStride]) << 16);
        const uint32_t vb1 =
            static_cast<uint32_t>(vc[8 * kStride]) | (static_cast<uint32_t>(vc[9 * kStride]) << 16);
        Mma16816<T>(o[dt], a0, a1, a2, a3, vb0, vb1);
      }
    }
  }
#pragma unroll
  for (int off = 1; off <= 2; off *= 2) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }
  const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
  uint16_t* oh = static_cast<uint16_t*>(out) + static_cast<int64_t>(h) * g.n * D;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    const int col = dt * 8 + 2 * tq;
    if (row0 < g.n) {
      *reinterpret_cast<uint32_t*>(oh + static_cast<int64_t>(row0) * D + col) =
          PackPair<T>(o[dt][0] * inv0, o[dt][1] * inv0);
    }
    if (row1 < g.n) {
      *reinterpret_cast<uint32_t*>(oh + static_cast<int64_t>(row1) * D + col) =
          PackPair<T>(o[dt][2] * inv1, o[dt][3] * inv1);
    }
  }
}

// What kernels::ValidateSalePrefill asks of a prompt's counts and scale (both launchers check it
// beside their own limits; the CUDA library links no host library to call it).
bool PromptOk(const SalePrefill& pr) {
  return pr.tokens >= 0 && pr.num_kv_heads >= 1 && pr.num_q_heads >= 1 &&
         pr.num_q_heads % pr.num_kv_heads == 0 && std::isfinite(pr.scale) && pr.scale > 0.f;
}

}  // namespace

bool SaleSupports(const SaleParams& b, int32_t head_dim) {
  return b.block_q >= 1 && b.block_q <= kMaxBlock && b.block_k >= 1 && b.block_k <= kMaxBlock &&
         b.block_q % b.block_k == 0 && b.sink_tokens >= 0 && b.sink_tokens % b.block_k == 0 &&
         b.local_tokens >= b.block_q && b.local_tokens % b.block_k == 0 &&
         b.sink_tokens + b.local_tokens <= 1024 && b.block_k % 8 == 0 && head_dim >= 32 &&
         head_dim <= kMaxHeadDim && head_dim % 32 == 0;
}

size_t SaleSelectWorkspaceBytes(const SaleSelectParams& p) { return Carve(p, nullptr).bytes; }

cudaError_t SaleSelect(const SaleSelectParams& p, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream) {
  const SalePrefill& pr = p.prompt;
  if (!SaleSupports(p.blocks, pr.head_dim) || !PromptOk(pr)) return cudaErrorInvalidValue;
  if (pr.tokens == 0) return cudaSuccess;
  if (pr.q == nullptr || pr.k == nullptr || p.tau == nullptr || p.mask == nullptr) {
    return cudaErrorInvalidValue;
  }
  const Operands ops = Carve(p, workspace);
  if (workspace == nullptr || workspace_bytes < ops.bytes) return cudaErrorInvalidValue;
  const int32_t n = pr.tokens, d = pr.head_dim, H = pr.num_q_heads, hkv = pr.num_kv_heads;
  SelectGeometry g;
  g.n = n;
  g.d = d;
  g.group = H / hkv;
  g.bq = p.blocks.block_q;
  g.bk = p.blocks.block_k;
  g.sink_blocks = p.blocks.sink_tokens / g.bk;
  g.local_blocks = p.blocks.local_tokens / g.bk;
  g.k_blocks = Blocks(n, g.bk);
  g.score_cap = p.blocks.sink_tokens + p.blocks.local_tokens + g.bk;
  g.scale = pr.scale;
  const dim3 select_grid(Blocks(n, g.bq), H);
  cudaError_t select_err = cudaSuccess;
  KVSPARSE_CUDA_RETURN_IF_ERROR(ByDtype(pr.dtype, [&](auto tag) {
    using T = decltype(tag);
    KeyMeanKernel<T><<<hkv, d, 0, stream>>>(pr.k, n, d, ops.mean);
    QuantizeKeysKernel<T>
        <<<dim3(g.k_blocks, hkv), 128, 0, stream>>>(pr.k, ops.mean, n, d, g.bk, ops.k, ops.k_scale);
    QuantizeQueriesKernel<T><<<dim3(Blocks(n, kSelectWarps), H), kSelectThreads, 0, stream>>>(
        pr.q, ops.mean, n, d, g.group, ops.q, ops.q_scale, ops.q_mean);
    select_err = LaunchWithSmem(&SelectKernel<T>, select_grid, dim3(kSelectThreads), SelectSmem(g),
                                stream, g, pr.q, pr.k, p.tau, ops, p.mask);
  }));
  return select_err;
}

bool SaleAttendSupports(const SaleParams& b, int32_t head_dim, DType dtype) {
  return b.block_q == kAttendBq && b.block_k == kAttendBk && (head_dim == 64 || head_dim == 128) &&
         (dtype == DType::kBf16 || dtype == DType::kFp16);
}

cudaError_t SaleAttend(const SaleAttendParams& p, cudaStream_t stream) {
  const SalePrefill& pr = p.prompt;
  if (!SaleAttendSupports(p.blocks, pr.head_dim, pr.dtype) || !PromptOk(pr)) {
    return cudaErrorInvalidValue;
  }
  if (pr.tokens == 0) return cudaSuccess;
  if (pr.q == nullptr || pr.k == nullptr || pr.v == nullptr || pr.out == nullptr ||
      p.mask == nullptr) {
    return cudaErrorInvalidValue;
  }
  AttendGeometry g;
  g.n = pr.tokens;
  g.group = pr.num_q_heads / pr.num_kv_heads;
  g.k_blocks = Blocks(pr.tokens, kAttendBk);
  g.q_blocks = Blocks(pr.tokens, kAttendBq);
  g.scale_log2 = pr.scale * kLog2e;
  const dim3 grid(g.q_blocks, pr.num_q_heads), block(kAttendWarps * 32);
  auto launch = [&](auto kernel) {
    kernel<<<grid, block, 0, stream>>>(g, pr.q, pr.k, pr.v, pr.out, p.mask);
    return cudaGetLastError();
  };
  if (pr.dtype == DType::kBf16) {
    return pr.head_dim == 64 ? launch(&AttendKernel<Bf16, 64>) : launch(&AttendKernel<Bf16, 128>);
  }
  return pr.head_dim == 64 ? launch(&AttendKernel<Fp16, 64>) : launch(&AttendKernel<Fp16, 128>);
}

}  // namespace kvsparse::kernels::cuda
