// SANTA / S2ANTA (kernels/santa.h): S samples per query head from the post-softmax distribution
// (i.i.d., stratified or systematic; global, proportional or flash allocation over tiles), whose
// V rows are averaged. The scores read every K row: the placement keeps K resident, or every K
// row is fetched first; only the sampled V rows cross.
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

class Santa final : public MethodUnit {
 public:
  absl::Status Validate(const Method& m, const EngineOptions& options) const override {
    return kernels::ValidateSantaParams(Resolve(m, options));
  }
  CpuPlan Plan(const Method&) const override {
    CpuPlan plan;
    plan.all_keys = true;
    return plan;
  }
  absl::Status Select(CpuStep& step, kernels::RowSelection* sel) const override {
    return kernels::SantaSelectCpu(step.problem(), Resolve(step.method(), step.options()),
                                   step.seed(), sel);
  }
};

}  // namespace

const MethodUnit& SantaUnit() {
  static const Santa unit;
  return unit;
}

}  // namespace kvsparse::engine
