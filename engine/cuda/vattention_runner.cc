// vAttention on the GPU, two predictors:
//   hash        the query signatures, then VAttentionDecode (fixed set from the signatures,
//               uniform base sample, budget for (epsilon, delta), uniform final sample, estimate);
//   compressed  with the importance sampler: every token's score from the sequence's compressed
//               keys (engine/cuda/compressed_scoring.h, the CPU's scores up to rounding), then
//               VAttentionDecode in importance mode (fixed set by those scores, draws from their
//               softmax, weights 1 / (b p_t); kernels/cuda/vattention.h).
// Each reads each row once per GQA group (the union of the group's lists, copied into a row set).
// The exact predictor, and the compressed one with the uniform sampler (its residual bound),
// run on the CPU engine. The compressed predictor's calls also run as captured steps
// (engine/cuda/static_step.cc): every stage reads the step's lengths and seeds on the device and
// computes the budget there.
#include <algorithm>
#include <vector>

#include "engine/cuda/compressed_scoring.h"
#include "engine/cuda/gpu_runner.h"
#include "kernels/cuda/vattention.h"
#include "kernels/hash_topk.h"

namespace kvsparse::engine::gpu {
namespace {

namespace kc = kernels::cuda;

class VAttentionCall final : public MethodCall {
 public:
  explicit VAttentionCall(const Method& m)
      : params_(m.vattention),
        compressed_(m.vattention.predictor == kernels::TopKPredictor::kCompressed) {}
  // The hash predictor over signatures on the device (SimHash, or learned MLPs that fit), or the
  // compressed predictor with the importance sampler over a sequence that keeps compressed keys.
  // Rows from a store in another process are staged part by part (K and V in the same tier: the
  // fetch reads both by list position).
  static absl::Status Supports(const Method& m, const SequenceDesc& desc, const GpuCaps& caps) {
    const kernels::VAttentionParams& p = m.vattention;
    kernels::Reasons reasons(absl::StatusCode::kFailedPrecondition);
    reasons.Add(StagedRowsFit(desc, caps));
    reasons.AddIf(p.exact_statistics, "vAttention's exact statistics run on the CPU");
    if (p.predictor == kernels::TopKPredictor::kCompressed) {
      reasons.AddIf(p.sampler != kernels::ResidualSampler::kImportance ||
                        p.bound == kernels::BudgetBound::kHoeffding,
                    "vAttention over compressed keys on the GPU: the importance sampler, not the "
                    "Hoeffding bound");
      reasons.AddIf(desc.placement.compressed_key_bits == 0,
                    "the placement keeps no compressed keys");
      // At per-channel widths (key widths) too: the importance sampler reads the scores only
      // (no logit bound, so not the open group's left-out channels' norm either), which the
      // scores kernels take through the maps (GpuEngineTest.KeyWidthsOnTheGpu).
    } else if (p.predictor == kernels::TopKPredictor::kHash) {
      reasons.Add(SignaturesOnGpu(m, desc, caps));
    } else {
      reasons.AddIf(true, "vAttention on the GPU predicts with signatures or compressed keys");
    }
    return reasons.ToStatus();
  }
  // Captured steps, the compressed predictor with the importance sampler: its kernels read the
  // step's lengths and seeds on the device, compute the budget there and size their lists and
  // row set for the plan's longest sequence (VAttentionWorkspaceBytes); the compressed keys they
  // score are what the step's append keeps up to date. The hash predictor's steps would need the
  // appended key signed on the device, as hash top-k's are: not captured.
  static bool Capturable(const Method& m, const SequenceDesc& desc) {
    return m.vattention.predictor == kernels::TopKPredictor::kCompressed &&
           desc.placement.compressed_key_bits >= 2 && Supports(m, desc, GpuCaps{}).ok();
  }

  absl::Status Plan(LaunchPlan& lp) override {
    for (int32_t b = 0; b < lp.B; ++b) {
      absl::StatusOr<int32_t> k = kernels::ResolveTopK(params_.fixed, lp.len(b));
      if (!k.ok()) return k.status();
    }
    if (compressed_) {
      scoring_.Plan(lp);
      return absl::OkStatus();
    }
    return lp.LoadPlanes();
  }

