// Dense attention: every row of the layer, exact. The reference every other method is measured
// against, and the no-offload control.
#include "engine/cpu_step.h"
#include "engine/methods/method_unit.h"

namespace kvsparse::engine {
namespace {

class Dense final : public MethodUnit {
 public:
  absl::Status Validate(const Method&, const EngineOptions&) const override {
    return absl::OkStatus();
  }
  absl::Status Select(CpuStep& step, kernels::RowSelection* sel) const override {
    return kernels::SelectAllRows(step.problem(), sel);
  }
};

}  // namespace

const MethodUnit& DenseUnit() {
  static const Dense unit;
  return unit;
}

}  // namespace kvsparse::engine
