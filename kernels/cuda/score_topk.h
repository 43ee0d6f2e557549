// Sink + local window + top-k by float scores on the GPU, per (sequence, query head): the
// selection rule of kernels/hash_topk.h SelectSinkLocalTopK (score descending, ties to the lower
// token index), exactly, so that with the scores of CompressedScores (kernels/cuda/
// compressed_keys.h, the CPU's up to rounding) it selects the rows of the CPU reference
// (kernels/score_topk.h) except between near-ties. A radix select of the k-th largest score (four
// 8-bit passes over the scores), then one ordered compaction pass. Its output is HashTopK's, so the
// union over the GQA group and the selected-rows path (row cache, fetch, estimate) take it as they
// are. The launcher never allocates or synchronises.
#ifndef KVSPARSE_KERNELS_CUDA_SCORE_TOPK_H_
#define KVSPARSE_KERNELS_CUDA_SCORE_TOPK_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/sink_local_topk.h"

namespace kvsparse::kernels::cuda {

struct ScoreTopKLaunchParams {
  int32_t batch = 0;              // B
  int32_t num_q_heads = 0;        // H
  const float* scores = nullptr;  // device, shape: [B, H, score_stride] (finite)
  int64_t score_stride = 0;
  const int32_t* seq_lens = nullptr;  // device, shape: [B]
  int32_t max_seq_len = 0;            // host upper bound of seq_lens
  // The fixed set: k clamped to the tokens outside sink and window, at least one where those are
  // empty (kernels/sink_local_topk.h).
  FixedSet fixed;
  // device, shape: [B, H, max(1, MaxSelected())]: the chosen tokens, ascending, in the first
  // counts[b, h] entries (the rest untouched).
  int32_t* indices = nullptr;
  int32_t* counts = nullptr;   // device, shape: [B, H]
  int32_t* budgets = nullptr;  // optional device [B, H]: top-k rows chosen (without sink/window)

  int32_t MaxSelected() const;
};

cudaError_t ScoreTopK(const ScoreTopKLaunchParams& p, cudaStream_t stream);

}  // namespace kvsparse::kernels::cuda

#endif  // KVSPARSE_KERNELS_CUDA_SCORE_TOPK_H_
