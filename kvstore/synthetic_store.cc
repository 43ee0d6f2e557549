#include "kvstore/synthetic_store.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvsparse::kvstore {

ModelShape ShapeOf(const kernels::SyntheticProblem& prob, uint32_t layers) {
  const kernels::DecodeProblem& p = prob.problem;
  return {layers, static_cast<uint32_t>(p.num_q_heads), static_cast<uint32_t>(p.num_kv_heads),
          static_cast<uint32_t>(p.head_dim), p.dtype};
}

absl::Status LoadSynthetic(Store& store, const kernels::SyntheticProblem& prob,
                           const Placement& placement, uint32_t layers, absl::string_view prefix) {
  const kernels::DecodeProblem& p = prob.problem;
  for (int32_t b = 0; b < p.batch; ++b) {
    const std::string id = absl::StrCat(prefix, b);
    absl::Status s = store.CreateSequence(id, ShapeOf(prob, layers), placement).status();
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat("sequence ", id, ": ", s.message()));
    const std::vector<uint8_t> k = prob.LayerRows(prob.k, b, layers);
    const std::vector<uint8_t> v = prob.LayerRows(prob.v, b, layers);
    AppendRequest r;
    r.sequence_id = id;
    r.num_layers = layers;
    r.num_tokens = static_cast<uint64_t>(prob.seq_lens[b]);
    r.dtype = p.dtype;
    r.num_kv_heads = static_cast<uint32_t>(p.num_kv_heads);
    r.head_dim = static_cast<uint32_t>(p.head_dim);
    r.k = k;
    r.v = v;
    s = store.Append(r).status();
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat("sequence ", id, ": ", s.message()));
  }
  return absl::OkStatus();
}

}  // namespace kvsparse::kvstore
