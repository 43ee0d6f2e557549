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
__host__ __device__ inline SeedSource Seeds(const SantaLaunchParams& p) {
  return {p.seed, p.seeds};
}

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

cudaError_t ValidateSanta(const SantaLaunchParams& p) {
  KVSPARSE_CUDA_RETURN_IF_ERROR(ValidateShape(p.shape, /*k_paged_ok=*/false, /*v_paged_ok=*/true));
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

constexpr int kFlashBufs = 2;  // K staging ring depth of the flash kernel

// ---------------------------------------------------------------------------------------------
// S2ANTA-flash, Algorithm 7 fused over tiles_per_block tiles per block, with the block's tiles
// merged in registers (the same deferred normalisation as Algorithm 8); MergePartials then
// merges the blocks.
template <typename T, int D, int G>
__global__ void __launch_bounds__(TileCfg<D, G>::kThreads, TileCfg<D, G>::kMinBlocks)
    FlashKernel(SantaLaunchParams p, int tiles_per_block, int num_parts, float* __restrict__ part_o,
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
  extern __shared__ uint4 kst[];  // K staging, ScoreStageBytes<NW, kFlashBufs>
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
  const uint16_t* kb0 = KvHeadBase(s, false, b, kvh);
  const RowReader vr = MakeRowReader(s, true, b, kvh, lr * 8);
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
  KStream<D, G, NW, Cfg::kUnroll, kFlashBufs> ks;
  ks.Start(kb0, ts, n, t_begin, t_end, kst, warp, lane);
  for (int t = t_begin; t < t_end; ++t) {
    const int t0 = t * kTile;
    const int len = min(kTile, n - t0);
    ScoreTileAny<T, D, G, NW, Cfg::kUnroll>(qs, ks, len, ssm, warp, lane);
    __syncthreads();
    for (int g = warp; g < G; g += NW) {
      const int h = kvh * G + g;
      float m2, ell, u[kPerLane];
      HeadStats(ssm + g * kTile, lane, m2, ell, u);
      const float inv_delta = ell > 0.f ? static_cast<float>(s_tile) / ell : 0.f;
      const float a0 = PhiloxUniform(SequenceStream(Seeds(p), RngTag::kFlashTileOffset, b, h), t);
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
    GatherRows<T, D, G, NW>(vr, t0, idx, sm_rows, cnt, sm_w, warp, row, acc);
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
// Prop sample records. Pass 1 cannot know a tile's budget S_t (it depends on every tile), but it
// can precompute where systematic sampling would land for each small budget: with inclusive
// prefix sums P_n of u and inv_delta = k / ell, Algorithm 5's k samples of offset a0 are at
//   token(m) = first n with inv_delta * P_n >= m - a0,   m = 1 .. k
// (c_n = floor(a0 + p_n) - floor(a0 + p_{n-1}) counts exactly the m in (a0 + p_{n-1}, a0 + p_n]).
// Per (b, h, tile) a 32-byte record holds the tile-relative tokens for every k <= kRecMax, at
// bytes k (k - 1) / 2 .. + k - 1. Pass 2 reads the record of the actual budget, so no score
// stash crosses DRAM; a tile whose budget exceeds kRecMax (peaked attention: the sink, a needle)
// is rescored from K by PropBigTileKernel, a block per such tile, and skipped by pass 2.
constexpr int kRecMax = 7;
constexpr int kRecEntries = kRecMax * (kRecMax + 1) / 2;  // 28
constexpr int kRecBytes = 32;

// Inclusive prefix sums of one tile's u (lane owns tokens lane*8 .. lane*8+7) into p[0, kTile);
// returns the tile sum ell on every lane. The caller __syncwarp()s before reading other lanes'.
__device__ __forceinline__ float WarpPrefix(const float (&u)[kPerLane], int lane, float* p) {
  float run[kPerLane];
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    acc = __fadd_rn(acc, u[i]);
    run[i] = acc;
  }
  const float excl = WarpExclusiveSum(acc, lane);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) run[i] = __fadd_rn(run[i], excl);
  float4* dst = reinterpret_cast<float4*>(p + lane * kPerLane);
#pragma unroll
  for (int i = 0; i < kPerLane / 4; ++i) {
    dst[i] = make_float4(run[4 * i], run[4 * i + 1], run[4 * i + 2], run[4 * i + 3]);
  }
  return __shfl_sync(0xffffffffu, run[kPerLane - 1], 31);
}

// First n in [0, len) with inv_delta * p[n] >= target (len - 1 if rounding leaves none).
__device__ __forceinline__ int FirstAtLeast(const float* p, int len, float inv_delta,
                                            float target) {
  int lo = 0, hi = len;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (__fmul_rn(inv_delta, p[mid]) < target) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return min(lo, len - 1);
}

// ---------------------------------------------------------------------------------------------
// Pass 1 of prop and iid (Algorithm 3): tile maxima m (log2 units) and sums ell of every head,
// and per (b, h, tile) either the u stash (iid: [B, H, T_max * kTile] fp32, whole tiles
// written) or the prop sample record ([B, H, T_max, kRecBytes] bytes).
// Layouts: m_tiles, l_tiles [B, H, T_max].
// Warp-specialised: kScoreWarps warps stream K and score tiles into one of two score buffers;
// G statistics warps (one per head) take each scored tile from there. Named barriers hand the
// buffers over (full: scored; empty: read), so the K stream never waits for the statistics of
// a tile, only for the buffer of the tile two back.
enum class Pass1Out { kStash, kRecords };

template <int D, int G>
struct Pass1Cfg {
  static constexpr int kScoreWarps = TileCfg<D, G>::kWarps;
  static constexpr int kThreads = (kScoreWarps + G) * 32;
  static constexpr int kMinBlocks = TileCfg<D, G>::kMinBlocks;
  static constexpr int kBufs = 3;  // K staging ring depth
  static constexpr size_t kSmem = ScoreStageBytes<kScoreWarps, kBufs>();
};

template <typename T, int D, int G, Pass1Out kOut>
__global__ void __launch_bounds__(Pass1Cfg<D, G>::kThreads, Pass1Cfg<D, G>::kMinBlocks)
    Pass1Kernel(DecodeShape s, SeedSource seed, int tiles_per_block, int max_tiles,
                float* __restrict__ m_tiles, float* __restrict__ l_tiles, void* __restrict__ out,
                int* __restrict__ zero, int zero_words) {
  using Cfg = Pass1Cfg<D, G>;
  constexpr int NW = Cfg::kScoreWarps;
  constexpr int kAll = Cfg::kThreads;
  constexpr int kFullBar = 1, kEmptyBar = 3;  // + buffer index (ids stay compile-time)
  __shared__ __align__(16) float ssm[2][G * kTile];
  extern __shared__ uint4 kst[];                                // K staging, Pass1Cfg::kSmem
  if constexpr (kOut == Pass1Out::kRecords) AllowDependents();  // the budget kernel waits anyway
  const int kvh = blockIdx.x, blk = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {  // for the budget kernel, which
    for (int i = threadIdx.x; i < zero_words; i += kAll) zero[i] = 0;  // waits for this grid
  }
  const int n = s.seq_lens[b];
  const int num_tiles = (n + kTile - 1) / kTile;
  const int t_begin = blk * tiles_per_block;
  const int t_end = min(num_tiles, t_begin + tiles_per_block);
  if (warp < NW) {  // scoring warps
    QState<D, G> qs;
    LoadQState<T, D, G>(s, b, kvh, lane, lane % (D / 8), qs);
    const uint16_t* kb0 = KvHeadBase(s, false, b, kvh);
    KStream<D, G, NW, TileCfg<D, G>::kUnroll, Cfg::kBufs> ks;
    ks.Start(kb0, s.kv.token_stride, n, t_begin, t_end, kst, warp, lane);
    for (int t = t_begin; t < t_end; ++t) {
      const int buf = (t - t_begin) & 1;
      if (t - t_begin >= 2) {
        if (buf == 0) NamedBarrierSync(kEmptyBar, kAll);
        if (buf == 1) NamedBarrierSync(kEmptyBar + 1, kAll);
      }
      ScoreTileAny<T, D, G, NW, TileCfg<D, G>::kUnroll>(qs, ks, min(kTile, n - t * kTile), ssm[buf],
                                                        warp, lane);
      if (buf == 0) NamedBarrierArrive(kFullBar, kAll);
      if (buf == 1) NamedBarrierArrive(kFullBar + 1, kAll);
    }
    return;
  }
  // Statistics warp of head g.
  const int g = warp - NW;
  const int64_t bh = static_cast<int64_t>(b) * s.num_q_heads + kvh * G + g;
  for (int t = t_begin; t < t_end; ++t) {
    const int buf = (t - t_begin) & 1;
    const int len = min(kTile, n - t * kTile);
    if (buf == 0) NamedBarrierSync(kFullBar, kAll);
    if (buf == 1) NamedBarrierSync(kFullBar + 1, kAll);
    float* sc = ssm[buf] + g * kTile;
    float m2, ell, u[kPerLane];
    HeadStats(sc, lane, m2, ell, u);
    if constexpr (kOut == Pass1Out::kStash) {
      const int64_t off = (bh * max_tiles + t) * kTile + lane * kPerLane;
      float4* dst = reinterpret_cast<float4*>(static_cast<float*>(out) + off);
#pragma unroll
      for (int i = 0; i < kPerLane / 4; ++i) {
        dst[i] = make_float4(u[4 * i], u[4 * i + 1], u[4 * i + 2], u[4 * i + 3]);
      }
    } else {
      ell = WarpPrefix(u, lane, sc);  // the scores are no longer needed
      __syncwarp();
      if (lane < kRecEntries) {
        int k = 1, first = 0;  // entry lane = first + (m - 1) of budget k
        while (first + k <= lane) first += k++;
        const float a0 =
            PhiloxUniform(SequenceStream(seed, RngTag::kPropTileOffset, b, kvh * G + g), t);
        const float inv_delta = static_cast<float>(k) / ell;
        const int tok =
            FirstAtLeast(sc, len, inv_delta, __fsub_rn(static_cast<float>(lane - first + 1), a0));
        static_cast<uint8_t*>(out)[(bh * max_tiles + t) * kRecBytes + lane] =
            static_cast<uint8_t>(tok);
      }
    }
    if (lane == 0) {
      m_tiles[bh * max_tiles + t] = m2;
      l_tiles[bh * max_tiles + t] = ell;
    }
    __syncwarp();  // every lane is done with the buffer
    if (t + 2 < t_end) {
      if (buf == 0) NamedBarrierArrive(kEmptyBar, kAll);
      if (buf == 1) NamedBarrierArrive(kEmptyBar + 1, kAll);
    }
  }
}

// Block-wide reductions for 256-thread blocks.
constexpr int kSmallThreads = 256;
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
// Prop budgets (kernels/santa.h): W_t = 2^(m_t - m*) ell_t, q_t = S W_t / Z, in fixed point
// Q_t = round(q_t 2^32) with integer prefix sums C_t (exact: the CPU's in any order), and
// systematic rounding with the GQA group's offset U (RngTag::kPropRounding of (b, kv head),
// U_fp = U 2^32):
//   S_t = floor((C_t + U_fp) / 2^32) - floor((C_{t-1} + U_fp) / 2^32),   E[S_t] = q_t,
// so the estimate is unbiased (a tile with q_t < 1 samples with probability q_t) and a tile
// without mass (all scores -inf: ell = 0, W_t = 0) never samples. One block per (b, h); thread
// tid owns the consecutive tiles [tid * per, (tid + 1) * per). Also zeroes the output
// accumulator and (once per kv head) the pass-2 completion counter.
__device__ __forceinline__ unsigned long long PropQuota(float mt, float lt, float mstar,
                                                        double zsum, int num_samples) {
  const double w = static_cast<double>(exp2f(mt - mstar) * lt);
  return __double2ull_rn(static_cast<double>(num_samples) * (w / zsum) * 4294967296.0);
}

__global__ void __launch_bounds__(kSmallThreads)
    PropBudgetKernel(DecodeShape s, SeedSource seed, int num_samples, int max_tiles,
                     const float* __restrict__ m_tiles, const float* __restrict__ l_tiles,
                     int* __restrict__ s_tiles, float* __restrict__ accum,
                     unsigned* __restrict__ counters, int max_big, int* __restrict__ big_count,
                     uint32_t* __restrict__ big_map, int* __restrict__ big_list) {
  __shared__ float red[kSmallThreads / 32];
  __shared__ double red_d[kSmallThreads / 32];
  __shared__ unsigned long long red_u[kSmallThreads / 32];
  AllowDependents();
  const int64_t bh = blockIdx.x;
  const int b = static_cast<int>(bh / s.num_q_heads);
  const int h = static_cast<int>(bh % s.num_q_heads);
  const int G = s.num_q_heads / s.num_kv_heads;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  GridDependencyWait();
  for (int i = tid; i < s.head_dim; i += kSmallThreads) accum[bh * s.head_dim + i] = 0.f;
  if (tid == 0 && h % G == 0) counters[b * s.num_kv_heads + h / G] = 0u;
  const int n = s.seq_lens[b];
  const int num_tiles = (n + kTile - 1) / kTile;
  if (num_tiles == 0) return;  // uniform over the block
  const float* mt = m_tiles + bh * max_tiles;
  const float* lt = l_tiles + bh * max_tiles;
  float mx = kNegInf;
  for (int t = tid; t < num_tiles; t += kSmallThreads) mx = fmaxf(mx, mt[t]);
  const float mstar = BlockMax(mx, red);
  double z = 0.0;
  for (int t = tid; t < num_tiles; t += kSmallThreads) {
    z += static_cast<double>(exp2f(mt[t] - mstar) * lt[t]);
  }
  const double zsum = BlockSumD(z, red_d);
  const int per = (num_tiles + kSmallThreads - 1) / kSmallThreads;
  const int t0 = min(num_tiles, tid * per), t1 = min(num_tiles, t0 + per);
  unsigned long long local = 0;
  for (int t = t0; t < t1; ++t) local += PropQuota(mt[t], lt[t], mstar, zsum, num_samples);
  // Exclusive scan of the threads' sums: C before this thread's first tile.
  unsigned long long x = local;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) red_u[warp] = x;
  __syncthreads();
  unsigned long long c = x - local;
  for (int w = 0; w < warp; ++w) c += red_u[w];
  // One offset per (b, kv head): the group's heads round up the same tiles (kernels/santa.h).
  const float u = PhiloxUniform(SequenceStream(seed, RngTag::kPropRounding, b, h / G), 0);
  const unsigned long long off =
      static_cast<unsigned long long>(static_cast<double>(u) * 4294967296.0);
  unsigned long long before = (c + off) >> 32;
  for (int t = t0; t < t1; ++t) {
    c += PropQuota(mt[t], lt[t], mstar, zsum, num_samples);
    const unsigned long long upto = (c + off) >> 32;
    const int st = static_cast<int>(upto - before);
    before = upto;
    s_tiles[bh * max_tiles + t] = st;
    if (st > kRecMax && max_big > 0) {  // listed once per (b, kv head), whichever head sees it
      const int pair = b * s.num_kv_heads + h / G;
      const uint32_t bit = 1u << (t % 32);
      if ((atomicOr(big_map + static_cast<int64_t>(pair) * ((max_tiles + 31) / 32) + t / 32, bit) &
           bit) == 0u) {
        const int slot = atomicAdd(big_count + pair, 1);
        if (slot < max_big) big_list[static_cast<int64_t>(pair) * max_big + slot] = t;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Prop pass 2 (Algorithm 5). Each warp takes batches of nb <= kNB = 32 / G consecutive tiles
// (fewer when there are few tiles, for more warps in flight), one lane per (tile, head): the lane
// reads its budget and, when it is at most kRecMax, the sampled tokens from its record; the warp
// compacts the batch's samples into a list and gathers their V rows (up to 16 loads in flight per
// lane). Tiles where a budget is larger are PropBigTileKernel's. The block's sums go to an fp32
// accumulator; the last block of a (b, kv head) to finish writes out = accum / S.
constexpr int kPass2Warps = 4;

template <int D, int G>
struct Pass2Geom {
  static constexpr int kNB = 32 / G;                  // tiles per warp batch
  static constexpr int kList = 32 * kRecMax;          // list entries per warp
  static constexpr int kMapWords = kNB * kTile / 32;  // rows_read bitmap words per warp
  static constexpr int kWarpFloats = kList + kMapWords;
  static constexpr size_t kSmem = sizeof(float) * Max(kPass2Warps * kWarpFloats, kPass2Warps* G* D);
};

// Adds the V rows of up to 32 samples, one per lane (entry = (token << 3) | head, or -1), times
// the lane's weight (the sample's count), to acc[head]. cnt (warp-uniform) = number of lanes
// holding a sample, which are the first cnt.
template <typename T, int D, int G>
__device__ __forceinline__ void GatherEntries(int entry, int cnt, const RowReader& vb, int row,
                                              float (&acc)[G][8], float weight = 1.f) {
  constexpr int R = 32 / (D / 8);
  constexpr int kIn = 32 / R < 8 ? 32 / R : 8;  // rows in flight per lane
  for (int j0 = 0; j0 < cnt; j0 += R * kIn) {
    uint4 vr[kIn];
    int ge[kIn];
    float wt[kIn];
#pragma unroll
    for (int i = 0; i < kIn; ++i) {
      const int idx = j0 + i * R + row;
      const int e = __shfl_sync(0xffffffffu, entry, idx & 31);
      wt[i] = __shfl_sync(0xffffffffu, weight, idx & 31);
      ge[i] = idx < cnt ? (e & 7) : -1;
      vr[i] = idx < cnt ? LoadStream16(vb.Row(e >> 3)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kIn; ++i) {
      if (ge[i] < 0) continue;
      float vf[8];
      Unpack8<T>(vr[i], vf);
      // Every head's accumulator is updated (weight 0 or w): a branch on g == ge[i] would be
      // folded into acc[ge[i]], a run-time index that moves acc to local memory.
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float w = g == ge[i] ? wt[i] : 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(w, vf[e], acc[g][e]);
      }
    }
  }
}

// Diagnostics of one list of samples (entries as in GatherEntries, one per lane).
__device__ __forceinline__ void NoteEntry(const SantaLaunchParams& p, int entry, int64_t bh0,
                                          int tb0, uint32_t* map, int count = 1) {
  if (entry < 0) return;
  const int tok = entry >> 3;
  if (p.sample_counts != nullptr) {
    atomicAdd(p.sample_counts + (bh0 + (entry & 7)) * p.shape.max_seq_len + tok, count);
  }
  if (p.rows_read != nullptr) {
    const int r = tok - tb0;  // row within the batch's tiles
    atomicOr(map + r / 32, 1u << (r % 32));
  }
}

// Scores of tile [t0, t0 + len) for the G heads into sc[g * kTile + i] (log2 units; -inf past
// len) by one warp on the CUDA cores, straight from global memory.
template <typename T, int D, int G>
__device__ __forceinline__ void WarpScoreTile(const DecodeShape& s, int b, int kvh, int t0, int len,
                                              float* sc, int lane, int first = 0,
                                              int count = kTile) {
  constexpr int L = D / 8;
  constexpr int R = 32 / L;
  constexpr int U = G >= 8 ? 4 : 8;  // rows in flight per lane (register budget)
  const int row = lane / L, lr = lane % L;
  float qf[G][8];
  LoadQ<T, D, G>(s, b, kvh, lr, qf);
  const uint16_t* kb = KvHeadBase(s, false, b, kvh) + lr * 8;
  for (int base = first; base < first + count; base += R * U) {
    uint4 kr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int tok = base + u * R + row;
      kr[u] = tok < len ? LoadStream16(kb + static_cast<int64_t>(t0 + tok) * s.kv.token_stride)
                        : make_uint4(0, 0, 0, 0);
    }
    float part[G * U];
    PartialDots<T, G, U>(qf, kr, part);
    ReduceDots<G, U, L>(part, lr, [&](int g, int u, float v) {
      const int tok = base + u * R + row;
      sc[g * kTile + tok] = tok < len ? v : kNegInf;
    });
  }
}

// The samples of head g in tile t whose budget exceeds kRecMax, from the tile's rescored scores
// `pre` ([kTile] floats, log2 units; overwritten by their prefix sums): sample m lands on
// FirstAtLeast(m - a0); instead of placing the samples one by one, each lane counts how many land
// on each of its tokens (the same comparisons, so the same counts), and the distinct tokens go to
// list as items (count << 11) | (token - t0) << 3 | g. Returns the number of items (<= kTile) on
// every lane. One warp.
__device__ __forceinline__ int HeadItems(const SantaLaunchParams& p, int b, int h, int g, int t,
                                         int len, int budget, float* pre, int* list, int lane) {
  float m2, ell, u[kPerLane];
  HeadStats(pre, lane, m2, ell, u);
  __syncwarp();
  ell = WarpPrefix(u, lane, pre);
  __syncwarp();
  const float a0 = PhiloxUniform(SequenceStream(Seeds(p), RngTag::kPropTileOffset, b, h), t);
  const float inv_delta = static_cast<float>(budget) / ell;
  // Samples placed at or before token i: #{m in [1, budget] : m - a0 <= inv_delta * pre[i]}
  // (all of them from the last token on, as FirstAtLeast's fallback to len - 1).
  auto placed = [&](int i) -> int {
    if (i < 0) return 0;
    if (i >= len - 1) return budget;
    const float x = __fmul_rn(inv_delta, pre[i]);
    int m =
        static_cast<int>(fminf(fmaxf(floorf(__fadd_rn(x, a0)), 0.f), static_cast<float>(budget)));
    while (m < budget && __fsub_rn(static_cast<float>(m + 1), a0) <= x) ++m;
    while (m > 0 && __fsub_rn(static_cast<float>(m), a0) > x) --m;
    return m;
  };
  int cnt[kPerLane];
  int prev = placed(lane * kPerLane - 1);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int cum = placed(lane * kPerLane + i);
    cnt[i] = cum - prev;
    prev = cum;
  }
  int nz = 0;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) nz += cnt[i] > 0;
  int pos = WarpInclusiveSum(nz, lane);
  const int items = __shfl_sync(0xffffffffu, pos, 31);
  pos -= nz;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    if (cnt[i] > 0) list[pos++] = (cnt[i] << 11) | ((lane * kPerLane + i) << 3) | g;
  }
  __syncwarp();
  return items;
}

// Prop's big tiles: a tile where some head's budget exceeds kRecMax (the sink, the local window,
// a needle: peaked attention) is taken off pass 2 and done here, one block per tile: the block's
// warps rescore the tile's 256 tokens for the G heads together (32 tokens each), then warp g
// takes head g (its record when its budget is small, its rescored samples otherwise) and adds
// the count-weighted V rows of its distinct tokens to the accumulator. The budget kernel lists
// the big tiles of each (b, kv head). Runs between the budget kernel and pass 2 (which skips
// these tiles and writes the output).
constexpr int kBigWarps = 8;  // kBigWarps * 32 tokens = one tile

template <typename T, int D, int G>
__global__ void __launch_bounds__(kBigWarps * 32, 1)
    PropBigTileKernel(SantaLaunchParams p, int max_tiles, int max_big,
                      const uint8_t* __restrict__ rec, const int* __restrict__ s_tiles,
                      const int* __restrict__ big_count, const int* __restrict__ big_list,
                      float* __restrict__ accum) {
  static_assert(kBigWarps * 32 == kTile && G <= kBigWarps, "one token per thread, a warp a head");
  constexpr int L = D / 8;
  __shared__ __align__(16) float sc[G * kTile];
  __shared__ int lists[G][kTile];
  __shared__ uint32_t tile_map[kTile / 32];
  const DecodeShape& s = p.shape;
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, row = lane / L;
  GridDependencyWait();  // budgets and the list of big tiles
  const int pair = b * s.num_kv_heads + kvh;
  const int count = min(big_count[pair], max_big);
  const int n = s.seq_lens[b];
  const int64_t bh0 = static_cast<int64_t>(b) * s.num_q_heads + kvh * G;
  const RowReader vr = MakeRowReader(s, true, b, kvh, (lane % L) * 8);
  for (int i = blockIdx.x; i < count; i += gridDim.x) {  // uniform over the block
    const int t = big_list[static_cast<int64_t>(pair) * max_big + i];
    const int t0 = t * kTile, len = min(kTile, n - t0);
    if (threadIdx.x < kTile / 32) tile_map[threadIdx.x] = 0u;
    WarpScoreTile<T, D, G>(s, b, kvh, t0, len, sc, lane, warp * 32, 32);
    __syncthreads();
    if (warp < G) {
      const int g = warp;
      const int st = s_tiles[(bh0 + g) * max_tiles + t];
      int* list = lists[g];
      int total = 0;
      if (st > kRecMax) {
        total = HeadItems(p, b, kvh * G + g, g, t, len, st, sc + g * kTile, list, lane);
      } else if (st > 0) {  // the pass-1 record of a small budget, as pass 2 would read it
        const uint8_t* r = rec + ((bh0 + g) * max_tiles + t) * kRecBytes + st * (st - 1) / 2;
        if (lane < st) list[lane] = (1 << 11) | (__ldg(r + lane) << 3) | g;
        __syncwarp();
        total = st;
      }
      float acc[1][8] = {};
      for (int c0 = 0; c0 < total; c0 += 32) {
        const int item = c0 + lane < total ? list[c0 + lane] : -1;
        const int tok = (item >> 3) & 255;
        if (item >= 0) {
          atomicOr(tile_map + tok / 32, 1u << (tok % 32));
          if (p.sample_counts != nullptr) {
            atomicAdd(p.sample_counts + (bh0 + g) * s.max_seq_len + t0 + tok, item >> 11);
          }
        }
        GatherEntries<T, D, 1>(item < 0 ? -1 : (t0 + tok) << 3, min(32, total - c0), vr, row, acc,
                               item < 0 ? 0.f : static_cast<float>(item >> 11));
      }
#pragma unroll
      for (int o = L; o < 32; o *= 2) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[0][e] += __shfl_xor_sync(0xffffffffu, acc[0][e], o);
      }
      if (lane < L && total > 0) {
#pragma unroll
        for (int e = 0; e < 8; ++e) atomicAdd(accum + (bh0 + g) * D + lane * 8 + e, acc[0][e]);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0 && p.rows_read != nullptr) {
      int rows = 0;
      for (int w = 0; w < kTile / 32; ++w) rows += __popc(tile_map[w]);
      atomicAdd(p.rows_read + pair, rows);
    }
    __syncthreads();  // scores, lists and the map are reused by the next tile
  }
}

template <typename T, int D, int G>
__global__ void __launch_bounds__(kPass2Warps * 32, G >= 8 ? 2 : 3)
    PropPass2Kernel(SantaLaunchParams p, int max_tiles, int num_parts, int nb,
                    const uint8_t* __restrict__ rec, const int* __restrict__ s_tiles,
                    float* __restrict__ accum, unsigned* __restrict__ counters) {
  using Geo = Pass2Geom<D, G>;
  constexpr int NW = kPass2Warps;
  constexpr int L = D / 8;
  extern __shared__ __align__(16) float dsm[];
  __shared__ bool sm_last;
  const DecodeShape& s = p.shape;
  const int kvh = blockIdx.x, blk = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = lane / L;
  int* list = reinterpret_cast<int*>(dsm + warp * Geo::kWarpFloats);
  uint32_t* map = reinterpret_cast<uint32_t*>(list + Geo::kList);
  const int64_t bh0 = static_cast<int64_t>(b) * s.num_q_heads + kvh * G;
  const RowReader vr = MakeRowReader(s, true, b, kvh, (lane % L) * 8);
  float acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
  }
  GridDependencyWait();
  const int n = s.seq_lens[b];
  const int num_tiles = (n + kTile - 1) / kTile;
  const int num_batches = (num_tiles + nb - 1) / nb;
  const int my_g = lane % G;
  for (int bi = blk * NW + warp; bi < num_batches; bi += num_parts * NW) {
    const int t = bi * nb + lane / G;
    const int64_t bh = bh0 + my_g;
    const int st = (lane / G < nb && t < num_tiles) ? s_tiles[bh * max_tiles + t] : 0;
    if (__ballot_sync(0xffffffffu, st != 0) == 0) continue;  // uniform over the warp
    const int tb0 = bi * nb * kTile;
    if (p.rows_read != nullptr) {
      for (int i = lane; i < Geo::kMapWords; i += 32) map[i] = 0u;
      __syncwarp();
    }
    // Tiles where a head's budget exceeds kRecMax are PropBigTileKernel's, for every head.
    const unsigned big = __ballot_sync(0xffffffffu, st > kRecMax);
    const bool tile_big = ((big >> ((lane / G) * G)) & ((1u << G) - 1u)) != 0u;
    const int k = st <= kRecMax && !tile_big ? st : 0;
    const uint8_t* r = rec + (bh * max_tiles + t) * kRecBytes + k * (k - 1) / 2;
    int toks[kRecMax];
#pragma unroll
    for (int j = 0; j < kRecMax; ++j) toks[j] = j < k ? __ldg(r + j) : 0;
    int pos = WarpInclusiveSum(k, lane);
    const int total = __shfl_sync(0xffffffffu, pos, 31);
    pos -= k;
#pragma unroll
    for (int j = 0; j < kRecMax; ++j) {
      if (j < k) list[pos + j] = ((t * kTile + toks[j]) << 3) | my_g;
    }
    __syncwarp();
    for (int c0 = 0; c0 < total; c0 += 32) {
      const int entry = c0 + lane < total ? list[c0 + lane] : -1;
      NoteEntry(p, entry, bh0, tb0, map);
      GatherEntries<T, D, G>(entry, min(32, total - c0), vr, row, acc);
    }
    if (p.rows_read != nullptr) {
      __syncwarp();
      int rows = 0;
      for (int i = lane; i < Geo::kMapWords; i += 32) rows += __popc(map[i]);
#pragma unroll
      for (int o = 16; o > 0; o /= 2) rows += __shfl_xor_sync(0xffffffffu, rows, o);
      if (lane == 0) atomicAdd(p.rows_read + b * s.num_kv_heads + kvh, rows);
      __syncwarp();
    }
    __syncwarp();  // the list is rewritten by the next batch
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
    IidSampleKernel(SantaLaunchParams p, int max_tiles, const float* __restrict__ m_tiles,
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
  const PhiloxStream rng = SequenceStream(Seeds(p), RngTag::kSantaIid, b, h);
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
  const RowReader vr = MakeRowReader(s, true, b, h / G, lr * 8);
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int i0 = warp * R + row; i0 < p.num_samples; i0 += NW * R * 4) {
    uint4 vrow[4];
    int ti[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int i = i0 + k * NW * R;
      ti[k] = i < p.num_samples ? sidx[i] : -1;
      vrow[k] = ti[k] >= 0 ? LoadStream16(vr.Row(ti[k])) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float vf[8];
      Unpack8<T>(vrow[k], vf);
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

struct IidSpace {
  float* m_tiles;  // [B, H, T_max]
  float* l_tiles;  // [B, H, T_max]
  float* stash;    // [B, H, T_max * kTile]
};

IidSpace CarveIid(const DecodeShape& s, const TilePlan& plan, void* base, size_t* bytes) {
  const size_t bh = static_cast<size_t>(s.batch) * s.num_q_heads;
  Carver c(base);
  IidSpace r;
  r.m_tiles = c.Take<float>(bh * plan.max_tiles);
  r.l_tiles = c.Take<float>(bh * plan.max_tiles);
  r.stash = c.Take<float>(bh * plan.max_tiles * kTile);
  *bytes = c.used();
  return r;
}

struct PropSpace {
  float* m_tiles;      // [B, H, T_max]
  float* l_tiles;      // [B, H, T_max]
  uint8_t* records;    // [B, H, T_max, kRecBytes]
  int* s_tiles;        // [B, H, T_max]
  float* accum;        // [B, H, d]
  unsigned* counters;  // [B, Hkv]
  // Big tiles (PropBigTileKernel): counts [B, Hkv] and the tile bitmap [B, Hkv, map_words]
  // (adjacent: zeroed together by pass 1), the list [B, Hkv, max_big].
  int* big_count;
  uint32_t* big_map;
  int* big_list;
  size_t big_zero_bytes;
};

// Most big tiles of one (b, kv head): each has a head with a budget of 8 or more, so at most
// G * S / 8, and at most the number of tiles.
int MaxBigTiles(const SantaLaunchParams& p, const TilePlan& plan) {
  return static_cast<int>(std::min<int64_t>(
      plan.max_tiles,
      static_cast<int64_t>(p.shape.group_size()) * (p.num_samples / (kRecMax + 1))));
}

PropSpace CarveProp(const SantaLaunchParams& p, const TilePlan& plan, void* base, size_t* bytes) {
  const DecodeShape& s = p.shape;
  const size_t bh = static_cast<size_t>(s.batch) * s.num_q_heads;
  const size_t pairs = static_cast<size_t>(s.batch) * s.num_kv_heads;
  Carver c(base);
  PropSpace r;
  r.m_tiles = c.Take<float>(bh * plan.max_tiles);
  r.l_tiles = c.Take<float>(bh * plan.max_tiles);
  r.records = c.Take<uint8_t>(bh * plan.max_tiles * kRecBytes);
  r.s_tiles = c.Take<int>(bh * plan.max_tiles);
  r.accum = c.Take<float>(bh * s.head_dim);
  r.counters = c.Take<unsigned>(pairs);
  const size_t map_words = (plan.max_tiles + 31) / 32;
  const size_t zero_from = c.used();
  r.big_count = c.Take<int>(pairs);
  r.big_map = c.Take<uint32_t>(pairs * map_words);
  r.big_zero_bytes = c.used() - zero_from;
  r.big_list = c.Take<int>(pairs * std::max(1, MaxBigTiles(p, plan)));
  *bytes = c.used();
  return r;
}

template <Pass1Out kOut>
struct Pass1Launch {
  const DecodeShape& s;
  SeedSource seed;
  TilePlan plan;
  float* m_tiles;
  float* l_tiles;
  void* out;
  cudaStream_t stream;
  int* zero = nullptr;  // zeroed by the first block (ints; for the kernels that follow)
  int zero_words = 0;
  template <typename T, int D, int G>
  cudaError_t operator()() const {
    const dim3 grid(s.num_kv_heads, plan.num_parts, s.batch);
    using Cfg = Pass1Cfg<D, G>;
    return LaunchWithSmem(&Pass1Kernel<T, D, G, kOut>, grid, dim3(Cfg::kThreads), Cfg::kSmem,
                          stream, s, seed, plan.tiles_per_block, plan.max_tiles, m_tiles, l_tiles,
                          out, zero, zero_words);
  }
};

struct Pass2Launch {
  const SantaLaunchParams& p;
  TilePlan plan;
  PropSpace ws;
  cudaStream_t stream;
  template <typename T, int D, int G>
  cudaError_t operator()() const {
    constexpr int NW = kPass2Warps;
    const int64_t pairs =
        std::max<int64_t>(1, static_cast<int64_t>(p.shape.batch) * p.shape.num_kv_heads);
    // Tiles per warp batch: halved until there are about four warp batches per multiprocessor
    // (each batch is a short chain of dependent loads, so small problems want many of them).
    int nb = Pass2Geom<D, G>::kNB;
    while (nb > 1 && pairs * ((plan.max_tiles + nb - 1) / nb) < int64_t{NumSms()} * 4) nb /= 2;
    const int64_t slots = static_cast<int64_t>(NumSms()) * 8;
    const int64_t batches = (plan.max_tiles + nb - 1) / nb;
    const int parts = static_cast<int>(
        std::max<int64_t>(1, std::min<int64_t>((batches + NW - 1) / NW, slots / pairs)));
    const dim3 grid(p.shape.num_kv_heads, parts, p.shape.batch);
    constexpr size_t kSmem = Pass2Geom<D, G>::kSmem;
    auto* kernel = &PropPass2Kernel<T, D, G>;
    KVSPARSE_CUDA_RETURN_IF_ERROR(
        SetMaxDynamicSmem(reinterpret_cast<const void*>(kernel), int{kSmem}));
    return LaunchDependent(kernel, grid, dim3(NW * 32), kSmem, stream, p, plan.max_tiles, parts, nb,
                           static_cast<const uint8_t*>(ws.records),
                           static_cast<const int*>(ws.s_tiles), ws.accum, ws.counters);
  }
};

struct IidLaunch {
  const SantaLaunchParams& p;
  int max_tiles;
  IidSpace ws;
  cudaStream_t stream;
  template <typename T, int D, int G>
  cudaError_t operator()() const {
    const size_t smem = (static_cast<size_t>(max_tiles) + 4) * sizeof(double) +
                        (static_cast<size_t>(p.num_samples) + 4) * sizeof(int);
    if (smem > 200 * 1024) return cudaErrorInvalidValue;
    return LaunchWithSmem(&IidSampleKernel<T, D>, dim3(p.shape.batch * p.shape.num_q_heads),
                          dim3(kSmallThreads), smem, stream, p, max_tiles, ws.m_tiles, ws.l_tiles,
                          ws.stash);
  }
};

struct FlashLaunch {
  const SantaLaunchParams& p;
  TilePlan plan;
  float* part_o;
  float* part_lse;
  cudaStream_t stream;
  template <typename T, int D, int G>
  cudaError_t operator()() const {
    const DecodeShape& s = p.shape;
    const dim3 grid(s.num_kv_heads, plan.num_parts, s.batch);
    constexpr size_t kSmem = ScoreStageBytes<TileCfg<D, G>::kWarps, kFlashBufs>();
    KVSPARSE_CUDA_RETURN_IF_ERROR(
        LaunchWithSmem(&FlashKernel<T, D, G>, grid, dim3(TileCfg<D, G>::kThreads), kSmem, stream, p,
                       plan.tiles_per_block, plan.num_parts, part_o, part_lse));
    return MergeSplits(part_o, part_lse, s.batch * s.num_q_heads, plan.num_parts, D, s.dtype, s.out,
                       stream);
  }
};

cudaError_t LaunchBudget(const SantaLaunchParams& p, const TilePlan& plan, const PropSpace& ws,
                         cudaStream_t stream) {
  const dim3 grid(p.shape.batch * p.shape.num_q_heads);
  return LaunchDependent(&PropBudgetKernel, grid, dim3(kSmallThreads), 0, stream, p.shape, Seeds(p),
                         p.num_samples, plan.max_tiles, static_cast<const float*>(ws.m_tiles),
                         static_cast<const float*>(ws.l_tiles), ws.s_tiles, ws.accum, ws.counters,
                         MaxBigTiles(p, plan), ws.big_count, ws.big_map, ws.big_list);
}

struct BigTileLaunch {
  const SantaLaunchParams& p;
  TilePlan plan;
  PropSpace ws;
  cudaStream_t stream;
  template <typename T, int D, int G>
  cudaError_t operator()() const {
    const int max_big = MaxBigTiles(p, plan);
    // Blocks per (b, kv head): a few big tiles each, in a grid-stride loop over the list.
    const dim3 grid(std::max(1, std::min(max_big, 8)), p.shape.num_kv_heads, p.shape.batch);
    return LaunchDependent(
        &PropBigTileKernel<T, D, G>, grid, dim3(kBigWarps * 32), 0, stream, p, plan.max_tiles,
        max_big, static_cast<const uint8_t*>(ws.records), static_cast<const int*>(ws.s_tiles),
        static_cast<const int*>(ws.big_count), static_cast<const int*>(ws.big_list), ws.accum);
  }
};

// ---------------------------------------------------------------------------------------------
// Sampled rows: marks -> ascending token lists, one block per (b, kv head).
constexpr int kListThreads = 512;

__global__ void MarkIndicesKernel(SampledRowsParams p, int32_t* marks) {
  const int64_t total = static_cast<int64_t>(p.batch) * p.num_q_heads * p.num_samples;
  const int G = p.num_q_heads / p.num_kv_heads;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t bh = i / p.num_samples;
    const int b = static_cast<int>(bh / p.num_q_heads), h = static_cast<int>(bh % p.num_q_heads);
    const int tok = p.indices[i];
    if (tok >= 0 && tok < p.max_seq_len) {
      marks[(static_cast<int64_t>(b) * p.num_kv_heads + h / G) * p.max_seq_len + tok] = 1;
    }
  }
}

// marks of (b, j): `per` rows of max_seq_len (the group's heads, or one).
__global__ void __launch_bounds__(kListThreads)
    ListMarkedKernel(SampledRowsParams p, const int32_t* __restrict__ marks, int per) {
  __shared__ int wcount[kListThreads / 32];
  const int i = blockIdx.x, b = i / p.num_kv_heads;
  const int n = min(p.seq_lens[b], p.max_seq_len);
  const int32_t* m = marks + static_cast<int64_t>(i) * per * p.max_seq_len;
  int32_t* out = p.tokens + static_cast<int64_t>(i) * p.max_seq_len;
  int written = 0;
  for (int t0 = 0; t0 < n; t0 += blockDim.x) {
    const int t = t0 + threadIdx.x;
    bool keep = false;
    for (int g = 0; g < per && t < n; ++g)
      keep |= m[static_cast<int64_t>(g) * p.max_seq_len + t] > 0;
    written += BlockCompactRound<kListThreads / 32>(keep, t, out, written, wcount);
  }
  if (threadIdx.x == 0) p.counts[i] = written;
}

}  // namespace

size_t SampledRowsWorkspaceBytes(const SampledRowsParams& p) {
  if (p.num_samples <= 0) return 0;  // from sample_counts: no workspace
  return AlignUp(sizeof(int32_t) * p.batch * p.num_kv_heads * static_cast<size_t>(p.max_seq_len),
                 256);
}

cudaError_t SampledRows(const SampledRowsParams& p, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream) {
  if (p.batch < 0 || p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0 ||
      p.max_seq_len < 0 || (p.sample_counts == nullptr) == (p.indices == nullptr) ||
      (p.indices != nullptr) != (p.num_samples > 0)) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0) return cudaSuccess;
  if (p.seq_lens == nullptr || p.tokens == nullptr || p.counts == nullptr ||
      workspace_bytes < SampledRowsWorkspaceBytes(p)) {
    return cudaErrorInvalidValue;
  }
  const unsigned lists = static_cast<unsigned>(p.batch) * p.num_kv_heads;
  const int32_t* marks = p.sample_counts;
  int per = p.num_q_heads / p.num_kv_heads;
  if (p.indices != nullptr) {
    if (workspace == nullptr) return cudaErrorInvalidValue;
    KVSPARSE_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(workspace, 0, SampledRowsWorkspaceBytes(p), stream));
    const int64_t total = static_cast<int64_t>(p.batch) * p.num_q_heads * p.num_samples;
    const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 4096));
    MarkIndicesKernel<<<blocks, 256, 0, stream>>>(p, static_cast<int32_t*>(workspace));
    KVSPARSE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    marks = static_cast<const int32_t*>(workspace);
    per = 1;
  }
  ListMarkedKernel<<<lists, kListThreads, 0, stream>>>(p, marks, per);
  return cudaGetLastError();
}

