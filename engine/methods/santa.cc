// SANTA / S2ANTA (kernels/santa.h): S samples per query head from the post-softmax distribution
// (i.i.d., stratified or systematic; global, proportional or flash allocation over tiles), whose
// V rows are averaged. Exact scores read every K row: the placement keeps K resident, or every K
// row is fetched first; only the sampled V rows cross. Scores from the sequence's compressed keys
// (placement.compressed_key_bits) read no K row for the selection; the ratio correction then
// gathers the sampled K rows with their V rows (kernels/santa.h, "Scores from compressed keys").
#include "engine/cpu_step.h"
#include "engine/methods/method_unit.h"

namespace kvsparse::engine {
namespace {

// The request's parameters with the engine's default tile size for a 0.
kernels::SantaParams Resolve(const Method& m, const EngineOptions& options) {
  kernels::SantaParams p = m.santa;
  if (p.tile_size == 0) p.tile_size = options.default_tile_size;
  return p;
}

bool Compressed(const Method& m) { return m.santa.scores == kernels::ScoreSource::kCompressedKeys; }

class Santa final : public MethodUnit {
 public:
  absl::Status Validate(const Method& m, const EngineOptions& options) const override {
    return kernels::ValidateSantaParams(Resolve(m, options));
  }
  absl::Status CheckFits(const Method& m, const SequenceDesc& desc,
                         const SignatureMaker&) const override {
    if (Compressed(m) && desc.placement.compressed_key_bits == 0) {
      return absl::FailedPreconditionError(
          "santa with compressed-key scores needs compressed keys: create the sequence with "
          "placement.compressed_key_bits (or ask for exact scores)");
    }
    return absl::OkStatus();
  }
  CpuPlan Plan(const Method& m) const override {
    CpuPlan plan;
    plan.all_keys = !Compressed(m);
    return plan;
  }
  absl::Status Select(CpuStep& step, kernels::RowSelection* sel) const override {
    const Method& m = step.method();
    const kernels::SantaParams p = Resolve(m, step.options());
    if (!Compressed(m)) return kernels::SantaSelectCpu(step.problem(), p, step.seed(), sel);
    return kernels::SantaSelectCpu(step.problem(), p, step.seed(), sel, nullptr,
                                   step.CompressedKeys());
  }
};

}  // namespace

const MethodUnit& SantaUnit() {
  static const Santa unit;
  return unit;
}

}  // namespace kvsparse::engine
