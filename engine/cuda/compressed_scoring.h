// The scores of every token of every query head from the sequences' compressed keys
// (kernels/cuda/compressed_keys.h, CompressedScores: the CPU reference's scores up to a stated
// rounding bound), for the GPU runners that select from them: top-k, S2ANTA (per head and the
// group mixture) and vAttention's compressed predictor over compressed keys. DeviceState keeps
// the keys (a few bits per channel in closed groups of kKeyGroupTokens, the open group's rows
// exact); this reads them where they live.
#ifndef KVSPARSE_ENGINE_CUDA_COMPRESSED_SCORING_H_
#define KVSPARSE_ENGINE_CUDA_COMPRESSED_SCORING_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "engine/cuda/gpu_runner.h"
#include "kernels/cuda/compressed_keys.h"

namespace kvsparse::engine::gpu {

class CompressedScoring {
 public:
  // In the call's Plan: the kernel's shape (it reads the blocks' and open rows' bases per
  // (b, kv head) from the plan's shared tables).
  void Plan(LaunchPlan& lp);
  // In the run pass: scale * q . k~ into scores [B * H, lp.n_max] (device).
  absl::Status Enqueue(LaunchPlan& lp, float* scores);
  // Device bytes one pass reads for sequence b per kv head: the closed groups' blocks and the
  // open group's exact rows (CompressedKeysView::bytes_read, as the CPU engine counts them).
  uint64_t DeviceBytes(const LaunchPlan& lp, int32_t b) const;

 private:
  kernels::cuda::CompressedScoreParams cs_;
};

}  // namespace kvsparse::engine::gpu

#endif  // KVSPARSE_ENGINE_CUDA_COMPRESSED_SCORING_H_
