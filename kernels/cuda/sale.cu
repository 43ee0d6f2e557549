// SALE's selection and computation passes (kernels/cuda/sale.h): the quantization kernels, the
// mma.sync kernels and the public launchers. The warpgroup-MMA kernels of sm_90a builds are in
// sale_wg.cu, which the launchers dispatch to; what both files share is in sale_common.cuh.
#include <algorithm>
#include <climits>
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/sale.h"
#include "kernels/cuda/sale_common.cuh"

namespace kvsparse::kernels::cuda {
namespace sale_internal {
namespace {

constexpr int kMaxHeadDim = 256;

int32_t Blocks(int32_t n, int32_t b) { return (n + b - 1) / b; }

constexpr int32_t kMeanChunk = 512;  // tokens per partial sum of the key mean

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
  o.mean_part = static_cast<double*>(
      take(hkv * Blocks(static_cast<int32_t>(n), kMeanChunk) * d * sizeof(double)));
  o.mean = static_cast<float*>(take(hkv * d * sizeof(float)));
  o.k_scale = static_cast<float*>(take(hkv * kb * sizeof(float)));
  o.q_scale = static_cast<float*>(take(H * n * sizeof(float)));
  o.q_mean = static_cast<float*>(take(H * n * sizeof(float)));
  o.thr = static_cast<float*>(take(H * n * sizeof(float)));
  o.k = static_cast<int8_t*>(take(hkv * n * d));
  o.q = static_cast<int8_t*>(take(H * n * d));
  o.bytes = at;
  return o;
}

// The reference's Round8: round to nearest even, clamped to [-127, 127].
__device__ __forceinline__ int8_t Round8(float x) {
  return static_cast<int8_t>(fminf(fmaxf(rintf(x), -127.f), 127.f));
}

// mean[j, e] = (sum over tokens in double) / n, as the reference, the sum in two levels: each
// chunk of kMeanChunk tokens in order (KeyMeanPartialKernel, grid (Hkv, chunks), block d), then
// the chunks' sums in order (KeyMeanKernel, grid Hkv, block d). The reference adds the tokens
// in one sequence; the two orders differ by double rounding, far below the float the mean is
// stored as (kernels/cuda/sale_test.cc compares the masks).
template <typename T>
__global__ void KeyMeanPartialKernel(const void* k, int32_t n, int32_t d, double* part) {
  const int j = blockIdx.x, c = blockIdx.y, e = threadIdx.x;
  if (e >= d) return;
  const int32_t t1 = min(n, (c + 1) * kMeanChunk);
  double sum = 0.0;
  for (int32_t t = c * kMeanChunk; t < t1; ++t) {
    sum += LoadElem<T>(k, (static_cast<int64_t>(j) * n + t) * d + e);
  }
  part[(static_cast<int64_t>(j) * gridDim.y + c) * d + e] = sum;
}

__global__ void KeyMeanKernel(const double* part, int32_t chunks, int32_t n, int32_t d,
                              float* mean) {
  const int j = blockIdx.x, e = threadIdx.x;
  if (e >= d) return;
  double sum = 0.0;
  for (int32_t c = 0; c < chunks; ++c) sum += part[(static_cast<int64_t>(j) * chunks + c) * d + e];
  mean[j * d + e] = static_cast<float>(sum / n);
}

// Elements [i, i + 16) of x (T in {float, Bf16, Fp16}; x + i 16-byte aligned) as floats,
// exactly, by 16-byte loads.
template <typename T>
__device__ __forceinline__ void Load16AsFloat(const void* x, int64_t i, float (&f)[16]) {
  if constexpr (std::is_same_v<T, float>) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(x) + i);
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const float4 w = p[v];
      f[4 * v] = w.x;
      f[4 * v + 1] = w.y;
      f[4 * v + 2] = w.z;
      f[4 * v + 3] = w.w;
    }
  } else {
    const uint4* p = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(x) + i);
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      float h[8];
      Unpack8<T>(p[v], h);
#pragma unroll
      for (int e = 0; e < 8; ++e) f[8 * v + e] = h[e];
    }
  }
}

