#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/dense_decode.h"
#include "kernels/cuda/santa.h"
#include "kernels/cuda/tile_common.cuh"
#include "kernels/philox.h"

namespace kvsparse::kernels::cuda {
namespace {

constexpr int kBlocksPerSm = 2;

// PhiloxStream::Uniform(i) without the run-time index into the block's words (which would put
// the block in local memory).
__device__ __forceinline__ float PhiloxUniform(const PhiloxStream& st, uint64_t i) {
  const Philox4x32 r = st.Block(static_cast<uint32_t>(i >> 2));
  const uint32_t k = static_cast<uint32_t>(i & 3);
  const uint32_t w = k == 0 ? r.v[0] : k == 1 ? r.v[1] : k == 2 ? r.v[2] : r.v[3];
  return U32ToUniformFloat(w);
}

// Grid partition shared by the tile kernels: each (sequence, kv head) gets num_parts blocks of
// tiles_per_block consecutive tiles, about one wave of blocks in all.
struct TilePlan {
  int32_t max_tiles = 0;  // T_max = ceil(max_seq_len / kTile)
  int32_t tiles_per_block = 1;
  int32_t num_parts = 1;
};

TilePlan MakeTilePlan(const DecodeShape& s) {
  TilePlan plan;
  plan.max_tiles = std::max(1, (s.max_seq_len + kTile - 1) / kTile);
  const int64_t pairs = std::max<int64_t>(1, static_cast<int64_t>(s.batch) * s.num_kv_heads);
  const int64_t slots = static_cast<int64_t>(NumSms()) * kBlocksPerSm;
  const int64_t per_pair = std::max<int64_t>(1, slots / pairs);
  plan.tiles_per_block = static_cast<int32_t>((plan.max_tiles + per_pair - 1) / per_pair);
  plan.num_parts = (plan.max_tiles + plan.tiles_per_block - 1) / plan.tiles_per_block;
  return plan;
}

cudaError_t ValidateSanta(const SantaParams& p) {
  KVSPARSE_CUDA_RETURN_IF_ERROR(ValidateShape(p.shape));
  if (p.num_samples < 1) return cudaErrorInvalidValue;
  return cudaSuccess;
}

// Carves consecutive 256-byte-aligned regions out of a workspace.
class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<char*>(base)) {}
  template <typename X>
  X* Take(size_t count) {
    X* r = reinterpret_cast<X*>(base_ == nullptr ? nullptr : base_ + used_);
    used_ += AlignUp(count * sizeof(X), 256);
    return r;
  }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

// ---------------------------------------------------------------------------------------------
// S2ANTA-flash, Algorithm 7 fused over tiles_per_block tiles per block, with the block's tiles
// merged in registers (the same deferred normalisation as Algorithm 8); MergePartials then
// merges the blocks.
template <typename T, int D, int G>
__global__ void __launch_bounds__(TileCfg<D, G>::kThreads, TileCfg<D, G>::kMinBlocks)
    FlashKernel(SantaParams p, int tiles_per_block, int num_parts, float* __restrict__ part_o,
                float* __restrict__ part_lse) {
  using Cfg = TileCfg<D, G>;
  constexpr int NW = Cfg::kWarps;
  constexpr int L = D / 8;
  constexpr int kScoreFloats = G * kTile;
  constexpr int kSm = Max(kScoreFloats + G * kTile + kTile, NW * G * D);
  __shared__ __align__(16) float sm[kSm];
  __shared__ float sm_m[G], sm_l[G], sm_alpha[G], sm_w[G];
  __shared__ int sm_rows;
  float* ssm = sm;
  extern __shared__ uint4 kst[];  // K staging, ScoreStageBytes
  int* cnt = reinterpret_cast<int*>(sm + kScoreFloats);
  int* idx = cnt + G * kTile;

  const DecodeShape& s = p.shape;
  const int kvh = blockIdx.x, blk = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = lane / L, lr = lane % L;
  const int n = s.seq_lens[b];
  const int num_tiles = (n + kTile - 1) / kTile;
  // S_tile = max(1, ceil(S / T)) (kernels/santa.h: rounded up so that every tile samples).
  const int s_tile = num_tiles > 0 ? max(1, (p.num_samples + num_tiles - 1) / num_tiles) : 0;
  const int t_begin = blk * tiles_per_block;
  const int t_end = min(num_tiles, t_begin + tiles_per_block);

  QState<D, G> qs;
  LoadQState<T, D, G>(s, b, kvh, lane, lr, qs);
  const int64_t kv_base = b * s.kv.batch_stride + kvh * s.kv.head_stride;
  const uint16_t* kb0 = static_cast<const uint16_t*>(s.k) + kv_base;
  const uint16_t* vb = static_cast<const uint16_t*>(s.v) + kv_base + lr * 8;
  const int64_t ts = s.kv.token_stride;

  float acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
  }
  if (threadIdx.x < G) {
    sm_m[threadIdx.x] = kNegInf;
    sm_l[threadIdx.x] = 0.f;
  }
  int kbuf = 0;
  if (t_begin < t_end) {
    StartKPipeline<D, G, NW, Cfg::kUnroll>(kb0, ts, t_begin * kTile,
                                           min(kTile, n - t_begin * kTile), kst, warp, lane);
  }
  for (int t = t_begin; t < t_end; ++t) {
    const int t0 = t * kTile;
    const int len = min(kTile, n - t0);
    const int next_len = t + 1 < t_end ? min(kTile, n - t0 - kTile) : 0;
    ScoreTileAny<T, D, G, NW, Cfg::kUnroll>(qs, kb0, ts, t0, len, ssm, warp, lane, kst, kbuf,
                                            next_len);
    __syncthreads();
    for (int g = warp; g < G; g += NW) {
      const int h = kvh * G + g;
      float m2, ell, u[kPerLane];
      HeadStats(ssm + g * kTile, lane, m2, ell, u);
      const float inv_delta = ell > 0.f ? static_cast<float>(s_tile) / ell : 0.f;
      const float a0 = PhiloxUniform(PhiloxStream::Make(p.seed, RngTag::kFlashTileOffset, b, h), t);
      SystematicCounts(u, inv_delta, a0, lane, cnt + g * kTile);
      if (p.sample_counts != nullptr) {
        __syncwarp();
        int32_t* dst =
            p.sample_counts + (static_cast<int64_t>(b) * s.num_q_heads + h) * s.max_seq_len + t0;
        for (int i = lane; i < len; i += 32) dst[i] = cnt[g * kTile + i];
      }
      if (lane == 0) {
        const float mo = sm_m[g];
        const float mn = fmaxf(mo, m2);
        const float alpha = mo == kNegInf ? 0.f : exp2f(mo - mn);
        const float wt = m2 == kNegInf ? 0.f : exp2f(m2 - mn) * ell;
        sm_l[g] = sm_l[g] * alpha + wt;
        sm_m[g] = mn;
        sm_alpha[g] = alpha;
        sm_w[g] = wt / static_cast<float>(s_tile);
      }
    }
    __syncthreads();
    if (warp == 0) CompactRows<G>(cnt, lane, idx, &sm_rows);
    __syncthreads();
    if (threadIdx.x == 0 && p.rows_read != nullptr) {
      atomicAdd(p.rows_read + b * s.num_kv_heads + kvh, sm_rows);
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float a = sm_alpha[g];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] *= a;
    }
    GatherRows<T, D, G, NW>(vb, ts, t0, idx, sm_rows, cnt, sm_w, warp, row, acc);
    __syncthreads();
  }

  BlockSumAcc<D, G, NW>(acc, sm, warp, lane);
  for (int i = threadIdx.x; i < G * D; i += NW * 32) {
    const int g = i / D, dim = i % D;
    const float lt = sm_l[g];
    const float val = lt > 0.f ? sm[i] / lt : 0.f;
    const int64_t bh = static_cast<int64_t>(b) * s.num_q_heads + kvh * G + g;
    if (num_parts == 1) {
      static_cast<uint16_t*>(s.out)[bh * D + dim] = FloatToBits<T>(val);
    } else {
      part_o[(bh * num_parts + blk) * D + dim] = val;
      if (dim == 0) part_lse[bh * num_parts + blk] = lt > 0.f ? sm_m[g] + log2f(lt) : kNegInf;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Pass 1 of prop and iid (Algorithm 3): tile maxima m (log2 units), sums ell and the u stash.
// Layouts: m_tiles, l_tiles [B, H, T_max]; stash [B, H, T_max * kTile] (whole tiles written).
template <typename T, int D, int G>
__global__ void __launch_bounds__(TileCfg<D, G>::kThreads, TileCfg<D, G>::kMinBlocks)
    Pass1Kernel(DecodeShape s, int tiles_per_block, int max_tiles, float* __restrict__ m_tiles,
                float* __restrict__ l_tiles, void* __restrict__ stash, bool fp16_stash) {
  using Cfg = TileCfg<D, G>;
  constexpr int NW = Cfg::kWarps;
  constexpr int L = D / 8;
  __shared__ __align__(16) float ssm[G * kTile];
  extern __shared__ uint4 kst[];  // K staging, ScoreStageBytes
  const int kvh = blockIdx.x, blk = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int lr = lane % L;
  const int n = s.seq_lens[b];
  const int num_tiles = (n + kTile - 1) / kTile;
  const int t_begin = blk * tiles_per_block;
  const int t_end = min(num_tiles, t_begin + tiles_per_block);
  QState<D, G> qs;
  LoadQState<T, D, G>(s, b, kvh, lane, lr, qs);
  const uint16_t* kb0 =
      static_cast<const uint16_t*>(s.k) + b * s.kv.batch_stride + kvh * s.kv.head_stride;
  int kbuf = 0;
  if (t_begin < t_end) {
    StartKPipeline<D, G, NW, Cfg::kUnroll>(kb0, s.kv.token_stride, t_begin * kTile,
                                           min(kTile, n - t_begin * kTile), kst, warp, lane);
  }
  for (int t = t_begin; t < t_end; ++t) {
    const int t0 = t * kTile;
    const int len = min(kTile, n - t0);
    const int next_len = t + 1 < t_end ? min(kTile, n - t0 - kTile) : 0;
    ScoreTileAny<T, D, G, NW, Cfg::kUnroll>(qs, kb0, s.kv.token_stride, t0, len, ssm, warp, lane,
                                            kst, kbuf, next_len);
    __syncthreads();
    for (int g = warp; g < G; g += NW) {
      const int64_t bh = static_cast<int64_t>(b) * s.num_q_heads + kvh * G + g;
      float m2, ell, u[kPerLane];
      HeadStats(ssm + g * kTile, lane, m2, ell, u);
      const int64_t off = (bh * max_tiles + t) * kTile + lane * kPerLane;
      if (fp16_stash) {
        *reinterpret_cast<uint4*>(static_cast<uint16_t*>(stash) + off) = Pack8<Fp16>(u);
      } else {
        float4* dst = reinterpret_cast<float4*>(static_cast<float*>(stash) + off);
#pragma unroll
        for (int i = 0; i < kPerLane / 4; ++i) {
          dst[i] = make_float4(u[4 * i], u[4 * i + 1], u[4 * i + 2], u[4 * i + 3]);
        }
      }
      if (lane == 0) {
        m_tiles[bh * max_tiles + t] = m2;
        l_tiles[bh * max_tiles + t] = ell;
      }
    }
    __syncthreads();
  }
}

// Block-wide reductions for 256-thread blocks.
constexpr int kSmallThreads = 256;
__device__ __forceinline__ float BlockMax(float v, float* red) {
  v = WarpMax(v);
  __syncthreads();
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float r = kNegInf;
  for (int i = 0; i < kSmallThreads / 32; ++i) r = fmaxf(r, red[i]);
  return r;
}
__device__ __forceinline__ double BlockSumD(double v, double* red) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  double r = 0.0;
  for (int i = 0; i < kSmallThreads / 32; ++i) r += red[i];
  return r;
}

// ---------------------------------------------------------------------------------------------
// Prop budgets (Algorithm 4), one block per (b, h): W_t = 2^(m_t - m*) ell_t, S_t = floor(S W_t/Z)
// plus one for the S - sum floor tiles of largest fractional part (ties: lower tile first).
// Also zeroes the output accumulator and the pass-2 completion counters.
__global__ void __launch_bounds__(kSmallThreads)
    PropBudgetKernel(DecodeShape s, int num_samples, int max_tiles,
                     const float* __restrict__ m_tiles, const float* __restrict__ l_tiles,
                     int* __restrict__ s_tiles, float* __restrict__ inv_delta,
                     float* __restrict__ accum, unsigned* __restrict__ counters) {
  extern __shared__ double frac[];  // [max_tiles]
  __shared__ float red[kSmallThreads / 32];
  __shared__ double red_d[kSmallThreads / 32];
  const int64_t bh = blockIdx.x;
  const int b = static_cast<int>(bh / s.num_q_heads);
  const int h = static_cast<int>(bh % s.num_q_heads);
  const int G = s.num_q_heads / s.num_kv_heads;
  const int n = s.seq_lens[b];
  const int num_tiles = (n + kTile - 1) / kTile;
  const float* mt = m_tiles + bh * max_tiles;
  const float* lt = l_tiles + bh * max_tiles;
  for (int i = threadIdx.x; i < s.head_dim; i += kSmallThreads) accum[bh * s.head_dim + i] = 0.f;
  if (threadIdx.x == 0 && h % G == 0) counters[b * s.num_kv_heads + h / G] = 0u;
  float mx = kNegInf;
  for (int t = threadIdx.x; t < num_tiles; t += kSmallThreads) mx = fmaxf(mx, mt[t]);
  const float mstar = BlockMax(mx, red);
  double z = 0.0;
  for (int t = threadIdx.x; t < num_tiles; t += kSmallThreads) {
    z += static_cast<double>(exp2f(mt[t] - mstar) * lt[t]);
  }
  const double zsum = BlockSumD(z, red_d);
  double fsum = 0.0;
  for (int t = threadIdx.x; t < num_tiles; t += kSmallThreads) {
    const double w = static_cast<double>(exp2f(mt[t] - mstar) * lt[t]);
    const double q = static_cast<double>(num_samples) * (w / zsum);
    const double f = floor(q);
    frac[t] = q - f;
    s_tiles[bh * max_tiles + t] = static_cast<int>(f);
    fsum += f;
  }
  const int rem = num_samples - static_cast<int>(BlockSumD(fsum, red_d));
  // BlockSum ends with every frac[] write visible (it has barriers).
  for (int t = threadIdx.x; t < num_tiles; t += kSmallThreads) {
    const double ft = frac[t];
    int rank = 0;
    for (int j = 0; j < num_tiles; ++j) {
      const double fj = frac[j];
      rank += (fj > ft || (fj == ft && j < t)) ? 1 : 0;
    }
    const int st = s_tiles[bh * max_tiles + t] + (rank < rem ? 1 : 0);
    s_tiles[bh * max_tiles + t] = st;
    inv_delta[bh * max_tiles + t] = st > 0 ? static_cast<float>(st) / lt[t] : 0.f;
  }
}

// Prop pass 2 (Algorithm 5), one warp per tile: warp w of block blk takes tiles
// t = blk * NW + w, + num_parts * NW, ...; a tile where no head of the group got samples is
// skipped without touching V or the stash. Warps need no block barrier until the end, so many
// tiles' dependent loads (budgets, stash, V rows) are in flight at once. The last block of a
// (b, kv head) to finish writes out = accum / S.
template <int G>
constexpr size_t Pass2SmemBytes(int warps) {
  return size_t{1} * warps * (G + 1) * kTile * sizeof(int);
}

template <typename T, int D, int G>
__global__ void __launch_bounds__(TileCfg<D, G>::kThreads, TileCfg<D, G>::kMinBlocks)
    PropPass2Kernel(SantaParams p, int max_tiles, int num_parts, const void* __restrict__ stash,
                    const int* __restrict__ s_tiles, const float* __restrict__ inv_delta,
                    float* __restrict__ accum, unsigned* __restrict__ counters) {
  using Cfg = TileCfg<D, G>;
  constexpr int NW = Cfg::kWarps;
  constexpr int L = D / 8;
  extern __shared__ __align__(16) float dsm[];  // per warp: cnt [G][kTile], idx [kTile]
  __shared__ bool sm_last;
  const DecodeShape& s = p.shape;
  const int kvh = blockIdx.x, blk = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = lane / L;
  int* cnt = reinterpret_cast<int*>(dsm) + warp * (G + 1) * kTile;
  int* idx = cnt + G * kTile;
  const int n = s.seq_lens[b];
  const int num_tiles = (n + kTile - 1) / kTile;
  const int64_t bh0 = static_cast<int64_t>(b) * s.num_q_heads + kvh * G;
  const int64_t kv_off = b * s.kv.batch_stride + kvh * s.kv.head_stride + (lane % L) * 8;
  const uint16_t* vb = static_cast<const uint16_t*>(s.v) + kv_off;
  float ones[G];
  float acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    ones[g] = 1.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
  }
  for (int t = blk * NW + warp; t < num_tiles; t += num_parts * NW) {
    const int my_st = lane < G ? s_tiles[(bh0 + lane) * max_tiles + t] : 0;
    if (__ballot_sync(0xffffffffu, my_st != 0) == 0) continue;  // uniform over the warp
    const int t0 = t * kTile;
    const int len = min(kTile, n - t0);
    // Every head's stash slice and inv_delta first (one round trip), then the counts.
    float u[G][kPerLane];
    float invd[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int64_t bh = bh0 + g;
      const bool on = __shfl_sync(0xffffffffu, my_st, g) != 0;
      invd[g] = on ? inv_delta[bh * max_tiles + t] : 0.f;
      const int64_t off = (bh * max_tiles + t) * kTile + lane * kPerLane;
      if (!on) {
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) u[g][i] = 0.f;
      } else if (p.fp16_stash) {
        Unpack8<Fp16>(*reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(stash) + off),
                      u[g]);
      } else {
        const float4* src = reinterpret_cast<const float4*>(static_cast<const float*>(stash) + off);
#pragma unroll
        for (int i = 0; i < kPerLane / 4; ++i) {
          const float4 x = src[i];
          u[g][4 * i] = x.x;
          u[g][4 * i + 1] = x.y;
          u[g][4 * i + 2] = x.z;
          u[g][4 * i + 3] = x.w;
        }
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const int64_t bh = bh0 + g;
      int* c = cnt + g * kTile;
      if (invd[g] == 0.f) {
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) c[lane * kPerLane + i] = 0;
      } else {
        const float a0 =
            PhiloxUniform(PhiloxStream::Make(p.seed, RngTag::kPropTileOffset, b, kvh * G + g), t);
        SystematicCounts(u[g], invd[g], a0, lane, c);
      }
      if (p.sample_counts != nullptr) {
        __syncwarp();
        int32_t* dst = p.sample_counts + bh * s.max_seq_len + t0;
        for (int i = lane; i < len; i += 32) dst[i] = c[i];
      }
    }
    __syncwarp();
    const int rows = CompactRows<G>(cnt, lane, idx, nullptr);
    __syncwarp();
    if (lane == 0 && p.rows_read != nullptr) {
      atomicAdd(p.rows_read + b * s.num_kv_heads + kvh, rows);
    }
    GatherRows<T, D, G, 1>(vb, s.kv.token_stride, t0, idx, rows, cnt, ones, 0, row, acc);
    __syncwarp();
  }
  float* sacc = dsm;  // reused once every warp is done (BlockSumAcc starts with a barrier)
  BlockSumAcc<D, G, NW>(acc, sacc, warp, lane);
  for (int i = threadIdx.x; i < G * D; i += NW * 32) {
    if (sacc[i] != 0.f) atomicAdd(accum + bh0 * D + i, sacc[i]);
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    sm_last =
        atomicAdd(counters + b * s.num_kv_heads + kvh, 1u) == static_cast<unsigned>(num_parts - 1);
  }
  __syncthreads();
  if (sm_last) {
    __threadfence();
    const float inv_s = 1.f / static_cast<float>(p.num_samples);
    for (int i = threadIdx.x; i < G * D; i += NW * 32) {
      static_cast<uint16_t*>(s.out)[bh0 * D + i] =
          FloatToBits<T>(__ldcg(accum + bh0 * D + i) * inv_s);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// SANTA i.i.d., one block per (b, h): tile CDF from the pass-1 stats, S draws by inverse CDF
// (tile by binary search, token by a scan of the stash), then the mean of the S V rows.
template <typename T, int D>
__global__ void __launch_bounds__(kSmallThreads)
    IidSampleKernel(SantaParams p, int max_tiles, const float* __restrict__ m_tiles,
                    const float* __restrict__ l_tiles, const float* __restrict__ stash) {
  constexpr int L = D / 8;
  constexpr int R = 32 / L;
  constexpr int NW = kSmallThreads / 32;
  extern __shared__ double dyn[];  // cdf [max_tiles] (double), then sample indices [S]
  __shared__ float red[NW];
  __shared__ __align__(16) float sacc[NW * D];
  const DecodeShape& s = p.shape;
  const int64_t bh = blockIdx.x;
  const int b = static_cast<int>(bh / s.num_q_heads);
  const int h = static_cast<int>(bh % s.num_q_heads);
  const int G = s.num_q_heads / s.num_kv_heads;
  const int n = s.seq_lens[b];
  const int num_tiles = (n + kTile - 1) / kTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = lane / L, lr = lane % L;
  double* cdf = dyn;
  int* sidx = reinterpret_cast<int*>(dyn + max_tiles);
  const float* mt = m_tiles + bh * max_tiles;
  const float* lt = l_tiles + bh * max_tiles;

  float mx = kNegInf;
  for (int t = threadIdx.x; t < num_tiles; t += kSmallThreads) mx = fmaxf(mx, mt[t]);
  const float mstar = BlockMax(mx, red);
  // Inclusive scan of W_t (double) over the tiles, kSmallThreads at a time.
  __shared__ double red_d[NW];
  double carry = 0.0;
  for (int c0 = 0; c0 < num_tiles; c0 += kSmallThreads) {
    const int t = c0 + threadIdx.x;
    const double w = t < num_tiles ? static_cast<double>(exp2f(mt[t] - mstar) * lt[t]) : 0.0;
    double x = w;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const double y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    __syncthreads();
    if (lane == 31) red_d[warp] = x;
    __syncthreads();
    double before = carry;
    for (int w2 = 0; w2 < warp; ++w2) before += red_d[w2];
    if (t < num_tiles) cdf[t] = before + x;
    double total = 0.0;
    for (int w2 = 0; w2 < NW; ++w2) total += red_d[w2];
    carry += total;
  }
  __syncthreads();
  const double z = num_tiles > 0 ? cdf[num_tiles - 1] : 0.0;
  const PhiloxStream rng = PhiloxStream::Make(p.seed, RngTag::kSantaIid, b, h);
  for (int i = threadIdx.x; i < p.num_samples; i += kSmallThreads) {
    int tok = -1;
    if (num_tiles > 0) {
      const double target = static_cast<double>(PhiloxUniform(rng, i)) * z;
      int lo = 0, hi = num_tiles - 1;  // first tile with cdf > target
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (cdf[mid] > target) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      const int t = lo;
      const double excl = t > 0 ? cdf[t - 1] : 0.0;
      const float r =
          static_cast<float>((target - excl) / static_cast<double>(exp2f(mt[t] - mstar)));
      const int len = min(kTile, n - t * kTile);
      const float* u = stash + (bh * max_tiles + t) * kTile;
      float cum = 0.f;
      int last = 0;
      tok = -1;
      for (int j = 0; j < len; ++j) {
        const float uj = u[j];
        if (uj > 0.f) last = j;
        cum += uj;
        if (cum > r) {
          tok = j;
          break;
        }
      }
      if (tok < 0) tok = last;
      tok += t * kTile;
    }
    sidx[i] = tok;
    if (p.indices != nullptr) p.indices[bh * p.num_samples + i] = tok;
  }
  __syncthreads();
  const int64_t kv_off = b * s.kv.batch_stride + (h / G) * s.kv.head_stride + lr * 8;
  const uint16_t* vb = static_cast<const uint16_t*>(s.v) + kv_off;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int i0 = warp * R + row; i0 < p.num_samples; i0 += NW * R * 4) {
    uint4 vr[4];
    int ti[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int i = i0 + k * NW * R;
      ti[k] = i < p.num_samples ? sidx[i] : -1;
      vr[k] = ti[k] >= 0 ? LoadStream16(vb + static_cast<int64_t>(ti[k]) * s.kv.token_stride)
                         : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float vf[8];
      Unpack8<T>(vr[k], vf);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += vf[e];
    }
  }
#pragma unroll
  for (int off = L; off < 32; off *= 2) {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], off);
  }
  if (row == 0) {
#pragma unroll
    for (int e = 0; e < 8; ++e) sacc[warp * D + lr * 8 + e] = acc[e];
  }
  __syncthreads();
  const float inv_s = num_tiles > 0 ? 1.f / static_cast<float>(p.num_samples) : 0.f;
  for (int dim = threadIdx.x; dim < D; dim += kSmallThreads) {
    float t = 0.f;
    for (int w = 0; w < NW; ++w) t += sacc[w * D + dim];
    static_cast<uint16_t*>(s.out)[bh * D + dim] = FloatToBits<T>(t * inv_s);
  }
}

