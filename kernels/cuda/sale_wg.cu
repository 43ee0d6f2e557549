// SALE's kernels on Hopper's warpgroup MMA, for builds where every arch is sm_90a (the body of
// this file compiles only with KVSPARSE_CUDA_SM90A; other builds get an empty object): the middle
// blocks' int8 estimate (MiddleKernelWg), the exact regions' thresholds (ThresholdsKernelWg) and
// the computation pass (AttendKernelWg), all for head_dim 128, with their launchers. sale.cu keeps
// the mma.sync kernels and the public launchers (kernels/cuda/sale.h), which dispatch here through
// the launchers declared in sale_common.cuh; what both files share is there too.
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/hopper.cuh"
#include "kernels/cuda/sale_common.cuh"
#include "kernels/sale.h"

#if defined(KVSPARSE_CUDA_SM90A)

namespace kvsparse::kernels::cuda::sale_internal {
namespace {

// ---- The middle blocks on Hopper's warpgroup MMA (sm_90a builds, head_dim 128, block_k 32) ----
// The same CTA tiles as MiddleKernel (8 (head, query block) pairs of one kv head, the key blocks
// [lo, hi) walked once) with the loads apart from the arithmetic, two key blocks a step: thread
// 0 copies each pair of key blocks (64 keys of 128 bytes, 8 KB, which QuantizeKeysKernel stores
// already in the 128-byte swizzle) into a ring of kWgStages buffers with one bulk copy that
// completes on the buffer's "full" barrier; four warpgroups (two (head, query block) pairs each)
// wait on it, run four wgmma.m64n64k32 per pair (A: the first pair's 64 int8 query rows in
// registers, the second's in shared memory, so that both pairs' two-block sums fit in 128
// registers without spilling), release the buffer on its "empty" barrier and test each row's
// largest sum in each of the two blocks, first by a three-instruction screen, exactly only where
// the screen lets a row through. No CTA-wide barrier per step: the warpgroups drift apart by up
// to a few steps, one's tests running while another's MMAs do. Measured on an H200 at 64k
// (docs/PERF.md, "SALE on an H200: two key blocks a step, thresholds per kv head"): 14.2 ms
// against 16.4 for one block a step (m64n32k32: a barrier wait, an MMA wait and a release per
// block), the same as both pairs' A in registers with 80 bytes spilled; a ring of 16 or 32
// single blocks, the refill 4 or 8 steps behind, one vote per step for both pairs, or the screens
// in shared memory were each no faster or slower.
constexpr int kWgConsumers = 4;  // warpgroups (measured best of 2, 4 and 8 for the 8 pairs)
constexpr int kWgPairs = kSelectWarps / kWgConsumers;  // pairs per warpgroup
constexpr int kWgThreads = kWgConsumers * 128;
constexpr int kWgStages = 8;                              // steps (block pairs) in flight
constexpr int kWgKeyBytes = 128;                          // head_dim 128, int8
constexpr int kWgBlockBytes = 8 * kFastKt * kWgKeyBytes;  // one 32-key block
constexpr int kWgStepBytes = 2 * kWgBlockBytes;           // the two blocks of a step
constexpr int kWgTileBytes = 64 * kWgKeyBytes;            // a pair's 64 int8 query rows
constexpr int kWgAlign = 1024;                            // the 128-byte swizzle's atom
constexpr size_t kMiddleWgSmem =
    kWgStages * kWgStepBytes + kWgConsumers * kWgTileBytes + kWgAlign;  // dynamic, MiddleKernelWg

// One pair as a consumer thread holds it through the walk: the A fragments of its rows
// 16 (warp % 4) + lane / 4 and + 8 (or none: its rows in shared memory), their screens
// (kernels/sale.h's SaleScreen) and its steps [xb, xe) of the CTA's walk (in blocks). Its warp's 16
// rows' thresholds, query scales and mean terms stay in shared memory (`vals`, [3][16]: the warp's
// own for the pair) and its mask row is found again (WgPairMaskRow): only the rare exact test needs
// them, and registers are what bounds this kernel (two blocks' sums of two pairs take 64 of its
// 128).
struct WgPairRows {
  uint32_t qa[kFastKs][4];
  SaleScreen screen[2];
  int32_t xb, xe;
};

// The query head of the CTA's pair p (p = kWgPairs (warp / 4) + the warpgroup's pair; its query
// block is i0 + p / head_tile).
__device__ __forceinline__ int WgPairHead(const MiddleTile& mt, int p) {
  return blockIdx.y * mt.head_tile + p % mt.head_tile;
}

// Its mask row at block lo (a live pair's: one whose query block is in the prompt).
__device__ __forceinline__ uint8_t* WgPairMaskRow(const SelectGeometry& g, const MiddleTile& mt,
                                                  uint8_t* mask, int p, int32_t i0, int32_t lo) {
  const int32_t i = i0 + p / mt.head_tile;
  return mask + (static_cast<int64_t>(WgPairHead(mt, p)) * mt.q_blocks + i) * g.k_blocks + lo;
}

// Rows past the prompt never pass (threshold +inf, zero queries). With a_tile, the pair's 64
// int8 query rows go there instead of into w.qa (the warpgroup's tile, 8 KB, 1024-aligned: the
// 128-byte swizzle, as wgmma reads A from shared memory; the caller fences and syncs).
__device__ __forceinline__ void LoadWgPair(const SelectGeometry& g, const MiddleTile& mt,
                                           const Operands& ops, int p, int32_t i0, int32_t lo,
                                           int32_t count, float* vals, int8_t* a_tile,
                                           WgPairRows& w) {
  const int lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3, wq = (threadIdx.x >> 5) & 3;
  const int h = WgPairHead(mt, p);
  const int32_t i = i0 + p / mt.head_tile;
  const bool live = i < mt.q_blocks;
  const Regions rg = RegionsOf(g, live ? i : i0);
  w.xb = live ? rg.sink_end - lo : count;
  w.xe = live ? rg.local_first - lo : 0;
  const int32_t r0 = (live ? i : 0) * g.bq;
  const int rows = live ? min(g.n, r0 + g.bq) - r0 : 0;
  const int64_t base = static_cast<int64_t>(h) * g.n + r0;
  if (a_tile != nullptr) {
    const int4* rows16 = reinterpret_cast<const int4*>(ops.q + base * kWgKeyBytes);
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // the warp's 16 rows, 16-byte chunk lane % 8 of each
      const int r = 16 * wq + 4 * e + (lane >> 3), c = lane & 7;
      *reinterpret_cast<int4*>(a_tile + r * kWgKeyBytes + ((c ^ (r & 7)) << 4)) =
          r < rows ? rows16[r * (kWgKeyBytes / 16) + c] : make_int4(0, 0, 0, 0);
    }
  } else {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int r = 16 * wq + gr + 8 * hf;
      const bool ok = r < rows;
      const int* words = reinterpret_cast<const int*>(ops.q + (base + (ok ? r : 0)) * g.d);
#pragma unroll
      for (int x = 0; x < kFastKs; ++x) {
        w.qa[x][hf] = ok ? words[8 * x + tq] : 0;
        w.qa[x][2 + hf] = ok ? words[8 * x + 4 + tq] : 0;
      }
    }
  }
  if (lane < 16) {
    const int r = 16 * wq + lane;
    const bool ok = r < rows;
    vals[lane] = ok ? ops.thr[base + r] : -kNegInf;
    vals[16 + lane] = ok ? ops.q_scale[base + r] : 0.f;
    vals[32 + lane] = ok ? ops.q_mean[base + r] : 0.f;
  }
  __syncwarp();
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = gr + 8 * hf;
    w.screen[hf] = MakeSaleScreen(g.scale, vals[16 + r], vals[32 + r], vals[r]);
  }
}