// Per (kv head, key block): the block's scale max |k - mean| / 127 and its int8 keys, each
// thread 16 consecutive elements at a time (16-byte loads, one 16-byte store). Grid
// (k_blocks, Hkv). swizzle128 (head_dim 128, block_k a multiple of 8): each key's 16-byte
// chunk c stored at chunk c ^ (token % 8), the layout Hopper's warpgroup MMA reads a 128-byte
// swizzled tile in, so that a key block lands in shared memory ready with one bulk copy.
template <typename T>
__global__ void QuantizeKeysKernel(const void* k, const float* mean, int32_t n, int32_t d,
                                   int32_t bk, bool swizzle128, int8_t* kq, float* k_scale) {
  __shared__ float red[32];
  const int blk = blockIdx.x, j = blockIdx.y;
  const int32_t t0 = blk * bk, t1 = min(n, t0 + bk);
  const int64_t base = (static_cast<int64_t>(j) * n + t0) * d;
  const int32_t chunks = (t1 - t0) * d / 16;  // d is a multiple of 32
  const float* m = mean + static_cast<int64_t>(j) * d;
  float amax = 0.f;
  for (int32_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float v[16], mv[16];
    Load16AsFloat<T>(k, base + 16 * c, v);
    Load16AsFloat<float>(m, (16 * c) % d, mv);
#pragma unroll
    for (int e = 0; e < 16; ++e) amax = fmaxf(amax, fabsf(__fsub_rn(v[e], mv[e])));
  }
  amax = BlockMax(amax, red);
  const float s = amax > 0.f ? amax / 127.f : 1.f;
  if (threadIdx.x == 0) k_scale[static_cast<int64_t>(j) * gridDim.x + blk] = s;
  for (int32_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    float v[16], mv[16];
    Load16AsFloat<T>(k, base + 16 * c, v);
    Load16AsFloat<float>(m, (16 * c) % d, mv);
    uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int e = 0; e < 16; ++e) {
      w[e / 4] |= static_cast<uint32_t>(static_cast<uint8_t>(Round8(__fsub_rn(v[e], mv[e]) / s)))
                  << (8 * (e % 4));
    }
    const int32_t x = 16 * c;
    const int32_t at = swizzle128 ? (x & ~127) | ((((x >> 4) ^ (x >> 7)) & 7) << 4) : x;
    *reinterpret_cast<uint4*>(kq + base + at) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Per (query head, token): the scale max |q| / 127 and the int8 query, and q . mean (a
// sequential fp32 dot product, as the reference's). Each warp takes 32 tokens: it copies their
// rows into shared memory (16-byte loads; rows padded to an odd number of words, so that the
// lane-per-token reads below fall in distinct banks), then the scales and int8 rows (four
// lanes a row, eight rows at once), then q . mean with one lane per token. Grid (ceil(n / (32
// kQuantWarps)), H), block 32 kQuantWarps, QuantizeQueriesSmem bytes of shared memory.
constexpr int kQuantWarps = 4;

int QuantRowWords(int32_t d, DType dtype) { return d * static_cast<int>(DTypeSize(dtype)) / 4 + 1; }
size_t QuantizeQueriesSmem(int32_t d, DType dtype) {
  return static_cast<size_t>(kQuantWarps) * 32 * QuantRowWords(d, dtype) * sizeof(uint32_t);
}

template <typename T>
__global__ void __launch_bounds__(kQuantWarps * 32)
    QuantizeQueriesKernel(const void* q, const float* mean, int32_t n, int32_t d, int32_t group,
                          int8_t* qq, float* q_scale, float* q_mean) {
  extern __shared__ __align__(16) uint32_t rows_smem[];
  constexpr int kElemBytes = sizeof(T);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row_words = d * kElemBytes / 4, stride = row_words + 1;
  uint32_t* buf = rows_smem + warp * 32 * stride;
  const int32_t t0 = (blockIdx.x * kQuantWarps + warp) * 32;
  const int h = blockIdx.y;
  const int tokens = min(32, n - t0);
  if (tokens <= 0) return;  // uniform over the warp
  const int64_t row0 = static_cast<int64_t>(h) * n + t0;
  const uint4* src =
      reinterpret_cast<const uint4*>(static_cast<const char*>(q) + row0 * d * kElemBytes);
  for (int x = lane; x < tokens * (row_words / 4); x += 32) {
    const int r = x / (row_words / 4), c = 4 * (x % (row_words / 4));
    const uint4 v = src[x];
    uint32_t* dst = buf + r * stride + c;
    dst[0] = v.x;
    dst[1] = v.y;
    dst[2] = v.z;
    dst[3] = v.w;
  }
  __syncwarp();
  // Quantization: four lanes a row (d / 4 consecutive elements each, stored 8 bytes at a time),
  // eight rows at once.
  const int sub = lane & 3, per = d / 4;
  for (int r = lane >> 2; r < 32; r += 8) {  // uniform over the warp (the quad's max)
    const bool valid = r < tokens;
    const uint32_t* row = buf + r * stride;
    float amax = 0.f;
    if (valid) {
      for (int e = sub * per; e < (sub + 1) * per; ++e)
        amax = fmaxf(amax, fabsf(LoadElem<T>(row, e)));
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    if (!valid) continue;
    const float s = amax > 0.f ? amax / 127.f : 1.f;
    for (int e = sub * per; e < (sub + 1) * per; e += 8) {
      uint32_t w[2] = {0u, 0u};
#pragma unroll
      for (int x = 0; x < 8; ++x) {
        w[x / 4] |= static_cast<uint32_t>(static_cast<uint8_t>(Round8(LoadElem<T>(row, e + x) / s)))
                    << (8 * (x % 4));
      }
      *reinterpret_cast<uint2*>(qq + (row0 + r) * d + e) = make_uint2(w[0], w[1]);
    }
    if (sub == 0) q_scale[row0 + r] = s;
  }
  if (lane >= tokens) return;
  const uint32_t* row = buf + lane * stride;
  const float* m = mean + static_cast<int64_t>(h / group) * d;
  float acc = 0.f;
  for (int e = 0; e < d; ++e) acc = __fadd_rn(acc, __fmul_rn(LoadElem<T>(row, e), m[e]));
  q_mean[row0 + lane] = acc;
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
  if (lane == 0) *thr_out = RowThreshold(mr, lr, tau);
  __syncwarp();
}

// Step 1 on the tensor cores (T bf16 or fp16): the exact key blocks staged in shared memory one
// after another (`kb`: two buffers of bk rows of d + 8 halves, cp.async, the next block's copy
// overlapping this one's arithmetic); warp w scores row tile w % 4 (16 rows of the query block,
// staged as `qb`, row stride qb_stride halves) against the block's 8-key tiles t with t % 2 ==
// w / 4 (the two halves of the warps split the tiles), S = Q K^T with mma.m16n8k16 and K's
// fragments by ldmatrix, an online max and sum per row (fp32, natural units, the reference's
// scale), written as partials pm / pl [2][kMaxBlock] for the kernel to merge. The sums run in
// another order than the reference's sequential dots: a threshold may move by an ulp. Every
// thread of the block calls it (the staging is shared).
size_t ExactStageBytes(const SelectGeometry& g) {
  return 2 * static_cast<size_t>(g.bk) * (g.d + 8) * sizeof(uint16_t);
}

// Copies key block blk (bk rows of d halves from kh, one kv head's keys; rows past the prompt
// zero) into dst, rows `stride` halves apart, by cp.async: every thread of the CTA a share.
__device__ __forceinline__ void StageKeyBlock(const SelectGeometry& g, const uint16_t* kh, int d,
                                              int32_t blk, uint16_t* dst, int stride) {
  const int32_t c0 = blk * g.bk;
  for (int e = threadIdx.x; e < g.bk * (d / 8); e += blockDim.x) {
    const int r = e / (d / 8), c = (e % (d / 8)) * 8;
    const bool in = c0 + r < g.n;
    CpAsync16(dst + r * stride + c, kh + static_cast<int64_t>(in ? c0 + r : 0) * d + c, in);
  }
}

template <typename T>
__device__ void ExactPartialsMma(const SelectGeometry& g, const Regions& rg, const void* k, int j,
                                 int32_t r0, int rows, const uint16_t* qb, int qb_stride,
                                 uint16_t* kb, float* pm, float* pl) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3;
  const int rt = warp & 3, parity = warp >> 2;
  const bool active = rt * 16 < rows;  // a row tile past the prompt only stages
  const int ra = rt * 16 + gr, rb = ra + 8;
  const int32_t tile_last_row = r0 + rt * 16 + 15;
  const int kstride = g.d + 8, buf_elems = g.bk * kstride, tiles = (g.bk / 8 - parity + 1) / 2;
  const uint16_t* kh = static_cast<const uint16_t*>(k) + static_cast<int64_t>(j) * g.n * g.d;
  const uint16_t* qa = qb + ra * qb_stride + 2 * tq;
  const ExactBlocks blocks = ExactBlocksOf(rg);
  const int32_t nx = blocks.count;
  auto stage = [&](int32_t x) {
    StageKeyBlock(g, kh, g.d, blocks[x], kb + (x & 1) * buf_elems, kstride);
  };
  ExactRows st;
  if (nx > 0) stage(0);
  CpAsyncCommit();
  for (int32_t x = 0; x < nx; ++x) {
    if (x + 1 < nx) stage(x + 1);
    CpAsyncCommit();
    CpAsyncWait<1>();
    __syncthreads();  // block x staged
    const int32_t c_blk = blocks[x] * g.bk;
    if (active && c_blk <= tile_last_row) {
      const uint16_t* kx = kb + (x & 1) * buf_elems;
      float acc[kExactTiles][4] = {};
      for (int kk = 0; kk < g.d / 16; kk += 2) {
        const int e = 16 * kk;
        uint32_t a[2][4];
#pragma unroll
        for (int s2 = 0; s2 < 2; ++s2) {
          a[s2][0] = *reinterpret_cast<const uint32_t*>(qa + e + 16 * s2);
          a[s2][1] = *reinterpret_cast<const uint32_t*>(qa + 8 * qb_stride + e + 16 * s2);
          a[s2][2] = *reinterpret_cast<const uint32_t*>(qa + e + 16 * s2 + 8);
          a[s2][3] = *reinterpret_cast<const uint32_t*>(qa + 8 * qb_stride + e + 16 * s2 + 8);
        }
#pragma unroll
        for (int t = 0; t < kExactTiles; ++t) {
          if (t < tiles) {
            // lane l addresses key (2 t + parity) 8 + l % 8 at dims e + 8 (l / 8): b0 / b1 of
            // k-steps kk and kk + 1.
            uint32_t b[4];
            LdMatrixX4(b[0], b[1], b[2], b[3],
                       kx + ((2 * t + parity) * 8 + (lane & 7)) * kstride + e + 8 * (lane >> 3));
            Mma16816<T>(acc[t], a[0][0], a[0][1], a[0][2], a[0][3], b[0], b[1]);
            Mma16816<T>(acc[t], a[1][0], a[1][1], a[1][2], a[1][3], b[2], b[3]);
          }
        }
      }
      FoldExactTiles(g, acc, tiles, c_blk + parity * 8, 16, r0 + ra, r0 + rb, st);
    }
    __syncthreads();  // every warp is done with block x's buffer before block x + 2 refills it
  }
  if (!active) return;
  SumExactRows(st);
  if (tq == 0) {
    pm[parity * kMaxBlock + ra] = st.ma;
    pl[parity * kMaxBlock + ra] = st.la;
    pm[parity * kMaxBlock + rb] = st.mb;
    pl[parity * kMaxBlock + rb] = st.lb;
  }
}

// The middle blocks for the paper's geometry (head_dim 64 or 128, block_k 32), a kernel of
// their own after every row's threshold is written: one CTA per (query blocks x
// query heads of one kv head), 8 (head, block) pairs (MiddleTile: GQA groups of 4 take 4 heads
// x 2 query blocks), warp w estimating pair w. Each middle key block's int8 keys are staged
// once in shared memory for the eight warps (cp.async, kMidStages deep), so the keys are read
// from L2 once per 8 pairs instead of once per warp; B fragments by ldmatrix; each warp's A (its
// query block's int8 rows) stays in registers, its rows' scales, mean terms and thresholds in
// shared memory. Builds for sm_90a run head_dim 128 on MiddleKernelWg (sale_wg.cu, Hopper's
// warpgroup MMA) instead; this kernel keeps head_dim 64 and builds for other archs. The test is
// applied to each row's largest integer sum in the block: S~ >= threshold is monotone in the sum
// (every step a correctly rounded product or sum with non-negative factors, a = q_scale k_scale
// >= 0, scale > 0), so a row passes somewhere in the block if and only if it passes at its largest
// sum; the arithmetic is the general loop's, so the mask is the same.
constexpr int kFastRt = kMaxBlock / 16;  // 16-row tiles of the query block
constexpr int kMidStages = 4;            // key blocks in flight per CTA
// Bytes per staged key: 16 past the key, so the 8 rows of an ldmatrix tile fall in distinct banks.
constexpr int kKeyPitch = 32 * kFastKs + 16;
constexpr int kStageBytes = 8 * kFastKt * kKeyPitch;

// A warp's query block: its A fragments in registers; in shared memory (thr, qs, qm:
// [kMaxBlock] each, the warp's own) the rows' thresholds, query scales and mean terms. Rows past
// the prompt never pass.
template <int KS>
struct WarpRows {
  uint32_t qa[kFastRt][KS][4];
  float* thr;
  float* qs;
  float* qm;
};

template <int KS>
__device__ __forceinline__ void LoadWarpRows(const SelectGeometry& g, const Operands& ops, int h,
                                             int32_t r0, int rows, WarpRows<KS>& w) {
  const int lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3;
  const int64_t base = static_cast<int64_t>(h) * g.n + r0;
#pragma unroll
  for (int rt = 0; rt < kFastRt; ++rt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = rt * 16 + gr + 8 * hf;
      const bool ok = r < rows;
      const int* words = reinterpret_cast<const int*>(ops.q + (base + min(r, rows - 1)) * g.d);
#pragma unroll
      for (int x = 0; x < KS; ++x) {
        w.qa[rt][x][hf] = ok ? words[8 * x + tq] : 0;
        w.qa[rt][x][2 + hf] = ok ? words[8 * x + 4 + tq] : 0;
      }
    }
  }
  for (int r = lane; r < kMaxBlock; r += 32) {
    w.thr[r] = r < rows ? ops.thr[base + r] : -kNegInf;
    w.qs[r] = r < rows ? ops.q_scale[base + r] : 0.f;
    w.qm[r] = r < rows ? ops.q_mean[base + r] : 0.f;
  }
  __syncwarp();
}

// Whether any of the warp's rows passes somewhere in the staged key block `sk` (key scale ks):
// every 8-key tile's sums (the four row tiles' MMA chains independent, every row tile computed:
// rows past the prompt have zero queries and never pass), each row's largest tested once at the
// end (a block is far more often skipped than taken, so testing early saves less than it
// costs). KS: 32-dim steps, head_dim / 32.
template <int KS>
__device__ __forceinline__ bool EstimateStagedBlock(const SelectGeometry& g, const WarpRows<KS>& w,
                                                    const int8_t* sk, float ks) {
  const int lane = threadIdx.x & 31;
  int mx[2 * kFastRt];
#pragma unroll
  for (int x = 0; x < 2 * kFastRt; ++x) mx[x] = INT_MIN;
#pragma unroll
  for (int kt = 0; kt < kFastKt; ++kt) {
    // B of the 8-key tile: lane l gives the address of key kt * 8 + l % 8's bytes
    // [16 (l / 8), + 16) (and + 64): tiles 0..3 are b0 / b1 of k-steps 0 and 1 (2 and 3).
    uint32_t b[4][2];
    const int8_t* at = sk + (kt * 8 + (lane & 7)) * kKeyPitch + 16 * (lane >> 3);
    LdMatrixX4(b[0][0], b[0][1], b[1][0], b[1][1], at);
    if constexpr (KS > 2) LdMatrixX4(b[2][0], b[2][1], b[3][0], b[3][1], at + 64);
    int acc[kFastRt][4] = {};
#pragma unroll
    for (int x = 0; x < KS; ++x) {
#pragma unroll
      for (int rt = 0; rt < kFastRt; ++rt) {
        MmaInt8(acc[rt], w.qa[rt][x][0], w.qa[rt][x][1], w.qa[rt][x][2], w.qa[rt][x][3], b[x][0],
                b[x][1]);
      }
    }
#pragma unroll
    for (int rt = 0; rt < kFastRt; ++rt) {
      mx[2 * rt] = max(mx[2 * rt], max(acc[rt][0], acc[rt][1]));
      mx[2 * rt + 1] = max(mx[2 * rt + 1], max(acc[rt][2], acc[rt][3]));
    }
  }
  bool any = false;
#pragma unroll
  for (int x = 0; x < 2 * kFastRt; ++x) {
    const int r = (x / 2) * 16 + (lane >> 2) + 8 * (x % 2);
    any |= SaleEstimatePasses(g.scale, w.qs[r], ks, mx[x], w.qm[r], w.thr[r]);
  }
  return __any_sync(0xffffffffu, any);
}

// Two CTAs per multiprocessor for head_dim 128 (measured on an H100: 16 warps hide the MMA
// chains' latency better than one CTA with more registers); head_dim 64 fits its schedule in
// 128 registers only with spills, so it keeps one.
template <int KS>
__global__ void __launch_bounds__(kSelectThreads, KS == 4 ? 2 : 1)
    MiddleKernel(SelectGeometry g, MiddleTile mt, Operands ops, uint8_t* mask) {
  __shared__ __align__(128) int8_t stage[kMidStages][kStageBytes];
  __shared__ float row_vals[kSelectWarps][3][kMaxBlock];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int q_tile = kSelectWarps / mt.head_tile;
  // The last query blocks (the longest rows) first.
  const int32_t i0 = (gridDim.x - 1 - blockIdx.x) * q_tile;
  const int h = blockIdx.y * mt.head_tile + warp % mt.head_tile, j = h / g.group;
  const int32_t i = i0 + warp / mt.head_tile;
  const bool live = i < mt.q_blocks;
  // The CTA's key blocks: from the first query block's sink end to the last one's local start
  // (both grow with the query block).
  const int32_t lo = RegionsOf(g, i0).sink_end;
  const int32_t hi = RegionsOf(g, min(mt.q_blocks - 1, i0 + q_tile - 1)).local_first;
  if (lo >= hi) return;  // uniform: no middle block
  // The warp's own blocks, as steps x of the CTA's walk [0, count).
  const Regions rg = RegionsOf(g, live ? i : i0);
  const int32_t count = hi - lo;
  const int32_t x_begin = live ? rg.sink_end - lo : count, x_end = live ? rg.local_first - lo : 0;
  const int32_t r0 = i * g.bq;
  const int rows = live ? min(g.n, r0 + g.bq) - r0 : 0;
  WarpRows<KS> w;
  w.thr = row_vals[warp][0];
  w.qs = row_vals[warp][1];
  w.qm = row_vals[warp][2];
  if (live) LoadWarpRows(g, ops, h, r0, rows, w);
  // Each thread copies one 16-byte piece of every staged block (32 keys of KS * 32 bytes: 256
  // or 128 pieces); middle keys precede every row, so every piece is in the prompt.
  constexpr int kPieces = 8 * kFastKt * 2 * KS;
  const bool copies = threadIdx.x < kPieces;
  const int key = threadIdx.x / (2 * KS), col = (threadIdx.x % (2 * KS)) * 16;
  const int8_t* src = ops.k + (static_cast<int64_t>(j) * g.n + lo * 8 * kFastKt + key) * g.d + col;
  const int dst = key * kKeyPitch + col;
  const int64_t src_step = static_cast<int64_t>(8 * kFastKt) * g.d;
#pragma unroll
  for (int x = 0; x < kMidStages - 1; ++x) {
    if (copies && x < count) CpAsync16(&stage[x][dst], src + x * src_step, true);
    CpAsyncCommit();
  }
  const float* kscale = ops.k_scale + static_cast<int64_t>(j) * g.k_blocks + lo;
  uint8_t* out = mask + (static_cast<int64_t>(h) * mt.q_blocks + (live ? i : 0)) * g.k_blocks + lo;
  for (int32_t x = 0; x < count; ++x) {
    CpAsyncWait<kMidStages - 2>();
    __syncthreads();  // block x staged; every warp is past block x - 1, whose stage is refilled
    const int32_t nx = x + kMidStages - 1;
    if (copies && nx < count) CpAsync16(&stage[nx % kMidStages][dst], src + nx * src_step, true);
    CpAsyncCommit();
    if (x >= x_begin && x < x_end) {
      if (EstimateStagedBlock<KS>(g, w, stage[x % kMidStages], kscale[x]) && lane == 0) out[x] = 1;
    }
  }
}

// One (query block, query head) per block: the exact regions' thresholds per row, then (unless
// MiddleKernel does it) each middle key block estimated from int8 Q and K, the block's row of
// the mask written whole (the middle blocks 0 until they pass).
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
  uint16_t* kb = qb + kMaxBlock * (g.d + 8);                       // [2][bk][d + 8]
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
    ExactPartialsMma<T>(g, rg, k, j, r0, rows, qb, qb_stride, kb, pm, pl);
    __syncthreads();
    const float t = tau[h];
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
      const float m0 = pm[r], m1 = pm[kMaxBlock + r], m = fmaxf(m0, m1);
      const float l = pl[r] * expf(m0 - m) + pl[kMaxBlock + r] * expf(m1 - m);
      thr[r] = RowThreshold(m, l, t);
    }
  }
  if (g.middle_apart) {
    __syncthreads();  // thr ready
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
      ops.thr[static_cast<int64_t>(h) * g.n + r0 + r] = thr[r];
    }
    return;
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
  // threshold (the paper's geometry has a kernel of its own, MiddleKernel).
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
          if (r < rows) any |= SaleEstimatePasses(g.scale, qs[r], ks, acc[e], qm[r], thr[r]);
        }
        hit = __any_sync(0xffffffffu, any);
      }
    }
    if (hit && lane == 0) out[blk] = 1;
  }
}

