#include <cooperative_groups.h>

#include <algorithm>
#include <cub/block/block_scan.cuh>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/dense_decode.h"
#include "kernels/cuda/selected_rows.h"

namespace kvsparse::kernels::cuda {
namespace {

// ---------------------------------------------------------------------------------------------
// UnionSelected: one block per (b, j). The G lists set bits in a token bitmap; a block scan of
// the words' popcounts gives every word's rank, from which the ascending union and each
// selected token's position follow.
constexpr int kUnionThreads = 512;
// Bitmap and rank words a block keeps in shared memory where every sequence fits (up to 160k
// tokens: UnionKernel<true>); longer ones use the workspace.
constexpr int kUnionStagedWords = 5120;

template <bool kStaged>
__global__ void __launch_bounds__(kUnionThreads)
    UnionKernel(UnionSelectedParams p, int words_stride, uint32_t* __restrict__ bits_ws,
                int32_t* __restrict__ rank_ws) {
  GridDependencyWait();  // LaunchDependent: the earlier kernels' writes first
  using Scan = cub::BlockScan<int, kUnionThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ uint32_t bits_s[kStaged ? kUnionStagedWords : 1];
  __shared__ int32_t rank_s[kStaged ? kUnionStagedWords : 1];
  const int i = blockIdx.x;
  const int b = i / p.num_kv_heads, j = i % p.num_kv_heads;
  const int G = p.num_q_heads / p.num_kv_heads;
  const int n = p.seq_lens[b];
  const int words = (n + 31) / 32;
  uint32_t* bits = kStaged ? bits_s : bits_ws + static_cast<int64_t>(i) * words_stride;
  int32_t* rank = kStaged ? rank_s : rank_ws + static_cast<int64_t>(i) * words_stride;
  for (int w = threadIdx.x; w < words; w += kUnionThreads) bits[w] = 0u;
  __syncthreads();
  for (int g = 0; g < G; ++g) {
    const int64_t bh = static_cast<int64_t>(b) * p.num_q_heads + j * G + g;
    const int c = p.counts[bh];
    const int32_t* idx = p.indices + bh * p.max_selected;
    for (int k = threadIdx.x; k < c; k += kUnionThreads) {
      const int t = idx[k];
      if (t >= 0 && t < n) atomicOr(bits + (t >> 5), 1u << (t & 31));
    }
  }
  __syncthreads();
  const int per = (words + kUnionThreads - 1) / kUnionThreads;
  const int w0 = min(words, threadIdx.x * per), w1 = min(words, w0 + per);
  int local = 0;
  for (int w = w0; w < w1; ++w) local += __popc(bits[w]);
  int off = 0, total = 0;
  Scan(scan_tmp).ExclusiveSum(local, off, total);
  int32_t* toks = p.out.tokens[i];
  const int cap = p.out.capacity;
  for (int w = w0; w < w1; ++w) {
    rank[w] = off;
    uint32_t word = bits[w];
    while (word != 0u) {
      if (off < cap) toks[off] = w * 32 + __ffs(word) - 1;
      ++off;
      word &= word - 1u;
    }
  }
  if (threadIdx.x == 0) *p.out.count[i] = min(total, cap);
  __syncthreads();  // ranks of every word written
  for (int g = 0; g < G; ++g) {
    const int64_t bh = static_cast<int64_t>(b) * p.num_q_heads + j * G + g;
    const int c = p.counts[bh];
    const int32_t* idx = p.indices + bh * p.max_selected;
    int32_t* pos = p.positions + bh * p.max_selected;
    for (int k = threadIdx.x; k < c; k += kUnionThreads) {
      const int t = idx[k];
      const int at =
          (t >= 0 && t < n) ? rank[t >> 5] + __popc(bits[t >> 5] & ((1u << (t & 31)) - 1u)) : -1;
      pos[k] = at < cap ? at : -1;
    }
  }
}

int UnionWords(const UnionSelectedParams& p) { return (std::max(p.max_seq_len, 1) + 31) / 32; }

// ---------------------------------------------------------------------------------------------
// PlaceRows: one block per (b, j). Hits are found by binary search in the cache's ascending
// tokens and mark their slots in a bitmap; the unmarked slots, in order, are the free list; block
// scans over the union give each miss its rank m (slot free[m], or overflow row m - free count at
// location -1 - row) and each kept row its place in the cache's new token list.
constexpr int kPlaceThreads = 512;
constexpr int kPlaceStagedTokens = 4096;  // cached tokens searched from shared memory
constexpr int32_t kMiss = INT32_MIN;      // a union row not (yet) placed

__device__ __forceinline__ int FindSorted(const int32_t* a, int n, int t) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (a[mid] < t) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo < n && a[lo] == t ? lo : -1;
}

struct PlaceWorkspace {
  int words = 0;    // bitmap words per (b, j): ceil(C / 32)
  size_t used = 0;  // offsets: uint32 [sets][words], int32 free [sets][C], loc [sets][rows cap]
  size_t free = 0;
  size_t loc = 0;
  size_t total = 0;
  static PlaceWorkspace Of(const PlaceRowsParams& p) {
    PlaceWorkspace w;
    const size_t sets = static_cast<size_t>(std::max(p.batch, 0)) * std::max(p.num_kv_heads, 0);
    const size_t cap = static_cast<size_t>(std::max(p.cache.capacity, 0));
    w.words = static_cast<int>((cap + 31) / 32);
    w.free = AlignUp(sets * w.words * sizeof(uint32_t), 256);
    w.loc = w.free + AlignUp(sets * cap * sizeof(int32_t), 256);
    w.total = w.loc + AlignUp(sets * std::max(p.rows.capacity, 0) * sizeof(int32_t), 256);
    return w;
  }
};

__global__ void __launch_bounds__(kPlaceThreads)
    PlaceKernel(PlaceRowsParams p, PlaceWorkspace w, char* __restrict__ ws) {
  GridDependencyWait();  // LaunchDependent: the earlier kernels' writes first
  using Scan = cub::BlockScan<int, kPlaceThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  const int i = blockIdx.x;
  const int tid = threadIdx.x;
  const int C = p.cache.capacities != nullptr ? p.cache.capacities[i] : p.cache.capacity;
  const int u = *p.rows.count[i];
  const int32_t* toks = p.rows.tokens[i];
  __shared__ int32_t held_s[kPlaceStagedTokens];
  int32_t* loc = reinterpret_cast<int32_t*>(ws + w.loc) + static_cast<int64_t>(i) * p.rows.capacity;
  int32_t* free_slots =
      reinterpret_cast<int32_t*>(ws + w.free) + static_cast<int64_t>(i) * p.cache.capacity;
  int num_free = 0;
  if (C > 0) {
    uint32_t* used = reinterpret_cast<uint32_t*>(ws + w.used) + static_cast<int64_t>(i) * w.words;
    const int held = *p.cache.count[i];
    const int words = (C + 31) / 32;
    const int32_t* cached = p.cache.tokens[i];  // searched from shared memory where it fits
    if (held <= kPlaceStagedTokens) {
      for (int x = tid; x < held; x += kPlaceThreads) held_s[x] = cached[x];
      cached = held_s;
    }
    for (int x = tid; x < words; x += kPlaceThreads) used[x] = 0u;
    __syncthreads();
    for (int r = tid; r < u; r += kPlaceThreads) {
      const int x = FindSorted(cached, held, toks[r]);
      const int slot = x >= 0 ? p.cache.slots[i][x] : kMiss;
      loc[r] = slot;
      if (slot >= 0) atomicOr(used + (slot >> 5), 1u << (slot & 31));
    }
    __syncthreads();
    const int per = (words + kPlaceThreads - 1) / kPlaceThreads;
    const int x0 = min(words, tid * per), x1 = min(words, x0 + per);
    auto free_bits = [&](int x) {
      const int valid = min(32, C - x * 32);
      return ~used[x] & (valid == 32 ? 0xffffffffu : (1u << valid) - 1u);
    };
    int local = 0;
    for (int x = x0; x < x1; ++x) local += __popc(free_bits(x));
    int off = 0;
    Scan(scan_tmp).ExclusiveSum(local, off, num_free);
    for (int x = x0; x < x1; ++x) {
      uint32_t bits = free_bits(x);
      while (bits != 0u) {
        free_slots[off++] = x * 32 + __ffs(bits) - 1;
        bits &= bits - 1u;
      }
    }
    __syncthreads();  // free list written; scan storage free again
  } else {
    for (int r = tid; r < u; r += kPlaceThreads) loc[r] = kMiss;
  }
  // Misses, in token order: a free slot while there are any, then overflow rows.
  int misses = 0;
  for (int r0 = 0; r0 < u; r0 += kPlaceThreads) {
    const int r = r0 + tid;
    const bool miss = r < u && loc[r] == kMiss;
    int rank = 0, total = 0;
    Scan(scan_tmp).ExclusiveSum(miss ? 1 : 0, rank, total);
    if (miss) {
      const int m = misses + rank;
      const int dest = m < num_free ? free_slots[m] : -1 - (m - num_free);
      loc[r] = dest;
      p.fetch.tokens[i][m] = toks[r];
      p.fetch_dest[i][m] = dest;
    }
    misses += total;
    __syncthreads();
  }
  if (tid == 0) {
    *p.fetch.count[i] = misses;
    if (p.hits != nullptr) p.hits[i] = u - misses;
  }
  // The cache's new token list: the union rows that have a slot, ascending (the old list was
  // last read before the free list's barrier).
  if (C > 0) {
    int kept = 0;
    for (int r0 = 0; r0 < u; r0 += kPlaceThreads) {
      const int r = r0 + tid;
      const bool keep = r < u && loc[r] >= 0;
      int rank = 0, total = 0;
      Scan(scan_tmp).ExclusiveSum(keep ? 1 : 0, rank, total);
      if (keep) {
        p.cache.tokens[i][kept + rank] = toks[r];
        p.cache.slots[i][kept + rank] = loc[r];
      }
      kept += total;
      __syncthreads();
    }
    if (tid == 0) *p.cache.count[i] = kept;
  }
  __syncthreads();  // every location written
  const int b = i / p.num_kv_heads, j = i % p.num_kv_heads;
  const int G = p.num_q_heads / p.num_kv_heads;
  for (int g = 0; g < G; ++g) {
    const int64_t bh = static_cast<int64_t>(b) * p.num_q_heads + j * G + g;
    const int c = p.counts[bh];
    int32_t* pos = p.positions + bh * p.max_selected;
    for (int k = tid; k < c; k += kPlaceThreads) pos[k] = pos[k] >= 0 ? loc[pos[k]] : -1;
  }
}

// ---------------------------------------------------------------------------------------------
// FetchRows: blocks of kFetchRows rows of one (b, j). Each row's source (the DecodeShape
// addressing) and destination are resolved once into shared memory, then the block copies
// 16-byte vectors with several loads in flight per thread (zero-copy reads over the host link
// need many outstanding requests).
constexpr int kFetchThreads = 256;
constexpr int kFetchRows = 64;
constexpr int kFetchIn = 4;

__global__ void __launch_bounds__(kFetchThreads) FetchKernel(FetchRowsParams p, int row_vecs) {
  GridDependencyWait();  // LaunchDependent: the earlier kernels' writes first
  __shared__ const uint4* src[2][kFetchRows];
  __shared__ uint4* dst[2][kFetchRows];
  __shared__ int sm_count;
  const DecodeShape& s = p.shape;
  const int i = blockIdx.y;
  const int b = i / s.num_kv_heads, j = i % s.num_kv_heads;
  const int r0 = blockIdx.x * kFetchRows;
  if (threadIdx.x == 0) {
    int c;
    if (p.all_tokens) {
      c = p.seq_lens[b];
      if (blockIdx.x == 0) *p.out.count[i] = c;
    } else {
      c = *p.out.count[i];
    }
    sm_count = c;
  }
  __syncthreads();
  const int count = sm_count;
  if (r0 >= count) return;
  const int rows = min(kFetchRows, count - r0);
  if (threadIdx.x < rows) {
    const int r = r0 + threadIdx.x;
    int t;
    if (p.all_tokens) {
      t = r;
      p.out.tokens[i][r] = r;
    } else {
      t = p.out.tokens[i][r];
    }
    const int from = p.source_by_position ? r : t;
    src[0][threadIdx.x] =
        reinterpret_cast<const uint4*>(MakeRowReader(s, false, b, j, 0).Row(from));
    src[1][threadIdx.x] = reinterpret_cast<const uint4*>(MakeRowReader(s, true, b, j, 0).Row(from));
    const int loc = p.dest != nullptr ? p.dest[i][r] : r;
    const bool second = loc < 0;
    const int64_t off = static_cast<int64_t>(second ? -1 - loc : loc) * row_vecs;
    dst[0][threadIdx.x] = static_cast<uint4*>(second ? p.second.k[i] : p.out.k[i]) + off;
    dst[1][threadIdx.x] = static_cast<uint4*>(second ? p.second.v[i] : p.out.v[i]) + off;
  }
  __syncthreads();
  // (row, kv, vector): a row's K and V side by side in a warp's loads, where a paged store keeps
  // them in one slot (one translation, one stretch of host memory for both).
  const int per_row = 2 * row_vecs, total = rows * per_row;
  for (int e0 = threadIdx.x; e0 < total; e0 += kFetchThreads * kFetchIn) {
    uint4 v[kFetchIn];
#pragma unroll
    for (int u = 0; u < kFetchIn; ++u) {
      const int e = e0 + u * kFetchThreads;
      if (e < total) {
        const int r = e / per_row, x = e % per_row;
        v[u] = LoadStream16(src[x / row_vecs][r] + x % row_vecs);
      }
    }
#pragma unroll
    for (int u = 0; u < kFetchIn; ++u) {
      const int e = e0 + u * kFetchThreads;
      if (e < total) {
        const int r = e / per_row, x = e % per_row;
        dst[x / row_vecs][r][x % row_vecs] = v[u];
      }
    }
  }
}

// WarmPagedRows: each thread a chain over the (page, b, j) indices t, t + threads, ...; a page's
// address depends on the previous read's value (laundered to zero), so a chain has one read in
// flight.
constexpr int kWarmThreads = 128;

__global__ void __launch_bounds__(kWarmThreads)
    WarmKernel(WarmPagedRowsParams p, int32_t max_pages, int64_t threads) {
  const int lanes = p.batch * p.num_kv_heads;
  const int64_t total = static_cast<int64_t>(lanes) * max_pages;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarmThreads + threadIdx.x;
  if (t >= threads) return;
  uint32_t dep = 0;
  for (int64_t idx = t; idx < total; idx += threads) {
    if (p.stop != nullptr && *reinterpret_cast<const volatile int32_t*>(p.stop) >= p.stop_at) {
      break;
    }
    const int lane = static_cast<int>(idx % lanes);
    const int page = static_cast<int>(idx / lanes);
    const int len = min(p.seq_lens[lane / p.num_kv_heads], p.max_seq_len);
    if (len <= 0 || page > ((len - 1) >> p.pages.page_shift)) continue;
    const char* at = static_cast<const char*>(p.pages.tables[lane][page]) + dep;
    uint32_t x;
    asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(x) : "l"(at) : "memory");
    asm volatile("and.b32 %0, %1, 0;" : "=r"(dep) : "r"(x));
    if (p.pages_read != nullptr) atomicAdd(p.pages_read + lane, 1);
  }
}