// The thread's two rows' largest sums of one block (d: the pair's sums over the block, the
// thread's columns 8 i + 2 (lane % 4) (+1) of rows lane / 4 and + 8), by three-way maxima (one
// instruction each on Hopper).
__device__ __forceinline__ void WgRowMaxima(const int* d, int (&m)[2]) {
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int* e = d + 2 * hf;
    m[hf] = __vimax3_s32(__vimax3_s32(__vimax3_s32(e[0], e[1], e[4]), e[5], e[8]), e[9], e[12]);
    m[hf] = max(m[hf], e[13]);
  }
}

// Whether either of the thread's two rows gets through its screen (a row that passes
// WgRowsPass always does).
__device__ __forceinline__ bool WgRowsMayPass(const int (&m)[2], const WgPairRows& w, float ks) {
  return SaleScreenMayPass(w.screen[0], ks, m[0]) | SaleScreenMayPass(w.screen[1], ks, m[1]);
}

// Whether any of the thread's two rows passes at its largest sum m of the block (vals: the
// pair's, as LoadWgPair wrote them): the general loop's arithmetic, so the mask is the
// reference's.
__device__ __forceinline__ bool WgRowsPass(const SelectGeometry& g, const int (&m)[2],
                                           const float* vals, float ks) {
  bool any = false;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int r = ((threadIdx.x & 31) >> 2) + 8 * hf;
    any |= SaleEstimatePasses(g.scale, vals[16 + r], ks, m[hf], vals[32 + r], vals[r]);
  }
  return any;
}