// Step 1 for the paper's geometry (SelectGeometry::middle_apart) on bf16 / fp16 prompts, instead
// of SelectKernel: the thresholds of kHeads query heads of one kv head per CTA, so each exact key
// block is staged in shared memory once for all of them (cp.async, kThrStages deep, one CTA
// barrier a block). Warp w scores head h0 + w / 4's row tile w % 4 (16 rows; A fragments in
// registers, loaded once) against every 8-key tile of the block (mma.m16n8k16, B by ldmatrix),
// an online max and sum per row in fp32 natural units (another order of sums than the
// reference's sequential dots: a threshold may move by an ulp, as in ExactPartialsMma), then
// writes the row's threshold m + ln(tau l) (in double, as the reference). Every middle block of
// the rows' masks is written 0 (the middle kernel sets the taken ones), every exact one 1.
// Measured on an H200 at 64k (docs/PERF.md): 1.33 ms with two heads a CTA, 1.44 with four (one
// CTA a multiprocessor at 96 registers), 2.38 for SelectKernel's one head.
size_t ThresholdsSmem(const SelectGeometry& g) {
  return static_cast<size_t>(kThrStages) * g.bk * (g.d + 8) * sizeof(uint16_t);
}

template <typename T, int D, int kHeads>
__global__ void __launch_bounds__(kHeads * 128)
    ThresholdsKernel(SelectGeometry g, const void* q, const void* k, const float* tau, Operands ops,
                     uint8_t* mask) {
  extern __shared__ __align__(16) char smem[];
  uint16_t* kb = reinterpret_cast<uint16_t*>(smem);  // [kThrStages][bk][D + 8]
  constexpr int kStride = D + 8;
  const int i = blockIdx.x, h0 = blockIdx.y * kHeads, j = h0 / g.group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3;
  const int h = h0 + warp / 4, rt = warp % 4;
  const Regions rg = RegionsOf(g, i);
  const int32_t r0 = i * g.bq, rows = min(g.n, r0 + g.bq) - r0;
  WriteExactMaskRows(g, rg, h0, kHeads, i, mask);
  const bool active = rt * 16 < rows;  // a row tile past the prompt only stages
  const int ra = rt * 16 + gr, rb = ra + 8;
  const int32_t tile_last_row = r0 + rt * 16 + 15;
  uint32_t a[D / 16][4];
  {
    const uint32_t* qa =
        static_cast<const uint32_t*>(q) + ((static_cast<int64_t>(h) * g.n + r0) * D) / 2;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      a[kk][0] = ra < rows ? qa[ra * (D / 2) + 8 * kk + tq] : 0u;
      a[kk][1] = rb < rows ? qa[rb * (D / 2) + 8 * kk + tq] : 0u;
      a[kk][2] = ra < rows ? qa[ra * (D / 2) + 8 * kk + 4 + tq] : 0u;
      a[kk][3] = rb < rows ? qa[rb * (D / 2) + 8 * kk + 4 + tq] : 0u;
    }
  }
  const uint16_t* kh = static_cast<const uint16_t*>(k) + static_cast<int64_t>(j) * g.n * D;
  const ExactBlocks blocks = ExactBlocksOf(rg);
  const int32_t nx = blocks.count;
  auto stage = [&](int32_t x) {
    StageKeyBlock(g, kh, D, blocks[x], kb + (x % kThrStages) * g.bk * kStride, kStride);
  };
  ExactRows st;
