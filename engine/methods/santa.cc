// SANTA / S2ANTA (kernels/santa.h): S samples per query head from the post-softmax distribution
// (i.i.d., stratified or systematic; global, proportional or flash allocation over tiles), whose
// V rows are averaged. Exact scores read every K row: the placement keeps K resident, or every K
// row is fetched first; only the sampled V rows cross. Scores from the sequence's compressed keys
// (placement.compressed_key_bits) read no K row for the selection; the ratio correction then
// gathers the sampled K rows with their V rows (kernels/santa.h, "Scores from compressed keys").
// Bernoulli qK^T's scores report the K features they read (HeadStats::key_features_*).
#include "absl/strings/str_cat.h"
#include "engine/cpu_step.h"
#include "engine/methods/method_unit.h"

namespace kvsparse::engine {
namespace {

bool Compressed(const Method& m) { return m.santa.scores == kernels::ScoreSource::kCompressedKeys; }

// The fewest bits per key channel S2ANTA draws from (kernels/santa.h, "Scores from compressed
// keys"): 1-bit keys are refused.
constexpr uint32_t kMinSantaKeyBits = 2;

class Santa final : public MethodUnit {
 public:
  // The engine's tile size for a request's 0.
  bool Resolve(Method* m, const EngineOptions& options) const override {
    if (m->santa.tile_size != 0) return false;
    m->santa.tile_size = options.default_tile_size;
    return true;
  }
  absl::Status Validate(const Method& m, const EngineOptions&) const override {
    return kernels::ValidateSantaParams(m.santa);
  }
  absl::Status CheckFits(const Method& m, const SequenceDesc& desc,
                         const SignatureMaker&) const override {
    if (!Compressed(m)) return absl::OkStatus();
    // The ratio correction cannot make up for 1-bit scores: on the trained model S2ANTA S=128
    // over 1-bit keys kept 42 of 90 pass keys with perplexity +87% (docs/ACCURACY.md).
    return CheckCompressedKeys("santa with compressed-key scores", desc, kMinSantaKeyBits,
                               "ask for exact scores",
                               "its estimate's bias there is far beyond its standard error");
  }
  CpuPlan Plan(const Method& m) const override {
    CpuPlan plan;
    plan.all_keys = !Compressed(m);
    plan.states_standard_error = true;  // every row S2ANTA uses is one of its draws
    return plan;
  }
  absl::Status Select(CpuStep& step, kernels::RowSelection* sel) const override {
    const Method& m = step.method();
    const kernels::SantaParams& p = m.santa;
    if (Compressed(m)) {
      return kernels::SantaSelectCpu(step.problem(), p, step.seed(), sel, nullptr,
                                     step.CompressedKeys());
    }
    if (p.bernoulli_qk_samples == 0) {
      return kernels::SantaSelectCpu(step.problem(), p, step.seed(), sel);
    }
    kernels::SantaStats stats;
    if (absl::Status s = kernels::SantaSelectCpu(step.problem(), p, step.seed(), sel, &stats);
        !s.ok()) {
      return s;
    }
    for (int32_t j = 0; j < step.problem().num_kv_heads; ++j) {
      step.CountKeyFeatures(j, static_cast<uint64_t>(stats.key_features_head[j]),
                            static_cast<uint64_t>(stats.key_features_group[j]));
    }
    return absl::OkStatus();
  }
};

}  // namespace

const MethodUnit& SantaUnit() {
  static const Santa unit;
  return unit;
}

}  // namespace kvsparse::engine
