// Block-level pieces of the tile-based sampling kernels (S2ANTA prop/flash/iid): score a tile of
// kSantaTile tokens for the G heads of a GQA group into shared memory, per-head tile statistics,
// systematic counts, compaction of the sampled rows and a weighted V-row gather.
#ifndef KVSPARSE_KERNELS_CUDA_TILE_COMMON_CUH_
#define KVSPARSE_KERNELS_CUDA_TILE_COMMON_CUH_

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/santa.h"

namespace kvsparse::kernels::cuda {

constexpr int kTile = kSantaTile;
constexpr int kPerLane = kTile / 32;  // tokens of a tile per lane in the per-head scans

template <int D, int G>
struct TileCfg {
  using Geom = RowGeom<D>;
  static constexpr int kWarps = (G * D >= 2048) ? 4 : 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kUnroll = G >= 8 ? 2 : 4;
  static constexpr int kMinBlocks = G >= 8 ? 1 : 2;
};

// K rows are staged into shared memory with cp.async in rounds of kStageSlots 16-byte vectors
// per thread, in a ring of kBufs buffers: while one round is scored the next kBufs - 1 are
// loading (across tile boundaries). Each thread reads back only the slots it filled, so staging
// needs no barrier. Dynamic shared memory: ScoreStageBytes.
constexpr int kStageSlots = 8;

template <int D, int G, int NW, int U>
struct ScoreGeom {
  static constexpr int L = D / 8;
  static constexpr int R = 32 / L;
  static constexpr int TOK = R * U;                  // tokens per warp iteration
  static constexpr int kIters = kTile / (NW * TOK);  // iterations per warp and tile
  static constexpr int kPerRound = Max(1, Min(kIters, kStageSlots / U));
  static constexpr int kRounds = kIters / kPerRound;
};

template <int NW, int kBufs>
constexpr size_t ScoreStageBytes() {
  return size_t{kBufs} * kStageSlots * NW * 32 * 16;
}

// Issues round `round` of the K rows of tile [t0, t0 + len) into `buf` (one cp.async group).
template <int D, int G, int NW, int U>
__device__ __forceinline__ void IssueKRound(const uint16_t* kb, int64_t ts, int t0, int len,
                                            int round, uint4* buf, int warp, int row) {
  using Geo = ScoreGeom<D, G, NW, U>;
  const int tid = threadIdx.x;
#pragma unroll
  for (int it = 0; it < Geo::kPerRound; ++it) {
    const int base = (round * Geo::kPerRound + it) * NW * Geo::TOK + warp * Geo::TOK;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int tok = base + u * Geo::R + row;
      const bool ok = tok < len;
      CpAsync16(&buf[(it * U + u) * NW * 32 + tid],
                kb + (ok ? static_cast<int64_t>(t0 + tok) * ts : 0), ok);
    }
  }
  CpAsyncCommit();
}

// ---- Tensor-core scoring geometry (head_dim 64 and 128) ---------------------------------------
// S^T[token][head] = K[token, :] . Q[head, :] with mma.m16n8k16 (A = 16 tokens x 16 dims of K,
// B = 16 dims x 8 heads of Q; heads >= G are zero). The head dimension inside one mma is a
// permutation of the physical one: lane c = lane % 4 holds, for every 32-dim segment m, the
// 16 bytes at dims 32m + 8c .. 32m + 8c + 7 of its token rows (tokens lane / 4 and lane / 4 + 8
// of a 16-token chunk) and of its head's q row (head lane / 4); words 0-1 feed k-step 2m and
// words 2-3 k-step 2m + 1, for A and B alike, so the products pair the same physical dims.
template <int D, int NW>
struct MmaGeom {
  static constexpr int kSeg = D / 32;                // 16-byte segments per lane and row
  static constexpr int kSlotsPerChunk = 2 * kSeg;    // two token rows per lane
  static constexpr int kChunks = kTile / (16 * NW);  // 16-token chunks per warp and tile
  static constexpr int kPerRound = Max(1, Min(kChunks, kStageSlots / kSlotsPerChunk));
  static constexpr int kRounds = kChunks / kPerRound;
};