#pragma unroll
  for (int x = 0; x < kThrStages - 1; ++x) {
    if (x < nx) stage(x);
    CpAsyncCommit();
  }
  for (int32_t x = 0; x < nx; ++x) {
    CpAsyncWait<kThrStages - 2>();
    __syncthreads();  // block x staged; every warp is past block x - 1, whose buffer is refilled
    if (x + kThrStages - 1 < nx) stage(x + kThrStages - 1);
    CpAsyncCommit();
    const int32_t c_blk = blocks[x] * g.bk;
    if (!active || c_blk > tile_last_row) continue;
    const uint16_t* kx = kb + (x % kThrStages) * g.bk * kStride;
    float acc[kExactTiles][4] = {};
#pragma unroll
    for (int t = 0; t < kExactTiles; ++t) {
      if (t < g.bk / 8) {
#pragma unroll
        for (int kk = 0; kk < D / 16; kk += 2) {
          // lane l addresses key t * 8 + l % 8 at dims 16 kk + 8 (l / 8): b0 / b1 of k-steps kk
          // and kk + 1.
          uint32_t b[4];
          LdMatrixX4(b[0], b[1], b[2], b[3],
                     kx + (t * 8 + (lane & 7)) * kStride + 16 * kk + 8 * (lane >> 3));
          Mma16816<T>(acc[t], a[kk][0], a[kk][1], a[kk][2], a[kk][3], b[0], b[1]);
          Mma16816<T>(acc[t], a[kk + 1][0], a[kk + 1][1], a[kk + 1][2], a[kk + 1][3], b[2], b[3]);
        }
      }
    }
    // middle_apart: block_k 32, so the block's four 8-key tiles are kExactTiles.
    FoldExactTiles(g, acc, g.bk / 8, c_blk, 8, r0 + ra, r0 + rb, st);
  }
  if (!active) return;
  StoreRowThresholds(tau[h], ops.thr + static_cast<int64_t>(h) * g.n + r0, rows, ra, st);
}