  absl::Status Enqueue(LaunchPlan& lp, Carver& c) override {
    const int32_t BH = lp.BH;
    // Everything the layer's kernels use is read within the layer: a captured plan's layers share
    // it (the transient region; an eager call's own scratch). The row set alone is max_seq_len K
    // and V rows per (b, kv head).
    uint32_t* qsig =
        compressed_ ? nullptr : c.TakeTransient<uint32_t>(static_cast<size_t>(BH) * lp.words);
    float* scores =
        compressed_ ? c.TakeTransient<float>(static_cast<size_t>(BH) * lp.n_max) : nullptr;
    kc::VAttentionLaunchParams vp;
    vp.shape = lp.shape();
    vp.seeds = lp.seeds();
    vp.epsilon = params_.epsilon;
    vp.delta = params_.delta;
    vp.fixed = params_.fixed;
    vp.base_rate = params_.base_rate;
    vp.bound = static_cast<int32_t>(params_.bound);
    vp.target = static_cast<int32_t>(params_.target);
    if (compressed_) {
      vp.scores = scores;
      vp.scores_stride = lp.n_max;
    } else {
      vp.bits = lp.words * 32;
      vp.q_sigs = qsig;
      vp.k_sig_heads = lp.sig_heads();
      vp.k_token_stride = lp.words;
      vp.key_heads = lp.hkv;
    }
    const size_t wb = kc::VAttentionWorkspaceBytes(vp);
    void* ws = c.TakeTransient<char>(wb);
    if (!lp.running()) return absl::OkStatus();
    const cudaStream_t stream = lp.stream();
    if (compressed_) {
      if (absl::Status s = scoring_.Enqueue(lp, scores); !s.ok()) return s;
    } else if (absl::Status s = lp.SignQueries(qsig); !s.ok()) {
      return s;
    }
    KVS_CUDA_OK(kc::VAttentionSelect(vp, ws, wb, stream), "VAttentionSelect");
    // Stages: selection, then no gather stage of its own (the rows are read in both later
    // phases, beside the statistics and the estimate): all of it counts as compute.
    if (absl::Status s = lp.Mark(1); !s.ok()) return s;
    if (absl::Status s = lp.Mark(2); !s.ok()) return s;
    // Each part's rows: read in place, or (a store in another process) gathered into staging in
    // list order once the part's list is known.
    const kc::VAttentionSelectionView v = kc::VAttentionSelection(vp, ws);
    kc::DecodeShape staged = vp.shape;
    kc::VAttentionRowSource src;
    if (lp.staged()) {
      if (absl::Status s = lp.StageListed(v.union_a, v.max_list, v.union_a_count, &staged);
          !s.ok()) {
        return s;
      }
      src = {&staged, true};
    }
    KVS_CUDA_OK(kc::VAttentionVerify(vp, src, ws, wb, stream), "VAttentionVerify");
    if (lp.staged()) {
      staged = vp.shape;
      if (absl::Status s = lp.StageListed(v.union_r, v.max_list, v.union_r_count, &staged);
          !s.ok()) {
        return s;
      }
    }
    KVS_CUDA_OK(kc::VAttentionEstimate(vp, src, ws, wb, stream), "VAttentionEstimate");
    // The statistics in every call's layout (StaticStep::kStatBlocks, which a captured plan's
    // readers rely on): block 0 the rows fetched per (b, kv head) (the union), blocks 1 and 2 per
    // query head the fixed set's and the final sample's counts, block 3 the row cache's hits
    // (vAttention keeps none: zeros).
    int32_t* stats = lp.stats();
    const int32_t* counts[] = {v.fetched, v.fixed_count, v.dyn_count};
    for (int x = 0; x < 3; ++x) {
      const size_t n = x == 0 ? lp.BK : BH;
      KVS_CUDA_OK(cudaMemcpyAsync(stats + x * BH, counts[x], sizeof(int32_t) * n,
                                  cudaMemcpyDeviceToDevice, stream),
                  "stats");
    }
    KVS_CUDA_OK(cudaMemsetAsync(stats + 3 * BH, 0, sizeof(int32_t) * BH, stream), "stats");
    budgets_.device = v.budget;
    epsilon_.device = v.epsilon;
    return absl::OkStatus();
  }

  absl::Status Download(LaunchPlan& lp) override {
    if (absl::Status s = budgets_.Fetch(lp.BH, lp.stream()); !s.ok()) return s;
    return epsilon_.Fetch(lp.BH, lp.stream());
  }

  void Stats(const LaunchPlan& lp, int32_t b, int32_t j, HeadStats* hs) const override {
    const int32_t* st = lp.host_stats();
    const int32_t BH = lp.BH;
    const uint64_t n = static_cast<uint64_t>(lp.len(b));
    for (int32_t g = 0; g < lp.G; ++g) {
      const int32_t bh = b * lp.H + j * lp.G + g;
      const uint64_t fixed = static_cast<uint64_t>(st[BH + bh]);
      const uint64_t dyn = static_cast<uint64_t>(std::max(st[2 * BH + bh], 0));
      hs->rows_selected += fixed + dyn;
      hs->budgets.push_back(static_cast<uint64_t>(std::max<int64_t>(budgets_.host[bh], 0)));
      hs->epsilon.push_back(epsilon_.host[bh]);  // what the head's final sample promises
    }
    hs->rows_fetched = static_cast<uint64_t>(st[b * lp.hkv + j]);  // the union
    // The predictor's reads: every key's compressed form, or every key's signature.
    hs->bytes[kDeviceTier] += compressed_ ? scoring_.DeviceBytes(lp, b) : n * lp.words * 4;
    hs->bytes[lp.k_tier()] += hs->rows_fetched * lp.row;
    hs->bytes[lp.v_tier()] += hs->rows_fetched * lp.row;
  }

 private:
  const kernels::VAttentionParams params_;
  const bool compressed_;
  CompressedScoring scoring_;    // the compressed predictor's scores
  Downloaded<int64_t> budgets_;  // the budgets b [B, H]
  Downloaded<float> epsilon_;    // the epsilon each budget promises [B, H]
};

}  // namespace

const GpuRunner& VAttentionRunner() {
  static const RunnerOf<VAttentionCall> runner;
  return runner;
}

}  // namespace kvsparse::engine::gpu
