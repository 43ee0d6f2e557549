// Device-side building blocks shared by the decode kernels: 16-byte row loads and conversions,
// the warp "transpose reduction" of partial dot products, and the one place where a runtime
// (head_dim, group size, dtype) triple becomes template arguments.
#ifndef KVSPARSE_KERNELS_CUDA_COMMON_CUH_
#define KVSPARSE_KERNELS_CUDA_COMMON_CUH_

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kernels/cuda/decode_params.h"
#include "kernels/dtype.h"
#include "kernels/philox.h"
#include "kernels/sink_local_topk.h"

namespace kvsparse::kernels::cuda {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -__builtin_huge_valf();

// Returns the first error of a CUDA runtime call from the enclosing function.
#define KVSPARSE_CUDA_RETURN_IF_ERROR(expr)                 \
  do {                                                      \
    const cudaError_t kvsparse_err_ = (expr);               \
    if (kvsparse_err_ != cudaSuccess) return kvsparse_err_; \
  } while (0)

// Runtime -> compile-time dispatch, in one place. Calls
//   body.template operator()<T, D, G>()
// with T in {Bf16, Fp16}, D in {64, 128, 256}, G in {1, 2, 4, 8}; cudaErrorInvalidValue for
// anything else.
template <typename Body>
cudaError_t DispatchDecode(DType dtype, int head_dim, int group, Body&& body) {
  auto with_g = [&](auto t_tag, auto d_tag) -> cudaError_t {
    using T = decltype(t_tag);
    constexpr int D = decltype(d_tag)::value;
    switch (group) {
      case 1:
        return body.template operator()<T, D, 1>();
      case 2:
        return body.template operator()<T, D, 2>();
      case 4:
        return body.template operator()<T, D, 4>();
      case 8:
        return body.template operator()<T, D, 8>();
      default:
        return cudaErrorInvalidValue;
    }
  };
  auto with_d = [&](auto t_tag) -> cudaError_t {
    switch (head_dim) {
      case 64:
        return with_g(t_tag, std::integral_constant<int, 64>{});
      case 128:
        return with_g(t_tag, std::integral_constant<int, 128>{});
      case 256:
        return with_g(t_tag, std::integral_constant<int, 256>{});
      default:
        return cudaErrorInvalidValue;
    }
  };
  switch (dtype) {
    case DType::kBf16:
      return with_d(Bf16{});
    case DType::kFp16:
      return with_d(Fp16{});
    default:
      return cudaErrorInvalidValue;
  }
}

// Runtime dtype -> element type, for kernels templated on the element type alone (the
// signature and quantization kernels): calls body(tag) with a value of Bf16, Fp16 or float and
// returns the launch's error.
template <typename Body>
cudaError_t ByDtype(DType t, Body&& body) {
  switch (t) {
    case DType::kBf16:
      body(Bf16{});
      break;
    case DType::kFp16:
      body(Fp16{});
      break;
    case DType::kFp32:
      body(0.f);
      break;
  }
  return cudaGetLastError();
}

// Whether a device pointer is off the 16-byte alignment the kernels' vector loads and cp.async
// copies need (launchers refuse such operands with cudaErrorInvalidValue).
inline bool Misaligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) != 0; }