size_t SelectSmem(const SelectGeometry& g) {
  const size_t words = g.d / 4;
  const size_t sequential = static_cast<size_t>(kSelectWarps) * (g.d + g.score_cap) * sizeof(float);
  const size_t mma =
      4 * kMaxBlock * sizeof(float) + kMaxBlock * (g.d + 8) * sizeof(uint16_t) + ExactStageBytes(g);
  return kMaxBlock * (words + 1) * sizeof(int) + 3 * kMaxBlock * sizeof(float) +
         std::max(sequential, mma);
}

// ---- The computation pass (its block walk and softmax in sale_common.cuh) -------------------

// One (query block i, query head h) per block: Q's fragments in registers, the selected key
// blocks' K and V rows staged in shared memory two deep (cp.async: the next block's copy
// overlaps this block's arithmetic; zero past the prompt), S = Q K^T and O += P V on the tensor
// cores (B fragments by ldmatrix, V's transposed) with an online softmax per row.
template <typename T, int D>
__global__ void __launch_bounds__(kAttendThreads)
    AttendKernel(AttendGeometry g, const void* q, const void* k, const void* v, void* out,
                 const uint8_t* mask) {
  constexpr int kStride = D + 8;  // halves per staged row (ldmatrix rows in distinct banks)
  __shared__ __align__(16) uint16_t ks_buf[2][kAttendBk * kStride];
  __shared__ __align__(16) uint16_t vs_buf[2][kAttendBk * kStride];
  __shared__ BlockList list;
  const int i = blockIdx.x, h = blockIdx.y, j = h / g.group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3;
  AttendRows st;
  st.row0 = i * kAttendBq + warp * 16 + gr;
  st.row1 = st.row0 + 8;
  const int32_t row0 = st.row0, row1 = st.row1;
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
  SelectedBlocks walk(&list, mask + (static_cast<int64_t>(h) * g.q_blocks + i) * g.k_blocks,
                      (min(g.n, (i + 1) * kAttendBq) - 1) / kAttendBk + 1);
  auto stage = [&](int32_t blk, int buf) {
    const int32_t c0 = blk * kAttendBk;
    for (int x = threadIdx.x; x < kAttendBk * D / 8; x += blockDim.x) {
      const int r = x / (D / 8), e = (x % (D / 8)) * 8;
      const bool in = c0 + r < g.n;
      const int64_t at = static_cast<int64_t>(in ? c0 + r : 0) * D + e;
      CpAsync16(ks_buf[buf] + r * kStride + e, kh + at, in);
      CpAsync16(vs_buf[buf] + r * kStride + e, vh + at, in);
    }
  };
  int32_t blk = walk.Next();
  if (blk >= 0) stage(blk, 0);
  CpAsyncCommit();
  for (int buf = 0; blk >= 0; buf ^= 1) {
    const int32_t next = walk.Next();
    if (next >= 0) stage(next, buf ^ 1);
    CpAsyncCommit();
    CpAsyncWait<1>();
    __syncthreads();  // this block's K and V are staged
    const uint16_t* ks = ks_buf[buf];
    const uint16_t* vs = vs_buf[buf];
    const int32_t c0 = blk * kAttendBk;
    // S = Q K^T: four 8-key tiles; lane l addresses key nt * 8 + l % 8 at dims 16 kk + 8 (l / 8):
    // b0 / b1 of k-steps kk and kk + 1.
    float sc[kAttendBk / 8][4];
#pragma unroll
    for (int nt = 0; nt < kAttendBk / 8; ++nt) {
      sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
      const uint16_t* kr = ks + (nt * 8 + (lane & 7)) * kStride + 8 * (lane >> 3);
#pragma unroll
      for (int kk = 0; kk < D / 16; kk += 2) {
        uint32_t b[4];
        LdMatrixX4(b[0], b[1], b[2], b[3], kr + kk * 16);
        Mma16816<T>(sc[nt], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[0], b[1]);
        Mma16816<T>(sc[nt], qa[kk + 1][0], qa[kk + 1][1], qa[kk + 1][2], qa[kk + 1][3], b[2], b[3]);
      }
    }
    RescaleRows(o, ScoresToProbabilities(g, c0, tq, sc, st));
    // O += P V: two 16-key steps; P's A fragments from the score tiles, V's B fragments
    // (keys 2 tq, 2 tq + 1 (+ 8) of column gr) by a transposing ldmatrix: lane l addresses key
    // 16 kstep + 8 ((l / 8) % 2) + l % 8 at dims 8 dt + 8 (l / 16), b0 / b1 of dt and dt + 1.
#pragma unroll
    for (int kstep = 0; kstep < kAttendBk / 16; ++kstep) {
      uint32_t a[4];
      ProbabilityFragments<T>(sc, kstep, a);
      const uint16_t* v0 =
          vs + (kstep * 16 + 8 * ((lane >> 3) & 1) + (lane & 7)) * kStride + 8 * (lane >> 4);
#pragma unroll
      for (int dt = 0; dt < D / 8; dt += 2) {
        uint32_t vb[4];
        LdMatrixX4Trans(vb[0], vb[1], vb[2], vb[3], v0 + dt * 8);
        Mma16816<T>(o[dt], a[0], a[1], a[2], a[3], vb[0], vb[1]);
        Mma16816<T>(o[dt + 1], a[0], a[1], a[2], a[3], vb[2], vb[3]);
      }
    }
    __syncthreads();  // every warp is done with this buffer before the next stage refills it
    blk = next;
  }
  StoreAttendRows<T, D>(g, h, tq, o, st, out);
}