__global__ void __launch_bounds__(kWgThreads, 1)
    MiddleKernelWg(SelectGeometry g, MiddleTile mt, Operands ops, uint8_t* mask) {
  // Dynamic shared memory (kMiddleWgSmem bytes): the ring of key blocks, then each warpgroup's
  // query tile, both 1024-aligned (the swizzle's atom).
  extern __shared__ __align__(16) int8_t wg_smem[];
  int8_t* ring = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(wg_smem) + kWgAlign - 1) &
                                           ~uintptr_t{kWgAlign - 1});
  auto stage = [&](int s) { return ring + s * kWgStepBytes; };
  int8_t* qtile = ring + kWgStages * kWgStepBytes + (threadIdx.x >> 7) * kWgTileBytes;
  __shared__ uint64_t full[kWgStages], empty[kWgStages];
  __shared__ float row_vals[kWgConsumers * 4][kWgPairs][3 * 16];  // each warp's, each pair's vals
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int q_tile = kSelectWarps / mt.head_tile;
  const int32_t i0 = (gridDim.x - 1 - blockIdx.x) * q_tile;  // the longest rows first
  const int32_t lo = RegionsOf(g, i0).sink_end;
  const int32_t hi = RegionsOf(g, min(mt.q_blocks - 1, i0 + q_tile - 1)).local_first;
  if (lo >= hi) return;  // uniform: no middle block
  const int32_t count = hi - lo, steps = (count + 1) / 2;
  const int j = (blockIdx.y * mt.head_tile) / g.group;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kWgStages; ++s) {
      BarrierInit(&full[s], 1);
      BarrierInit(&empty[s], kWgConsumers * 4);  // every consumer warp
    }
    BarrierInitFence();
  }
  __syncthreads();
  // The producer, thread 0: step y's blocks 2y and 2y + 1 (the second only inside the walk: past
  // it the buffer's second half keeps stale keys, whose sums are never tested). The first
  // kWgStages steps now, the others in the walk below.
  const int8_t* src = ops.k + (static_cast<int64_t>(j) * g.n + lo * 8 * kFastKt) * kWgKeyBytes;
  auto produce = [&](int32_t y) {
    const int s = y % kWgStages;
    if (y >= kWgStages) BarrierWait(&empty[s], (y / kWgStages - 1) & 1);
    const uint32_t bytes = 2 * y + 1 < count ? kWgStepBytes : kWgBlockBytes;
    BarrierArriveExpectTx(&full[s], bytes);
    BulkCopyToShared(stage(s), src + static_cast<int64_t>(y) * kWgStepBytes, bytes, &full[s]);
  };
  if (threadIdx.x == 0) {
    for (int32_t y = 0; y < min(steps, kWgStages); ++y) produce(y);
  }
  // Each warpgroup's last pair keeps its A in shared memory (qtile) instead of registers: the
  // registers this frees keep both pairs' two-block sums out of local memory.
  WgPairRows w[kWgPairs];
