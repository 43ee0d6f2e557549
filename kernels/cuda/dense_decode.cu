#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <utility>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/dense_decode.h"
#include "kernels/cuda/tile_common.cuh"

namespace kvsparse::kernels::cuda {

cudaError_t SetMaxDynamicSmem(const void* kernel, int bytes) {
  int dev = -1;
  if (cudaGetDevice(&dev) != cudaSuccess) return cudaGetLastError();
  // The largest limit set so far per (kernel, device): a launch needing no more skips the call.
  // The limit is only ever raised (lowering it would break a later, larger launch that the
  // cache says is covered).
  static std::mutex mu;
  static auto* limits = new std::map<std::pair<const void*, int>, int>();
  const auto key = std::make_pair(kernel, dev);
  {
    std::lock_guard<std::mutex> lock(mu);
    const auto it = limits->find(key);
    if (it != limits->end() && it->second >= bytes) return cudaSuccess;
  }
  const cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess) {
    std::lock_guard<std::mutex> lock(mu);
    int& limit = (*limits)[key];
    limit = std::max(limit, bytes);
  }
  return e;
}

int NumSms() {
  static std::atomic<int> cache[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0) return 132;
  if (dev < 64) {
    const int c = cache[dev].load(std::memory_order_relaxed);
    if (c > 0) return c;
  }
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      sms <= 0) {
    return 132;
  }
  if (dev < 64) cache[dev].store(sms, std::memory_order_relaxed);
  return sms;
}

namespace {

constexpr int kDenseBlocksPerSm = 2;
constexpr int kMinChunk = 256;

template <int D, int G>
struct DenseCfg {
  using Geom = RowGeom<D>;
  static constexpr int kUnroll = G >= 8 ? 2 : 4;          // tokens per row per iteration
  static constexpr int kTok = Geom::kRows * kUnroll;      // tokens per warp per iteration
  static constexpr int kWarps = (G * D >= 2048) ? 4 : 8;  // keeps the merge buffer <= 32 KB
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMinBlocks = G >= 8 ? 1 : 2;  // G = 8 needs > 128 registers
  static constexpr int kStages = 3;                  // cp.async pipeline depth
  static constexpr size_t kStageBytes = size_t{kStages} * 2 * kUnroll * kThreads * 16;
};

// Merges the per-row online-softmax states of a block (rows of each warp, then warps) and writes
// the block's partial (or, with one split, the output). Call with every thread.
template <typename T, int D, int G, int NW, int L>
__device__ __forceinline__ void MergeBlock(float (&m)[G], float (&l)[G], float (&acc)[G][8],
                                           float* sm, float (*sm_m)[G], float (*sm_l)[G],
                                           const DecodeShape& s, int b, int kvh, int split,
                                           int num_splits, float* __restrict__ part_o,
                                           float* __restrict__ part_lse) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int row = lane / L;
  const int lr = lane % L;
  const int H = s.num_q_heads;
  const int h0 = kvh * G;
  // Merge the rows of the warp (same dims, different tokens).
#pragma unroll
  for (int off = L; off < 32; off *= 2) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[g], off);
      const float lo = __shfl_xor_sync(0xffffffffu, l[g], off);
      const float mx = fmaxf(m[g], mo);
      const float a = m[g] == kNegInf ? 0.f : exp2f(m[g] - mx);
      const float ao = mo == kNegInf ? 0.f : exp2f(mo - mx);
      l[g] = l[g] * a + lo * ao;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        acc[g][e] = acc[g][e] * a + __shfl_xor_sync(0xffffffffu, acc[g][e], off) * ao;
      }
      m[g] = mx;
    }
  }

  // Merge the warps through shared memory.
  __syncthreads();
  float* sacc = sm;  // [NW][G][D]
  if (row == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float4* dst = reinterpret_cast<float4*>(sacc + (warp * G + g) * D + lr * 8);
      dst[0] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
      dst[1] = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      sm_m[warp][g] = m[g];
      sm_l[warp][g] = l[g];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * D; idx += NW * 32) {
    const int g = idx / D;
    const int dim = idx % D;
    float mx = kNegInf;
#pragma unroll
    for (int w = 0; w < NW; ++w) mx = fmaxf(mx, sm_m[w][g]);
    float lt = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float wt = sm_m[w][g] == kNegInf ? 0.f : exp2f(sm_m[w][g] - mx);
      lt += wt * sm_l[w][g];
      o += wt * sacc[(w * G + g) * D + dim];
    }
    const int64_t bh = static_cast<int64_t>(b) * H + h0 + g;
    const float val = lt > 0.f ? o / lt : 0.f;
    if (num_splits == 1) {
      static_cast<uint16_t*>(s.out)[bh * D + dim] = FloatToBits<T>(val);
    } else {
      part_o[(bh * num_splits + split) * D + dim] = val;
      if (dim == 0) part_lse[bh * num_splits + split] = lt > 0.f ? mx + log2f(lt) : kNegInf;
    }
  }
}