// What kernels::ValidateSalePrefill asks of a prompt's counts and scale (both launchers check it
// beside their own limits; the CUDA library links no host library to call it).
bool PromptOk(const SalePrefill& pr) {
  return pr.tokens >= 0 && pr.num_kv_heads >= 1 && pr.num_q_heads >= 1 &&
         pr.num_q_heads % pr.num_kv_heads == 0 && std::isfinite(pr.scale) && pr.scale > 0.f;
}

}  // namespace
}  // namespace sale_internal

// The launchers below, over the kernels above and sale_common.cuh's.
using sale_internal::AttendGeometry;
using sale_internal::AttendKernel;
using sale_internal::Blocks;
using sale_internal::Carve;
using sale_internal::kAttendBk;
using sale_internal::kAttendBq;
using sale_internal::kAttendThreads;
using sale_internal::KeyMeanKernel;
using sale_internal::KeyMeanPartialKernel;
using sale_internal::kFastKt;
using sale_internal::kMaxBlock;
using sale_internal::kMaxHeadDim;
using sale_internal::kMeanChunk;
using sale_internal::kQuantWarps;
using sale_internal::kSelectThreads;
using sale_internal::kSelectWarps;
using sale_internal::kSwizzledDim;
using sale_internal::kThrHeads;
using sale_internal::MiddleKernel;
using sale_internal::MiddleTile;
using sale_internal::Operands;
using sale_internal::PromptOk;
using sale_internal::QuantizeKeysKernel;
using sale_internal::QuantizeQueriesKernel;
using sale_internal::QuantizeQueriesSmem;
using sale_internal::SelectGeometry;
using sale_internal::SelectKernel;
using sale_internal::SelectSmem;
using sale_internal::ThresholdsKernel;
using sale_internal::ThresholdsSmem;
#if defined(KVSPARSE_CUDA_SM90A)
using sale_internal::LaunchAttendKernelWg;
using sale_internal::LaunchMiddleKernelWg;
using sale_internal::LaunchThresholdsKernelWg;
#endif

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
  if (pr.q == nullptr || pr.k == nullptr || p.tau == nullptr || p.mask == nullptr ||
      Misaligned16(pr.q) || Misaligned16(pr.k)) {
    return cudaErrorInvalidValue;
  }
  const Operands ops = Carve(p, workspace);
  if (workspace == nullptr || workspace_bytes < ops.bytes || Misaligned16(workspace)) {
    return cudaErrorInvalidValue;
  }
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
  g.middle_apart = (d == 64 || d == 128) && g.bk == 8 * kFastKt;