#pragma unroll
  for (int pp = 0; pp < kWgPairs; ++pp) {
    LoadWgPair(g, mt, ops, kWgPairs * (warp >> 2) + pp, i0, lo, count, row_vals[warp][pp],
               pp + 1 < kWgPairs ? nullptr : qtile, w[pp]);
  }
  FenceProxyAsyncShared();  // the last pairs' query tiles, for wgmma's reads
  __syncthreads();
  const float* kscale = ops.k_scale + static_cast<int64_t>(j) * g.k_blocks + lo;
  int d[kWgPairs][32];  // the pair's sums: the step's first block in d[0..15], its second after
  const uint64_t desc0 = Swizzled128Desc(stage(0));
  const uint64_t qdesc = Swizzled128Desc(qtile);
  for (int32_t y = 0; y < steps; ++y) {
    // Step y - 1 + kWgStages into step y - 1's buffer, once every warp has released it.
    if (threadIdx.x == 0 && y >= 1 && y - 1 + kWgStages < steps) produce(y - 1 + kWgStages);
    const int32_t x = 2 * y;  // the step's first block
    const int s = y % kWgStages;
    const float ks[2] = {kscale[x], kscale[min(x + 1, count - 1)]};
    BarrierWait(&full[s], (y / kWgStages) & 1);
    const uint64_t desc = desc0 + s * (kWgStepBytes >> 4);
    WgmmaFence();
#pragma unroll
    for (int pp = 0; pp < kWgPairs; ++pp) {
#pragma unroll
      for (int k = 0; k < kFastKs; ++k) {
        if (pp + 1 < kWgPairs) {
          WgmmaS8N64(d[pp], w[pp].qa[k], desc + 2 * k, k);
        } else {
          WgmmaS8N64Shared(d[pp], qdesc + 2 * k, desc + 2 * k, k);
        }
      }
    }
    WgmmaCommitAndWaitAll();
    FenceAccumulators(d);
    __syncwarp();
    if (lane == 0) BarrierArrive(&empty[s]);
#pragma unroll
    for (int b = 0; b < 2; ++b) {
#pragma unroll
      for (int pp = 0; pp < kWgPairs; ++pp) {
        int m[2];
        WgRowMaxima(d[pp] + 16 * b, m);
        const bool on = x + b >= w[pp].xb && x + b < w[pp].xe;  // uniform over the warp
        if (__any_sync(0xffffffffu, on && WgRowsMayPass(m, w[pp], ks[b]))) {  // rarely
          const int p = kWgPairs * (warp >> 2) + pp;
          if (__any_sync(0xffffffffu, WgRowsPass(g, m, row_vals[warp][pp], ks[b])) && lane == 0) {
            WgPairMaskRow(g, mt, mask, p, i0, lo)[x + b] = 1;
          }
        }
      }
    }
  }
}

// ---- 16-bit rows of head_dim 128 in the 128-byte swizzle (the warpgroup-MMA kernels) ---------

constexpr int kSwizzledRowBytes = kSwizzledDim * 2;     // one 16-bit row
constexpr int kSwizzledTile = 64 * kSwizzledRowBytes;   // 64 query rows: 16 KB
constexpr int kSwizzledBlock = 32 * kSwizzledRowBytes;  // one 32-key block: 8 KB

// Rows [first, first + rows) of a head's 16-bit [n x 128] matrix into `tile` in the 128-byte
// swizzle, as two 64-dim atoms' columns (dims 64 hf + 8 c of row r at
// hf * rows * 128 + r * 128 + ((c ^ (r % 8)) * 16)); rows past the prompt zero; thread `tid` of
// `threads` a share (cp.async). K-major for Q and K (Swizzled128Desc), MN-major for V
// (Swizzled128MnDesc): the one layout serves both.
__device__ __forceinline__ void StageSwizzledRows(uint8_t* tile, int rows, const uint16_t* src,
                                                  int32_t first, int32_t n, int tid, int threads) {
  for (int x = tid; x < rows * 16; x += threads) {
    const int r = x >> 4, c = x & 15;  // 16 chunks of 16 bytes a row
    const bool in = first + r < n;
    const uint16_t* from = src + static_cast<int64_t>(in ? first + r : 0) * kSwizzledDim + c * 8;
    CpAsync16(tile + (c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4), from, in);
  }
}

// The descriptor offset (16-byte units) of 16-deep k-step kk in such a tile of `rows` rows: 32
// bytes within a 64-dim atom, the next atom rows * 128 bytes on.
__host__ __device__ constexpr int SwizzledKStep(int kk, int rows) {
  return (kk / 4) * (rows * 128 >> 4) + (kk % 4) * 2;
}

// ---- The thresholds on the warpgroup MMA (head_dim 128, block_k 32) -----------------------