// ---------------------------------------------------------------------------------------------
// Workspaces.

struct PropSpace {
  float* m_tiles;
  float* l_tiles;
  void* stash;  // float, or fp16 with SantaParams::fp16_stash
  int* s_tiles;
  float* inv_delta;
  float* accum;
  unsigned* counters;
};

PropSpace CarveProp(const DecodeShape& s, const TilePlan& plan, bool fp16_stash, void* base,
                    size_t* bytes) {
  const size_t bh = static_cast<size_t>(s.batch) * s.num_q_heads;
  Carver c(base);
  PropSpace r;
  r.m_tiles = c.Take<float>(bh * plan.max_tiles);
  r.l_tiles = c.Take<float>(bh * plan.max_tiles);
  r.stash = fp16_stash ? static_cast<void*>(c.Take<uint16_t>(bh * plan.max_tiles * kTile))
                       : static_cast<void*>(c.Take<float>(bh * plan.max_tiles * kTile));
  r.s_tiles = c.Take<int>(bh * plan.max_tiles);
  r.inv_delta = c.Take<float>(bh * plan.max_tiles);
  r.accum = c.Take<float>(bh * s.head_dim);
  r.counters = c.Take<unsigned>(static_cast<size_t>(s.batch) * s.num_kv_heads);
  *bytes = c.used();
  return r;
}

