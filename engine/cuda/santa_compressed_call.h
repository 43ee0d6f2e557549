// S2ANTA over compressed keys on the GPU (kernels/santa.h, "Scores from compressed keys"; the
// ratio correction, prop allocation): the sequence's compressed keys score every token
// (engine/cuda/compressed_scoring.h), PropFromScores samples S rows per query head from those
// scores as the CPU reference does (kernels/cuda/santa_scores.h), or, with the group mixture
// proposal, S rows per kv head from the mixture of its heads' (GroupMixtureFromScores) for every
// head of the group, either under a uniform floor when asked (ProposalFloorOnScores);
// UnionSelected merges each GQA group's rows, and the selected-rows path
// (engine/cuda/selected_rows_call.h) fetches the sampled K and V rows (through the row cache)
// and takes the ratio estimate: the softmax over the rows of the exact score plus log2(count) -
// s~ (the mixture's score for the group mixture). The santa runner (engine/cuda/santa_runner.cc)
// hands these calls here; other allocations and correction "none" run on the CPU engine.
#ifndef KVSPARSE_ENGINE_CUDA_SANTA_COMPRESSED_CALL_H_
#define KVSPARSE_ENGINE_CUDA_SANTA_COMPRESSED_CALL_H_

#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/cuda/gpu_runner.h"
#include "kernels/cuda/santa.h"

namespace kvsparse::engine::gpu {

// What both S2ANTA paths on the GPU need: tiles of kernels::cuda::kSantaTile (the engine's
// default, MethodUnit::Resolve).
inline absl::Status SantaTilesOnGpu(const kernels::SantaParams& p) {
  if (p.tile_size != kernels::cuda::kSantaTile) {
    return NotOnGpu(absl::StrCat("S2ANTA on the GPU takes tiles of ", kernels::cuda::kSantaTile,
                                 " tokens, not ", p.tile_size));
  }
  return absl::OkStatus();
}

// Scores from compressed keys that the sequence keeps, the ratio correction, systematic sampling
// with prop allocation over tiles of kernels::cuda::kSantaTile (as the santa runner's); rows
// staged from a store in another process need K and V in one tier.
absl::Status SantaOverCompressedKeysSupports(const Method& m, const SequenceDesc& desc,
                                             const GpuCaps& caps);
std::unique_ptr<MethodCall> BeginSantaOverCompressedKeys(const Method& m);
// Captured steps: what Supports takes over compressed keys the sequence keeps (the step appends
// its key to them on the device; the sampler reads the step's lengths and seeds there).
bool SantaOverCompressedKeysCapturable(const Method& m, const SequenceDesc& desc);

}  // namespace kvsparse::engine::gpu

#endif  // KVSPARSE_ENGINE_CUDA_SANTA_COMPRESSED_CALL_H_