// Tensor cores for head_dim <= 128, CUDA cores for 256.
template <int D>
constexpr bool kUseMma = D <= 128;

// The B fragments of q: head lane / 4 (zero for heads >= G), kSeg 16-byte segments.
template <int D, int G>
__device__ __forceinline__ void LoadQFrag(const DecodeShape& s, int b, int kvh, int lane,
                                          uint4 (&qfrag)[D / 32]) {
  const int head = lane / 4, c = lane % 4;
  const uint16_t* qb = static_cast<const uint16_t*>(s.q) +
                       (static_cast<int64_t>(b) * s.num_q_heads + kvh * G + head) * D + 8 * c;
#pragma unroll
  for (int m = 0; m < D / 32; ++m) {
    qfrag[m] =
        head < G ? __ldg(reinterpret_cast<const uint4*>(qb + 32 * m)) : make_uint4(0, 0, 0, 0);
  }
}

template <int D, int G, int NW>
__device__ __forceinline__ void IssueKRoundMma(const uint16_t* kb0, int64_t ts, int t0, int len,
                                               int round, uint4* buf, int warp, int lane) {
  using Geo = MmaGeom<D, NW>;
  const int tid = threadIdx.x;
  const uint16_t* kb = kb0 + 8 * (lane % 4);
#pragma unroll
  for (int ch = 0; ch < Geo::kPerRound; ++ch) {
    const int q = (round * Geo::kPerRound + ch) * NW + warp;  // chunk within the tile
    const int tok0 = q * 16 + lane / 4, tok1 = tok0 + 8;
    const bool ok0 = tok0 < len, ok1 = tok1 < len;
    const int64_t off0 = ok0 ? static_cast<int64_t>(t0 + tok0) * ts : 0;
    const int64_t off1 = ok1 ? static_cast<int64_t>(t0 + tok1) * ts : 0;
#pragma unroll
    for (int m = 0; m < Geo::kSeg; ++m) {
      CpAsync16(&buf[(ch * Geo::kSlotsPerChunk + 2 * m) * NW * 32 + tid], kb + off0 + 32 * m, ok0);
      CpAsync16(&buf[(ch * Geo::kSlotsPerChunk + 2 * m + 1) * NW * 32 + tid], kb + off1 + 32 * m,
                ok1);
    }
  }
  CpAsyncCommit();
}

// The K rounds of tiles [t_begin, t_end) of one (sequence, kv head), in order, through a ring
// of kBufs staging buffers. Threads 0 .. NW * 32 - 1 of the block (the scoring warps) all run
// the same sequence of calls.
template <int D, int G, int NW, int U, int kBufs>
struct KStream {
  static constexpr int kRounds =
      kUseMma<D> ? MmaGeom<D, NW>::kRounds : ScoreGeom<D, G, NW, U>::kRounds;  // per tile
  static constexpr int kBuf = kStageSlots * NW * 32;                           // uint4 per buffer

  const uint16_t* kb0;  // token 0, dim 0 of the K rows
  int64_t ts;           // token stride (elements)
  int n;                // sequence length
  int t_begin;
  int total;  // rounds in all
  uint4* kst;
  int issued;
  int consumed;

  // Starts the first kBufs - 1 rounds.
  __device__ __forceinline__ void Start(const uint16_t* k0, int64_t stride, int len, int tb, int te,
                                        uint4* stage, int warp, int lane) {
    kb0 = k0;
    ts = stride;
    n = len;
    t_begin = tb;
    total = te > tb ? (te - tb) * kRounds : 0;
    kst = stage;
    issued = 0;
    consumed = 0;
#pragma unroll
    for (int i = 0; i < kBufs - 1; ++i) IssueNext(warp, lane);
  }

