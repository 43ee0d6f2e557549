// Hopper's asynchronous machinery for the kernels that use it (device code; builds for
// sm_90a define KVSPARSE_CUDA_SM90A and compile the bodies, other builds never launch a kernel
// that calls these): shared-memory barriers (mbarrier) with transaction counts, bulk copies from
// global to shared memory that complete on such a barrier, and the int8 warpgroup MMA
// (wgmma.m64n32k32 and m64n64k32) with A in registers and B in shared memory in the 128-byte
// swizzle, and the bf16 / fp16 warpgroup MMA (m64n32k16 from shared memory, m64n128k16 with A in
// registers and B transposed) with fp32 accumulators.
#pragma once

#include <cstdint>

namespace kvsparse::kernels::cuda {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- Barriers in shared memory ----------------------------------------------------------------

__device__ __forceinline__ void BarrierInit(uint64_t* bar, uint32_t count) {
#if defined(KVSPARSE_CUDA_SM90A)
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddr(bar)), "r"(count)
               : "memory");
#endif
}
// The barriers' initialization made visible to the async proxy (bulk copies complete on them).
__device__ __forceinline__ void BarrierInitFence() {
#if defined(KVSPARSE_CUDA_SM90A)
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// One arrival.
__device__ __forceinline__ void BarrierArrive(uint64_t* bar) {
#if defined(KVSPARSE_CUDA_SM90A)
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SmemAddr(bar)) : "memory");
#endif
}
// One arrival that also expects `bytes` of transactions (bulk copies) before the phase ends.
__device__ __forceinline__ void BarrierArriveExpectTx(uint64_t* bar, uint32_t bytes) {
#if defined(KVSPARSE_CUDA_SM90A)
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SmemAddr(bar)),
               "r"(bytes)
               : "memory");
#endif
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void BarrierWait(uint64_t* bar, uint32_t parity) {
#if defined(KVSPARSE_CUDA_SM90A)
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(SmemAddr(bar)), "r"(parity)
        : "memory");
  }
#endif
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory, the
// transfer counted on `bar`.
__device__ __forceinline__ void BulkCopyToShared(void* smem, const void* gmem, uint32_t bytes,
                                                 uint64_t* bar) {
#if defined(KVSPARSE_CUDA_SM90A)
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(SmemAddr(smem)),
      "l"(gmem), "r"(bytes), "r"(SmemAddr(bar))
      : "memory");
#endif
}

// ---- Warpgroup MMA, int8 ----------------------------------------------------------------------

