#include "engine/cuda/compressed_scoring.h"

#include <algorithm>

#include "kernels/compressed_keys.h"

namespace kvsparse::engine::gpu {

namespace kc = kernels::cuda;

void CompressedScoring::Plan(LaunchPlan& lp) {
  int32_t max_groups = 0;
  for (int32_t b = 0; b < lp.B; ++b) {
    max_groups = std::max(max_groups, lp.len(b) / kernels::kKeyGroupTokens);
  }
  const kernels::KeyCompression c{static_cast<int32_t>(lp.descs()[0].placement.compressed_key_bits),
                                  kernels::kKeyGroupTokens};
  cs_.num_seqs = lp.B;
  cs_.num_q_heads = lp.H;
  cs_.num_kv_heads = lp.hkv;
  cs_.head_dim = lp.d;
  cs_.bits = c.bits;
  cs_.group = c.group_tokens;
  cs_.max_groups = max_groups;
  cs_.dtype = lp.dtype;
  cs_.block_bytes = static_cast<int64_t>(kernels::KeyGroupBytes(c, lp.d));
  cs_.score_stride = lp.n_max;
}

absl::Status CompressedScoring::Enqueue(LaunchPlan& lp, float* scores) {
  cs_.q = lp.shape().q;
  cs_.scale = lp.shape().scale;
  cs_.group_heads = lp.ck_heads_table();
  cs_.tails = lp.ck_tails_table();
  cs_.seq_lens = lp.shape().seq_lens;
  cs_.scores = scores;
  cs_.map_channel = lp.key_map().channel;
  cs_.map_part = lp.key_map().part;
  KVS_CUDA_OK(kc::CompressedScores(cs_, lp.stream()), "CompressedScores");
  return absl::OkStatus();
}

uint64_t CompressedScoring::DeviceBytes(const LaunchPlan& lp, int32_t b) const {
  const uint64_t n = static_cast<uint64_t>(lp.len(b)), g = static_cast<uint64_t>(cs_.group);
  return n / g * static_cast<uint64_t>(cs_.block_bytes) + n % g * lp.row;
}

}  // namespace kvsparse::engine::gpu