  __device__ __forceinline__ void IssueNext(int warp, int lane) {
    if (issued < total) {
      const int t = t_begin + issued / kRounds;
      const int r = issued % kRounds;
      const int t0 = t * kTile;
      const int len = min(kTile, n - t0);
      uint4* buf = kst + (issued % kBufs) * kBuf;
      if constexpr (kUseMma<D>) {
        IssueKRoundMma<D, G, NW>(kb0, ts, t0, len, r, buf, warp, lane);
      } else {
        constexpr int L = D / 8;
        IssueKRound<D, G, NW, U>(kb0 + (lane % L) * 8, ts, t0, len, r, buf, warp, lane / L);
      }
    } else {
      CpAsyncCommit();  // an empty group keeps the wait count uniform
    }
    ++issued;
  }

  // Starts the round kBufs - 1 ahead and returns this thread's slots of the next round, once
  // they have landed.
  __device__ __forceinline__ const uint4* Next(int warp, int lane) {
    IssueNext(warp, lane);
    CpAsyncWait<kBufs - 1>();
    const uint4* cur = kst + (consumed % kBufs) * kBuf;
    ++consumed;
    return cur;
  }
};

// Scores (log2 units) of tokens t0 .. t0 + len - 1 (len <= kTile, the stream's next tile) into
// ssm[g * kTile + i]; entries i >= len get -inf. CUDA-core path: lane (row, lr) holds dims lr*8
// of its rows.
template <typename T, int D, int G, int NW, int U, typename KS>
__device__ __forceinline__ void ScoreTile(const float (&qf)[G][8], KS& ks, int len, float* ssm,
                                          int warp, int lane) {
  using Geo = ScoreGeom<D, G, NW, U>;
  constexpr int L = Geo::L;
  constexpr int R = Geo::R;
  const int tid = threadIdx.x;
  const int row = lane / L, lr = lane % L;
  for (int round = 0; round < Geo::kRounds; ++round) {
    const uint4* cur = ks.Next(warp, lane);
#pragma unroll
    for (int it = 0; it < Geo::kPerRound; ++it) {
      const int base = (round * Geo::kPerRound + it) * NW * Geo::TOK + warp * Geo::TOK;
      uint4 kr[U];
#pragma unroll
      for (int u = 0; u < U; ++u) kr[u] = cur[(it * U + u) * NW * 32 + tid];
      float part[G * U];
      PartialDots<T, G, U>(qf, kr, part);
      ReduceDots<G, U, L>(part, lr, [&](int g, int u, float v) {
        const int tok = base + u * R + row;
        ssm[g * kTile + tok] = tok < len ? v : kNegInf;
      });
    }
  }
}

// Tensor-core ScoreTile.
template <typename T, int D, int G, int NW, typename KS>
__device__ __forceinline__ void ScoreTileMma(const uint4 (&qfrag)[D / 32], float qscale, KS& ks,
                                             int len, float* ssm, int warp, int lane) {
  using Geo = MmaGeom<D, NW>;
  const int tid = threadIdx.x;
  const int c = lane % 4;
  for (int round = 0; round < Geo::kRounds; ++round) {
    const uint4* cur = ks.Next(warp, lane);
#pragma unroll
    for (int ch = 0; ch < Geo::kPerRound; ++ch) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int m = 0; m < Geo::kSeg; ++m) {
        const uint4 k0 = cur[(ch * Geo::kSlotsPerChunk + 2 * m) * NW * 32 + tid];
        const uint4 k1 = cur[(ch * Geo::kSlotsPerChunk + 2 * m + 1) * NW * 32 + tid];
        Mma16816<T>(acc, k0.x, k1.x, k0.y, k1.y, qfrag[m].x, qfrag[m].y);
        Mma16816<T>(acc, k0.z, k1.z, k0.w, k1.w, qfrag[m].z, qfrag[m].w);
      }
      const int q = (round * Geo::kPerRound + ch) * NW + warp;
      const int tok0 = q * 16 + lane / 4, tok1 = tok0 + 8;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int h = 2 * c + j;
        if (h < G) {
          ssm[h * kTile + tok0] = tok0 < len ? acc[j] * qscale : kNegInf;
          ssm[h * kTile + tok1] = tok1 < len ? acc[2 + j] * qscale : kNegInf;
        }
      }
    }
  }
}