// ---------------------------------------------------------------------------------------------
// SelectedRowsDecode: blocks of (b, h, split); each warp takes U groups of R rows at a time (all
// loads first), one running softmax per row slot, merged over the block; splits merged by
// MergePartials. kInPlace: each row read by its token from the shape's K/V addressing (e.g. over
// the host link) instead of from a row set.
constexpr int kRowThreads = 256;
constexpr int kRowsUnroll = 4;
constexpr int kMaxClusterSplits = 8;  // in place: a head's splits are one cluster (portable size)

// Rows one block of SelectedRowsKernel loads at once for head dim d (every warp's U groups of R).
constexpr int RowsPerBlockRound(int d) { return (kRowThreads / 32) * (32 / (d / 8)) * kRowsUnroll; }

// The splits of head bh as a cluster of num_splits <= kMaxSplits blocks (block rank = split):
// each block's normalised output o [D] and log2-sum-exp lse in its shared memory; the first block
// combines them (as MergeSplits does) and writes the head's output.
// A read of another block's shared memory waits about 200 cycles, so each thread issues all the
// splits' reads of a value before it uses any (a loop over the splits waits num_splits times).
template <typename T, int D, int kMaxSplits>
__device__ __forceinline__ void MergeCluster(float* o, float* lse, int num_splits, int64_t bh,
                                             void* out) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every block's part written
  if (cluster.block_rank() == 0) {
    float l[kMaxSplits];
#pragma unroll
    for (int r = 0; r < kMaxSplits; ++r) {
      l[r] = r < num_splits ? *cluster.map_shared_rank(lse, r) : kNegInf;
    }
    float mx = kNegInf;
#pragma unroll
    for (int r = 0; r < kMaxSplits; ++r) mx = fmaxf(mx, l[r]);
    float den = 0.f;
#pragma unroll
    for (int r = 0; r < kMaxSplits; ++r) {
      l[r] = l[r] == kNegInf ? 0.f : exp2f(l[r] - mx);  // the split's weight
      den += l[r];
    }
    const float inv = den > 0.f ? 1.f / den : 0.f;
    for (int dim = threadIdx.x; dim < D; dim += blockDim.x) {
      float x[kMaxSplits];
#pragma unroll
      for (int r = 0; r < kMaxSplits; ++r) {
        x[r] = r < num_splits && l[r] > 0.f ? cluster.map_shared_rank(o, r)[dim] : 0.f;
      }
      float v = 0.f;
#pragma unroll
      for (int r = 0; r < kMaxSplits; ++r) v = fmaf(l[r], x[r], v);
      static_cast<uint16_t*>(out)[bh * D + dim] = FloatToBits<T>(v * inv);
    }
  }
  cluster.sync();  // the other blocks' shared memory stays until the first has read it
}

