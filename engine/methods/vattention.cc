// vAttention (kernels/vattention.h, Algorithm 1): per query head, sink + local window + the
// predicted top-k (hash: signatures; exact: every key's score; compressed: the compressed keys'
// scores, with a sound bound on the rest's) as a fixed set I_f, a base sample B of the rest
// (uniform, or i.i.d. from the predictor's softmax with the importance sampler) whose statistics
// set the budget b for (epsilon, delta), then the final sample of b rows; the estimator
// re-weights the sampled part by n_s / b (importance: 1 / (b p_t) per draw). The rows of
// I_f u B are read during the selection (their K for the statistics), the final sample's after.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "engine/cpu_step.h"
#include "engine/methods/method_unit.h"
#include "kernels/reasons.h"

namespace kvsparse::engine {
namespace {

bool UsesHash(const Method& m) { return m.vattention.predictor == kernels::TopKPredictor::kHash; }
bool UsesCompressed(const Method& m) {
  return m.vattention.predictor == kernels::TopKPredictor::kCompressed;
}

// The fewest bits per key channel the compressed predictor reads (docs/ACCURACY.md, "Pairings
// served over compressed keys"): over 1-bit keys the (epsilon, delta) promise fails per head on
// ordinary heavy-tailed families, so the pairing is refused.
constexpr uint32_t kMinVAttentionKeyBits = 2;

class VAttention final : public MethodUnit {
 public:
  absl::Status Validate(const Method& m, const EngineOptions&) const override {
    kernels::VAttentionParams p = m.vattention;
    if (p.bits == 0) p.bits = 32;
    kernels::Reasons reasons;
    reasons.AddIf(p.exact_statistics, "exact_statistics is test-only");
    reasons.Add(kernels::ValidateVAttentionParams(p));
    return reasons.ToStatus();
  }
  absl::Status CheckFits(const Method& m, const SequenceDesc& desc,
                         const SignatureMaker& signatures) const override {
    if (UsesCompressed(m)) {
      return CheckCompressedKeys("vattention with the compressed predictor", desc,
                                 kMinVAttentionKeyBits, nullptr,
                                 "its (epsilon, delta) promise does not hold per head there");
    }
    if (!UsesHash(m)) return absl::OkStatus();
    return CheckSignatures(m, m.vattention.bits, "vattention (hash predictor)", desc, signatures);
  }
  CpuPlan Plan(const Method& m) const override {
    CpuPlan plan;
    plan.all_keys = !UsesHash(m) && !UsesCompressed(m);  // the exact predictor scores every key
    return plan;
  }
  absl::Status Select(CpuStep& step, kernels::RowSelection* sel) const override;
};

// The relative error a head's final sample promises at probability 1 - delta: every bound's
// budget grows as 1 / epsilon^2, so b rows give epsilon sqrt(b_needed / b); a residual read whole
// (b = n_s, or the importance sampler's exact residual) gives 0.
float PromisedEpsilon(const kernels::VAttentionParams& params,
                      const kernels::VAttentionHeadResult& r) {
  if (r.b <= 0 || r.b >= r.stats.n_s || r.residual_exact) return 0.f;
  const double needed = std::min(r.budget.raw, static_cast<double>(r.b));
  return static_cast<float>(params.epsilon * std::sqrt(std::max(needed, 0.0) / r.b));
}

absl::Status VAttention::Select(CpuStep& step, kernels::RowSelection* sel) const {
  const kernels::DecodeProblem& p = step.problem();
  const int32_t H = p.num_q_heads, hkv = p.num_kv_heads, G = H / hkv, d = p.head_dim;
  const int32_t n = step.length();
  const kernels::DType dt = p.dtype;
  const size_t es = kernels::DTypeSize(dt), row = static_cast<size_t>(d) * es;
  const uint64_t seed = step.seed();
  kernels::VAttentionParams params = step.method().vattention;
  const bool hash = UsesHash(step.method());
  const bool compressed = UsesCompressed(step.method());
  absl::Span<const kernels::CompressedKeysView> keys;
  if (compressed) {
    keys = step.CompressedKeys();
    for (const kernels::CompressedKeysView& v : keys) {
      if (v.length != n)
        return absl::InternalError("compressed keys out of step with the sequence");
    }
  }
  kernels::SignatureView view;
  if (hash) {
    if (params.bits == 0) params.bits = static_cast<int32_t>(step.desc().placement.signature_bits);
    view = step.Signatures(params.bits);
  }
  absl::StatusOr<int32_t> k = kernels::ResolveTopK(params.fixed, n);
  if (!k.ok()) return k.status();

  // Steps 1 and 3 per query head: fixed set and base sample, from the predictor alone.
  std::vector<kernels::VAttentionHeadResult> r(H);
  std::vector<std::vector<float>> logits(hash ? 0 : H);
  std::vector<float> bounds(H);  // compressed: the residual's logit bound per query head
  const std::vector<float> qf = step.QueryFloats();
  std::vector<int32_t> sim, scratch;
  for (int32_t h = 0; h < H; ++h) {
    const int32_t j = h / G;
    if (hash) {
      const int32_t words = params.bits / 32;
      const int32_t sh = view.key_heads == H ? h : j;
      const uint32_t* qs = view.q + static_cast<size_t>(h) * words;
      const uint32_t* ks = view.k + sh * view.head_stride;
      sim.resize(n);
      for (int32_t t = 0; t < n; ++t) {
        sim[t] = kernels::HammingSimilarity(qs, ks + static_cast<int64_t>(t) * words, words);
      }
      kernels::VAttentionPlanFixed(sim.data(), n, *k, params, &r[h], &scratch);
    } else if (compressed) {
      logits[h].resize(n);
      kernels::ApproximateScores(keys[j], qf.data() + h * d, p.scale, logits[h].data());
      kernels::VAttentionPlanFixed(logits[h].data(), n, *k, params, &r[h], &scratch);
      bounds[h] = kernels::CompressedLogitUpperBound(keys[j], qf.data() + h * d, p.scale,
                                                     logits[h].data(), r[h].fixed);
    } else {
      logits[h].resize(n);
      const uint8_t* kb = static_cast<const uint8_t*>(p.k);
      for (int32_t t = 0; t < n; ++t) {
        logits[h][t] = Logit(qf.data() + h * d,
                             kb + (j * p.kv_layout.head_stride + t * p.kv_layout.token_stride) * es,
                             d, dt, p.scale);
      }
      kernels::VAttentionPlanFixed(logits[h].data(), n, *k, params, &r[h], &scratch);
    }
    kernels::VAttentionSampleBase(n, params, seed, 0, h, &r[h], hash ? nullptr : logits[h].data());
  }

  // Read I_f u B of each kv head (K and V).
  std::vector<std::vector<uint32_t>> base_tokens(hkv);
  for (int32_t j = 0; j < hkv; ++j) {
    auto& toks = base_tokens[j];
    for (int32_t g = 0; g < G; ++g) {
      const auto& hr = r[j * G + g];
      toks.insert(toks.end(), hr.fixed.begin(), hr.fixed.end());
      toks.insert(toks.end(), hr.base.begin(), hr.base.end());
    }
    std::sort(toks.begin(), toks.end());
    toks.erase(std::unique(toks.begin(), toks.end()), toks.end());
  }
  sel->Reset(kernels::EstimateKind::kSoftmax, 1, hkv, G);
  absl::StatusOr<const FetchedRows*> fetched = step.FetchForSelection(std::move(base_tokens));
  if (!fetched.ok()) return fetched.status();
  const FetchedRows& base = **fetched;

  // Steps 4-6 per query head: statistics from the fetched rows, budget, final sample.
  std::vector<kernels::HeadRows> group_rows(G);
  std::vector<float> epsilon(G);
  for (int32_t j = 0; j < hkv; ++j) {
    for (int32_t g = 0; g < G; ++g) {
      const int32_t h = j * G + g;
      kernels::VAttentionRowAccess access;
      access.dv = d;
      const float* qh = qf.data() + h * d;
      access.load_v = [&](int32_t t, float* o) {
        RowToFloat(base.VRow(j, base.Find(j, t), row), d, dt, o);
      };
      if (hash || compressed) {
        access.logit = [&](int32_t t) {
          return Logit(qh, base.KRow(j, base.Find(j, t), row), d, dt, p.scale);
        };
        if (compressed && std::isfinite(bounds[h])) access.residual_logit_max = bounds[h];
      } else {
        const std::vector<float>& lg = logits[h];
        access.logit = [&](int32_t t) { return lg[t]; };
        float rmax = -std::numeric_limits<float>::infinity();
        size_t e = 0;
        for (int32_t t = 0; t < n; ++t) {
          if (e < r[h].fixed.size() && r[h].fixed[e] == t) {
            ++e;
          } else {
            rmax = std::max(rmax, lg[t]);
          }
        }
        if (std::isfinite(rmax)) access.residual_logit_max = rmax;
      }
      kernels::VAttentionBudgetAndSample(n, params, access, seed, 0, h, &r[h]);
      r[h].ToHeadRows(&group_rows[g]);
      epsilon[g] = PromisedEpsilon(params, r[h]);
    }
    kernels::MergeGroup(group_rows, &sel->at(0, j));
    step.StateEpsilon(j, epsilon);
  }
  return absl::OkStatus();
}

}  // namespace

const MethodUnit& VAttentionUnit() {
  static const VAttention unit;
  return unit;
}

}  // namespace kvsparse::engine