// Checks what every decode launcher relies on; cudaSuccess if the shape is supported.
// accepts_paged: which of K and V the launcher can read from pages (DecodeShape::k_pages /
// v_pages); paged rows given to a launcher that cannot read them are cudaErrorInvalidValue.
// kv_required false: a kernel that reads K and V only through FetchRows (which checks the
// addressing it is given) may be given a shape without them.
inline cudaError_t ValidateShape(const DecodeShape& s, bool k_paged_ok = false,
                                 bool v_paged_ok = false, bool kv_required = true) {
  if (s.batch < 0 || s.num_kv_heads <= 0 || s.num_q_heads <= 0 ||
      s.num_q_heads % s.num_kv_heads != 0 || s.max_seq_len < 0) {
    return cudaErrorInvalidValue;
  }
  if ((s.k_pages.enabled() && !k_paged_ok) || (s.v_pages.enabled() && !v_paged_ok)) {
    return cudaErrorInvalidValue;
  }
  // Listed V rows: single-row readers only, over strided or per-head rows.
  if (s.v_listed.enabled() && (!v_paged_ok || s.v_pages.enabled() || s.v_listed.counts == nullptr ||
                               s.v_listed.capacity < 0)) {
    return cudaErrorInvalidValue;
  }
  if (s.batch == 0) return cudaSuccess;
  const bool has_k = s.k != nullptr || s.k_heads != nullptr || s.k_pages.enabled();
  const bool has_v = s.v != nullptr || s.v_heads != nullptr || s.v_pages.enabled();
  if (s.q == nullptr || (kv_required && (!has_k || !has_v)) || s.out == nullptr ||
      s.seq_lens == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (Misaligned16(s.q) || Misaligned16(s.k) || Misaligned16(s.v) || Misaligned16(s.out)) {
    return cudaErrorInvalidValue;
  }
  if (s.kv.batch_stride % 8 != 0 || s.kv.head_stride % 8 != 0 || s.kv.token_stride % 8 != 0) {
    return cudaErrorInvalidValue;
  }
  for (const PagedRows* pr : {&s.k_pages, &s.v_pages}) {
    if (pr->enabled() && (pr->page_shift < 0 || pr->page_shift > 24 || pr->slot_bytes % 16 != 0 ||
                          pr->offset_bytes % 16 != 0)) {
      return cudaErrorInvalidValue;
    }
  }
  return cudaSuccess;
}

inline size_t AlignUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Number of multiprocessors of the current device (cached per device ordinal).
int NumSms();

// Makes kernel's MaxDynamicSharedMemorySize at least `bytes` on the current device, calling
// cudaFuncSetAttribute only when the limit must be raised: launchers call this before every
// launch, and each driver call is host time on the decode path. (A cudaDeviceReset drops the
// limits but not this record; nothing here resets the device.)
cudaError_t SetMaxDynamicSmem(const void* kernel, int bytes);

// Launches `kernel` with `smem` bytes of dynamic shared memory, raising its limit first where
// needed (SetMaxDynamicSmem), and returns the launch's error: the launch every kernel with
// dynamic shared memory goes through.
template <typename... KernelArgs, typename... Args>
cudaError_t LaunchWithSmem(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                           cudaStream_t stream, Args&&... args) {
  KVSPARSE_CUDA_RETURN_IF_ERROR(
      SetMaxDynamicSmem(reinterpret_cast<const void*>(kernel), static_cast<int>(smem)));
  kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
  return cudaGetLastError();
}

// Programmatic dependent launch (sm_90): launches `kernel` so that it may start while the
// previous kernel on the stream is still finishing (its blocks are scheduled once every block of
// that kernel has called AllowDependents() or exited). The kernel must call GridDependencyWait()
// before it touches memory the previous kernel writes or reads; past that call, the previous
// kernel has completed and its writes are visible (and, as that kernel waited for its own, every
// earlier one). Recorded into CUDA graphs as a programmatic edge. After a launch of another kind
// (a memset, a copy, another library's kernel) it orders as a plain launch does. What it saves
// is the launch latency between short kernels of a chain (a captured decode step's).
// LaunchDependentClusters: the same with thread block clusters of `cluster` blocks (sm_90; the
// grid a multiple of it, at most 8 blocks): the blocks of a cluster run together and read each
// other's shared memory (cooperative_groups::this_cluster()).
template <typename... KernelArgs, typename... Args>
cudaError_t LaunchDependentClusters(void (*kernel)(KernelArgs...), dim3 grid, dim3 block,
                                    dim3 cluster, size_t smem, cudaStream_t stream,
                                    Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  attr[1].id = cudaLaunchAttributeClusterDimension;
  attr[1].val.clusterDim.x = cluster.x;
  attr[1].val.clusterDim.y = cluster.y;
  attr[1].val.clusterDim.z = cluster.z;
  cfg.attrs = attr;
  cfg.numAttrs = cluster.x * cluster.y * cluster.z > 1 ? 2 : 1;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}
template <typename... KernelArgs, typename... Args>
cudaError_t LaunchDependent(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                            cudaStream_t stream, Args&&... args) {
  return LaunchDependentClusters(kernel, grid, block, dim3(1, 1, 1), smem, stream,
                                 std::forward<Args>(args)...);
}

// ---------------------------------------------------------------------------------------------
// Device helpers.

// See LaunchDependent. Both are no-ops for a kernel launched without the attribute.
__device__ __forceinline__ void GridDependencyWait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void AllowDependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// The random numbers of sequence b: one seed for the batch (streams (seed, tag, b, head)), or
// a seed per sequence (streams (seeds[b], tag, 0, head): each sequence drawn as the batch-1
// problem the CPU engine solves for it, see kernels::SequenceSeed).
struct SeedSource {
  uint64_t seed = 0;
  const uint64_t* seeds = nullptr;  // device [B] or null
};
__device__ __forceinline__ PhiloxStream SequenceStream(const SeedSource& s, RngTag tag, int b,
                                                       int h) {
  return s.seeds != nullptr
             ? PhiloxStream::Make(s.seeds[b], tag, 0, static_cast<uint32_t>(h))
             : PhiloxStream::Make(s.seed, tag, static_cast<uint32_t>(b), static_cast<uint32_t>(h));
}

// Row 0 of (b, kv head j) of K (v = false) or V (v = true) for strided or per-head bases (not
// paged rows), as uint16 elements.
__device__ __forceinline__ const uint16_t* KvHeadBase(const DecodeShape& s, bool v, int b, int j) {
  const void* const* heads = v ? s.v_heads : s.k_heads;
  if (heads != nullptr) {
    return static_cast<const uint16_t*>(heads[static_cast<int64_t>(b) * s.num_kv_heads + j]);
  }
  return static_cast<const uint16_t*>(v ? s.v : s.k) + b * s.kv.batch_stride + j * s.kv.head_stride;
}

// Where the single rows of one (b, kv head) of K or V are, strided or paged; `lane_elems` is
// added to every row (the 8-element slice a lane reads).
struct RowReader {
  const uint16_t* base = nullptr;  // strided: row t at base + t * ts
  int64_t ts = 0;
  const char* const* pages = nullptr;  // paged: this (b, kv head)'s page list
  int32_t shift = 0, slot = 0, offset = 0;
  const int32_t* list = nullptr;  // listed (DecodeShape::v_listed): token t at row r, list[r] == t
  int32_t list_n = 0;

  __device__ __forceinline__ const uint16_t* Row(int64_t t) const {
    if (list != nullptr) {  // the first listed token >= t (t is listed)
      int lo = 0, hi = list_n;
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (list[mid] < t) {
          lo = mid + 1;
        } else {
          hi = mid;
        }
      }
      t = lo;
    }
    if (pages == nullptr) return base + t * ts;
    const char* page = pages[t >> shift];
    return reinterpret_cast<const uint16_t*>(page + (t & ((1 << shift) - 1)) * slot + offset);
  }
};