// In place: this lane's 16 bytes of token t's K and V rows where `listed` (a row of the list)
// and 0 <= t < n (zeros otherwise); whether they were read.
__device__ __forceinline__ bool LoadTokenRows(const RowReader& kread, const RowReader& vread,
                                              bool listed, int t, int n, uint4* k, uint4* v) {
  const bool ok = listed && t >= 0 && t < n;
  *k = ok ? LoadStream16(kread.Row(t)) : make_uint4(0, 0, 0, 0);
  *v = ok ? LoadStream16(vread.Row(t)) : make_uint4(0, 0, 0, 0);
  return ok;
}

// A head's split rows kept for its standard error (SelectedRowsParams::standard_errors): at most
// one round's rows a block, in row order: each row's V (raw), its log2 score with its weight and
// its draws (0: no row).
template <int D>
struct DrawStash {
  static constexpr int kRows = RowsPerBlockRound(D);
  __align__(16) uint4 v[kRows][D / 8];
  float score[kRows];
  int32_t draws[kRows];
  float out[D];                 // the head's output, fp32
  float z_first[D], z_last[D];  // this split's first and last draw's deviation z
  float red[kRowThreads / 32];
  float sum2;     // this split's sum of squared successive differences
  int32_t total;  // this split's draws
  int32_t has;    // whether it has a row
};