template <int G>
__device__ __forceinline__ void InitSoftmaxState(float (&m)[G], float (&l)[G], float (&acc)[G][8]) {
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = kNegInf;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
  }
}

// Online-softmax step of one row of lanes over its NV new tokens: scores (log2 units) at
// sc[(u * R + row) * G + g], V vectors vr[u] (this lane's 8 dims of token u of the row).
template <typename T, int NV, int G, int R>
__device__ __forceinline__ void SoftmaxStep(const float* sc, int row, const uint4 (&vr)[NV],
                                            float (&m)[G], float (&l)[G], float (&acc)[G][8]) {
  float p[NV][G];
#pragma unroll
  for (int u = 0; u < NV; ++u) {
#pragma unroll
    for (int g = 0; g < G; ++g) p[u][g] = sc[(u * R + row) * G + g];
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float mx = m[g];
#pragma unroll
    for (int u = 0; u < NV; ++u) mx = fmaxf(mx, p[u][g]);
    const float alpha = m[g] == kNegInf ? 0.f : exp2f(m[g] - mx);
    float sum = 0.f;
#pragma unroll
    for (int u = 0; u < NV; ++u) {
      p[u][g] = p[u][g] == kNegInf ? 0.f : exp2f(p[u][g] - mx);
      sum += p[u][g];
    }
    l[g] = l[g] * alpha + sum;
    m[g] = mx;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] *= alpha;
  }
#pragma unroll
  for (int u = 0; u < NV; ++u) {
    float vf[8];
    Unpack8<T>(vr[u], vf);
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(p[u][g], vf[e], acc[g][e]);
    }
  }
}

// One block: tokens [split * chunk_len, min(n, (split + 1) * chunk_len)) of sequence b, kv head
// kvh, for the G query heads of the group. Each warp runs its own online softmax over
// interleaved groups of kTok tokens (each row of lanes over its own tokens); warps and rows are
// merged at the end. Scores are kept in log2 units (q is prescaled by scale * log2(e)).
template <typename T, int D, int G>
__global__ void __launch_bounds__(DenseCfg<D, G>::kThreads, DenseCfg<D, G>::kMinBlocks)
    DenseSplitKernel(DecodeShape s, int chunk_len, int num_splits, float* __restrict__ part_o,
                     float* __restrict__ part_lse) {
  using Cfg = DenseCfg<D, G>;
  constexpr int L = Cfg::Geom::kLanes;
  constexpr int R = Cfg::Geom::kRows;
  constexpr int U = Cfg::kUnroll;
  constexpr int TOK = Cfg::kTok;
  constexpr int NW = Cfg::kWarps;
  constexpr int kSm = Max(NW * TOK * G, NW * G * D);
  __shared__ __align__(16) float sm[kSm];
  __shared__ float sm_m[NW][G];
  __shared__ float sm_l[NW][G];

  // Kv head fastest: blocks running together read neighbouring rows of the same tokens (one
  // DRAM page serves all kv heads of a token in the sequence-major layout).
  const int kvh = blockIdx.x;
  const int split = blockIdx.y;
  const int b = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int row = lane / L;
  const int lr = lane % L;
  const int n = s.seq_lens[b];
  const int start = split * chunk_len;
  const int end = min(n, start + chunk_len);

  float qf[G][8];
  LoadQ<T, D, G>(s, b, kvh, lr, qf);
  const uint16_t* kb = KvHeadBase(s, false, b, kvh) + lr * 8;
  const uint16_t* vb = KvHeadBase(s, true, b, kvh) + lr * 8;
  const int64_t ts = s.kv.token_stride;

  float m[G], l[G], acc[G][8];
  InitSoftmaxState(m, l, acc);

  // Per-thread cp.async pipeline: kStages iterations of this thread's K and V vectors in
  // flight; each thread reads back only the slots it filled, so no barrier is needed.
  extern __shared__ uint4 stage[];  // [kStages][2U][NW * 32]
  constexpr int kStages = Cfg::kStages;
  constexpr int NT = NW * 32;
  const int tid = threadIdx.x;
  auto issue = [&](int it_base, int slot) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int tok = it_base + u * R + row;
      const bool ok = tok < end;
      const int64_t off = ok ? tok * ts : 0;
      CpAsync16(&stage[(slot * 2 * U + u) * NT + tid], kb + off, ok);
      CpAsync16(&stage[(slot * 2 * U + U + u) * NT + tid], vb + off, ok);
    }
    CpAsyncCommit();
  };
  const int first = start + warp * TOK;
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) issue(first + st * NW * TOK, st);

  float* sc = sm + warp * TOK * G;  // [TOK][G] scores of this warp's current iteration
  int slot = 0;
  for (int base = first; base < end; base += NW * TOK) {
    issue(base + (kStages - 1) * NW * TOK, (slot + kStages - 1) % kStages);
    CpAsyncWait<kStages - 1>();
    uint4 kr[U], vr[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      kr[u] = stage[(slot * 2 * U + u) * NT + tid];
      vr[u] = stage[(slot * 2 * U + U + u) * NT + tid];
    }
    slot = (slot + 1) % kStages;
    float part[G * U];
    PartialDots<T, G, U>(qf, kr, part);
    ReduceDots<G, U, L>(part, lr, [&](int g, int u, float v) {
      sc[(u * R + row) * G + g] = base + u * R + row < end ? v : kNegInf;
    });
    __syncwarp();
    SoftmaxStep<T, U, G, R>(sc, row, vr, m, l, acc);
    __syncwarp();
  }

  CpAsyncWait<0>();  // nothing may land in shared memory after this point
  MergeBlock<T, D, G, NW, L>(m, l, acc, sm, sm_m, sm_l, s, b, kvh, split, num_splits, part_o,
                             part_lse);
}

