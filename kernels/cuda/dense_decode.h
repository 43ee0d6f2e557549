// Dense (exact) split-KV decode attention on the GPU, FlashDecoding style: each block reads one
// chunk of one sequence's K/V for one kv head and all G query heads of its group (K and V are
// read once per group), keeps an online softmax in fp32, and a merge kernel combines the chunks
// by their log-sum-exp. The exact mode of kvsparse and the control every sparse method is
// measured against. CPU reference: kernels/dense.h (DenseDecodeCpu).
#ifndef KVSPARSE_KERNELS_CUDA_DENSE_DECODE_H_
#define KVSPARSE_KERNELS_CUDA_DENSE_DECODE_H_

#include <cuda_runtime_api.h>

#include <cstddef>

#include "kernels/cuda/decode_params.h"

namespace kvsparse::kernels::cuda {

// How a dense decode is split: num_splits chunks of chunk_len tokens per (sequence, kv head).
// Depends only on host-side fields of the shape and on the device's multiprocessor count.
struct SplitPlan {
  int32_t num_splits = 1;
  int32_t chunk_len = 0;
};
// waves: target number of block waves (1: one block per resident slot; more, smaller blocks
// trade merge work for better load balance).
SplitPlan DenseDecodePlan(const DecodeShape& shape, int32_t waves = 1);

// Workspace bytes DenseDecode needs for this shape (0 when no merge pass is needed).
size_t DenseDecodeWorkspaceBytes(const DecodeShape& shape, int32_t waves = 1);

// out[b, h] = softmax(scale * q[b, h] . K[b, h / G]^T) V[b, h / G] over the first seq_lens[b]
// tokens; fp32 accumulation, output rounded to the dtype. See decode_params.h for the contract.
cudaError_t DenseDecode(const DecodeShape& shape, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream, int32_t waves = 1);

// The merge pass on its own (used by the sparse kernels that produce the same partials):
// out[bh, :] = sum_s w_s * partial_o[bh, s, :] / sum_s w_s with w_s = 2^(partial_lse[bh, s] - max)
// where partial_o: [BH, num_splits, d] fp32, normalised per split; partial_lse: [BH, num_splits]
// fp32 in log2 units (-inf for an empty split). out: [BH, d] in dtype (zeros if all are empty).
cudaError_t MergePartials(const float* partial_o, const float* partial_lse, int32_t num_rows,
                          int32_t num_splits, int32_t head_dim, DType dtype, void* out,
                          cudaStream_t stream);
// The end of a split launch: MergePartials where there are several splits; with one, the kernel
// wrote `out` itself and nothing is launched.
inline cudaError_t MergeSplits(const float* partial_o, const float* partial_lse, int32_t num_rows,
                               int32_t num_splits, int32_t head_dim, DType dtype, void* out,
                               cudaStream_t stream) {
  if (num_splits <= 1) return cudaSuccess;
  return MergePartials(partial_o, partial_lse, num_rows, num_splits, head_dim, dtype, out, stream);
}

}  // namespace kvsparse::kernels::cuda

#endif  // KVSPARSE_KERNELS_CUDA_DENSE_DECODE_H_
