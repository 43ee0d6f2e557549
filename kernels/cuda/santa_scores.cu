#include <algorithm>
#include <cmath>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/santa_scores.h"
#include "kernels/philox.h"
#include "kernels/santa.h"

namespace kvsparse::kernels::cuda {
namespace {

// The sampler runs in four launches, each spread over every (sequence, head) and tile so that a
// batch of one keeps the device busy. The statistics are the CPU reference's quantities; its
// floating-point sums run in a fixed parallel order of their own (the same result every call, and
// the CPU's to rounding), so that no sum waits on one lane:
//   TileStats  a warp per tile: m_t (a max: any order), then ell_t as each lane's strided sum
//              (tokens lane, lane + 32, ...) combined by a butterfly;
//   Budgets    a block per (b, h): m*, W_t side by side, Z (double) as each thread's strided sum
//              combined by a block reduction, the fixed-point quotas side by side and their
//              prefix sums (integers: any order), the budgets, and where each budgeted tile may
//              write its rows (at most S_t + 1 of them);
//   Sample     a warp per budgeted tile (Budgets lists them): each lane owns a run of consecutive
//              tokens, the x_n and their running sum there, the lanes' totals by a warp scan;
//              the counts side by side and the rows ranked by a warp scan of each lane's hits;
//   Compact    a block per (b, h): the tiles' rows ascending into the outputs.
constexpr int kWarps = 8;  // tiles per block of TileStats and Sample
constexpr int kTileThreads = 32 * kWarps;
constexpr int kMaxTile = 512;               // tokens per tile
constexpr int kPerLaneMax = kMaxTile / 32;  // a tile's tokens a lane holds in registers
constexpr int kScanThreads = 256;
constexpr float kLog2E = 1.4426950408889634f;

struct Workspace {
  float* tile_max;                // [B * H, T_max]
  float* tile_sum;                // [B * H, T_max]
  float* weight;                  // [B * H, T_max]: W_t
  unsigned long long* quota_cum;  // [B * H, T_max]
  int32_t* budget;                // [B * H, T_max]
  int32_t* slot;                  // [B * H, T_max]: the tile's first row in the staging rows
  int32_t* emitted;               // [B * H, T_max]: rows the tile sampled
  int32_t* budgeted;              // [B * H, S + 1]: the budgeted tiles, ascending
  int32_t* budgeted_count;        // [B * H]
  int32_t* rows;                  // [B * H, RowsPerHead]: staged tokens
  float* row_weight;              // [B * H, RowsPerHead]: their log2 weights
  int32_t* row_count;             // [B * H, RowsPerHead]: their draws
};

__host__ __device__ inline int32_t MaxTiles(const PropFromScoresParams& p) {
  return (p.max_seq_len + p.tile_size - 1) / p.tile_size;
}
// Staged rows per (b, h): each budgeted tile holds at most S_t + 1 (systematic rounding inside a
// tile hands out at most one draw more than its budget) and the budgets sum to at most S + 1.
__host__ __device__ inline int64_t RowsPerHead(const PropFromScoresParams& p) {
  return static_cast<int64_t>(p.num_samples) + 2 + MaxTiles(p);
}

template <typename T>
T* Take(char*& c, size_t count) {
  T* out = reinterpret_cast<T*>(c);
  c += AlignUp(count * sizeof(T), 256);
  return out;
}

Workspace Carve(const PropFromScoresParams& p, void* ws) {
  const size_t bh = static_cast<size_t>(p.batch) * p.num_q_heads;
  const size_t cells = bh * MaxTiles(p);
  char* c = static_cast<char*>(ws);
  Workspace w;
  w.tile_max = Take<float>(c, cells);
  w.tile_sum = Take<float>(c, cells);
  w.weight = Take<float>(c, cells);
  w.quota_cum = Take<unsigned long long>(c, cells);
  w.budget = Take<int32_t>(c, cells);
  w.slot = Take<int32_t>(c, cells);
  w.emitted = Take<int32_t>(c, cells);
  w.budgeted = Take<int32_t>(c, bh * (p.num_samples + 1));
  w.budgeted_count = Take<int32_t>(c, bh);
  w.rows = Take<int32_t>(c, bh * RowsPerHead(p));
  w.row_weight = Take<float>(c, bh * RowsPerHead(p));
  w.row_count = Take<int32_t>(c, bh * RowsPerHead(p));
  return w;
}

size_t WorkspaceBytes(const PropFromScoresParams& p) {
  const size_t bh = static_cast<size_t>(p.batch) * p.num_q_heads;
  const size_t cells = bh * MaxTiles(p), rows = bh * RowsPerHead(p);
  return 3 * AlignUp(cells * sizeof(float), 256) +
         AlignUp(cells * sizeof(unsigned long long), 256) +
         3 * AlignUp(cells * sizeof(int32_t), 256) +
         AlignUp(bh * (p.num_samples + 1) * sizeof(int32_t), 256) +
         AlignUp(bh * sizeof(int32_t), 256) + 2 * AlignUp(rows * sizeof(int32_t), 256) +
         AlignUp(rows * sizeof(float), 256);
}

struct Head {
  int64_t bh;
  int b, h, kvh, n, tiles;
};
__device__ __forceinline__ Head HeadOf(const PropFromScoresParams& p, int64_t bh) {
  Head x;
  x.bh = bh;
  x.b = static_cast<int>(bh / p.num_q_heads);
  x.h = static_cast<int>(bh % p.num_q_heads);
  x.kvh = x.h / (p.num_q_heads / p.num_kv_heads);
  x.n = p.seq_lens[x.b];
  x.tiles = (x.n + p.tile_size - 1) / p.tile_size;
  return x;
}

// A warp per tile (blockIdx.y: the head): m_t over the tile's tokens, u_n = e^{s_n - m_t} and
// ell_t their sum (kernels/santa.cc, TileStatistics): lane l holds tokens l, l + 32, ... (one
// coalesced load each, all issued together), adds its u ascending, and a butterfly adds the
// lanes' sums. An empty (all -inf) tile has no mass.
__global__ void __launch_bounds__(kTileThreads)
    TileStatsKernel(PropFromScoresParams p, Workspace w, int32_t t_max) {
  GridDependencyWait();  // LaunchDependent: the earlier kernels' writes first
  const Head x = HeadOf(p, blockIdx.y);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = blockIdx.x * kWarps + warp;
  if (t >= x.tiles) return;
  const int lo = t * p.tile_size, hi = min(x.n, lo + p.tile_size);
  const float* s = p.scores + x.bh * p.score_stride;
  float v[kPerLaneMax];
  float m = -INFINITY;
#pragma unroll
  for (int k = 0; k < kPerLaneMax; ++k) {
    const int i = lo + lane + 32 * k;
    v[k] = i < hi ? s[i] : -INFINITY;
    m = fmaxf(m, v[k]);
  }
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float l = 0.f;
  if (m != -INFINITY) {
#pragma unroll
    for (int k = 0; k < kPerLaneMax; ++k)
      l = __fadd_rn(l, v[k] == -INFINITY ? 0.f : expf(v[k] - m));
    for (int o = 16; o > 0; o >>= 1) l = __fadd_rn(l, __shfl_xor_sync(0xffffffffu, l, o));
  }
  if (lane == 0) {
    w.tile_max[x.bh * t_max + t] = m;
    w.tile_sum[x.bh * t_max + t] = l;
  }
}

// The budget S of each query head row x serves.
__device__ __forceinline__ void WriteBudgets(const PropFromScoresParams& p, const Head& x) {
  if (p.budgets == nullptr) return;
  for (int i = 0; i < p.heads_per_row; ++i) {
    p.budgets[x.bh * p.heads_per_row + i] = x.n > 0 ? p.num_samples : 0;
  }
}

struct FMax {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Inclusive prefix sums of v[0, count) in place, the block's threads over chunks of kScanThreads.
template <typename T, typename Scan>
__device__ void BlockInclusiveSum(T* v, int count, typename Scan::TempStorage& tmp) {
  T carry = 0;
  for (int base = 0; base < count; base += kScanThreads) {
    const int i = base + static_cast<int>(threadIdx.x);
    T x = i < count ? v[i] : T(0);
    T total;
    Scan(tmp).InclusiveSum(x, x, total);
    if (i < count) v[i] = x + carry;
    carry += total;
    __syncthreads();  // the temp storage is reused by the next chunk
  }
}

// A block per (b, h): the budgets S_t of prop allocation (kernels/santa.cc, PlanSantaHead and
// PropTileBudgets) and where each budgeted tile stages its rows.
__global__ void __launch_bounds__(kScanThreads)
    BudgetsKernel(PropFromScoresParams p, Workspace w, int32_t t_max) {
  GridDependencyWait();  // LaunchDependent: the earlier kernels' writes first
  using ScanU = cub::BlockScan<unsigned long long, kScanThreads>;
  using ScanI = cub::BlockScan<int32_t, kScanThreads>;
  using MaxR = cub::BlockReduce<float, kScanThreads>;
  using SumD = cub::BlockReduce<double, kScanThreads>;
  __shared__ union {
    typename ScanU::TempStorage u;
    typename ScanI::TempStorage i;
    typename MaxR::TempStorage m;
    typename SumD::TempStorage d;
  } tmp;
  __shared__ float mstar_s;
  __shared__ double z_s;
  __shared__ unsigned long long off_s;
  const Head x = HeadOf(p, blockIdx.x);
  const int tid = threadIdx.x;
  const float* tmax = w.tile_max + x.bh * t_max;
  const float* tsum = w.tile_sum + x.bh * t_max;
  float* wt = w.weight + x.bh * t_max;
  unsigned long long* qcum = w.quota_cum + x.bh * t_max;
  int32_t* bud = w.budget + x.bh * t_max;
  int32_t* slot = w.slot + x.bh * t_max;
  float m = -INFINITY;
  for (int t = tid; t < x.tiles; t += kScanThreads) m = fmaxf(m, tmax[t]);
  m = MaxR(tmp.m).Reduce(m, FMax());
  if (tid == 0) mstar_s = m;
  __syncthreads();
  const float mstar = mstar_s;
  int32_t* emitted = w.emitted + x.bh * t_max;
  if (mstar == -INFINITY) {  // no mass anywhere (or no tokens): no samples
    for (int t = tid; t < x.tiles; t += kScanThreads) {
      bud[t] = 0;
      slot[t] = 0;
      emitted[t] = 0;
    }
    if (tid == 0) {
      w.budgeted_count[x.bh] = 0;
      WriteBudgets(p, x);
    }
    return;
  }
  double zpart = 0.0;  // this thread's tiles' W_t, ascending; the block's sum below
  for (int t = tid; t < x.tiles; t += kScanThreads) {
    const float v = __fmul_rn(expf(tmax[t] - mstar), tsum[t]);
    wt[t] = v;
    emitted[t] = 0;  // Sample writes the budgeted tiles'
    zpart += static_cast<double>(v);
  }
  const double z_block = SumD(tmp.d).Sum(zpart);  // valid in thread 0
  if (tid == 0) {
    z_s = z_block;
    const SeedSource seeds{p.seed, p.seeds};
    const float u = SequenceStream(seeds, RngTag::kPropRounding, x.b, x.kvh).Uniform(0);
    off_s = static_cast<unsigned long long>(static_cast<double>(u) * kPropFixedOne);
  }
  __syncthreads();
  const double z = z_s;
  for (int t = tid; t < x.tiles; t += kScanThreads) {
    const double q = static_cast<double>(p.num_samples) * (static_cast<double>(wt[t]) / z);
    qcum[t] = static_cast<unsigned long long>(llround(q * kPropFixedOne));
  }
  __syncthreads();
  BlockInclusiveSum<unsigned long long, ScanU>(qcum, x.tiles, tmp.u);
  const unsigned long long off = off_s;
  for (int t = tid; t < x.tiles; t += kScanThreads) {
    const unsigned long long before = ((t == 0 ? 0ull : qcum[t - 1]) + off) >> 32;
    const int32_t b = static_cast<int32_t>(((qcum[t] + off) >> 32) - before);
    bud[t] = b;
    slot[t] = b > 0 ? b + 1 : 0;  // rows the tile may stage; made offsets below
  }
  __syncthreads();
  BlockInclusiveSum<int32_t, ScanI>(slot, x.tiles, tmp.i);
  // The budgeted tiles, ascending (at most S + 1: the budgets sum to S or S + 1), for Sample.
  int32_t* list = w.budgeted + x.bh * (p.num_samples + 1);
  int32_t carry = 0;
  for (int t0 = 0; t0 < x.tiles; t0 += kScanThreads) {
    const int t = t0 + tid;
    const int32_t has = t < x.tiles && bud[t] > 0 ? 1 : 0;
    if (t < x.tiles) slot[t] -= has ? bud[t] + 1 : 0;  // inclusive -> exclusive
    int32_t at = 0, total = 0;
    ScanI(tmp.i).ExclusiveSum(has, at, total);
    if (has && carry + at <= p.num_samples) list[carry + at] = t;
    carry += total;
    __syncthreads();
  }
  if (tid == 0) {
    w.budgeted_count[x.bh] = min(carry, p.num_samples + 1);
    WriteBudgets(p, x);
  }
}

// A warp per tile (blockIdx.y: the head): systematic sampling inside a budgeted tile
// (kernels/santa.cc, SystematicTile). Lane l owns the run of `per` consecutive tokens from
// l * per: their x_n, its running sum from a warp scan of the lanes' totals (p_n, the sum of x
// before n), each token's f0 = a0 + p_n, f1 = f0 + x_n and count c = floor(f1) - floor(f0); the
// rows with c > 0 staged ascending at the tile's slot (ranked by a warp scan of each lane's hits)
// with their ratio log-weights.
__global__ void __launch_bounds__(kTileThreads)
    SampleKernel(PropFromScoresParams p, Workspace w, int32_t t_max) {
  GridDependencyWait();  // LaunchDependent: the earlier kernels' writes first
  const Head x = HeadOf(p, blockIdx.y);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int k = blockIdx.x * kWarps + warp;  // the head's k-th budgeted tile
  if (k >= w.budgeted_count[x.bh]) return;
  const int t = w.budgeted[x.bh * (p.num_samples + 1) + k];
  const int64_t cell = x.bh * t_max + t;
  const int32_t bud = w.budget[cell];
  const int lo = t * p.tile_size, len = min(x.n, lo + p.tile_size) - lo;
  const float* s = p.scores + x.bh * p.score_stride + lo;
  const float mt = w.tile_max[cell];
  const float inv_delta = static_cast<float>(bud) / w.tile_sum[cell];
  const int per = (len + 31) / 32, i0 = lane * per;
  float sv[kPerLaneMax], xv[kPerLaneMax];
  float run = 0.f;
#pragma unroll
  for (int j = 0; j < kPerLaneMax; ++j) {
    const int i = i0 + j;
    const bool in = j < per && i < len;
    sv[j] = in ? s[i] : -INFINITY;
    xv[j] = in ? __fmul_rn(inv_delta, expf(sv[j] - mt)) : 0.f;
    run = __fadd_rn(run, xv[j]);  // + 0 past the run: exact
  }
  float pn = WarpExclusiveSum(run, lane);
  const SeedSource seeds{p.seed, p.seeds};
  const float a0 =
      SequenceStream(seeds, RngTag::kPropTileOffset, x.b, x.h * p.heads_per_row).Uniform(t);
  int cs[kPerLaneMax];
  int hits = 0;
#pragma unroll
  for (int j = 0; j < kPerLaneMax; ++j) {
    const float f0 = __fadd_rn(a0, pn);
    const float f1 = __fadd_rn(f0, xv[j]);
    cs[j] = static_cast<int>(floorf(f1)) - static_cast<int>(floorf(f0));  // 0 past the run
    pn = __fadd_rn(pn, xv[j]);
    hits += cs[j] > 0 ? 1 : 0;
  }
  int at = WarpExclusiveSum(hits, lane);
  const int total = __shfl_sync(0xffffffffu, at + hits, 31);
  const int64_t base = x.bh * RowsPerHead(p) + w.slot[cell];
  int32_t* rows = w.rows + base;
  float* lw = w.row_weight + base;
  int32_t* rc = w.row_count + base;
#pragma unroll
  for (int j = 0; j < kPerLaneMax; ++j) {
    if (cs[j] > 0) {
      if (at <= bud) {  // a tile stages at most bud + 1 rows
        rows[at] = lo + i0 + j;
        lw[at] = log2f(static_cast<float>(cs[j])) - sv[j] * kLog2E;
        rc[at] = cs[j];
      }
      ++at;
    }
  }
  if (lane == 0) w.emitted[cell] = min(total, bud + 1);
}

// A block per (b, h): each tile's staged rows, in tile order, into the outputs (at most
// max_selected, as the reference writes them).
__global__ void __launch_bounds__(kScanThreads)
    CompactKernel(PropFromScoresParams p, Workspace w, int32_t t_max) {
  GridDependencyWait();  // LaunchDependent: the earlier kernels' writes first
  using ScanI = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename ScanI::TempStorage tmp;
  const Head x = HeadOf(p, blockIdx.x);
  const int tid = threadIdx.x;
  const int32_t* emitted = w.emitted + x.bh * t_max;
  const int32_t* slot = w.slot + x.bh * t_max;
  const int64_t base = x.bh * RowsPerHead(p);
  const int k = p.heads_per_row;
  int32_t* idx = p.indices + x.bh * k * p.max_selected;
  float* lw = p.log2_weights + x.bh * k * p.max_selected;
  int32_t* rc = p.row_counts == nullptr ? nullptr : p.row_counts + x.bh * k * p.max_selected;
  int32_t carry = 0;
  for (int t0 = 0; t0 < x.tiles; t0 += kScanThreads) {
    const int t = t0 + tid;
    const int32_t e = t < x.tiles ? emitted[t] : 0;
    int32_t at = 0, total = 0;
    ScanI(tmp).ExclusiveSum(e, at, total);
    at += carry;
    for (int32_t r = 0; r < e && at + r < p.max_selected; ++r) {
      const int32_t row = w.rows[base + slot[t] + r];
      const float weight = w.row_weight[base + slot[t] + r];
      const int32_t draws = w.row_count[base + slot[t] + r];
      for (int i = 0; i < k; ++i) {  // the row's query heads (the group mixture's G)
        idx[i * p.max_selected + at + r] = row;
        lw[i * p.max_selected + at + r] = weight;
        if (rc != nullptr) rc[i * p.max_selected + at + r] = draws;
      }
    }
    carry += total;
    __syncthreads();
  }
  if (tid < k) p.counts[x.bh * k + tid] = min(carry, p.max_selected);
}

// The group mixture (GroupMixtureFromScores). LseKernel: a block per (chunk of kMixChunk tokens,
// b, h): the chunk's max m_c and sum z_c of e^{s - m_c}, each thread's kLsePerThread scores
// loaded together and held while the block reduces (one read of the scores). MixKernel: a block
// per (kMixTile tokens, b, kv head): warp g takes head g's lse from its chunks' partials (lanes
// over the chunks, then the warp's reductions), then the tile's mixture scores, kMixPerThread
// tokens a thread with their loads issued together. No shared staging of the partials: eight
// blocks fit an SM, so that at 128k (1,024 blocks) one wave covers the grid (2026-12-03, H200:
// the staged partials' 16 KiB a block left room for seven, 1.29 waves, 17.8 us under ncu).
constexpr int kMixChunk = 4096;
constexpr int kMixThreads = 256;
constexpr int kMixPerThread = 4;
constexpr int kMixTile = kMixThreads * kMixPerThread;
constexpr int kLsePerThread = kMixChunk / kMixThreads;
constexpr int kMixMaxChunks = 256;  // a row's chunks at most (1M tokens)

__host__ __device__ inline int32_t MixChunks(const GroupMixtureParams& p) {
  return (p.max_seq_len + kMixChunk - 1) / kMixChunk;
}

// Score rows whose lse is taken by chunks (LseKernel): row r of sequence r / rows_per_seq.
struct LseRows {
  const float* scores;
  int64_t stride;
  const int32_t* seq_lens;
  int32_t rows_per_seq;
  int32_t chunks;  // kMixChunk tokens each
};

__global__ void __launch_bounds__(kMixThreads) LseKernel(LseRows p, float* part_m, float* part_z) {
  GridDependencyWait();  // LaunchDependent: the earlier kernels' writes first
  using Reduce = cub::BlockReduce<float, kMixThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ float m_s;
  const int32_t chunks = p.chunks, c = blockIdx.x;
  const int64_t bh = blockIdx.y;
  const int32_t n = p.seq_lens[bh / p.rows_per_seq];
  const int32_t lo = c * kMixChunk, hi = min(n, lo + kMixChunk);
  const float* s = p.scores + bh * p.stride;
  float x[kLsePerThread];
#pragma unroll
  for (int i = 0; i < kLsePerThread; ++i) {
    const int32_t t = lo + i * kMixThreads + static_cast<int32_t>(threadIdx.x);
    x[i] = t < hi ? s[t] : -INFINITY;
  }
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kLsePerThread; ++i) m = fmaxf(m, x[i]);
  m = Reduce(tmp).Reduce(m, FMax());
  if (threadIdx.x == 0) m_s = m;
  __syncthreads();
  m = m_s;
  float z = 0.f;
  if (m != -INFINITY) {
#pragma unroll
    for (int i = 0; i < kLsePerThread; ++i) z += expf(x[i] - m);
  }
  __syncthreads();  // tmp is reused
  z = Reduce(tmp).Sum(z);
  if (threadIdx.x == 0) {
    part_m[bh * chunks + c] = m;
    part_z[bh * chunks + c] = z;
  }
}

// log sum_c z_c e^{m_c - max} + max over a row's chunk partials, by the calling warp's lanes
// (+inf: no mass).
__device__ __forceinline__ float WarpLseOfChunks(const float* pm, const float* pz, int32_t chunks,
                                                 int lane) {
  float m = -INFINITY;
  for (int32_t k = lane; k < chunks; k += 32) m = fmaxf(m, pm[k]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (m == -INFINITY) return INFINITY;
  float z = 0.f;
  for (int32_t k = lane; k < chunks; k += 32) {
    const float mk = pm[k];
    if (mk != -INFINITY) z += pz[k] * expf(mk - m);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) z += __shfl_xor_sync(0xffffffffu, z, o);
  return m + logf(z);
}

__global__ void __launch_bounds__(kMixThreads)
    MixKernel(GroupMixtureParams p, const float* part_m, const float* part_z) {
  GridDependencyWait();  // LaunchDependent: the earlier kernels' writes first
  __shared__ float lse_s[8];
  const int32_t chunks = MixChunks(p);
  const int32_t G = p.num_q_heads / p.num_kv_heads;
  const int64_t bj = blockIdx.y;  // b * Hkv + j
  const int64_t b = bj / p.num_kv_heads, h0 = b * p.num_q_heads + (bj % p.num_kv_heads) * G;
  const int32_t n = p.seq_lens[b];
  const int32_t lo = blockIdx.x * kMixTile;
  if (lo >= n) return;  // the whole block
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  if (warp < G) {  // head h0 + warp's lse over its chunks
    const float lse =
        WarpLseOfChunks(part_m + (h0 + warp) * chunks, part_z + (h0 + warp) * chunks, chunks, lane);
    if (lane == 0) lse_s[warp] = lse;
  }
  __syncthreads();
  const float ln_g = logf(static_cast<float>(G));
  float* out = p.mixture + bj * p.mixture_stride;
  float mx[kMixPerThread], sum[kMixPerThread];
#pragma unroll
  for (int i = 0; i < kMixPerThread; ++i) {
    mx[i] = -INFINITY;  // logsumexp over the heads, online
    sum[i] = 0.f;
  }
  for (int g = 0; g < G; ++g) {
    const float lse = lse_s[g];
    if (lse == INFINITY) continue;  // a head with no mass
    const float* s = p.scores + (h0 + g) * p.score_stride;
    float a[kMixPerThread];
#pragma unroll
    for (int i = 0; i < kMixPerThread; ++i) {
      const int32_t t = lo + i * kMixThreads + threadIdx.x;
      a[i] = t < n ? s[t] - lse : -INFINITY;
    }
#pragma unroll
    for (int i = 0; i < kMixPerThread; ++i) {
      if (a[i] == -INFINITY) continue;
      if (a[i] > mx[i]) {
        sum[i] = sum[i] * expf(mx[i] - a[i]) + 1.f;
        mx[i] = a[i];
      } else {
        sum[i] += expf(a[i] - mx[i]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kMixPerThread; ++i) {
    const int32_t t = lo + i * kMixThreads + threadIdx.x;
    if (t < n) out[t] = mx[i] == -INFINITY ? -INFINITY : mx[i] + logf(sum[i]) - ln_g;
  }
}

// The uniform floor (ProposalFloorOnScores): a block per (kMixTile tokens, row). Thread 0
// combines the row's chunk partials (LseKernel's) into its max m and sum z in float64, then
// every token's score becomes log((1 - a) e^{s - m} / z + a / n) (kernels::ProposalFloor).
__global__ void __launch_bounds__(kMixThreads)
    FloorKernel(ProposalFloorParams p, int32_t chunks, const float* part_m, const float* part_z) {
  GridDependencyWait();  // LaunchDependent: the earlier kernels' writes first
  __shared__ double m_s, z_s;
  const int64_t row = blockIdx.y;
  const int32_t n = p.seq_lens[row / p.rows_per_seq];
  const int32_t lo = blockIdx.x * kMixTile;
  if (lo >= n) return;  // the whole block
  if (threadIdx.x == 0) {
    double m = -INFINITY;
    for (int32_t k = 0; k < chunks; ++k) m = fmax(m, static_cast<double>(part_m[row * chunks + k]));
    double z = 0.0;
    if (m != -INFINITY) {
      for (int32_t k = 0; k < chunks; ++k) {
        const float mk = part_m[row * chunks + k];
        if (mk != -INFINITY) z += static_cast<double>(part_z[row * chunks + k]) * exp(mk - m);
      }
    }
    m_s = m;
    z_s = z;
  }
  __syncthreads();
  const double m = m_s, z = z_s, a = p.floor;
  const double floor = a / static_cast<double>(n);
  float* s = p.scores + row * p.score_stride;
  for (int32_t i = 0; i < kMixPerThread; ++i) {
    const int32_t t = lo + i * kMixThreads + threadIdx.x;
    if (t >= n) break;
    const double q = z > 0.0 ? (1.0 - a) * exp(static_cast<double>(s[t]) - m) / z : 0.0;
    s[t] = static_cast<float>(log(q + floor));
  }
}

}  // namespace

size_t PropFromScoresWorkspaceBytes(const PropFromScoresParams& p) {
  if (p.tile_size < 1 || p.batch < 0 || p.num_q_heads < 0 || p.num_samples < 0) return 0;
  return WorkspaceBytes(p);
}

cudaError_t PropFromScores(const PropFromScoresParams& p, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream) {
  if (p.batch < 0 || p.num_q_heads < 1 || p.num_kv_heads < 1 ||
      p.num_q_heads % p.num_kv_heads != 0 || p.heads_per_row < 1 ||
      p.heads_per_row > kScanThreads || p.num_samples < 1 || p.tile_size < 1 ||
      p.tile_size > kMaxTile || p.max_selected < p.num_samples + 1 || p.scores == nullptr ||
      p.seq_lens == nullptr || p.indices == nullptr || p.counts == nullptr ||
      p.log2_weights == nullptr || p.score_stride < p.max_seq_len ||
      workspace_bytes < PropFromScoresWorkspaceBytes(p) ||
      (PropFromScoresWorkspaceBytes(p) > 0 && workspace == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0) return cudaSuccess;
  const int64_t bh = static_cast<int64_t>(p.batch) * p.num_q_heads;
  const int32_t t_max = MaxTiles(p);
  if (bh > 65535) return cudaErrorInvalidValue;  // the heads ride blockIdx.y below
  const Workspace w = Carve(p, workspace);
  const dim3 tiles_grid(static_cast<unsigned>(std::max(1, (t_max + kWarps - 1) / kWarps)),
                        static_cast<unsigned>(bh));
  KVSPARSE_CUDA_RETURN_IF_ERROR(
      LaunchDependent(&TileStatsKernel, tiles_grid, dim3(kTileThreads), 0, stream, p, w, t_max));
  KVSPARSE_CUDA_RETURN_IF_ERROR(LaunchDependent(&BudgetsKernel, dim3(static_cast<unsigned>(bh)),
                                                dim3(kScanThreads), 0, stream, p, w, t_max));
  const dim3 sample_grid(static_cast<unsigned>((p.num_samples + 1 + kWarps - 1) / kWarps),
                         static_cast<unsigned>(bh));
  KVSPARSE_CUDA_RETURN_IF_ERROR(
      LaunchDependent(&SampleKernel, sample_grid, dim3(kTileThreads), 0, stream, p, w, t_max));
  return LaunchDependent(&CompactKernel, dim3(static_cast<unsigned>(bh)), dim3(kScanThreads), 0,
                         stream, p, w, t_max);
}

size_t GroupMixtureWorkspaceBytes(const GroupMixtureParams& p) {
  if (p.batch < 0 || p.num_q_heads < 0 || p.max_seq_len < 0) return 0;
  const size_t cells = static_cast<size_t>(p.batch) * p.num_q_heads * MixChunks(p);
  return 2 * AlignUp(cells * sizeof(float), 256);
}

cudaError_t GroupMixtureFromScores(const GroupMixtureParams& p, void* workspace,
                                   size_t workspace_bytes, cudaStream_t stream) {
  if (p.batch < 0 || p.num_q_heads < 1 || p.num_kv_heads < 1 ||
      p.num_q_heads % p.num_kv_heads != 0 || p.num_q_heads / p.num_kv_heads > 8 ||
      p.max_seq_len < 0 || p.scores == nullptr || p.seq_lens == nullptr || p.mixture == nullptr ||
      p.score_stride < p.max_seq_len || p.mixture_stride < p.max_seq_len ||
      MixChunks(p) > kMixMaxChunks || workspace_bytes < GroupMixtureWorkspaceBytes(p) ||
      (GroupMixtureWorkspaceBytes(p) > 0 && workspace == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const int32_t chunks = MixChunks(p);
  if (p.batch == 0 || chunks == 0) return cudaSuccess;
  if (static_cast<int64_t>(p.batch) * p.num_q_heads > 65535) return cudaErrorInvalidValue;
  char* c = static_cast<char*>(workspace);
  const size_t cells = static_cast<size_t>(p.batch) * p.num_q_heads * chunks;
  float* part_m = Take<float>(c, cells);
  float* part_z = Take<float>(c, cells);
  const LseRows rows{p.scores, p.score_stride, p.seq_lens, p.num_q_heads, chunks};
  KVSPARSE_CUDA_RETURN_IF_ERROR(LaunchDependent(&LseKernel, dim3(chunks, p.batch * p.num_q_heads),
                                                dim3(kMixThreads), 0, stream, rows, part_m,
                                                part_z));
  const unsigned tiles = static_cast<unsigned>((p.max_seq_len + kMixTile - 1) / kMixTile);
  return LaunchDependent(&MixKernel, dim3(tiles, p.batch * p.num_kv_heads), dim3(kMixThreads), 0,
                         stream, p, part_m, part_z);
}

namespace {
int32_t FloorChunks(const ProposalFloorParams& p) {
  return (p.max_seq_len + kMixChunk - 1) / kMixChunk;
}
}  // namespace

size_t ProposalFloorWorkspaceBytes(const ProposalFloorParams& p) {
  if (p.batch < 0 || p.rows_per_seq < 0 || p.max_seq_len < 0) return 0;
  const size_t cells = static_cast<size_t>(p.batch) * p.rows_per_seq * FloorChunks(p);
  return 2 * AlignUp(cells * sizeof(float), 256);
}

cudaError_t ProposalFloorOnScores(const ProposalFloorParams& p, void* workspace,
                                  size_t workspace_bytes, cudaStream_t stream) {
  if (p.batch < 0 || p.rows_per_seq < 1 || p.max_seq_len < 0 || p.max_seq_len > (1 << 20) ||
      p.scores == nullptr || p.seq_lens == nullptr || p.score_stride < p.max_seq_len ||
      !(p.floor > 0.f && p.floor < 1.f) || workspace_bytes < ProposalFloorWorkspaceBytes(p) ||
      (ProposalFloorWorkspaceBytes(p) > 0 && workspace == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const int32_t chunks = FloorChunks(p);
  if (p.batch == 0 || chunks == 0) return cudaSuccess;
  const int64_t rows = static_cast<int64_t>(p.batch) * p.rows_per_seq;
  if (rows > 65535) return cudaErrorInvalidValue;  // the rows ride blockIdx.y
  char* c = static_cast<char*>(workspace);
  const size_t cells = static_cast<size_t>(rows) * chunks;
  float* part_m = Take<float>(c, cells);
  float* part_z = Take<float>(c, cells);
  const LseRows lr{p.scores, p.score_stride, p.seq_lens, p.rows_per_seq, chunks};
  KVSPARSE_CUDA_RETURN_IF_ERROR(LaunchDependent(&LseKernel, dim3(chunks, rows), dim3(kMixThreads),
                                                0, stream, lr, part_m, part_z));
  const unsigned tiles = static_cast<unsigned>((p.max_seq_len + kMixTile - 1) / kMixTile);
  return LaunchDependent(&FloorKernel, dim3(tiles, rows), dim3(kMixThreads), 0, stream, p, chunks,
                         static_cast<const float*>(part_m), static_cast<const float*>(part_z));
}

}  // namespace kvsparse::kernels::cuda
