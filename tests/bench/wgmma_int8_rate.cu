// How fast Hopper's warpgroup MMA runs SALE's selection arithmetic, alone: int8
// wgmma.m64n32k32 with A (64 query rows) in registers and B (one 32-key block of 128 bytes a
// key) in shared memory in the 128-byte swizzle, four k-steps per (head, query block) pair,
// then each thread's row maxima, as kernels/cuda/sale_wg.cu's selection does per key block; no
// loads, no barriers. First checks one product against the host, then times PAIRS = 2 and 4
// pairs per warpgroup (2 warpgroups per CTA, 2 CTAs per multiprocessor). A standalone program
// for a Hopper GPU host (docs/PERF.md, "SALE's selection per GQA tile" cites its output), built
// for sm_90a as build/bin/wgmma_int8_rate (tests/bench/CMakeLists.txt; or nvcc -O2 -gencode
// arch=compute_90a,code=sm_90a), run with no arguments.
// (ptxas serializes the PAIRS = 4 variant's wgmma for want of registers: C7511.)
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/cuda/hopper.cuh"

using kvsparse::kernels::cuda::FenceProxyAsyncShared;
using kvsparse::kernels::cuda::Swizzled128Desc;
using kvsparse::kernels::cuda::WgmmaCommitAndWaitAll;
using kvsparse::kernels::cuda::WgmmaFence;
using kvsparse::kernels::cuda::WgmmaS8;

__global__ void Check(const int8_t* A, const int8_t* B, int* D) {
  __shared__ __align__(1024) int8_t sb[32 * 128];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  for (int x = tid; x < 32 * 8; x += 128) {
    const int r = x / 8, c = x % 8;
    *reinterpret_cast<int4*>(sb + r * 128 + ((c ^ (r & 7)) << 4)) =
        *reinterpret_cast<const int4*>(B + r * 128 + c * 16);
  }
  FenceProxyAsyncShared();
  __syncthreads();
  uint32_t a[4][4];
  const int ra = 16 * warp + g, rb = ra + 8;
  for (int s = 0; s < 4; ++s) {
    a[s][0] = *reinterpret_cast<const uint32_t*>(A + ra * 128 + 32 * s + 4 * t);
    a[s][1] = *reinterpret_cast<const uint32_t*>(A + rb * 128 + 32 * s + 4 * t);
    a[s][2] = *reinterpret_cast<const uint32_t*>(A + ra * 128 + 32 * s + 16 + 4 * t);
    a[s][3] = *reinterpret_cast<const uint32_t*>(A + rb * 128 + 32 * s + 16 + 4 * t);
  }
  int d[16];
  for (int i = 0; i < 16; ++i) d[i] = 0;
  WgmmaFence();
  for (int s = 0; s < 4; ++s) WgmmaS8(d, a[s], Swizzled128Desc(sb + 32 * s), s > 0);
  WgmmaCommitAndWaitAll();
  for (int i = 0; i < 4; ++i) {
    D[ra * 32 + 8 * i + 2 * t] = d[4 * i];
    D[ra * 32 + 8 * i + 2 * t + 1] = d[4 * i + 1];
    D[rb * 32 + 8 * i + 2 * t] = d[4 * i + 2];
    D[rb * 32 + 8 * i + 2 * t + 1] = d[4 * i + 3];
  }
}