struct Pass1Launch {
  const DecodeShape& s;
  TilePlan plan;
  float* m_tiles;
  float* l_tiles;
  void* stash;
  bool fp16_stash;
  cudaStream_t stream;
  template <typename T, int D, int G>
  cudaError_t operator()() const {
    const dim3 grid(s.num_kv_heads, plan.num_parts, s.batch);
    constexpr size_t kSmem = ScoreStageBytes<D, G, TileCfg<D, G>::kWarps>();
    KVSPARSE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
        &Pass1Kernel<T, D, G>, cudaFuncAttributeMaxDynamicSharedMemorySize, int{kSmem}));
    Pass1Kernel<T, D, G><<<grid, TileCfg<D, G>::kThreads, kSmem, stream>>>(
        s, plan.tiles_per_block, plan.max_tiles, m_tiles, l_tiles, stash, fp16_stash);
    return cudaGetLastError();
  }
};

struct Pass2Launch {
  const SantaParams& p;
  TilePlan plan;
  PropSpace ws;
  cudaStream_t stream;
  template <typename T, int D, int G>
  cudaError_t operator()() const {
    constexpr int NW = TileCfg<D, G>::kWarps;
    const int64_t pairs =
        std::max<int64_t>(1, static_cast<int64_t>(p.shape.batch) * p.shape.num_kv_heads);
    const int64_t slots = static_cast<int64_t>(NumSms()) * 4;
    const int parts = static_cast<int>(
        std::max<int64_t>(1, std::min<int64_t>((plan.max_tiles + NW - 1) / NW, slots / pairs)));
    const dim3 grid(p.shape.num_kv_heads, parts, p.shape.batch);
    constexpr size_t kSmem = Pass2SmemBytes<G>(NW);
    static_assert(kSmem >= size_t{NW} * G * D * sizeof(float), "merge buffer alias");
    KVSPARSE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
        &PropPass2Kernel<T, D, G>, cudaFuncAttributeMaxDynamicSharedMemorySize, int{kSmem}));
    PropPass2Kernel<T, D, G><<<grid, TileCfg<D, G>::kThreads, kSmem, stream>>>(
        p, plan.max_tiles, parts, ws.stash, ws.s_tiles, ws.inv_delta, ws.accum, ws.counters);
    return cudaGetLastError();
  }
};