struct NoStash {};

// The sum over the block of one float per thread (every thread gets it).
__device__ __forceinline__ float BlockSumAll(float x, float* red) {
  x = WarpSum(x);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // red is reused
  if (lane == 0) red[warp] = x;
  __syncthreads();
  float t = 0.f;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) t += red[w];
  return t;
}

// The relative standard error of head bh's estimate from its draws, as the CPU reference states
// it for ordered draws (kernels/row_selection.h, EstimateFromGathered): the head's m draws in
// token order (the splits' rows, one cluster, in rank order), each draw's z = m a (V - out) / L
// with a = w e^{s} / c (2^{score} / c here) and L the sum over the rows of w e^{s}, and
// Var^ = sum over successive draws of |z_{k+1} - z_k|^2 / 2 over m (m - 1). Each block's output
// part (o, lse) is in `part_o` / `part_lse` of its shared memory. Every block of the cluster
// calls it.
template <typename T, int D>
__device__ void StandardErrorOfDraws(DrawStash<D>& st, const float* part_o, const float* part_lse,
                                     int num_splits, int64_t bh, float* standard_errors) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x, rank = static_cast<int>(cluster.block_rank());
  cluster.sync();  // every block's part and stash written
  // The global reference max (over the parts' lse), L relative to it, and the head's draws.
  float mx = kNegInf;
  int32_t m_draws = 0;
  for (int r = 0; r < num_splits; ++r) {
    mx = fmaxf(mx, *cluster.map_shared_rank(part_lse, r));
    m_draws += cluster.map_shared_rank(&st, r)->total;
  }
  float mass = 0.f;
  for (int r = 0; r < num_splits; ++r)
    mass += Exp2OrZero(*cluster.map_shared_rank(part_lse, r) - mx);
  for (int dim = tid; dim < D; dim += blockDim.x) {
    float v = 0.f;
    for (int r = 0; r < num_splits; ++r) {
      const float w = Exp2OrZero(*cluster.map_shared_rank(part_lse, r) - mx);
      if (w > 0.f) v = fmaf(w, cluster.map_shared_rank(part_o, r)[dim], v);
    }
    st.out[dim] = mass > 0.f ? v / mass : 0.f;
  }
  __syncthreads();
  // This split's successive differences, a thread per dimension along the rows.
  const float m = static_cast<float>(m_draws);
  float acc = 0.f;
  bool any = false;
  for (int dim = tid; dim < D; dim += blockDim.x) {
    float prev = 0.f;
    any = false;
    for (int k = 0; k < DrawStash<D>::kRows; ++k) {
      const int32_t c = st.draws[k];
      if (c <= 0) continue;
      const float a = exp2f(st.score[k] - mx) / static_cast<float>(c);
      const float z = m * a * (LoadElem<T>(st.v[k], dim) - st.out[dim]) / mass;
      if (any) {
        acc = fmaf(z - prev, z - prev, acc);
      } else {
        st.z_first[dim] = z;
      }
      prev = z;
      any = true;
    }
    st.z_last[dim] = prev;
  }
  float sum2 = BlockSumAll(acc, st.red);
  if (tid == 0) st.has = st.total > 0 ? 1 : 0;
  cluster.sync();  // every split's first and last z
  // The difference across the boundary with the nearest earlier split that has a draw.
  int prev_rank = -1;
  if (st.total > 0) {
    for (int r = rank - 1; r >= 0 && prev_rank < 0; --r) {
      if (cluster.map_shared_rank(&st, r)->has) prev_rank = r;
    }
  }
  float edge = 0.f;
  if (prev_rank >= 0) {
    const float* zl = cluster.map_shared_rank(&st, prev_rank)->z_last;
    for (int dim = tid; dim < D; dim += blockDim.x) {
      const float dz = st.z_first[dim] - zl[dim];
      edge = fmaf(dz, dz, edge);
    }
  }
  sum2 += BlockSumAll(edge, st.red);
  float out2 = 0.f;
  for (int dim = tid; dim < D; dim += blockDim.x) out2 = fmaf(st.out[dim], st.out[dim], out2);
  out2 = BlockSumAll(out2, st.red);
  if (tid == 0) st.sum2 = sum2;
  cluster.sync();  // every split's sum
  if (rank == 0 && tid == 0) {
    float total2 = 0.f;
    for (int r = 0; r < num_splits; ++r) total2 += cluster.map_shared_rank(&st, r)->sum2;
    float se;
    if (m_draws < 2) {
      se = out2 > 0.f ? INFINITY : 0.f;
    } else if (!(mass > 0.f)) {
      se = 0.f;
    } else {
      const float var = total2 / 2.f / (m * (m - 1.f));
      se = out2 > 0.f ? sqrtf(var / out2) : (var > 0.f ? INFINITY : 0.f);
    }
    standard_errors[bh] = se;
  }
  cluster.sync();  // the other blocks' shared memory stays until the first has read it
}