// Throughput: each CTA (2 warpgroups) loops `iters` times over a 32-key block with PAIRS (64-row
// A tiles) per warpgroup, as the selection would: 4 k-steps per pair, row maxima of the sums.
template <int PAIRS>
__global__ void __launch_bounds__(256, 2) Rate(const int8_t* A, int iters, int* sink) {
  __shared__ __align__(1024) int8_t sb[4][32 * 128];
  const int tid = threadIdx.x, lane = tid % 32, g = lane / 4, t = lane % 4, warp = (tid / 32) % 4;
  for (int x = tid; x < 4 * 32 * 128 / 16; x += 256)
    reinterpret_cast<int4*>(&sb[0][0])[x] = reinterpret_cast<const int4*>(A)[x];
  FenceProxyAsyncShared();
  __syncthreads();
  uint32_t a[PAIRS][4][4];
  for (int p = 0; p < PAIRS; ++p)
    for (int s = 0; s < 4; ++s)
      for (int e = 0; e < 4; ++e)
        a[p][s][e] = *reinterpret_cast<const uint32_t*>(
            A + ((p * 64 + 16 * warp + g + 8 * (e & 1)) * 128 + 32 * s + 16 * (e >> 1) + 4 * t));
  int mx[PAIRS][2];
  for (int p = 0; p < PAIRS; ++p) mx[p][0] = mx[p][1] = INT_MIN;
  for (int it = 0; it < iters; ++it) {
    const int8_t* b = sb[it & 3];
    int d[PAIRS][16];
    WgmmaFence();
#pragma unroll
    for (int p = 0; p < PAIRS; ++p) {
#pragma unroll
      for (int s = 0; s < 4; ++s) WgmmaS8(d[p], a[p][s], Swizzled128Desc(b + 32 * s), s > 0);
    }
    WgmmaCommitAndWaitAll();
#pragma unroll
    for (int p = 0; p < PAIRS; ++p) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        mx[p][0] = max(mx[p][0], max(d[p][4 * i], d[p][4 * i + 1]));
        mx[p][1] = max(mx[p][1], max(d[p][4 * i + 2], d[p][4 * i + 3]));
      }
    }
  }
  int s = 0;
  for (int p = 0; p < PAIRS; ++p) s += mx[p][0] + mx[p][1];
  if (s == 12345) sink[tid] = s;
}

int main() {
  std::vector<int8_t> A(64 * 128 * 8), B(32 * 128);
  srand(1);
  for (auto& x : A) x = static_cast<int8_t>(rand() % 255 - 127);
  for (auto& x : B) x = static_cast<int8_t>(rand() % 255 - 127);
  int8_t *dA, *dB;
  int* dD;
  cudaMalloc(&dA, A.size());
  cudaMalloc(&dB, B.size());
  cudaMalloc(&dD, 64 * 32 * 4 + 4096);
  cudaMemcpy(dA, A.data(), A.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(dB, B.data(), B.size(), cudaMemcpyHostToDevice);
  Check<<<1, 128>>>(dA, dB, dD);
  std::vector<int> D(64 * 32);
  cudaError_t e = cudaMemcpy(D.data(), dD, D.size() * 4, cudaMemcpyDeviceToHost);
  printf("check: %s\n", cudaGetErrorString(e));
  int bad = 0;
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < 32; ++c) {
      int s = 0;
      for (int k = 0; k < 128; ++k) s += A[r * 128 + k] * B[c * 128 + k];
      if (s != D[r * 32 + c]) {
        if (bad < 5) printf("r %d c %d want %d got %d\n", r, c, s, D[r * 32 + c]);
        ++bad;
      }
    }
  printf("wgmma m64n32k32 s8: %d of %d differ\n", bad, 64 * 32);
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  const int iters = 20000, ctas = 132 * 2;
  for (int rep = 0; rep < 2; ++rep) {
    cudaEventRecord(t0);
    Rate<2><<<ctas, 256>>>(dA, iters, dD);
    cudaEventRecord(t1);
    cudaEventSynchronize(t1);
    float ms;
    cudaEventElapsedTime(&ms, t0, t1);
    const double ops = 2.0 * ctas * 2 /*wg*/ * 2 /*pairs*/ * 64.0 * 32 * 128 * iters;
    printf("rate PAIRS=2: %.3f ms, %.0f TOPS (%s)\n", ms, ops / ms / 1e9,
           cudaGetErrorString(cudaGetLastError()));
    cudaEventRecord(t0);
    Rate<4><<<ctas, 256>>>(dA, iters, dD);
    cudaEventRecord(t1);
    cudaEventSynchronize(t1);
    cudaEventElapsedTime(&ms, t0, t1);
    printf("rate PAIRS=4: %.3f ms, %.0f TOPS (%s)\n", ms,
           2.0 * ctas * 2 * 4 * 64.0 * 32 * 128 * iters / ms / 1e9,
           cudaGetErrorString(cudaGetLastError()));
  }
  return 0;
}