struct IidLaunch {
  const SantaParams& p;
  int max_tiles;
  PropSpace ws;
  cudaStream_t stream;
  template <typename T, int D, int G>
  cudaError_t operator()() const {
    const size_t smem = (static_cast<size_t>(max_tiles) + 4) * sizeof(double) +
                        (static_cast<size_t>(p.num_samples) + 4) * sizeof(int);
    if (smem > 200 * 1024) return cudaErrorInvalidValue;
    auto* kernel = &IidSampleKernel<T, D>;
    if (smem > 48 * 1024) {
      KVSPARSE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
          kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    }
    kernel<<<p.shape.batch * p.shape.num_q_heads, kSmallThreads, smem, stream>>>(
        p, max_tiles, ws.m_tiles, ws.l_tiles, static_cast<const float*>(ws.stash));
    return cudaGetLastError();
  }
};

struct FlashLaunch {
  const SantaParams& p;
  TilePlan plan;
  float* part_o;
  float* part_lse;
  cudaStream_t stream;
  template <typename T, int D, int G>
  cudaError_t operator()() const {
    const DecodeShape& s = p.shape;
    const dim3 grid(s.num_kv_heads, plan.num_parts, s.batch);
    constexpr size_t kSmem = ScoreStageBytes<D, G, TileCfg<D, G>::kWarps>();
    KVSPARSE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
        &FlashKernel<T, D, G>, cudaFuncAttributeMaxDynamicSharedMemorySize, int{kSmem}));
    FlashKernel<T, D, G><<<grid, TileCfg<D, G>::kThreads, kSmem, stream>>>(
        p, plan.tiles_per_block, plan.num_parts, part_o, part_lse);
    KVSPARSE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    if (plan.num_parts > 1) {
      return MergePartials(part_o, part_lse, s.batch * s.num_q_heads, plan.num_parts, D, s.dtype,
                           s.out, stream);
    }
    return cudaSuccess;
  }
};

