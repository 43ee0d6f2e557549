// SAAP (kernels/saap.h): sink + local window + every key in the buckets the GQA group's query
// classifiers rank highest. Each key's bucket is fixed when it reaches the resident state (the
// deployment's partitions, --saap_weights, make it its one-word "signature"); the K and V rows of
// the chosen tokens cross.
#include "absl/strings/str_cat.h"
#include "engine/cpu_step.h"
#include "engine/methods/method_unit.h"

namespace kvsparse::engine {
namespace {

class Saap final : public MethodUnit {
 public:
  absl::Status Validate(const Method& m, const EngineOptions& options) const override {
    const kernels::SaapWeights* w = options.signatures.saap.get();
    if (w == nullptr) {
      return absl::FailedPreconditionError(
          "saap: this server has no SAAP partitions (start it with --saap_weights)");
    }
    return kernels::ValidateSaapParams(m.saap, *w);
  }
  absl::Status CheckFits(const Method& m, const SequenceDesc& desc,
                         const SignatureMaker& signatures) const override {
    const kernels::SaapWeights& w = *signatures.config().saap;
    const kvstore::ModelShape& s = desc.shape;
    if (desc.placement.signature_bits != 32) {
      return absl::FailedPreconditionError(
          "saap keeps each key's bucket as its signature: create the sequence with "
          "placement.signature_bits = 32");
    }
    if (w.num_layers < static_cast<int32_t>(s.num_layers) ||
        w.num_q_heads != static_cast<int32_t>(s.num_q_heads) ||
        w.num_kv_heads != static_cast<int32_t>(s.num_kv_heads) ||
        w.head_dim != static_cast<int32_t>(s.head_dim)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the server's SAAP partitions (", w.num_layers, " layers, ", w.num_q_heads, "/",
          w.num_kv_heads, " heads, d = ", w.head_dim, ") do not fit this sequence's model"));
    }
    return absl::OkStatus();
  }
  absl::Status Select(CpuStep& step, kernels::RowSelection* sel) const override {
    const kernels::SignatureView& v = step.KeySignatures(32);
    const kernels::SaapBuckets buckets{reinterpret_cast<const int32_t*>(v.k), 0, v.head_stride};
    return kernels::SaapSelectCpu(step.problem(), step.method().saap,
                                  *step.options().signatures.saap,
                                  static_cast<int32_t>(step.layer()), buckets, sel);
  }
};

}  // namespace

const MethodUnit& SaapUnit() {
  static const Saap unit;
  return unit;
}

}  // namespace kvsparse::engine