// The shared-memory descriptor of a tile of 128-byte rows in the 128-byte swizzle (16-byte chunk
// c of row r at r * 128 + ((c ^ (r % 8)) * 16), 8-row atoms 1024 bytes apart, the tile
// 1024-aligned). `lead_bytes` is the descriptor's leading byte offset: unused by K-major tiles
// (16, as below), the stride of the 64-element atoms along N for MN-major ones
// (Swizzled128MnDesc).
__device__ __forceinline__ uint64_t Swizzled128Descriptor(const void* smem, uint32_t lead_bytes) {
  return static_cast<uint64_t>((SmemAddr(smem) & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>(lead_bytes >> 4) << 16) | (static_cast<uint64_t>(1024 >> 4) << 32) |
         (static_cast<uint64_t>(1) << 62);
}
// The descriptor of such a tile read K-major (int8 rows of 128 bytes, or one 64-element atom of
// 16-bit rows); a k-step of 32 bytes adds 2 to it.
__device__ __forceinline__ uint64_t Swizzled128Desc(const void* smem) {
  return Swizzled128Descriptor(smem, 16);
}

// d (+)= a b over one 32-deep k-step: d [64 x 32] int32 (thread t of the warpgroup: rows
// 16 (t / 32) + (t % 32) / 4 and + 8, columns 8 i + 2 (t % 4) (+1) in d[4i .. 4i + 3] as
// mma.m16n8k32's C), a [64 x 32] int8 in registers (mma.m16n8k32's A fragment of the warp's 16
// rows), b [32 keys x 32] from shared memory by `desc`. accumulate = 0 overwrites d.
__device__ __forceinline__ void WgmmaS8(int (&d)[16], const uint32_t (&a)[4], uint64_t desc,
                                        int accumulate) {
#if defined(KVSPARSE_CUDA_SM90A) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.s32.s8.s8 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "{%16, %17, %18, %19}, %20, p;\n}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]),
        "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]),
        "+r"(d[14]), "+r"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
#elif defined(KVSPARSE_CUDA_SM90A) && defined(__CUDA_ARCH__)
  __trap();  // device code for an arch without warpgroup MMA: never a silent no-op
#endif
}
// The same over 64 keys (b [64 x 32], two 32-key blocks one after the other in the swizzle):
// d [64 x 64], the first 32 columns in d[0..15] as WgmmaS8's d, the next 32 in d[16..31].
__device__ __forceinline__ void WgmmaS8N64(int (&d)[32], const uint32_t (&a)[4], uint64_t desc,
                                           int accumulate) {
#if defined(KVSPARSE_CUDA_SM90A) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p;\n}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]),
        "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]),
        "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]),
        "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]),
        "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
#elif defined(KVSPARSE_CUDA_SM90A) && defined(__CUDA_ARCH__)
  __trap();  // device code for an arch without warpgroup MMA: never a silent no-op
#endif
}
// WgmmaS8N64 with A [64 x 32] from shared memory too (`desc_a`: 64 K-major rows of 128 bytes in
// the 128-byte swizzle, as Swizzled128Desc; a k-step adds 2).
__device__ __forceinline__ void WgmmaS8N64Shared(int (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                                 int accumulate) {
#if defined(KVSPARSE_CUDA_SM90A) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p;\n}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]),
        "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]),
        "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]),
        "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]),
        "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
#elif defined(KVSPARSE_CUDA_SM90A) && defined(__CUDA_ARCH__)
  __trap();  // device code for an arch without warpgroup MMA: never a silent no-op
#endif
}

// ---- Warpgroup MMA, bf16 / fp16 in, fp32 accumulators --------------------------------------

// The descriptor of an MN-major 16-bit tile in the 128-byte swizzle (B of a product whose N runs
// along the rows in memory: 16-byte chunk c of k-row r of a 64-element atom at
// r * 128 + ((c ^ (r % 8)) * 16), 8-row groups 1024 bytes apart, the atoms along N
// `atom_bytes` apart, the tile 1024-aligned); a 16-deep k-step adds 2048 bytes to the start.
__device__ __forceinline__ uint64_t Swizzled128MnDesc(const void* smem, uint32_t atom_bytes) {
  return Swizzled128Descriptor(smem, atom_bytes);
}

// d (+)= a b over one 16-deep k-step, a [64 x 16] and b [16 x 32] (32 columns) bf16 (kBf16) or fp16
// from shared memory, both K-major in the 128-byte swizzle (Swizzled128Desc; a k-step of 32 bytes
// within the atom adds 2): d as WgmmaS8's (mma.m16n8's C layout per 8 columns, d[i] the i-th 8).
template <bool kBf16>
__device__ __forceinline__ void Wgmma16N32(float (&d)[4][4], uint64_t desc_a, uint64_t desc_b,
                                           int accumulate) {
#if defined(KVSPARSE_CUDA_SM90A) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KVSPARSE_WGMMA16_N32(TY)                                                                  \
  asm volatile(                                                                                   \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                                                \
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY                                     \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"                   \
      ", %16, %17, p, 1, 1, 0, 0;\n}\n"                                                           \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])                                \
      : "l"(desc_a), "l"(desc_b), "r"(accumulate))
  if constexpr (kBf16) {
    KVSPARSE_WGMMA16_N32("bf16");
  } else {
    KVSPARSE_WGMMA16_N32("f16");
  }
#undef KVSPARSE_WGMMA16_N32
#elif defined(KVSPARSE_CUDA_SM90A) && defined(__CUDA_ARCH__)
  __trap();  // device code for an arch without warpgroup MMA: never a silent no-op
#endif
}

// d (+)= a b over one 16-deep k-step, d [64 x 128] fp32 (d[i] the i-th 8 columns, mma.m16n8's C
// layout), a [64 x 16] bf16 / fp16 in registers (mma.m16n8k16's A fragment of the warp's 16
// rows), b [16 x 128] MN-major from shared memory (Swizzled128MnDesc: the instruction transposes
// it).
template <bool kBf16>
__device__ __forceinline__ void Wgmma16N128RegA(float (&d)[16][4], const uint32_t (&a)[4],
                                                uint64_t desc_b, int accumulate) {
#if defined(KVSPARSE_CUDA_SM90A) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KVSPARSE_WGMMA16_N128_REG_A(TY)                                                           \
  asm volatile(                                                                                   \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY                                    \
      " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, "             \
      "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, "          \
      "%33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, "          \
      "%49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"                \
      ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"                                             \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), \
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), \
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), \
        "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), \
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]),               \
        "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]),           \
        "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]),           \
        "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),           \
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]),           \
        "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])                                            \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))
  if constexpr (kBf16) {
    KVSPARSE_WGMMA16_N128_REG_A("bf16");
  } else {
    KVSPARSE_WGMMA16_N128_REG_A("f16");
  }
#undef KVSPARSE_WGMMA16_N128_REG_A
#elif defined(KVSPARSE_CUDA_SM90A) && defined(__CUDA_ARCH__)
  __trap();  // device code for an arch without warpgroup MMA: never a silent no-op
#endif
}
// Generic-proxy writes to shared memory made visible to the async proxy (wgmma's operand reads,
// bulk copies) before a barrier.
__device__ __forceinline__ void FenceProxyAsyncShared() {
#if defined(KVSPARSE_CUDA_SM90A)
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
// Before the first wgmma that reads registers other instructions wrote.
__device__ __forceinline__ void WgmmaFence() {
#if defined(KVSPARSE_CUDA_SM90A)
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
// Ends the batch of wgmma issued since the last commit.
__device__ __forceinline__ void WgmmaCommit() {
#if defined(KVSPARSE_CUDA_SM90A)
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
// Waits until at most kPending committed batches are still running (they finish in order).
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
#if defined(KVSPARSE_CUDA_SM90A)
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
#endif
}
// Ends the batch of wgmma issued since the last commit and waits for every batch to finish.
__device__ __forceinline__ void WgmmaCommitAndWaitAll() {
  WgmmaCommit();
  WgmmaWait<0>();
}
// Pins accumulator registers at this point of the program: the compiler sees each read and
// written here, so no read or write of them moves across (after a wait, and before a wgmma that
// uses them, where nothing else orders plain arithmetic against the asynchronous MMA).
__device__ __forceinline__ void FenceRegister(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void FenceRegister(int& r) { asm volatile("" : "+r"(r)::"memory"); }
template <typename T, int N, int M>
__device__ __forceinline__ void FenceAccumulators(T (&r)[N][M]) {
#pragma unroll
  for (int x = 0; x < N; ++x) {
#pragma unroll
    for (int y = 0; y < M; ++y) FenceRegister(r[x][y]);
  }
}

}  // namespace kvsparse::kernels::cuda