#if defined(KVSPARSE_CUDA_SM90A)
  const bool wgmma_middle = g.middle_apart && d == 128;  // MiddleKernelWg
#else
  const bool wgmma_middle = false;
#endif
  MiddleTile mt;
  mt.q_blocks = Blocks(n, g.bq);
  mt.head_tile = 1;
  while (mt.head_tile < kSelectWarps && g.group % (2 * mt.head_tile) == 0) mt.head_tile *= 2;
  const dim3 select_grid(mt.q_blocks, H);
  const int32_t mean_chunks = Blocks(n, kMeanChunk);
  cudaError_t select_err = cudaSuccess;
  KVSPARSE_CUDA_RETURN_IF_ERROR(ByDtype(pr.dtype, [&](auto tag) {
    using T = decltype(tag);
    KeyMeanPartialKernel<T><<<dim3(hkv, mean_chunks), d, 0, stream>>>(pr.k, n, d, ops.mean_part);
    KeyMeanKernel<<<hkv, d, 0, stream>>>(ops.mean_part, mean_chunks, n, d, ops.mean);
    QuantizeKeysKernel<T><<<dim3(g.k_blocks, hkv), 128, 0, stream>>>(
        pr.k, ops.mean, n, d, g.bk, wgmma_middle, ops.k, ops.k_scale);
    select_err = LaunchWithSmem(&QuantizeQueriesKernel<T>, dim3(Blocks(n, 32 * kQuantWarps), H),
                                dim3(32 * kQuantWarps), QuantizeQueriesSmem(d, pr.dtype), stream,
                                pr.q, ops.mean, n, d, g.group, ops.q, ops.q_scale, ops.q_mean);
    if (select_err != cudaSuccess) return;
    if constexpr (!std::is_same_v<T, float>) {
      if (g.middle_apart) {  // ThresholdsKernel, kThrHeads query heads a CTA where the group allows
        auto thresholds = [&](auto kernel, int heads) {
          return LaunchWithSmem(kernel, dim3(mt.q_blocks, H / heads), dim3(heads * 128),
                                ThresholdsSmem(g), stream, g, pr.q, pr.k, p.tau, ops, p.mask);
        };
        const bool two = mt.head_tile >= kThrHeads;
#if defined(KVSPARSE_CUDA_SM90A)
        if (d == kSwizzledDim) {  // ThresholdsKernelWg (sale_wg.cu), T as pr.dtype
          select_err = LaunchThresholdsKernelWg(pr.dtype, g, mt.q_blocks, H, two, pr.q, pr.k, p.tau,
                                                ops, p.mask, stream);
          return;
        }
#endif
        if (d == 128) {
          select_err = two ? thresholds(&ThresholdsKernel<T, 128, kThrHeads>, kThrHeads)
                           : thresholds(&ThresholdsKernel<T, 128, 1>, 1);
        } else {
          select_err = two ? thresholds(&ThresholdsKernel<T, 64, kThrHeads>, kThrHeads)
                           : thresholds(&ThresholdsKernel<T, 64, 1>, 1);
        }
        return;
      }
    }
    select_err = LaunchWithSmem(&SelectKernel<T>, select_grid, dim3(kSelectThreads), SelectSmem(g),
                                stream, g, pr.q, pr.k, p.tau, ops, p.mask);
  }));
  KVSPARSE_CUDA_RETURN_IF_ERROR(select_err);
  if (!g.middle_apart) return cudaSuccess;
  const dim3 middle_grid(Blocks(mt.q_blocks, kSelectWarps / mt.head_tile), H / mt.head_tile);
  auto middle = [&](auto kernel) {
    kernel<<<middle_grid, kSelectThreads, 0, stream>>>(g, mt, ops, p.mask);
    return cudaGetLastError();
  };