__device__ __forceinline__ RowReader MakeRowReader(const DecodeShape& s, bool v, int b, int j,
                                                   int lane_elems) {
  RowReader r;
  const PagedRows& pr = v ? s.v_pages : s.k_pages;
  if (pr.tables != nullptr) {
    r.pages = reinterpret_cast<const char* const*>(
        pr.tables[static_cast<int64_t>(b) * s.num_kv_heads + j]);
    r.shift = pr.page_shift;
    r.slot = pr.slot_bytes;
    r.offset = pr.offset_bytes + lane_elems * 2;
  } else {
    r.base = KvHeadBase(s, v, b, j) + lane_elems;
    r.ts = s.kv.token_stride;
  }
  if (v && s.v_listed.tokens != nullptr) {
    const int64_t i = static_cast<int64_t>(b) * s.num_kv_heads + j;
    r.list = s.v_listed.tokens + i * s.v_listed.capacity;
    r.list_n = s.v_listed.counts[i];
  }
  return r;
}

// 16 bytes of K or V read once: bypass L1 (streamed), keep the default L2 policy.
__device__ __forceinline__ uint4 LoadStream16(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// cp.async of 16 bytes into shared memory, zero-filled when !pred (then gmem is not read). The
// K streams read whole 256-byte rows in 16-byte pieces spread over several instructions; the
// L2::256B hint has L2 fetch the whole 256 bytes from DRAM on the first miss.
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool pred) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(n)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// ldmatrix.x4: four 8 x 8 tiles of 16-bit elements (or 8 rows of 16 bytes) from shared memory;
// lanes 8m .. 8m + 7 give the row addresses of tile m (16-byte aligned), and each lane gets,
// in r[m], the 32-bit word lane % 4 of row lane / 4 of tile m.
__device__ __forceinline__ void LdMatrixX4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                           const void* smem_row) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(s));
}