// q rows of the G heads of kv head kvh of sequence b, 8 dims per lane (dims lr*8 ..), prescaled
// by scale * log2(e) so that scores come out in log2 units.
template <typename T, int D, int G>
__device__ __forceinline__ void LoadQ(const DecodeShape& s, int b, int kvh, int lr,
                                      float (&qf)[G][8]) {
  const float qscale = s.scale * kLog2e;
  const uint16_t* qb = static_cast<const uint16_t*>(s.q);
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(
        qb + (static_cast<int64_t>(b) * s.num_q_heads + kvh * G + g) * D + lr * 8));
    Unpack8<T>(raw, qf[g]);
#pragma unroll
    for (int e = 0; e < 8; ++e) qf[g][e] *= qscale;
  }
}

// Per-thread q state of the scoring path.
template <int D, int G>
struct QState {
  float qf[G][8];       // CUDA-core path: dims lr*8 .. of each head, prescaled
  uint4 qfrag[D / 32];  // tensor-core path: raw q fragments
  float qscale = 0.f;
};

template <typename T, int D, int G>
__device__ __forceinline__ void LoadQState(const DecodeShape& s, int b, int kvh, int lane, int lr,
                                           QState<D, G>& q) {
  if constexpr (kUseMma<D>) {
    LoadQFrag<D, G>(s, b, kvh, lane, q.qfrag);
    q.qscale = s.scale * kLog2e;
  } else {
    LoadQ<T, D, G>(s, b, kvh, lr, q.qf);
  }
}

// Scores of the stream's next tile (len tokens) into ssm (see ScoreTile / ScoreTileMma).
template <typename T, int D, int G, int NW, int U, typename KS>
__device__ __forceinline__ void ScoreTileAny(const QState<D, G>& q, KS& ks, int len, float* ssm,
                                             int warp, int lane) {
  if constexpr (kUseMma<D>) {
    ScoreTileMma<T, D, G, NW>(q.qfrag, q.qscale, ks, len, ssm, warp, lane);
  } else {
    ScoreTile<T, D, G, NW, U>(q.qf, ks, len, ssm, warp, lane);
  }
}

// Named barriers (ids 1..15; 0 is __syncthreads) for producer / consumer warps of a block:
// Arrive does not wait; Sync waits until `threads` threads have arrived or synced.
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void NamedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Per-head statistics of one tile (one warp): lane owns tokens lane*8 .. lane*8+7.
// m2 = max score (log2 units), ell = sum of u, u[i] = 2^(s - m2) (0 for masked tokens).
__device__ __forceinline__ void HeadStats(const float* s, int lane, float& m2, float& ell,
                                          float (&u)[kPerLane]) {
  float v[kPerLane];
  const float4* s4 = reinterpret_cast<const float4*>(s + lane * kPerLane);
#pragma unroll
  for (int i = 0; i < kPerLane / 4; ++i) {
    const float4 x = s4[i];
    v[4 * i] = x.x;
    v[4 * i + 1] = x.y;
    v[4 * i + 2] = x.z;
    v[4 * i + 3] = x.w;
  }
  float mx = kNegInf;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) mx = fmaxf(mx, v[i]);
  m2 = WarpMax(mx);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    u[i] = (v[i] == kNegInf || m2 == kNegInf) ? 0.f : exp2f(v[i] - m2);
    sum += u[i];
  }
  ell = WarpSum(sum);
}