#if defined(KVSPARSE_CUDA_SM90A)
  if (wgmma_middle) return LaunchMiddleKernelWg(g, mt, ops, p.mask, middle_grid, stream);
#endif
  return d == 64 ? middle(&MiddleKernel<2>) : middle(&MiddleKernel<4>);
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
      p.mask == nullptr || Misaligned16(pr.q) || Misaligned16(pr.k) || Misaligned16(pr.v) ||
      Misaligned16(pr.out)) {
    return cudaErrorInvalidValue;
  }
  AttendGeometry g;
  g.n = pr.tokens;
  g.group = pr.num_q_heads / pr.num_kv_heads;
  g.k_blocks = Blocks(pr.tokens, kAttendBk);
  g.q_blocks = Blocks(pr.tokens, kAttendBq);
  g.scale_log2 = pr.scale * kLog2e;
  const dim3 grid(g.q_blocks, pr.num_q_heads), block(kAttendThreads);
  auto launch = [&](auto kernel) {
    kernel<<<grid, block, 0, stream>>>(g, pr.q, pr.k, pr.v, pr.out, p.mask);
    return cudaGetLastError();
  };
#if defined(KVSPARSE_CUDA_SM90A)
  if (pr.head_dim == kSwizzledDim) {  // AttendKernelWg (sale_wg.cu)
    return LaunchAttendKernelWg(pr.dtype, g, grid, pr.q, pr.k, pr.v, pr.out, p.mask, stream);
  }
#endif
  if (pr.dtype == DType::kBf16) {
    return pr.head_dim == 64 ? launch(&AttendKernel<Bf16, 64>) : launch(&AttendKernel<Bf16, 128>);
  }
  return pr.head_dim == 64 ? launch(&AttendKernel<Fp16, 64>) : launch(&AttendKernel<Fp16, 128>);
}

}  // namespace kvsparse::kernels::cuda