// ldmatrix.x4.trans: as LdMatrixX4, each tile transposed: r[m] holds elements (2 (lane % 4),
// lane / 4) and (2 (lane % 4) + 1, lane / 4) of tile m (row, column of the rows as addressed).
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                uint32_t& r3, const void* smem_row) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(s));
}

__device__ __forceinline__ void Bf16x2ToFloat2(uint32_t w, float& lo, float& hi) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
}

template <typename T>
__device__ __forceinline__ void Unpack8(const uint4& r, float (&f)[8]) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
  if constexpr (std::is_same_v<T, Bf16>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) Bf16x2ToFloat2(w[i], f[2 * i], f[2 * i + 1]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h;
      memcpy(&h, &w[i], 4);
      const float2 x = __half22float2(h);
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  }
}

// Element i of x (T in {float, Bf16, Fp16}) as float, exactly (single loads: the signature
// kernels, which follow the CPU references' element order).
template <typename T>
__device__ __forceinline__ float LoadElem(const void* x, int64_t i) {
  if constexpr (std::is_same_v<T, float>) {
    return static_cast<const float*>(x)[i];
  } else if constexpr (std::is_same_v<T, Bf16>) {
    return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(x)[i]) << 16);
  } else {
    return __half2float(__ushort_as_half(static_cast<const uint16_t*>(x)[i]));
  }
}

template <typename T>
__device__ __forceinline__ uint16_t FloatToBits(float x) {
  if constexpr (std::is_same_v<T, Bf16>) {
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  } else {
    return __half_as_ushort(__float2half_rn(x));
  }
}