template <typename T, int D, bool kInPlace, bool kStats = false>
__global__ void __launch_bounds__(kRowThreads, 2)
    SelectedRowsKernel(SelectedRowsParams p, int num_splits, float* __restrict__ part_o,
                       float* __restrict__ part_lse) {
  GridDependencyWait();  // LaunchDependent: the earlier kernels' writes first
  constexpr int L = D / 8, R = 32 / L, NW = kRowThreads / 32, U = kRowsUnroll;
  __shared__ SlotSoftmax<D, NW * R, true> slots;
  const DecodeShape& s = p.shape;
  const int64_t bh = blockIdx.x;
  const int split = blockIdx.y;
  const int b = static_cast<int>(bh / s.num_q_heads);
  const int h = static_cast<int>(bh % s.num_q_heads);
  const int G = s.num_q_heads / s.num_kv_heads;
  const int i = b * s.num_kv_heads + h / G;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, row = lane / L, lr = lane % L;
  const int c = p.counts[bh];
  const int per = (c + num_splits - 1) / num_splits;
  const int r0 = min(c, split * per), r1 = min(c, r0 + per);
  if (kInPlace && p.rows_read != nullptr && h % G == 0 && split == 0 && tid == 0) {
    int read = 0;
    for (int g = 0; g < G; ++g) read += p.counts[bh + g];
    *p.rows_read[i] = read;
  }
  const int32_t* pos = p.positions + bh * p.max_selected;  // in place: tokens
  // In place: this lane's 8 elements of a token's K and V row; n bounds the tokens read.
  RowReader kread, vread;
  int n = 0;
  if constexpr (kInPlace) {
    kread = MakeRowReader(s, false, b, h / G, lr * 8);
    vread = MakeRowReader(s, true, b, h / G, lr * 8);
    n = s.seq_lens[b];
  }
  const uint16_t* kb = kInPlace ? nullptr : static_cast<const uint16_t*>(p.rows.k[i]) + lr * 8;
  const uint16_t* vb = kInPlace ? nullptr : static_cast<const uint16_t*>(p.rows.v[i]) + lr * 8;
  const bool has_second = !kInPlace && p.second.k != nullptr;
  const uint16_t* kb2 = has_second ? static_cast<const uint16_t*>(p.second.k[i]) + lr * 8 : kb;
  const uint16_t* vb2 = has_second ? static_cast<const uint16_t*>(p.second.v[i]) + lr * 8 : vb;
  float qf[8];
  Unpack8<T>(*reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(s.q) + bh * D + lr * 8),
             qf);
  const float scale = s.scale * kLog2e;  // base-2 softmax
  float m = kNegInf, lsum = 0.f, acc[8] = {};
  // With the standard error: the split's rows (one round, SelectedRowsLaunch) kept in order.
  __shared__ std::conditional_t<kStats, DrawStash<D>, NoStash> stash;
  if constexpr (kStats) {
    if (r0 + warp * R * U >= r1 && lr == 0) {  // this warp's slots hold no row
#pragma unroll
      for (int u = 0; u < U; ++u) stash.draws[warp * R * U + u * R + row] = 0;
    }
  }
  for (int g0 = r0 + warp * R * U; g0 < r1; g0 += NW * R * U) {  // uniform over the warp
    uint4 kr[U], vr[U];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int r = g0 + u * R + row;
      ok[u] = r < r1;
      const int loc = ok[u] ? pos[r] : 0;
      if constexpr (kInPlace) {  // loc is the token
        ok[u] = LoadTokenRows(kread, vread, ok[u], loc, n, &kr[u], &vr[u]);
      } else {
        const bool sec = loc < 0;  // a second-set row (PlaceRows' overflow)
        const int64_t at = static_cast<int64_t>(sec ? -1 - loc : loc) * D;
        kr[u] = ok[u] ? LoadStream16((sec ? kb2 : kb) + at) : make_uint4(0, 0, 0, 0);
        vr[u] = ok[u] ? LoadStream16((sec ? vb2 : vb) + at) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[8], vf[8];
      Unpack8<T>(kr[u], kf);
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) dot = fmaf(qf[e], kf[e], dot);
#pragma unroll
      for (int o = L / 2; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      const int k_at = g0 - r0 + u * R + row;  // the row's place in the split (kStats: < kRows)
      if (!ok[u]) {
        if constexpr (kStats) {
          if (lr == 0) stash.draws[k_at] = 0;
        }
        continue;
      }
      Unpack8<T>(vr[u], vf);
      const float lw =
          p.log2_weights != nullptr ? p.log2_weights[bh * p.max_selected + g0 + u * R + row] : 0.f;
      const float sc = dot * scale + lw;
      if constexpr (kStats) {
        stash.v[k_at][lr] = vr[u];
        if (lr == 0) {
          stash.score[k_at] = sc;
          stash.draws[k_at] =
              p.row_counts != nullptr ? p.row_counts[bh * p.max_selected + g0 + u * R + row] : 1;
        }
      }
      const float mn = fmaxf(m, sc);
      const float a = Exp2OrZero(m - mn);
      const float pw = exp2f(sc - mn);
      lsum = lsum * a + pw;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = fmaf(acc[e], a, pw * vf[e]);
      m = mn;
    }
  }
  slots.Put(warp * R + row, lr, m, lsum, acc);
  __syncthreads();
  if constexpr (kStats) {
    if (tid == 0) {
      int32_t total = 0;
      for (int k = 0; k < DrawStash<D>::kRows; ++k) total += stash.draws[k];
      stash.total = total;
    }
  }
  // In place, the splits of a head are one cluster: each block's part stays in its shared memory
  // and the cluster's first block merges them (no workspace, no merge kernel).
  __shared__ float cluster_o[kInPlace ? D : 1];
  __shared__ float cluster_lse;
  slots.Merge(tid, kRowThreads, [&](int dim, float num, float den, float gm) {
    const float o = den > 0.f ? num / den : 0.f;
    const float lse = den > 0.f ? gm + log2f(den) : kNegInf;
    if (num_splits == 1) static_cast<uint16_t*>(s.out)[bh * D + dim] = FloatToBits<T>(o);
    if constexpr (kInPlace) {
      if (num_splits > 1 || kStats) {
        cluster_o[dim] = o;
        if (dim == 0) cluster_lse = lse;
      }
    } else if (num_splits > 1) {
      part_o[(bh * num_splits + split) * D + dim] = o;
      if (dim == 0) part_lse[bh * num_splits + split] = lse;
    }
  });
  if constexpr (kInPlace) {
    if (num_splits > 1) {
      MergeCluster<T, D, kMaxClusterSplits>(cluster_o, &cluster_lse, num_splits, bh, s.out);
    }
  }
  if constexpr (kStats) {
    StandardErrorOfDraws<T, D>(stash, cluster_o, &cluster_lse, num_splits, bh, p.standard_errors);
  }
}