// ---- Tensor-core variant (head_dim 64 and 128) ------------------------------------------------
// Scores of 16 tokens x G heads per warp iteration come from mma.m16n8k16 (tile_common.cuh:
// MmaGeom, LoadQFrag: the same permuted-dimension fragments as the sampling kernels), so the
// CUDA cores only run the softmax and the V accumulation; K is staged in the mma layout and V
// in the row layout, two cp.async stages deep (three measured slower on the H200).
template <int D, int G>
struct DenseMmaCfg {
  static constexpr int L = D / 8;
  static constexpr int R = 32 / L;
  static constexpr int kTok = 16;               // tokens per warp iteration
  static constexpr int kVPer = kTok / R;        // V vectors per lane and iteration
  static constexpr int kKSlots = 2 * (D / 32);  // K vectors per lane and iteration
  static constexpr int kSlots = kKSlots + kVPer;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStages = 2;
  static constexpr size_t kStageBytes = size_t{kStages} * kSlots * kThreads * 16;
};

template <typename T, int D, int G>
__global__ void __launch_bounds__(DenseMmaCfg<D, G>::kThreads, 1)
    DenseMmaKernel(DecodeShape s, int chunk_len, int num_splits, float* __restrict__ part_o,
                   float* __restrict__ part_lse) {
  using Cfg = DenseMmaCfg<D, G>;
  constexpr int L = Cfg::L;
  constexpr int R = Cfg::R;
  constexpr int NW = Cfg::kWarps;
  constexpr int NT = Cfg::kThreads;
  constexpr int VP = Cfg::kVPer;
  constexpr int KS = Cfg::kKSlots;
  constexpr int SL = Cfg::kSlots;
  constexpr int kSm = Max(NW * 16 * G, NW * G * D);
  __shared__ __align__(16) float sm[kSm];
  __shared__ float sm_m[NW][G];
  __shared__ float sm_l[NW][G];
  extern __shared__ uint4 stage[];  // [kStages][SL][NT]
  const int kvh = blockIdx.x;
  const int split = blockIdx.y;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int row = lane / L;
  const int lr = lane % L;
  const int c4 = lane % 4;
  const int n = s.seq_lens[b];
  const int start = split * chunk_len;
  const int end = min(n, start + chunk_len);
  uint4 qfrag[D / 32];
  LoadQFrag<D, G>(s, b, kvh, lane, qfrag);
  const float qscale = s.scale * kLog2e;
  const uint16_t* kb = KvHeadBase(s, false, b, kvh) + 8 * c4;
  const uint16_t* vb = KvHeadBase(s, true, b, kvh) + lr * 8;
  const int64_t ts = s.kv.token_stride;

  float m[G], l[G], acc[G][8];
  InitSoftmaxState(m, l, acc);
  auto issue = [&](int it_base, int slot) {
    const int tok0 = it_base + lane / 4, tok1 = tok0 + 8;
    const bool ok0 = tok0 < end, ok1 = tok1 < end;
    const int64_t off0 = ok0 ? tok0 * ts : 0, off1 = ok1 ? tok1 * ts : 0;
#pragma unroll
    for (int mm = 0; mm < D / 32; ++mm) {
      CpAsync16(&stage[(slot * SL + 2 * mm) * NT + tid], kb + off0 + 32 * mm, ok0);
      CpAsync16(&stage[(slot * SL + 2 * mm + 1) * NT + tid], kb + off1 + 32 * mm, ok1);
    }
#pragma unroll
    for (int u = 0; u < VP; ++u) {
      const int tok = it_base + u * R + row;
      const bool ok = tok < end;
      CpAsync16(&stage[(slot * SL + KS + u) * NT + tid], vb + (ok ? tok * ts : 0), ok);
    }
    CpAsyncCommit();
  };
  const int first = start + warp * 16;
  constexpr int kStride = NW * 16;
  constexpr int kStages = Cfg::kStages;
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) issue(first + st * kStride, st);
  float* sc = sm + warp * 16 * G;  // [16][G] scores of this warp's current iteration
  int slot = 0;
  for (int base = first; base < end; base += kStride) {
    issue(base + (kStages - 1) * kStride, (slot + kStages - 1) % kStages);
    CpAsyncWait<kStages - 1>();
    float sacc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int mm = 0; mm < D / 32; ++mm) {
      const uint4 k0 = stage[(slot * SL + 2 * mm) * NT + tid];
      const uint4 k1 = stage[(slot * SL + 2 * mm + 1) * NT + tid];
      Mma16816<T>(sacc, k0.x, k1.x, k0.y, k1.y, qfrag[mm].x, qfrag[mm].y);
      Mma16816<T>(sacc, k0.z, k1.z, k0.w, k1.w, qfrag[mm].z, qfrag[mm].w);
    }
    const int r0 = lane / 4;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int h = 2 * c4 + j;
      if (h < G) {
        sc[r0 * G + h] = base + r0 < end ? sacc[j] * qscale : kNegInf;
        sc[(r0 + 8) * G + h] = base + r0 + 8 < end ? sacc[2 + j] * qscale : kNegInf;
      }
    }
    uint4 vr[VP];
