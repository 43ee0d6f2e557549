#include "engine/cuda/santa_compressed_call.h"

#include <algorithm>

#include "engine/cuda/compressed_scoring.h"
#include "engine/cuda/selected_rows_call.h"
#include "kernels/cuda/santa.h"
#include "kernels/cuda/santa_scores.h"

namespace kvsparse::engine::gpu {
namespace {

namespace kc = kernels::cuda;

class SantaCompressedCall final : public SelectedRowsCall {
 public:
  explicit SantaCompressedCall(const Method& m)
      : params_(m.santa), group_(m.santa.proposal == kernels::SantaProposal::kGroupMixture) {}

 private:
  absl::StatusOr<int32_t> PlanSelection(LaunchPlan& lp) override {
    scoring_.Plan(lp);
    ps_.batch = lp.B;
    // The group mixture samples one row of scores per kv head for its G query heads.
    ps_.num_q_heads = group_ ? lp.hkv : lp.H;
    ps_.num_kv_heads = lp.hkv;
    ps_.heads_per_row = group_ ? lp.H / lp.hkv : 1;
    ps_.score_stride = lp.n_max;
    ps_.max_seq_len = lp.n_max;
    ps_.num_samples = params_.samples;
    ps_.tile_size = kc::kSantaTile;
    ps_.max_selected = params_.samples + 1;  // systematic rounding can hand out S + 1 draws
    if (group_) {
      gm_.batch = lp.B;
      gm_.num_q_heads = lp.H;
      gm_.num_kv_heads = lp.hkv;
      gm_.score_stride = lp.n_max;
      gm_.max_seq_len = lp.n_max;
      gm_.mixture_stride = lp.n_max;
    }
    return ps_.max_selected;
  }

  bool RowWeights() const override { return true; }
  // Each step draws its rows afresh (its own seed): a row cache would hold last step's sample,
  // which this step's shares little of (0.6% of the union rows on e2e_bench's model at 32k), and
  // placing rows against it cost more than it saved (docs/PERF.md, "No row cache for S2ANTA's
  // samples").
  bool RowsRepeat() const override { return false; }
  // Each head draws its own sample (their union was 99% of their sum inside vLLM): read in place,
  // skipping the union and the fetch. The group mixture's heads share one sample: read in place
  // once for the G heads (from a store in another process: a union of one head's rows, staged).
  bool ReadsInPlace() const override { return true; }
  bool SharesRows() const override { return group_; }
  // Systematic draws: the estimate states its standard error from them (per-head proposals, read
  // in place; SelectedRowsParams::standard_errors says where).
  bool StatesStandardError() const override { return true; }
  // The group mixture gives the G heads of a kv head the same rows: the union is one head's.
  int32_t UnionBound(const LaunchPlan& lp, int32_t max_sel) const override {
    return group_ ? std::min(lp.n_max, max_sel) : SelectedRowsCall::UnionBound(lp, max_sel);
  }

  absl::Status EnqueueSelection(LaunchPlan& lp, Carver& c, const Selection& s) override {
    const size_t BH = static_cast<size_t>(lp.BH);
    float* scores = c.TakeTransient<float>(BH * lp.n_max);
    ps_.scores = scores;
    ps_.seq_lens = lp.shape().seq_lens;
    ps_.seeds = lp.seeds();
    ps_.indices = c.Take<int32_t>(BH * s.max_selected);
    ps_.counts = s.counts;
    ps_.budgets = s.budgets;
    ps_.log2_weights = s.log2_weights;
    ps_.row_counts = s.row_counts;
    size_t gwb = 0;
    void* gws = nullptr;
    if (group_) {
      gm_.scores = scores;
      gm_.seq_lens = lp.shape().seq_lens;
      gm_.mixture = c.TakeTransient<float>(static_cast<size_t>(lp.B) * lp.hkv * lp.n_max);
      ps_.scores = gm_.mixture;
      gwb = kc::GroupMixtureWorkspaceBytes(gm_);
      gws = c.TakeTransient<char>(gwb);
    }
    // A uniform floor under the proposal (the per-head scores' or the mixture's), in place.
    kc::ProposalFloorParams fl;
    fl.batch = lp.B;
    fl.rows_per_seq = ps_.num_q_heads;
    fl.scores = group_ ? gm_.mixture : scores;
    fl.score_stride = lp.n_max;
    fl.seq_lens = lp.shape().seq_lens;
    fl.max_seq_len = lp.n_max;
    fl.floor = params_.uniform_floor;
    const size_t fwb = fl.floor > 0.f ? kc::ProposalFloorWorkspaceBytes(fl) : 0;
    void* fws = c.TakeTransient<char>(fwb);
    const size_t wb = kc::PropFromScoresWorkspaceBytes(ps_);
    void* ws = c.TakeTransient<char>(wb);
    const Union un = PlanUnion(lp, c, s, ps_.indices, ps_.counts);
    if (!lp.running()) return absl::OkStatus();
    if (absl::Status st = scoring_.Enqueue(lp, scores); !st.ok()) return st;
    if (group_) {
      KVS_CUDA_OK(kc::GroupMixtureFromScores(gm_, gws, gwb, lp.stream()), "GroupMixtureFromScores");
    }
    if (fl.floor > 0.f) {
      KVS_CUDA_OK(kc::ProposalFloorOnScores(fl, fws, fwb, lp.stream()), "ProposalFloorOnScores");
    }
    KVS_CUDA_OK(kc::PropFromScores(ps_, ws, wb, lp.stream()), "PropFromScores");
    return EnqueueUnion(lp, un);
  }

  // The selection reads every token's compressed key.
  uint64_t SelectionDeviceBytes(const LaunchPlan& lp, int32_t b) const override {
    return scoring_.DeviceBytes(lp, b);
  }

  const kernels::SantaParams params_;
  const bool group_;  // the group mixture proposal: one row of scores sampled per kv head
  CompressedScoring scoring_;
  kc::PropFromScoresParams ps_;
  kc::GroupMixtureParams gm_;  // the group mixture proposal only
};

}  // namespace

absl::Status SantaOverCompressedKeysSupports(const Method& m, const SequenceDesc& desc,
                                             const GpuCaps& caps) {
  const kernels::SantaParams& p = m.santa;
  kernels::Reasons reasons(absl::StatusCode::kFailedPrecondition);
  reasons.AddIf(p.scores != kernels::ScoreSource::kCompressedKeys,
                "S2ANTA without K on the device scores compressed keys only");
  reasons.Add(SantaTilesOnGpu(p));
  // Bernoulli qK^T with compressed-key scores is refused by ValidateSantaParams.
  reasons.AddIf(p.correction != kernels::SantaCorrection::kRatio ||
                    p.sampler != kernels::SantaSampler::kSystematic ||
                    p.allocation != kernels::SantaAllocation::kProp,
                "S2ANTA over compressed keys on the GPU: systematic, prop, ratio correction");
  reasons.AddIf(desc.placement.compressed_key_bits == 0, "the placement keeps no compressed keys");
  reasons.Add(StagedRowsFit(desc, caps));
  return reasons.ToStatus();
}

bool SantaOverCompressedKeysCapturable(const Method& m, const SequenceDesc& desc) {
  return SantaOverCompressedKeysSupports(m, desc, GpuCaps{}).ok();
}

std::unique_ptr<MethodCall> BeginSantaOverCompressedKeys(const Method& m) {
  return std::make_unique<SantaCompressedCall>(m);
}

}  // namespace kvsparse::engine::gpu