// SelectedRowsSharedKernel's blocks: half SelectedRowsKernel's threads, so that two fit an SM
// beside the G heads' softmax states in registers (about 180 registers a thread at G = 4), and a
// kv head's rows spread over as many blocks as load them in one round. No clusters: the splits
// write their parts and MergeSplits combines them. A kv head's splits as one cluster, as the
// per-head kernel's, run inside one GPC, and the host link's zero-copy reads wait on address
// translation there (2026-12-03, H200: a group sample of 513 rows a kv head in clusters of 7 or
// 13 blocks read 2.1 MB a layer in 110-123 us at 128k, without them in 95 us; the per-head
// kernel, its 96 blocks in clusters of 3 spread over the GPCs, in 66 us).
constexpr int kSharedThreads = 128;
// Row groups a lane of SelectedRowsSharedKernel loads at once for a GQA group of g: one more than
// SelectedRowsKernel, fewer at g = 8, whose eight heads' states fill the registers; and the rows
// a block loads so.
constexpr int SharedUnroll(int g) { return g >= 8 ? kRowsUnroll - 1 : kRowsUnroll + 1; }
constexpr int SharedRowsPerBlockRound(int d, int g) {
  return (kSharedThreads / 32) * (32 / (d / 8)) * SharedUnroll(g);
}

// In place, the G query heads of a kv head over the same rows (SelectedRowsParams::shared_rows):
// a block per (sequence, kv head) and split, each row's K and V read once and scored against the
// G heads' queries (in shared memory), each head with its own log2 weight and running softmax;
// with more than one split, each split's part per head into part_o / part_lse.
template <typename T, int D, int G>
__global__ void __launch_bounds__(kSharedThreads, 2)
    SelectedRowsSharedKernel(SelectedRowsParams p, int num_splits, float* __restrict__ part_o,
                             float* __restrict__ part_lse) {
  GridDependencyWait();  // LaunchDependent: the earlier kernels' writes first
  constexpr int L = D / 8, R = 32 / L, NW = kSharedThreads / 32, U = SharedUnroll(G);
  __shared__ SlotSoftmax<D, NW * R, true> slots;  // one head at a time
  __shared__ __align__(16) float qs[G][D];
  const DecodeShape& s = p.shape;
  const int64_t bj = blockIdx.x;  // b * Hkv + j
  const int split = blockIdx.y;
  const int b = static_cast<int>(bj / s.num_kv_heads), j = static_cast<int>(bj % s.num_kv_heads);
  const int64_t bh0 = static_cast<int64_t>(b) * s.num_q_heads + static_cast<int64_t>(j) * G;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, row = lane / L, lr = lane % L;
  const int c = p.counts[bh0];  // the G heads' rows are the first head's
  const int per = (c + num_splits - 1) / num_splits;
  const int r0 = min(c, split * per), r1 = min(c, r0 + per);
  if (p.rows_read != nullptr && split == 0 && tid == 0) *p.rows_read[bj] = c;  // once a group
  const int32_t* pos = p.positions + bh0 * p.max_selected;                     // tokens
  const RowReader kread = MakeRowReader(s, false, b, j, lr * 8);
  const RowReader vread = MakeRowReader(s, true, b, j, lr * 8);
  const int n = s.seq_lens[b];
  for (int x = tid; x < G * L; x += kSharedThreads) {
    float f[8];
    Unpack8<T>(*reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(s.q) +
                                               (bh0 + x / L) * D + (x % L) * 8),
               f);
#pragma unroll
    for (int e = 0; e < 8; ++e) qs[x / L][(x % L) * 8 + e] = f[e];
  }
  __syncthreads();
  const float scale = s.scale * kLog2e;  // base-2 softmax
  float m[G], lsum[G], acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = kNegInf;
    lsum[g] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
  }
  for (int g0 = r0 + warp * R * U; g0 < r1; g0 += NW * R * U) {  // uniform over the warp
    uint4 kr[U], vr[U];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int r = g0 + u * R + row;
      ok[u] = LoadTokenRows(kread, vread, r < r1, r < r1 ? pos[r] : 0, n, &kr[u], &vr[u]);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[8], vf[8];
      Unpack8<T>(kr[u], kf);
      Unpack8<T>(vr[u], vf);
      const int r = g0 + u * R + row;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float4 qa = *reinterpret_cast<const float4*>(&qs[g][lr * 8]);
        const float4 qb = *reinterpret_cast<const float4*>(&qs[g][lr * 8 + 4]);
        float dot = qa.x * kf[0];
        dot = fmaf(qa.y, kf[1], dot);
        dot = fmaf(qa.z, kf[2], dot);
        dot = fmaf(qa.w, kf[3], dot);
        dot = fmaf(qb.x, kf[4], dot);
        dot = fmaf(qb.y, kf[5], dot);
        dot = fmaf(qb.z, kf[6], dot);
        dot = fmaf(qb.w, kf[7], dot);
#pragma unroll
        for (int o = L / 2; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        if (!ok[u]) continue;
        const float lw =
            p.log2_weights != nullptr ? p.log2_weights[(bh0 + g) * p.max_selected + r] : 0.f;
        const float sc = dot * scale + lw;
        const float mn = fmaxf(m[g], sc);
        const float a = Exp2OrZero(m[g] - mn);
        const float pw = exp2f(sc - mn);
        lsum[g] = lsum[g] * a + pw;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(acc[g][e], a, pw * vf[e]);
        m[g] = mn;
      }
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    slots.Put(warp * R + row, lr, m[g], lsum[g], acc[g]);
    __syncthreads();
    slots.Merge(tid, kSharedThreads, [&](int dim, float num, float den, float gm) {
      const float o = den > 0.f ? num / den : 0.f;
      const int64_t bh = bh0 + g;
      if (num_splits == 1) {
        static_cast<uint16_t*>(s.out)[bh * D + dim] = FloatToBits<T>(o);
      } else {  // merged by MergeSplits
        part_o[(bh * num_splits + split) * D + dim] = o;
        if (dim == 0) part_lse[bh * num_splits + split] = den > 0.f ? gm + log2f(den) : kNegInf;
      }
    });
    __syncthreads();  // the slots are the next head's
  }
}

int StandardErrorSplits(const SelectedRowsParams& p);