size_t SantaIidWorkspaceBytes(const SantaLaunchParams& p) {
  size_t bytes = 0;
  CarveIid(p.shape, MakeTilePlan(p.shape), nullptr, &bytes);
  return bytes;
}

cudaError_t SantaIid(const SantaLaunchParams& p, void* workspace, size_t workspace_bytes,
                     cudaStream_t stream) {
  KVSPARSE_CUDA_RETURN_IF_ERROR(ValidateSanta(p));
  if (p.shape.batch == 0) return cudaSuccess;
  const TilePlan plan = MakeTilePlan(p.shape);
  size_t need = 0;
  const IidSpace ws = CarveIid(p.shape, plan, workspace, &need);
  if (workspace == nullptr || workspace_bytes < need) return cudaErrorInvalidValue;
  const DecodeShape& s = p.shape;
  KVSPARSE_CUDA_RETURN_IF_ERROR(DispatchDecode(
      s.dtype, s.head_dim, s.group_size(),
      Pass1Launch<Pass1Out::kStash>{s, Seeds(p), plan, ws.m_tiles, ws.l_tiles, ws.stash, stream}));
  return DispatchDecode(s.dtype, s.head_dim, s.group_size(),
                        IidLaunch{p, plan.max_tiles, ws, stream});
}

size_t S2antaPropWorkspaceBytes(const SantaLaunchParams& p) {
  size_t bytes = 0;
  CarveProp(p, MakeTilePlan(p.shape), nullptr, &bytes);
  return bytes;
}