cudaError_t LaunchBudget(const SantaParams& p, const TilePlan& plan, const PropSpace& ws,
                         cudaStream_t stream) {
  // + 32 bytes: the unrolled rank loop may load a vector that ends past the last element.
  const size_t smem = (static_cast<size_t>(plan.max_tiles) + 4) * sizeof(double);
  if (smem > 200 * 1024) return cudaErrorInvalidValue;
  if (smem > 48 * 1024) {
    KVSPARSE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
        &PropBudgetKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  PropBudgetKernel<<<p.shape.batch * p.shape.num_q_heads, kSmallThreads, smem, stream>>>(
      p.shape, p.num_samples, plan.max_tiles, ws.m_tiles, ws.l_tiles, ws.s_tiles, ws.inv_delta,
      ws.accum, ws.counters);
  return cudaGetLastError();
}

}  // namespace

size_t SantaIidWorkspaceBytes(const SantaParams& p) {
  size_t bytes = 0;
  CarveProp(p.shape, MakeTilePlan(p.shape), false, nullptr, &bytes);
  return bytes;
}

cudaError_t SantaIid(const SantaParams& p, void* workspace, size_t workspace_bytes,
                     cudaStream_t stream) {
  KVSPARSE_CUDA_RETURN_IF_ERROR(ValidateSanta(p));
  if (p.shape.batch == 0) return cudaSuccess;
  const TilePlan plan = MakeTilePlan(p.shape);
  size_t need = 0;
  const PropSpace ws = CarveProp(p.shape, plan, false, workspace, &need);
  if (workspace == nullptr || workspace_bytes < need) return cudaErrorInvalidValue;
  const DecodeShape& s = p.shape;
  KVSPARSE_CUDA_RETURN_IF_ERROR(
      DispatchDecode(s.dtype, s.head_dim, s.group_size(),
                     Pass1Launch{s, plan, ws.m_tiles, ws.l_tiles, ws.stash, false, stream}));
  return DispatchDecode(s.dtype, s.head_dim, s.group_size(),
                        IidLaunch{p, plan.max_tiles, ws, stream});
}

