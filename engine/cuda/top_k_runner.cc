// Top-k by scores on the GPU, scores from the sequence's compressed keys (DeviceState keeps
// them: a few bits per key channel, the open group's rows exact), then the shared
// selected-rows path (engine/cuda/selected_rows_call.h: row cache, fetch, estimate):
//   CompressedScores  scale * q . k~ for every token of every query head (the CPU reference's
//                     scores up to rounding, so both engines select the same rows except
//                     between near-ties; engine/cuda/compressed_scoring.h);
//   ScoreTopK         sink + local window + top-k by score per query head;
//   UnionSelected     the union over each GQA group (each row once per kv head).
// Only the selected K and V rows cross the host link. Exact scores (the oracle, which reads
// every key) stay on the CPU engine.
#include <algorithm>

#include "engine/cuda/compressed_scoring.h"
#include "engine/cuda/selected_rows_call.h"
#include "kernels/compressed_keys.h"
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
  static absl::Status Supports(const Method& m, const SequenceDesc& desc, const GpuCaps& caps) {
    kernels::Reasons reasons(absl::StatusCode::kFailedPrecondition);
    reasons.AddIf(m.top_k.source != kernels::ScoreSource::kCompressedKeys,
                  "top-k on the GPU scores compressed keys only");
    reasons.AddIf(desc.placement.compressed_key_bits == 0,
                  "the placement keeps no compressed keys");
    reasons.Add(StagedRowsFit(desc, caps));
    return reasons.ToStatus();
  }
  // Captured steps: the step appends its key to the compressed keys on the device
  // (kernels::cuda::AppendCompressedKeyStep), the scores and the selection read the step's
  // lengths there, and the row cache never holds a stale row (steps never rewrite one).
  static bool Capturable(const Method& m, const SequenceDesc& desc) {
    return m.top_k.source == kernels::ScoreSource::kCompressedKeys &&
           desc.placement.compressed_key_bits > 0;
  }

 private:
  absl::StatusOr<int32_t> PlanSelection(LaunchPlan& lp) override {
    for (int32_t b = 0; b < lp.B; ++b) {
      absl::StatusOr<int32_t> k = kernels::ResolveTopK(params_.fixed, lp.len(b));
      if (!k.ok()) return k.status();
    }
    scoring_.Plan(lp);
    tk_.batch = lp.B;
    tk_.num_q_heads = lp.H;
    tk_.score_stride = lp.n_max;
    tk_.max_seq_len = lp.n_max;
    tk_.fixed = params_.fixed;
    return std::max(1, tk_.MaxSelected());
  }

  absl::Status EnqueueSelection(LaunchPlan& lp, Carver& c, const Selection& s) override {
    const size_t BH = static_cast<size_t>(lp.BH);
    float* scores = c.TakeTransient<float>(BH * lp.n_max);
    tk_.scores = scores;
    tk_.seq_lens = lp.shape().seq_lens;
    tk_.indices = c.Take<int32_t>(BH * s.max_selected);
    tk_.counts = s.counts;
    tk_.budgets = s.budgets;
    const Union un = PlanUnion(lp, c, s, tk_.indices, tk_.counts);
    if (!lp.running()) return absl::OkStatus();
    if (absl::Status st = scoring_.Enqueue(lp, scores); !st.ok()) return st;
    KVS_CUDA_OK(kc::ScoreTopK(tk_, lp.stream()), "ScoreTopK");
    return EnqueueUnion(lp, un);
  }

  // The selection reads every token's compressed key.
  uint64_t SelectionDeviceBytes(const LaunchPlan& lp, int32_t b) const override {
    return scoring_.DeviceBytes(lp, b);
  }

  const kernels::ScoreTopKParams params_;
  CompressedScoring scoring_;
  kc::ScoreTopKLaunchParams tk_;
};

}  // namespace

const GpuRunner& TopKRunner() {
  static const RunnerOf<TopKCall> runner;
  return runner;
}

}  // namespace kvsparse::engine::gpu