cudaError_t S2antaProp(const SantaLaunchParams& p, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream) {
  KVSPARSE_CUDA_RETURN_IF_ERROR(ValidateSanta(p));
  if (p.shape.batch == 0) return cudaSuccess;
  const TilePlan plan = MakeTilePlan(p.shape);
  size_t need = 0;
  const PropSpace ws = CarveProp(p, plan, workspace, &need);
  if (workspace == nullptr || workspace_bytes < need) return cudaErrorInvalidValue;
  const DecodeShape& s = p.shape;
  const bool bigs = MaxBigTiles(p, plan) > 0;
  // Pass 1 zeroes the big-tile counts and bitmap (one launch fewer than a memset).
  KVSPARSE_CUDA_RETURN_IF_ERROR(
      DispatchDecode(s.dtype, s.head_dim, s.group_size(),
                     Pass1Launch<Pass1Out::kRecords>{
                         s, Seeds(p), plan, ws.m_tiles, ws.l_tiles, ws.records, stream,
                         bigs ? ws.big_count : nullptr,
                         bigs ? static_cast<int>(ws.big_zero_bytes / sizeof(int)) : 0}));
  KVSPARSE_CUDA_RETURN_IF_ERROR(LaunchBudget(p, plan, ws, stream));
  if (bigs) {
    KVSPARSE_CUDA_RETURN_IF_ERROR(
        DispatchDecode(s.dtype, s.head_dim, s.group_size(), BigTileLaunch{p, plan, ws, stream}));
  }
  return DispatchDecode(s.dtype, s.head_dim, s.group_size(), Pass2Launch{p, plan, ws, stream});
}

size_t S2antaFlashWorkspaceBytes(const SantaLaunchParams& p) {
  const TilePlan plan = MakeTilePlan(p.shape);
  if (plan.num_parts <= 1) return 0;
  const size_t rows = static_cast<size_t>(p.shape.batch) * p.shape.num_q_heads * plan.num_parts;
  return AlignUp(rows * p.shape.head_dim * sizeof(float), 256) + AlignUp(rows * sizeof(float), 256);
}

cudaError_t S2antaFlash(const SantaLaunchParams& p, void* workspace, size_t workspace_bytes,
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
