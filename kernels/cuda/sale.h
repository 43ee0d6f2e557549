// SALE's selection pass on the GPU (kernels/sale.h is the reference and the oracle): for one
// prompt, the block mask of every (query head, query block), from the sink and local regions
// computed exactly and the middle key blocks estimated from int8 Q and K, with the reference's
// quantization (K smoothed by its per-(kv head, channel) mean, per-block K scales, per-token Q
// scales) and its threshold test S~ >= m_r + ln(tau_h l_r).
//
// Int8 on Hopper: the estimate needs only the sign of S~ - threshold per element, and Hopper's
// tensor cores run int8 at twice the rate of bf16 (fp8 as fast, but its 3-bit mantissa makes the
// estimate coarser than int8's 7 bits at the same speed), so this pass uses int8, as the
// reference does: the middle blocks are estimated with mma.m16n8k32 (exact int32 sums). For
// the paper's geometry (head_dim 64 or 128, block_k 32) one CTA takes 8 (query head, query
// block) pairs of one kv head, stages each key block once in shared memory for them, and tests
// each row's largest sum in the block (the test is monotone in the sum, so the mask is the
// same); other geometries estimate tile by tile, stopping a block at its first hit.
//
// Arithmetic: the exact regions' scores on the bf16 / fp16 tensor cores (fp32 sums in another
// order than the reference's sequential dots, so a threshold may move by an ulp; fp32 prompts
// take the reference's sequential dots), the int8 products exact, the estimate's scaling in the
// reference's order without fused multiply-adds: the masks differ from the reference's only
// where an estimate sits within rounding of its threshold (kernels/cuda/sale_test.cc measures
// it).
//
// Launchers never allocate or synchronise: the quantized operands live in the caller's
// workspace (SaleSelectWorkspaceBytes), so the pass can be captured in a CUDA graph.
#ifndef KVSPARSE_KERNELS_CUDA_SALE_H_
#define KVSPARSE_KERNELS_CUDA_SALE_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/dtype.h"
#include "kernels/sale.h"

namespace kvsparse::kernels::cuda {

struct SaleSelectParams {
  // One prompt as the reference takes it, its q and k on the device (v and out unread); head
  // dim a multiple of 32, at most 256.
  SalePrefill prompt;
  const float* tau = nullptr;  // device [H], each in [0, 1)
  SaleParams blocks;           // block_q and block_k at most 64, block_k a multiple of 8
  // device [H, q_blocks, k_blocks], every byte written: 1 where query head h's query block i
  // attends key block j (the sink and local blocks always, no block past the diagonal), as
  // kernels::SaleMask::selected.
  uint8_t* mask = nullptr;
};

size_t SaleSelectWorkspaceBytes(const SaleSelectParams& p);
// cudaErrorInvalidValue for a shape or geometry it does not take (SaleSupports) or q / k /
// workspace off 16-byte alignment.
cudaError_t SaleSelect(const SaleSelectParams& p, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream);
// Whether SaleSelect takes this geometry and head dim (the reference takes more).
bool SaleSupports(const SaleParams& blocks, int32_t head_dim);

// The computation pass: per row r, softmax attention over the keys c <= r of the key blocks its
// query block's mask row selects (kernels::SaleAttend's rows), fp32 accumulation on the tensor
// cores (scores from bf16 / fp16 Q and K, the probabilities rounded to the dtype for P V, as
// FlashAttention does). One block per (query block, query head), four warps of 16 rows, the
// selected key blocks in ascending order with an online softmax: on the warpgroup MMA for
// head_dim 128 in sm_90a builds, mma.sync otherwise. With every causal block selected it is
// dense causal attention.
struct SaleAttendParams {
  // One prompt as the reference takes it, q, k, v and out on the device; head dim 64 or 128,
  // bf16 or fp16.
  SalePrefill prompt;
  SaleParams blocks;              // block_q 64, block_k 32
  const uint8_t* mask = nullptr;  // device [H, q_blocks, k_blocks], as SaleSelect writes it
};

bool SaleAttendSupports(const SaleParams& blocks, int32_t head_dim, DType dtype);
// cudaErrorInvalidValue for what SaleAttendSupports refuses or q / k / v / out off 16-byte
// alignment.
cudaError_t SaleAttend(const SaleAttendParams& p, cudaStream_t stream);

}  // namespace kvsparse::kernels::cuda

#endif  // KVSPARSE_KERNELS_CUDA_SALE_H_