struct SelectedRowsLaunch {
  const SelectedRowsParams& p;
  int splits;
  float* part_o;
  float* part_lse;
  cudaStream_t stream;
  template <typename T, int D, int G>
  cudaError_t operator()() const {
    const DecodeShape& s = p.shape;
    const int32_t bh = s.batch * s.num_q_heads;
    const dim3 grid(static_cast<unsigned>(bh), splits);
    if (p.in_place && p.shared_rows) {  // a block per (b, kv head) and split, then the merge
      const dim3 kv_grid(static_cast<unsigned>(s.batch * s.num_kv_heads), splits);
      KVSPARSE_CUDA_RETURN_IF_ERROR(LaunchDependent(&SelectedRowsSharedKernel<T, D, G>, kv_grid,
                                                    dim3(kSharedThreads), 0, stream, p, splits,
                                                    part_o, part_lse));
      if (splits == 1) return cudaSuccess;
      return MergeSplits(part_o, part_lse, bh, splits, D, s.dtype, s.out, stream);
    }
    if (p.in_place) {  // a head's splits merged inside their cluster
      // With the standard error, each split's rows in one round (StandardErrorSplits).
      if (const int se_splits = StandardErrorSplits(p); se_splits > 0) {
        return LaunchDependentClusters(
            &SelectedRowsKernel<T, D, true, true>, dim3(static_cast<unsigned>(bh), se_splits),
            dim3(kRowThreads), dim3(1, se_splits, 1), 0, stream, p, se_splits, part_o, part_lse);
      }
      return LaunchDependentClusters(&SelectedRowsKernel<T, D, true>, grid, dim3(kRowThreads),
                                     dim3(1, splits, 1), 0, stream, p, splits, part_o, part_lse);
    }
    KVSPARSE_CUDA_RETURN_IF_ERROR(LaunchDependent(&SelectedRowsKernel<T, D, false>, grid,
                                                  dim3(kRowThreads), 0, stream, p, splits, part_o,
                                                  part_lse));
    return MergeSplits(part_o, part_lse, bh, splits, D, s.dtype, s.out, stream);
  }
};

// The splits of the per-head in-place kernel that states each head's standard error: enough
// that every split's rows fit one round, within one cluster; 0 where none is asked, or where
// the rows are not read in place per head, or more would be needed (the heads' errors are then
// NaN: not stated).
int StandardErrorSplits(const SelectedRowsParams& p) {
  if (p.standard_errors == nullptr || !p.in_place || p.shared_rows) return 0;
  const int rows_per = RowsPerBlockRound(p.shape.head_dim);
  const int splits = std::max(1, (p.max_selected + rows_per - 1) / rows_per);
  return splits <= kMaxClusterSplits ? splits : 0;
}

int SelectedRowsSplits(const SelectedRowsParams& p) {
  const bool shared = p.in_place && p.shared_rows;  // a block per (b, kv head) and split
  const int64_t bh =
      static_cast<int64_t>(p.shape.batch) * (shared ? p.shape.num_kv_heads : p.shape.num_q_heads);
  if (bh <= 0) return 1;
  const int64_t want = (2 * static_cast<int64_t>(NumSms()) + bh - 1) / bh;
  // In place (rows read over the host link, a latency of microseconds each): splits enough that
  // a block loads all its rows in one round, within `want`; from device rows, 256 rows a split.
  const int64_t rows_per =
      shared ? SharedRowsPerBlockRound(p.shape.head_dim, p.shape.num_q_heads / p.shape.num_kv_heads)
      : p.in_place ? RowsPerBlockRound(p.shape.head_dim)
                   : 256;
  int64_t most = std::max<int64_t>(1, (p.max_selected + rows_per - 1) / rows_per);
  if (p.in_place && !shared) most = std::min<int64_t>(most, kMaxClusterSplits);  // one cluster
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, most)));
}

}  // namespace

size_t UnionSelectedWorkspaceBytes(const UnionSelectedParams& p) {
  const size_t sets = static_cast<size_t>(std::max(p.batch, 0)) * std::max(p.num_kv_heads, 0);
  return 2 * AlignUp(sets * UnionWords(p) * sizeof(uint32_t), 256);
}

cudaError_t UnionSelected(const UnionSelectedParams& p, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream) {
  if (p.batch < 0 || p.num_kv_heads <= 0 || p.num_q_heads <= 0 ||
      p.num_q_heads % p.num_kv_heads != 0 || p.num_q_heads / p.num_kv_heads > 32 ||
      p.max_selected < 0 || p.max_seq_len < 0) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0) return cudaSuccess;
  const int64_t G = p.num_q_heads / p.num_kv_heads;
  const int64_t longest = std::min<int64_t>(p.max_seq_len, G * p.max_selected);
  if (p.indices == nullptr || p.counts == nullptr || p.seq_lens == nullptr ||
      p.positions == nullptr || p.out.tokens == nullptr || p.out.count == nullptr ||
      p.max_union < 0 ||
      p.out.capacity < (p.max_union > 0 ? std::min<int64_t>(p.max_union, longest) : longest) ||
      workspace == nullptr || workspace_bytes < UnionSelectedWorkspaceBytes(p)) {
    return cudaErrorInvalidValue;
  }
  const int words = UnionWords(p);
  const size_t sets = static_cast<size_t>(p.batch) * p.num_kv_heads;
  auto* bits = static_cast<uint32_t*>(workspace);
  auto* rank = reinterpret_cast<int32_t*>(static_cast<char*>(workspace) +
                                          AlignUp(sets * words * sizeof(uint32_t), 256));
  const auto kernel = words <= kUnionStagedWords ? &UnionKernel<true> : &UnionKernel<false>;
  return LaunchDependent(kernel, dim3(static_cast<unsigned>(sets)), dim3(kUnionThreads), 0, stream,
                         p, words, bits, rank);
}

size_t PlaceRowsWorkspaceBytes(const PlaceRowsParams& p) { return PlaceWorkspace::Of(p).total; }