#pragma unroll
    for (int u = 0; u < VP; ++u) vr[u] = stage[(slot * SL + KS + u) * NT + tid];
    slot = (slot + 1) % kStages;
    __syncwarp();
    SoftmaxStep<T, VP, G, R>(sc, row, vr, m, l, acc);
    __syncwarp();
  }
  CpAsyncWait<0>();
  MergeBlock<T, D, G, NW, L>(m, l, acc, sm, sm_m, sm_l, s, b, kvh, split, num_splits, part_o,
                             part_lse);
}

template <typename T>
__global__ void MergeKernel(const float* __restrict__ po, const float* __restrict__ plse,
                            int num_splits, int d, uint16_t* __restrict__ out) {
  GridDependencyWait();  // LaunchDependent: the earlier kernels' writes first
  const int64_t r = blockIdx.x;
  const float* lse = plse + r * num_splits;
  float mx = kNegInf;
  for (int i = 0; i < num_splits; ++i) mx = fmaxf(mx, lse[i]);
  float den = 0.f;
  for (int i = 0; i < num_splits; ++i) den += lse[i] == kNegInf ? 0.f : exp2f(lse[i] - mx);
  const float inv = den > 0.f ? 1.f / den : 0.f;
  for (int dim = threadIdx.x; dim < d; dim += blockDim.x) {
    float o = 0.f;
    for (int i = 0; i < num_splits; ++i) {
      if (lse[i] != kNegInf) o += exp2f(lse[i] - mx) * po[(r * num_splits + i) * d + dim];
    }
    out[r * d + dim] = FloatToBits<T>(o * inv);
  }
}

struct DenseLaunch {
  const DecodeShape& s;
  SplitPlan plan;
  float* part_o;
  float* part_lse;
  cudaStream_t stream;