template <typename T>
__device__ __forceinline__ uint4 Pack8(const float (&f)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = static_cast<uint32_t>(FloatToBits<T>(f[2 * i])) |
           (static_cast<uint32_t>(FloatToBits<T>(f[2 * i + 1])) << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ float Exp2OrZero(float x) { return x == kNegInf ? 0.f : exp2f(x); }

// The fixed set's geometry in a sequence of n tokens (kernels/hash_topk.h's rule): k resolved as
// ResolveTopK does, sink [0, s_end), window [w_begin, n), the rest between, and kk = the top-k
// rows that fit in the rest.
struct SinkLocalTopK {
  int n, k, s_end, w_begin, rest, kk;
};

__device__ __forceinline__ SinkLocalTopK MakeSinkLocalTopK(int n, const FixedSet& f) {
  SinkLocalTopK g;
  g.n = n;
  g.k = static_cast<int>(min(max(FixedSetK(f, n), int64_t{0}), static_cast<int64_t>(n)));
  g.s_end = min(max(f.sink_tokens, 0), n);
  g.w_begin = max(g.s_end, n - max(f.local_tokens, 0));
  g.rest = g.w_begin - g.s_end;
  g.kk = SinkLocalTopKRest(n, g.s_end, g.w_begin, g.k);
  return g;
}

// d[16 x 8] += a[16 x 16] b[16 x 8] on the tensor cores, T in {Bf16, Fp16}, fp32 accumulation
// (mma.sync.m16n8k16, row-major a, column-major b). With g = lane / 4 and t = lane % 4: a0 holds
// row g, columns 2t and 2t + 1 (the lower column in the low half), a1 row g + 8, a2 and a3 the
// same rows at columns 2t + 8 and 2t + 9; b0 rows 2t and 2t + 1 of column g, b1 rows 2t + 8 and
// 2t + 9; c[0..1] row g, columns 2t and 2t + 1, c[2..3] row g + 8.
template <typename T>
__device__ __forceinline__ void Mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, Bf16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

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

// ---- Scans and compaction: the one copy of each, for every kernel. ----

// The max and the sum over the lanes of a warp (a butterfly: every lane gets the result; the sum
// in the same order in every lane).
__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// The max over the block (every thread calls it and gets it; red: shared, one float per warp,
// free before and after the call).
__device__ __forceinline__ float BlockMax(float v, float* red) {
  v = WarpMax(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float m = kNegInf;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) m = fmaxf(m, red[w]);
  __syncthreads();
  return m;
}
template <typename T>
__device__ __forceinline__ T WarpSum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Inclusive prefix sum over the lanes of a warp (lane i gets v_0 + ... + v_i).
template <typename T>
__device__ __forceinline__ T WarpInclusiveSum(T v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const T y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  return v;
}

// Exclusive prefix sum over the lanes of a warp (lane i gets v_0 + ... + v_{i-1}, as the
// inclusive sum less v).
template <typename T>
__device__ __forceinline__ T WarpExclusiveSum(T v, int lane) {
  return WarpInclusiveSum(v, lane) - v;
}

// Exclusive prefix sum over the block's kWarps full warps (int counts, or float / double sums in
// a fixed order: per warp, then over the warps' totals in warp 0); *total gets the block's sum
// (the same in every thread). ws: a __shared__ T[kWarps]. Every thread of the block must call it:
// it synchronises the block three times, the last so that ws may be reused at once.
template <int kWarps, typename T>
__device__ __forceinline__ T BlockExclusiveSum(T v, T* ws, T* total) {
  static_assert(kWarps >= 1 && kWarps <= 32, "one warp scans the warps' totals");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const T x = WarpInclusiveSum(v, lane);
  if (lane == 31) ws[warp] = x;
  __syncthreads();
  if (warp == 0) {
    const T y = WarpInclusiveSum(lane < kWarps ? ws[lane] : T{0}, lane);
    if (lane < kWarps) ws[lane] = y;
  }
  __syncthreads();
  const T r = (warp > 0 ? ws[warp - 1] : T{0}) + x - v;
  *total = ws[kWarps - 1];
  __syncthreads();
  return r;
}

// How many threads before this one in the block have `flag` set (exclusive prefix count), and
// the block's total in *total (the same in every thread). wcount: a __shared__ int[kWarps].
// Every thread of the block (kWarps full warps) must call it: it synchronises the block twice.
template <int kWarps>
__device__ __forceinline__ int BlockPrefixCount(bool flag, int* wcount, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned ballot = __ballot_sync(0xffffffffu, flag);
  if (lane == 0) wcount[warp] = __popc(ballot);
  __syncthreads();
  int before = 0, sum = 0;
  for (int k = 0; k < kWarps; ++k) {
    if (k < warp) before += wcount[k];
    sum += wcount[k];
  }
  __syncthreads();  // wcount is rewritten by the next call
  *total = sum;
  return before + __popc(ballot & ((1u << lane) - 1));
}

// One round of a block-wide stream compaction: each thread offers `value`, kept if `keep`; the
// kept values of the block go to out[written, written + returned) in thread order. Returns how
// many the block kept (the same in every thread). wcount: a __shared__ int[kWarps]. Every thread
// of the block (kWarps full warps) must call it: it synchronises the block twice.
template <int kWarps>
__device__ __forceinline__ int BlockCompactRound(bool keep, int32_t value, int32_t* out,
                                                 int written, int* wcount) {
  int total = 0;
  const int at = BlockPrefixCount<kWarps>(keep, wcount, &total);
  if (keep) out[written + at] = value;
  return total;
}

constexpr int Log2(int x) { return x <= 1 ? 0 : 1 + Log2(x / 2); }
constexpr int Min(int a, int b) { return a < b ? a : b; }
constexpr int Max(int a, int b) { return a > b ? a : b; }

// Row geometry of a warp reading rows of D elements as 16-byte vectors (8 elements per lane):
// kLanes lanes share a row, kRows rows per warp instruction.
template <int D>
struct RowGeom {
  static constexpr int kLanes = D / 8;
  static constexpr int kRows = 32 / kLanes;
  static constexpr int kLog2Lanes = Log2(kLanes);
};

// Transpose reduction: each of the kLanes lanes of a row holds V partial sums v[0..V); afterwards
// the row's full sums are spread over its lanes, kKeep per lane: lane lr holds sums
// q*kKeep + j (j < kKeep) where q = lr >> (log2(kLanes) - kSplits). Lanes that differ only in
// the low kDupBits bits hold the same values. Costs about V shuffles instead of V*log2(kLanes).
template <int V, int kLanes>
struct TransposeReduce {
  static constexpr int kSplits = Min(Log2(V), Log2(kLanes));
  static constexpr int kKeep = V >> kSplits;
  static constexpr int kDupBits = Log2(kLanes) - kSplits;

  __device__ __forceinline__ static int Q(int lr) { return lr >> kDupBits; }
  // Lane (within the row) that holds sum i, and the register it is in.
  static constexpr int SrcLane(int i) { return (i / kKeep) << kDupBits; }
  static constexpr int SrcReg(int i) { return i % kKeep; }

  __device__ __forceinline__ static void Run(float (&v)[V], int lr) { Step<0>(v, lr); }

  // One butterfly step per template instance, so every array index is a compile-time constant.
  template <int S>
  __device__ __forceinline__ static void Step(float (&v)[V], int lr) {
    if constexpr (S < Log2(kLanes)) {
      constexpr int off = kLanes >> (S + 1);
      if constexpr (S < kSplits) {
        constexpr int half = V >> (S + 1);
        // Bitwise selects: a ?: on array elements can become a select of addresses, which puts
        // v in local memory.
        const uint32_t upper = (lr & off) != 0 ? 0xffffffffu : 0u;
#pragma unroll
        for (int i = 0; i < half; ++i) {
          const uint32_t lo = __float_as_uint(v[i]), hi = __float_as_uint(v[i + half]);
          const float send = __uint_as_float((lo & upper) | (hi & ~upper));
          const float keep = __uint_as_float((hi & upper) | (lo & ~upper));
          v[i] = keep + __shfl_xor_sync(0xffffffffu, send, off);
        }
      } else {
#pragma unroll
        for (int i = 0; i < kKeep; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], off);
      }
      Step<S + 1>(v, lr);
    }
  }
};

// part[g * U + u] = q_g . k_u over this lane's 8 dims: the partial dot products of U rows
// (16-byte vectors kr) with the G prescaled q rows.
template <typename T, int G, int U>
__device__ __forceinline__ void PartialDots(const float (&qf)[G][8], const uint4 (&kr)[U],
                                            float (&part)[G * U]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    float kf[8];
    Unpack8<T>(kr[u], kf);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float d = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) d = fmaf(qf[g][e], kf[e], d);
      part[g * U + u] = d;
    }
  }
}

