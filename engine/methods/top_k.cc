// Top-k by scores (kernels/score_topk.h): sink + local window + the top-k tokens by score per
// query head. Scores from the sequence's compressed keys (placement.compressed_key_bits, kept in
// the worker's resident state) select without reading any K row, and only the chosen K and V rows
// are gathered; exact scores read every key (resident or fetched): the oracle top-k.
#include "absl/strings/str_cat.h"
#include "engine/cpu_step.h"
#include "engine/methods/method_unit.h"

namespace kvsparse::engine {
namespace {

bool Exact(const Method& m) { return m.top_k.source == kernels::ScoreSource::kExact; }

class TopK final : public MethodUnit {
 public:
  absl::Status Validate(const Method& m, const EngineOptions&) const override {
    return kernels::ValidateScoreTopKParams(m.top_k);
  }
  absl::Status CheckFits(const Method& m, const SequenceDesc& desc,
                         const SignatureMaker&) const override {
    if (Exact(m)) return absl::OkStatus();
    return CheckCompressedKeys("top_k with compressed-key scores", desc, 1, "ask for exact scores",
                               "");
  }
  CpuPlan Plan(const Method& m) const override {
    CpuPlan plan;
    plan.all_keys = Exact(m);  // the oracle scores every key
    return plan;
  }
  absl::Status Select(CpuStep& step, kernels::RowSelection* sel) const override {
    const Method& m = step.method();
    if (Exact(m)) return kernels::ScoreTopKSelectCpu(step.problem(), m.top_k, {}, sel);
    std::vector<double> left_out;  // every response states its missed mass (issue 50)
    if (absl::Status s = kernels::ScoreTopKSelectCpu(step.problem(), m.top_k, step.CompressedKeys(),
                                                     sel, &left_out);
        !s.ok()) {
      return s;
    }
    step.StateLeftOut(std::move(left_out));
    return absl::OkStatus();
  }
};

}  // namespace

const MethodUnit& TopKUnit() {
  static const TopK unit;
  return unit;
}

}  // namespace kvsparse::engine