  template <typename T, int D, int G>
  cudaError_t operator()() const {
    const dim3 grid(s.num_kv_heads, plan.num_splits, s.batch);
    if constexpr (D <= 128) {
      using Cfg = DenseMmaCfg<D, G>;
      KVSPARSE_CUDA_RETURN_IF_ERROR(
          LaunchWithSmem(&DenseMmaKernel<T, D, G>, grid, dim3(Cfg::kThreads), Cfg::kStageBytes,
                         stream, s, plan.chunk_len, plan.num_splits, part_o, part_lse));
    } else {
      using Cfg = DenseCfg<D, G>;
      KVSPARSE_CUDA_RETURN_IF_ERROR(
          LaunchWithSmem(&DenseSplitKernel<T, D, G>, grid, dim3(Cfg::kThreads), Cfg::kStageBytes,
                         stream, s, plan.chunk_len, plan.num_splits, part_o, part_lse));
    }
    if (plan.num_splits > 1) {
      KVSPARSE_CUDA_RETURN_IF_ERROR(
          LaunchDependent(&MergeKernel<T>, dim3(s.batch * s.num_q_heads), dim3(128), 0, stream,
                          part_o, part_lse, plan.num_splits, D, static_cast<uint16_t*>(s.out)));
    }
    return cudaSuccess;
  }
};

struct MergeLaunch {
  const float* po;
  const float* plse;
  int rows, splits, d;
  void* out;
  cudaStream_t stream;
  template <typename T, int D, int G>
  cudaError_t operator()() const {
    return LaunchDependent(&MergeKernel<T>, dim3(rows), dim3(128), 0, stream, po, plse, splits, d,
                           static_cast<uint16_t*>(out));
  }
};

size_t PartialBytes(int64_t rows, int splits, int d, size_t* lse_offset) {
  const size_t o_bytes = AlignUp(static_cast<size_t>(rows) * splits * d * sizeof(float), 256);
  if (lse_offset != nullptr) *lse_offset = o_bytes;
  return o_bytes + AlignUp(static_cast<size_t>(rows) * splits * sizeof(float), 256);
}

}  // namespace

SplitPlan DenseDecodePlan(const DecodeShape& s, int32_t waves) {
  SplitPlan plan;
  const int64_t pairs = std::max<int64_t>(1, static_cast<int64_t>(s.batch) * s.num_kv_heads);
  // The tensor-core kernel (head_dim <= 128) runs one block per multiprocessor.
  const int per_sm = s.head_dim <= 128 ? 1 : kDenseBlocksPerSm;
  const int64_t slots = static_cast<int64_t>(NumSms()) * per_sm * std::max(1, waves);
  const int64_t max_len = std::max(1, s.max_seq_len);
  int64_t splits = std::max<int64_t>(1, slots / pairs);
  splits = std::min(splits, (max_len + kMinChunk - 1) / kMinChunk);
  splits = std::max<int64_t>(splits, 1);
  int64_t chunk = (max_len + splits - 1) / splits;
  chunk = (chunk + 63) / 64 * 64;
  plan.chunk_len = static_cast<int32_t>(chunk);
  plan.num_splits = static_cast<int32_t>((max_len + chunk - 1) / chunk);
  return plan;
}

size_t DenseDecodeWorkspaceBytes(const DecodeShape& s, int32_t waves) {
  const SplitPlan plan = DenseDecodePlan(s, waves);
  if (plan.num_splits <= 1) return 0;
  return PartialBytes(static_cast<int64_t>(s.batch) * s.num_q_heads, plan.num_splits, s.head_dim,
                      nullptr);
}

cudaError_t DenseDecode(const DecodeShape& s, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream, int32_t waves) {
  KVSPARSE_CUDA_RETURN_IF_ERROR(ValidateShape(s));
  if (s.batch == 0) return cudaSuccess;
  const SplitPlan plan = DenseDecodePlan(s, waves);
  float* part_o = nullptr;
  float* part_lse = nullptr;
  if (plan.num_splits > 1) {
    size_t lse_off = 0;
    const size_t need = PartialBytes(static_cast<int64_t>(s.batch) * s.num_q_heads, plan.num_splits,
                                     s.head_dim, &lse_off);
    if (workspace == nullptr || workspace_bytes < need) return cudaErrorInvalidValue;
    part_o = static_cast<float*>(workspace);
    part_lse = reinterpret_cast<float*>(static_cast<char*>(workspace) + lse_off);
  }
  return DispatchDecode(s.dtype, s.head_dim, s.group_size(),
                        DenseLaunch{s, plan, part_o, part_lse, stream});
}

cudaError_t MergePartials(const float* partial_o, const float* partial_lse, int32_t num_rows,
                          int32_t num_splits, int32_t head_dim, DType dtype, void* out,
                          cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  return DispatchDecode(
      dtype, head_dim, 1,
      MergeLaunch{partial_o, partial_lse, num_rows, num_splits, head_dim, out, stream});
}

}  // namespace kvsparse::kernels::cuda