// ThresholdsKernel's work for head_dim 128 on the warpgroup MMA (sm_90a): warpgroup w takes
// query head h0 + w, its 64 rows staged once in shared memory in the 128-byte swizzle; each exact
// key block is staged once for all kHeads (cp.async, kThrStages deep) and scored by eight
// m64n32k16 steps from shared memory, then folded as ThresholdsKernel folds it (FoldExactTiles:
// the accumulators' layout is mma.m16n8's). The sums' order is the tensor cores' again: a
// threshold may move by an ulp. Launched for middle_apart geometries only: block_k is 32 (the
// literal 32-key blocks and four 8-key tiles below).
constexpr size_t ThresholdsWgSmem(int heads) {
  return kThrStages * kSwizzledBlock + heads * kSwizzledTile + kWgAlign;
}

template <typename T, int kHeads>
__global__ void __launch_bounds__(kHeads * 128)
    ThresholdsKernelWg(SelectGeometry g, const void* q, const void* k, const float* tau,
                       Operands ops, uint8_t* mask) {
  constexpr bool kBf16 = std::is_same_v<T, Bf16>;
  extern __shared__ __align__(16) uint8_t thr_smem[];
  uint8_t* kbuf = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(thr_smem) + kWgAlign - 1) & ~uintptr_t{kWgAlign - 1});
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  uint8_t* qs = kbuf + kThrStages * kSwizzledBlock + wg * kSwizzledTile;
  const int i = blockIdx.x, h0 = blockIdx.y * kHeads, j = h0 / g.group, h = h0 + wg;
  const Regions rg = RegionsOf(g, i);
  const int32_t r0 = i * g.bq, rows = min(g.n, r0 + g.bq) - r0;
  WriteExactMaskRows(g, rg, h0, kHeads, i, mask);
  const uint16_t* qh =
      static_cast<const uint16_t*>(q) + static_cast<int64_t>(h) * g.n * kSwizzledDim;
  const uint16_t* kh =
      static_cast<const uint16_t*>(k) + static_cast<int64_t>(j) * g.n * kSwizzledDim;
  StageSwizzledRows(qs, 64, qh, r0, g.n, threadIdx.x & 127, 128);
  const ExactBlocks blocks = ExactBlocksOf(rg);
  const int32_t nx = blocks.count;
  auto stage = [&](int32_t x) {
    StageSwizzledRows(kbuf + (x % kThrStages) * kSwizzledBlock, 32, kh, blocks[x] * 32, g.n,
                      threadIdx.x, kHeads * 128);
  };
#pragma unroll
  for (int x = 0; x < kThrStages - 1; ++x) {
    if (x < nx) stage(x);
    CpAsyncCommit();  // the first with Q's rows
  }
  const int ra = warp * 16 + (lane >> 2), rb = ra + 8;
  const uint64_t q_desc = Swizzled128Desc(qs);
  ExactRows st;
  for (int32_t x = 0; x < nx; ++x) {
    CpAsyncWait<kThrStages - 2>();
    FenceProxyAsyncShared();  // the staged rows visible to the MMA's operand reads
    __syncthreads();  // block x staged; every warp is past block x - 1, whose buffer is refilled
    if (x + kThrStages - 1 < nx) stage(x + kThrStages - 1);
    CpAsyncCommit();
    const uint64_t k_desc = Swizzled128Desc(kbuf + (x % kThrStages) * kSwizzledBlock);
    float acc[kExactTiles][4] = {};
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < kSwizzledDim / 16; ++kk) {
      Wgmma16N32<kBf16>(acc, q_desc + SwizzledKStep(kk, 64), k_desc + SwizzledKStep(kk, 32),
                        kk > 0);
    }
    WgmmaCommitAndWaitAll();
    FenceAccumulators(acc);
    FoldExactTiles(g, acc, 4, blocks[x] * 32, 8, r0 + ra, r0 + rb, st);
  }
  StoreRowThresholds(tau[h], ops.thr + static_cast<int64_t>(h) * g.n + r0, rows, ra, st);
}

// ---- The computation pass on the warpgroup MMA (sm_90a, head_dim 128) ----------------------

constexpr int kAttendWgStages = 3;  // K/V blocks in flight
// AttendKernelWg stages block j + 1 while block j - 1's P V still reads its V: a ring of two
// would overwrite it (outputs wrong on rows of three or more blocks).
static_assert(kAttendWgStages >= 3, "AttendKernelWg's ring: scored, in P V, arriving");
constexpr size_t kAttendWgSmem =
    kSwizzledTile + kAttendWgStages * 2 * kSwizzledBlock + kWgAlign;  // dynamic, AttendKernelWg

