// Top-k by scores on the GPU, scores from the sequence's compressed keys (DeviceState keeps
// them: a few bits per key channel, the open group's rows exact), then the shared
// selected-rows path (engine/cuda/selected_rows_call.h: row cache, fetch, estimate):
//   CompressedScores  scale * q . k~ for every token of every query head (the CPU reference's
//                     scores bit for bit, so both engines select the same rows);
//   ScoreTopK         sink + local window + top-k by score per query head;
//   UnionSelected     the union over each GQA group (each row once per kv head).
// Only the selected K and V rows cross the host link. Exact scores (the oracle, which reads
// every key) stay on the CPU engine.
#include <algorithm>

#include "engine/cuda/selected_rows_call.h"
#include "kernels/compressed_keys.h"
#include "kernels/cuda/compressed_keys.h"
#include "kernels/cuda/score_topk.h"
#include "kernels/hash_topk.h"

namespace kvsparse::engine::gpu {
namespace {

namespace kc = kernels::cuda;

class TopKCall final : public SelectedRowsCall {
 public:
  explicit TopKCall(const Method& m) : params_(m.top_k) {}
  // Compressed-key scores of a sequence that keeps compressed keys. Rows staged from a store in
  // another process: K and V in the same tier (the fetch reads both by list position).
  static bool Supports(const Method& m, const SequenceDesc& desc, const GpuCaps& caps) {
    const kvstore::Placement& pl = desc.placement;
    if (m.top_k.source != kernels::ScoreSource::kCompressedKeys || pl.compressed_key_bits == 0) {
      return false;
    }
    return StagedRowsFit(desc, caps);
  }

 private:
  absl::StatusOr<int32_t> PlanSelection(LaunchPlan& lp) override {
    int32_t max_groups = 0;
    for (int32_t b = 0; b < lp.B; ++b) {
      absl::StatusOr<int32_t> k =
          kernels::ResolveTopK(params_.top_k, params_.top_k_fraction, lp.len(b));
      if (!k.ok()) return k.status();
      max_groups = std::max(max_groups, lp.len(b) / kernels::kKeyGroupTokens);
    }
    const kernels::KeyCompression c{
        static_cast<int32_t>(lp.descs()[0].placement.compressed_key_bits),
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
    tk_.batch = lp.B;
    tk_.num_q_heads = lp.H;
    tk_.score_stride = lp.n_max;
    tk_.max_seq_len = lp.n_max;
    tk_.sink_tokens = params_.sink_tokens;
    tk_.local_tokens = params_.local_tokens;
    tk_.top_k = params_.top_k;
    tk_.top_k_fraction = params_.top_k_fraction;
    heads_off_ = lp.AddHostTable<const void*>(lp.BK);
    tails_off_ = lp.AddHostTable<const void*>(lp.BK);
    return std::max(1, tk_.MaxSelected());
  }

  void FillSelectionTables(LaunchPlan& lp) override {
    const size_t row = lp.row, block = static_cast<size_t>(cs_.block_bytes);
    const size_t group = static_cast<size_t>(cs_.group);
    for (int32_t b = 0; b < lp.B; ++b) {
      const DeviceLayer& l = lp.layer(b);
      for (int32_t j = 0; j < lp.hkv; ++j) {
        const int32_t i = b * lp.hkv + j;
        if (l.ck.ptr != nullptr) {
          lp.HostTable<const void*>(heads_off_)[i] = l.ck.as<uint8_t>() + j * l.ck_cap * block;
        }
        if (l.ck_tail.ptr != nullptr) {
          lp.HostTable<const void*>(tails_off_)[i] = l.ck_tail.as<uint8_t>() + j * group * row;
        }
      }
    }
  }

  absl::Status EnqueueSelection(LaunchPlan& lp, Carver& c, const Selection& s) override {
    const size_t BH = static_cast<size_t>(lp.BH);
    float* scores = c.Take<float>(BH * lp.n_max);
    tk_.scores = scores;
    tk_.seq_lens = lp.shape().seq_lens;
    tk_.indices = c.Take<int32_t>(BH * s.max_selected);
    tk_.counts = s.counts;
    tk_.budgets = s.budgets;
    const Union un = PlanUnion(lp, c, s, tk_.indices, tk_.counts);
    if (!lp.running()) return absl::OkStatus();
    cs_.q = lp.shape().q;
    cs_.scale = lp.shape().scale;
    cs_.group_heads = lp.Dev<const uint8_t* const>(heads_off_);
    cs_.tails = lp.Dev<const void* const>(tails_off_);
    cs_.seq_lens = lp.shape().seq_lens;
    cs_.scores = scores;
    const cudaStream_t stream = lp.stream();
    KVS_CUDA_OK(kc::CompressedScores(cs_, stream), "CompressedScores");
    KVS_CUDA_OK(kc::ScoreTopK(tk_, stream), "ScoreTopK");
    return EnqueueUnion(lp, un);
  }

  // The selection reads every token's compressed key: the closed groups' blocks and the open
  // group's exact rows (CompressedKeysView::bytes_read, as the CPU engine counts it).
  uint64_t SelectionDeviceBytes(const LaunchPlan& lp, int32_t b) const override {
    const uint64_t n = static_cast<uint64_t>(lp.len(b)), g = static_cast<uint64_t>(cs_.group);
    return n / g * static_cast<uint64_t>(cs_.block_bytes) + n % g * lp.row;
  }

  const kernels::ScoreTopKParams params_;
  kc::CompressedScoreParams cs_;
  kc::ScoreTopKParams tk_;
  size_t heads_off_ = 0, tails_off_ = 0;
};

}  // namespace

const GpuRunner& TopKRunner() {
  static const RunnerOf<TopKCall> runner;
  return runner;
}

}  // namespace kvsparse::engine::gpu