// Systematic counts of one tile (one warp), Algorithm 5 lines 5-9:
//   x_n = inv_delta * u_n,  c_n = floor(a0 + p_n + x_n) - floor(a0 + p_n),  p_{n+1} = p_n + x_n.
__device__ __forceinline__ void SystematicCounts(const float (&u)[kPerLane], float inv_delta,
                                                 float a0, int lane, int* cnt) {
  float x[kPerLane];
  float local = 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    x[i] = __fmul_rn(inv_delta, u[i]);
    local = __fadd_rn(local, x[i]);
  }
  float p = WarpExclusiveSum(local, lane);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const float f0 = __fadd_rn(a0, p);
    const float f1 = __fadd_rn(f0, x[i]);
    cnt[lane * kPerLane + i] = static_cast<int>(floorf(f1) - floorf(f0));
    p = __fadd_rn(p, x[i]);
  }
}

// One warp: indices (within the tile, increasing) of tokens sampled by any of the G heads into
// idx[0 .. E); returns E on every lane (and stores it to *num_rows unless null).
template <int G>
__device__ __forceinline__ int CompactRows(const int* cnt, int lane, int* idx, int* num_rows) {
  int flags = 0;
  int local = 0;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    int any = 0;
#pragma unroll
    for (int g = 0; g < G; ++g) any |= cnt[g * kTile + lane * kPerLane + i];
    if (any != 0) {
      flags |= 1 << i;
      ++local;
    }
  }
  int x = local;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  int pos = x - local;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    if (flags & (1 << i)) idx[pos++] = lane * kPerLane + i;
  }
  const int total = __shfl_sync(0xffffffffu, x, 31);
  if (lane == 31 && num_rows != nullptr) *num_rows = total;
  return total;
}

// Adds w[g] * cnt[g][n] * V[t0 + n] to acc[g] for the num_rows compacted rows; rows are spread
// over the warps' row slots, four loads in flight per lane.
template <typename T, int D, int G, int NW>
__device__ __forceinline__ void GatherRows(const RowReader& vb, int t0, const int* idx,
                                           int num_rows, const int* cnt, const float* w, int warp,
                                           int row, float (&acc)[G][8]) {
  constexpr int L = D / 8;
  constexpr int R = 32 / L;
  constexpr int kSlots = NW * R;
  constexpr int kIn = 4;
  for (int e0 = warp * R + row; e0 < num_rows; e0 += kSlots * kIn) {
    uint4 vr[kIn];
    int ni[kIn];
#pragma unroll
    for (int k = 0; k < kIn; ++k) {
      const int e = e0 + k * kSlots;
      ni[k] = e < num_rows ? idx[e] : -1;
      vr[k] = ni[k] >= 0 ? LoadStream16(vb.Row(t0 + ni[k])) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < kIn; ++k) {
      if (ni[k] < 0) continue;
      float vf[8];
      Unpack8<T>(vr[k], vf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float c = static_cast<float>(cnt[g * kTile + ni[k]]) * w[g];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(c, vf[e], acc[g][e]);
      }
    }
  }
}

// Sums acc over the rows of each warp and over the warps; afterwards sacc[g * D + dim] holds
// the block total (call with every thread; sacc has room for NW * G * D floats; ends with a
// barrier).
template <int D, int G, int NW>
__device__ __forceinline__ void BlockSumAcc(float (&acc)[G][8], float* sacc, int warp, int lane) {
  constexpr int L = D / 8;
#pragma unroll
  for (int off = L; off < 32; off *= 2) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], off);
    }
  }
  __syncthreads();
  if (lane < L) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float4* dst = reinterpret_cast<float4*>(sacc + (warp * G + g) * D + lane * 8);
      dst[0] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
      dst[1] = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < G * D; i += NW * 32) {
    float t = sacc[i];
    for (int w = 1; w < NW; ++w) t += sacc[w * G * D + i];
    sacc[i] = t;
  }
  __syncthreads();
}

}  // namespace kvsparse::kernels::cuda

#endif  // KVSPARSE_KERNELS_CUDA_TILE_COMMON_CUH_