size_t S2antaPropWorkspaceBytes(const SantaParams& p) {
  size_t bytes = 0;
  CarveProp(p.shape, MakeTilePlan(p.shape), p.fp16_stash, nullptr, &bytes);
  return bytes;
}

cudaError_t S2antaProp(const SantaParams& p, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream) {
  KVSPARSE_CUDA_RETURN_IF_ERROR(ValidateSanta(p));
  if (p.shape.batch == 0) return cudaSuccess;
  const TilePlan plan = MakeTilePlan(p.shape);
  size_t need = 0;
  const PropSpace ws = CarveProp(p.shape, plan, p.fp16_stash, workspace, &need);
  if (workspace == nullptr || workspace_bytes < need) return cudaErrorInvalidValue;
  const DecodeShape& s = p.shape;
  KVSPARSE_CUDA_RETURN_IF_ERROR(
      DispatchDecode(s.dtype, s.head_dim, s.group_size(),
                     Pass1Launch{s, plan, ws.m_tiles, ws.l_tiles, ws.stash, p.fp16_stash, stream}));
  KVSPARSE_CUDA_RETURN_IF_ERROR(LaunchBudget(p, plan, ws, stream));
  return DispatchDecode(s.dtype, s.head_dim, s.group_size(), Pass2Launch{p, plan, ws, stream});
}