// AttendKernel's work for head_dim 128 on one warpgroup: Q, and each selected block's K and V,
// staged in shared memory in the 128-byte swizzle (cp.async, kAttendWgStages blocks: the one
// being scored, the one whose P V is running, the next one arriving), S = Q K^T by eight
// m64n32k16 steps from shared memory, the same online softmax in registers (the accumulators'
// layout is mma.m16n8's), O += P V by two m64n128k16 steps with P from registers and V
// transposed by the instruction. A block's S is issued with the previous block's P V, so its
// softmax runs while that P V is on the tensor cores; o is rescaled once the P V is done.
template <typename T>
__global__ void __launch_bounds__(kAttendThreads, 3)
    AttendKernelWg(AttendGeometry g, const void* q, const void* k, const void* v, void* out,
                   const uint8_t* mask) {
  constexpr int D = kSwizzledDim;
  constexpr bool kBf16 = std::is_same_v<T, Bf16>;
  extern __shared__ __align__(16) uint8_t attend_smem[];
  uint8_t* qs = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(attend_smem) + kWgAlign - 1) & ~uintptr_t{kWgAlign - 1});
  auto ks_at = [&](int buf) { return qs + kSwizzledTile + buf * 2 * kSwizzledBlock; };
  auto vs_at = [&](int buf) { return ks_at(buf) + kSwizzledBlock; };
  __shared__ BlockList list;
  const int i = blockIdx.x, h = blockIdx.y, j = h / g.group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tq = lane & 3;
  AttendRows st;
  st.row0 = i * kAttendBq + warp * 16 + (lane >> 2);
  st.row1 = st.row0 + 8;
  const uint16_t* qh = static_cast<const uint16_t*>(q) + static_cast<int64_t>(h) * g.n * D;
  const uint16_t* kh = static_cast<const uint16_t*>(k) + static_cast<int64_t>(j) * g.n * D;
  const uint16_t* vh = static_cast<const uint16_t*>(v) + static_cast<int64_t>(j) * g.n * D;
  auto stage = [&](int32_t blk, int buf) {
    if (blk >= 0) {
      StageSwizzledRows(ks_at(buf), kAttendBk, kh, blk * kAttendBk, g.n, threadIdx.x,
                        kAttendThreads);
      StageSwizzledRows(vs_at(buf), kAttendBk, vh, blk * kAttendBk, g.n, threadIdx.x,
                        kAttendThreads);
    }
    CpAsyncCommit();
  };
  StageSwizzledRows(qs, kAttendBq, qh, i * kAttendBq, g.n, threadIdx.x, kAttendThreads);
  float o[D / 8][4];
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  SelectedBlocks walk(&list, mask + (static_cast<int64_t>(h) * g.q_blocks + i) * g.k_blocks,
                      (min(g.n, (i + 1) * kAttendBq) - 1) / kAttendBk + 1);
  int32_t blk = walk.Next();
  stage(blk, 0);  // with Q's rows
  if (blk < 0) {  // uniform: no block selected (a caller's mask may say so): zeros
    CpAsyncWait<0>();
    StoreAttendRows<T, D>(g, h, tq, o, st, out);
    return;
  }
  const uint64_t q_desc = Swizzled128Desc(qs);
  float sc[kAttendBk / 8][4];
  // Waits for the block in `buf`, stages the next selected block in the buffer after it (the
  // block two back's: every warp is past its P V at the barrier), and issues S = Q K^T (one
  // batch); returns the next block.
  auto begin_block = [&](int buf) {
    CpAsyncWait<0>();
    FenceProxyAsyncShared();  // the staged rows visible to the MMA's operand reads
    __syncthreads();
    const int32_t ahead = walk.Next();
    stage(ahead, buf + 1 == kAttendWgStages ? 0 : buf + 1);
#pragma unroll
    for (int nt = 0; nt < kAttendBk / 8; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
    const uint64_t k_desc = Swizzled128Desc(ks_at(buf));
    FenceAccumulators(sc);
    FenceAccumulators(o);
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      Wgmma16N32<kBf16>(sc, q_desc + SwizzledKStep(kk, kAttendBq),
                        k_desc + SwizzledKStep(kk, kAttendBk), kk > 0);
    }
    WgmmaCommit();
    return ahead;
  };
  uint32_t pa[kAttendBk / 16][4];  // the previous block's P fragments
  // O += P V of the block in `buf` (one batch).
  auto add_pv = [&](int buf) {
    const uint64_t v_desc = Swizzled128MnDesc(vs_at(buf), kAttendBk * 128);
#pragma unroll
    for (int kstep = 0; kstep < kAttendBk / 16; ++kstep) {
      Wgmma16N128RegA<kBf16>(o, pa[kstep], v_desc + kstep * (16 * 128 >> 4), 1);
    }
    WgmmaCommit();
  };
  auto take_probabilities = [&]() {
#pragma unroll
    for (int kstep = 0; kstep < kAttendBk / 16; ++kstep) {
      ProbabilityFragments<T>(sc, kstep, pa[kstep]);
    }
  };
  // The first block apart: inside the loop every step has a P V in flight, so no branch
  // separates an asynchronous MMA from the accumulators it writes.
  int32_t next = begin_block(0);
  WgmmaWait<0>();
  FenceAccumulators(sc);
  RescaleRows(o, ScoresToProbabilities(g, blk * kAttendBk, tq, sc, st));
  take_probabilities();
  int prev_buf = 0;
  for (int buf = 1; next >= 0; buf = buf + 1 == kAttendWgStages ? 0 : buf + 1) {
    blk = next;
    next = begin_block(buf);
    add_pv(prev_buf);
    WgmmaWait<1>();  // S (the previous block's P V may still run)
    FenceAccumulators(sc);
    const float2 f = ScoresToProbabilities(g, blk * kAttendBk, tq, sc, st);
    WgmmaWait<0>();
    FenceAccumulators(o);
    RescaleRows(o, f);
    take_probabilities();
    prev_buf = buf;
  }
  FenceAccumulators(o);
  WgmmaFence();
  add_pv(prev_buf);
  WgmmaWait<0>();
  FenceAccumulators(o);
  StoreAttendRows<T, D>(g, h, tq, o, st, out);
}

}  // namespace