cudaError_t PlaceRows(const PlaceRowsParams& p, void* workspace, size_t workspace_bytes,
                      cudaStream_t stream) {
  if (p.batch < 0 || p.num_kv_heads <= 0 || p.num_q_heads <= 0 ||
      p.num_q_heads % p.num_kv_heads != 0 || p.max_selected < 0 || p.cache.capacity < 0 ||
      p.rows.capacity < 0) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0) return cudaSuccess;
  const PlaceWorkspace w = PlaceWorkspace::Of(p);
  const bool cached = p.cache.capacity > 0;
  if (p.rows.tokens == nullptr || p.rows.count == nullptr || p.positions == nullptr ||
      p.counts == nullptr || p.fetch.tokens == nullptr || p.fetch.count == nullptr ||
      p.fetch_dest == nullptr || p.fetch.capacity < p.rows.capacity ||
      (cached &&
       (p.cache.tokens == nullptr || p.cache.slots == nullptr || p.cache.count == nullptr)) ||
      (w.total > 0 && workspace == nullptr) || workspace_bytes < w.total) {
    return cudaErrorInvalidValue;
  }
  return LaunchDependent(&PlaceKernel, dim3(static_cast<unsigned>(p.batch * p.num_kv_heads)),
                         dim3(kPlaceThreads), 0, stream, p, w, static_cast<char*>(workspace));
}

cudaError_t FetchRows(const FetchRowsParams& p, cudaStream_t stream) {
  const DecodeShape& s = p.shape;
  if (s.batch < 0 || s.num_kv_heads <= 0 || p.max_rows < 0 ||
      (s.head_dim * static_cast<int>(DTypeSize(s.dtype))) % 16 != 0 || s.head_dim <= 0) {
    return cudaErrorInvalidValue;
  }
  if (s.batch == 0 || p.max_rows == 0) return cudaSuccess;
  const bool has_k = s.k != nullptr || s.k_heads != nullptr || s.k_pages.enabled();
  const bool has_v = s.v != nullptr || s.v_heads != nullptr || s.v_pages.enabled();
  if (!has_k || !has_v || p.out.tokens == nullptr || p.out.count == nullptr || p.out.k == nullptr ||
      p.out.v == nullptr || (p.dest == nullptr && p.out.capacity < p.max_rows) ||
      (p.all_tokens && (p.seq_lens == nullptr || p.max_rows < p.max_seq_len || p.dest != nullptr ||
                        p.source_by_position)) ||
      ((p.second.k == nullptr) != (p.second.v == nullptr))) {
    return cudaErrorInvalidValue;
  }
  const int row_vecs = s.head_dim * static_cast<int>(DTypeSize(s.dtype)) / 16;
  const dim3 grid((p.max_rows + kFetchRows - 1) / kFetchRows,
                  static_cast<unsigned>(s.batch * s.num_kv_heads));
  return LaunchDependent(&FetchKernel, grid, dim3(kFetchThreads), 0, stream, p, row_vecs);
}

cudaError_t WarmPagedRows(const WarmPagedRowsParams& p, cudaStream_t stream) {
  if (p.batch < 0 || p.num_kv_heads <= 0 || p.max_seq_len < 0 || p.chains < 0 ||
      p.pages.page_shift < 0 || p.pages.page_shift > 30) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0 || p.max_seq_len == 0) return cudaSuccess;
  if (!p.pages.enabled() || p.seq_lens == nullptr) return cudaErrorInvalidValue;
  const int32_t max_pages = ((p.max_seq_len - 1) >> p.pages.page_shift) + 1;
  const int64_t total = static_cast<int64_t>(p.batch) * p.num_kv_heads * max_pages;
  const int64_t threads = p.chains > 0 ? std::min<int64_t>(p.chains, total) : total;
  const int64_t blocks = (threads + kWarmThreads - 1) / kWarmThreads;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  WarmKernel<<<static_cast<unsigned>(blocks), kWarmThreads, 0, stream>>>(p, max_pages, threads);
  return cudaGetLastError();
}

size_t SelectedRowsWorkspaceBytes(const SelectedRowsParams& p) {
  const int splits = SelectedRowsSplits(p);
  // Per head in place: merged inside each head's cluster. Shared rows: parts, merged after.
  if (splits == 1 || (p.in_place && !p.shared_rows)) return 0;
  const size_t bh = static_cast<size_t>(std::max(p.shape.batch, 0)) * p.shape.num_q_heads;
  return AlignUp(bh * splits * p.shape.head_dim * sizeof(float), 256) +
         AlignUp(bh * splits * sizeof(float), 256);
}

cudaError_t SelectedRowsDecode(const SelectedRowsParams& p, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream) {
  const DecodeShape& s = p.shape;
  if (s.batch < 0 || s.num_kv_heads <= 0 || s.num_q_heads <= 0 ||
      s.num_q_heads % s.num_kv_heads != 0 || p.max_selected < 0) {
    return cudaErrorInvalidValue;
  }
  if (s.batch == 0) return cudaSuccess;
  const bool has_k = s.k != nullptr || s.k_heads != nullptr || s.k_pages.enabled();
  const bool has_v = s.v != nullptr || s.v_heads != nullptr || s.v_pages.enabled();
  const bool rows_ok = p.in_place ? has_k && has_v && s.seq_lens != nullptr
                                  : p.rows.k != nullptr && p.rows.v != nullptr;
  const size_t need = SelectedRowsWorkspaceBytes(p);
  if (s.q == nullptr || s.out == nullptr || !rows_ok || p.positions == nullptr ||
      p.counts == nullptr || ((p.second.k == nullptr) != (p.second.v == nullptr)) ||
      workspace_bytes < need) {
    return cudaErrorInvalidValue;
  }
  const int splits = SelectedRowsSplits(p);
  const size_t bh = static_cast<size_t>(s.batch) * s.num_q_heads;
  const bool parts = need > 0;  // per head in place: merged in its cluster, no parts
  float* part_o = parts ? static_cast<float*>(workspace) : nullptr;
  float* part_lse =
      !parts ? nullptr
             : reinterpret_cast<float*>(static_cast<char*>(workspace) +
                                        AlignUp(bh * splits * s.head_dim * sizeof(float), 256));
  // The shared-rows kernel holds its G heads' states in registers: dispatched on the group.
  const int group = p.in_place && p.shared_rows ? s.num_q_heads / s.num_kv_heads : 1;
  if (p.standard_errors != nullptr && StandardErrorSplits(p) == 0) {  // not stated: NaN
    KVSPARSE_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(p.standard_errors, 0xFF, bh * sizeof(float), stream));
  }
  return DispatchDecode(s.dtype, s.head_dim, group,
                        SelectedRowsLaunch{p, splits, part_o, part_lse, stream});
}

}  // namespace kvsparse::kernels::cuda
