// HashAttention top-k (kernels/hash_topk.h): sink + local window + the top-k tokens by Hamming
// similarity of the query's and keys' bit signatures (kept resident per token); the K and V rows
// of the chosen tokens cross.
#include "engine/cpu_step.h"
#include "engine/methods/method_unit.h"

namespace kvsparse::engine {
namespace {

class HashTopK final : public MethodUnit {
 public:
  absl::Status Validate(const Method& m, const EngineOptions&) const override {
    kernels::HashTopKParams p = m.hash;
    if (p.bits == 0) p.bits = 32;  // the sequence's bits are checked per sequence
    return kernels::ValidateHashTopKParams(p);
  }
  absl::Status CheckFits(const Method& m, const SequenceDesc& desc,
                         const SignatureMaker& signatures) const override {
    return CheckSignatures(m, m.hash.bits, "hash_top_k", desc, signatures);
  }
  absl::Status Select(CpuStep& step, kernels::RowSelection* sel) const override {
    kernels::HashTopKParams p = step.method().hash;
    if (p.bits == 0) p.bits = static_cast<int32_t>(step.desc().placement.signature_bits);
    return kernels::HashTopKSelectCpu(step.problem(), p, step.Signatures(p.bits), sel);
  }
};

}  // namespace

const MethodUnit& HashTopKUnit() {
  static const HashTopK unit;
  return unit;
}

}  // namespace kvsparse::engine