cudaError_t LaunchMiddleKernelWg(const SelectGeometry& g, const MiddleTile& mt, const Operands& ops,
                                 uint8_t* mask, dim3 grid, cudaStream_t stream) {
  return LaunchWithSmem(&MiddleKernelWg, grid, dim3(kWgThreads), kMiddleWgSmem, stream, g, mt, ops,
                        mask);
}

cudaError_t LaunchThresholdsKernelWg(DType dtype, const SelectGeometry& g, int32_t q_blocks,
                                     int32_t num_q_heads, bool two_heads, const void* q,
                                     const void* k, const float* tau, const Operands& ops,
                                     uint8_t* mask, cudaStream_t stream) {
  auto thresholds_wg = [&](auto kernel, int heads) {
    return LaunchWithSmem(kernel, dim3(q_blocks, num_q_heads / heads), dim3(heads * 128),
                          ThresholdsWgSmem(heads), stream, g, q, k, tau, ops, mask);
  };
  if (dtype == DType::kBf16) {
    return two_heads ? thresholds_wg(&ThresholdsKernelWg<Bf16, kThrHeads>, kThrHeads)
                     : thresholds_wg(&ThresholdsKernelWg<Bf16, 1>, 1);
  }
  return two_heads ? thresholds_wg(&ThresholdsKernelWg<Fp16, kThrHeads>, kThrHeads)
                   : thresholds_wg(&ThresholdsKernelWg<Fp16, 1>, 1);
}

cudaError_t LaunchAttendKernelWg(DType dtype, const AttendGeometry& g, dim3 grid, const void* q,
                                 const void* k, const void* v, void* out, const uint8_t* mask,
                                 cudaStream_t stream) {
  auto launch_wg = [&](auto kernel) {
    return LaunchWithSmem(kernel, grid, dim3(kAttendThreads), kAttendWgSmem, stream, g, q, k, v,
                          out, mask);
  };
  return dtype == DType::kBf16 ? launch_wg(&AttendKernelWg<Bf16>)
                               : launch_wg(&AttendKernelWg<Fp16>);
}

}  // namespace kvsparse::kernels::cuda::sale_internal

#endif  // KVSPARSE_CUDA_SM90A