// Completes the dot products of PartialDots across the kLanes lanes of each row and calls
// store(g, u, value) for each, on one lane of the row that holds it (lane lr of the row).
template <int G, int U, int kLanes, typename Store>
__device__ __forceinline__ void ReduceDots(float (&part)[G * U], int lr, Store&& store) {
  using TR = TransposeReduce<G * U, kLanes>;
  TR::Run(part, lr);
  if ((lr & ((1 << TR::kDupBits) - 1)) == 0) {
    const int qi = TR::Q(lr);
#pragma unroll
    for (int j = 0; j < TR::kKeep; ++j) {
      const int i = qi * TR::kKeep + j;
      store(i / U, i % U, part[j]);
    }
  }
}

// Running softmax states of kSlots row slots of a block (one per group of lanes that walks its
// own rows): each slot's maximum m, sum l and accumulator acc[D], in shared memory, merged into
// one (num, den) per dimension. kBase2: m and the scores are in log2 units (exp2), else natural.
template <int D, int kSlots, bool kBase2>
struct SlotSoftmax {
  float m[kSlots], l[kSlots];
  __align__(16) float acc[kSlots][D];

  // The lane's part (dims lr * 8 .. + 8) of slot `slot`; lane lr == 0 also writes m and l.
  __device__ __forceinline__ void Put(int slot, int lr, float ms, float ls, const float (&a)[8]) {
    if (lr == 0) {
      m[slot] = ms;
      l[slot] = ls;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[slot][lr * 8 + e] = a[e];
  }
  // After a barrier: for every dimension (strided over the block's `threads`), calls
  // write(dim, num, den, gm) with the merged numerator, denominator and maximum.
  template <typename Write>
  __device__ __forceinline__ void Merge(int tid, int threads, Write&& write) const {
    auto ex = [](float x) { return kBase2 ? exp2f(x) : expf(x); };
    float gm = kNegInf;
    for (int k = 0; k < kSlots; ++k) gm = fmaxf(gm, m[k]);
    float den = 0.f;
    for (int k = 0; k < kSlots; ++k) den += m[k] == kNegInf ? 0.f : l[k] * ex(m[k] - gm);
    for (int dim = tid; dim < D; dim += threads) {
      float num = 0.f;
      for (int k = 0; k < kSlots; ++k) {
        if (m[k] != kNegInf) num += acc[k][dim] * ex(m[k] - gm);
      }
      write(dim, num, den, gm);
    }
  }
};

}  // namespace kvsparse::kernels::cuda

#endif  // KVSPARSE_KERNELS_CUDA_COMMON_CUH_