size_t S2antaFlashWorkspaceBytes(const SantaParams& p) {
  const TilePlan plan = MakeTilePlan(p.shape);
  if (plan.num_parts <= 1) return 0;
  const size_t rows = static_cast<size_t>(p.shape.batch) * p.shape.num_q_heads * plan.num_parts;
  return AlignUp(rows * p.shape.head_dim * sizeof(float), 256) + AlignUp(rows * sizeof(float), 256);
}

cudaError_t S2antaFlash(const SantaParams& p, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream) {
  KVSPARSE_CUDA_RETURN_IF_ERROR(ValidateSanta(p));
  if (p.shape.batch == 0) return cudaSuccess;
  const TilePlan plan = MakeTilePlan(p.shape);
  float* part_o = nullptr;
  float* part_lse = nullptr;
  if (plan.num_parts > 1) {
    if (workspace == nullptr || workspace_bytes < S2antaFlashWorkspaceBytes(p)) {
      return cudaErrorInvalidValue;
    }
    const size_t rows = static_cast<size_t>(p.shape.batch) * p.shape.num_q_heads * plan.num_parts;
    part_o = static_cast<float*>(workspace);
    part_lse = reinterpret_cast<float*>(static_cast<char*>(workspace) +
                                        AlignUp(rows * p.shape.head_dim * sizeof(float), 256));
  }
  return DispatchDecode(p.shape.dtype, p.shape.head_dim, p.shape.group_size(),
                        FlashLaunch{p, plan, part_o, part_lse, stream});
}

}  // namespace kvsparse::kernels::cuda
