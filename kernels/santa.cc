#include "kernels/santa.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/cpu_util.h"
#include "kernels/philox.h"
#include "kernels/reasons.h"

namespace kvsparse::kernels {
namespace {

bool KnownSampler(SantaSampler s) {
  return s == SantaSampler::kIid || s == SantaSampler::kStratified ||
         s == SantaSampler::kSystematic;
}

bool KnownAllocation(SantaAllocation a) {
  return a == SantaAllocation::kGlobal || a == SantaAllocation::kProp ||
         a == SantaAllocation::kFlash;
}

// Algorithm 3 for every tile: m_t, u_n, l_t (fp32, ascending n), then W_t / Z (double).
void TileStatistics(absl::Span<const float> scores, SantaHeadPlan* plan) {
  const int32_t n = plan->n;
  const int32_t bt = plan->tile_size;
  const int32_t tiles = (n + bt - 1) / bt;
  plan->num_tiles = tiles;
  plan->u.resize(n);
  plan->tile_max.resize(tiles);
  plan->tile_sum.resize(tiles);
  plan->tile_weight.resize(tiles);
  float m_star = -std::numeric_limits<float>::infinity();
  for (int32_t t = 0; t < tiles; ++t) {
    const int32_t lo = t * bt, hi = std::min(n, lo + bt);
    float m = -std::numeric_limits<float>::infinity();
    for (int32_t i = lo; i < hi; ++i) m = std::max(m, scores[i]);
    const bool empty = m == -std::numeric_limits<float>::infinity();  // masked: no mass
    float l = 0.f;
    for (int32_t i = lo; i < hi; ++i) {
      plan->u[i] = empty ? 0.f : std::exp(scores[i] - m);
      l += plan->u[i];
    }
    plan->tile_max[t] = m;
    plan->tile_sum[t] = l;
    m_star = std::max(m_star, m);
  }
  double z = 0.0;
  std::vector<float> w(tiles);
  for (int32_t t = 0; t < tiles; ++t) {
    w[t] = std::exp(plan->tile_max[t] - m_star) * plan->tile_sum[t];
    z += static_cast<double>(w[t]);
  }
  for (int32_t t = 0; t < tiles; ++t) plan->tile_weight[t] = static_cast<double>(w[t]) / z;
}

// Algorithm 5 inner loop for tile t with offset a0: appends rows with c_n > 0.
template <typename WeightFn>
void SystematicTile(const SantaHeadPlan& plan, int32_t t, float inv_delta, float a0,
                    WeightFn weight, HeadRows* out) {
  const int32_t lo = t * plan.tile_size, hi = std::min(plan.n, lo + plan.tile_size);
  float p = 0.f;
  for (int32_t i = lo; i < hi; ++i) {
    const float x = inv_delta * plan.u[i];
    const float f0 = a0 + p;
    const float f1 = f0 + x;
    const int32_t c = static_cast<int32_t>(std::floor(f1)) - static_cast<int32_t>(std::floor(f0));
    p = p + x;
    if (c > 0) out->Push(i, c, weight(c));
  }
}

// kRatio: the linear weights w_j of draws from softmax(s~) become kSoftmax weights
// w'_j = e^{ln w_j - s~_j - c}, c = max_j (ln w_j - s~_j), so that the estimate's
// sum w' e^{s} V / sum w' e^{s} is the ratio estimator of the header (w' in (0, 1]).
void ToRatioWeights(absl::Span<const float> approx, HeadRows* rows) {
  double c = -std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < rows->tokens.size(); ++i) {
    if (rows->weights[i] > 0.f) {
      c = std::max(c, std::log(static_cast<double>(rows->weights[i])) - approx[rows->tokens[i]]);
    }
  }
  for (size_t i = 0; i < rows->tokens.size(); ++i) {
    const double w = rows->weights[i];
    rows->weights[i] =
        w > 0.0 ? static_cast<float>(std::exp(std::log(w) - approx[rows->tokens[i]] - c)) : 0.f;
  }
}

}  // namespace

absl::Status ValidateSantaParams(const SantaParams& params) {
  Reasons reasons;
  const bool known_sampler = KnownSampler(params.sampler);
  reasons.AddIf(!known_sampler, "sampler: unknown value ", static_cast<int>(params.sampler));
  reasons.AddIf(!KnownAllocation(params.allocation), "allocation: unknown value ",
                static_cast<int>(params.allocation));
  reasons.AddIf(params.samples < 1, "samples (S) must be >= 1, got ", params.samples);
  const bool tiled =
      params.allocation == SantaAllocation::kProp || params.allocation == SantaAllocation::kFlash;
  reasons.AddIf(tiled && params.tile_size < 1, "tile_size must be >= 1 for prop / flash, got ",
                params.tile_size);
  reasons.AddIf(tiled && known_sampler && params.sampler != SantaSampler::kSystematic,
                "sampler: prop and flash allocations implement systematic sampling only "
                "(Appendices P, Q)");
  reasons.AddIf(params.bernoulli_qk_samples < 0, "bernoulli_qk_samples must be >= 0, got ",
                params.bernoulli_qk_samples);
  reasons.AddIf(
      params.proposal != SantaProposal::kPerHead && params.proposal != SantaProposal::kGroupMixture,
      "proposal: unknown value ", static_cast<int>(params.proposal));
  reasons.AddIf(params.proposal == SantaProposal::kGroupMixture &&
                    (params.scores != ScoreSource::kCompressedKeys ||
                     params.correction != SantaCorrection::kRatio),
                "proposal: the group mixture takes compressed-key scores with the ratio "
                "correction");
  reasons.AddIf(
      params.scores != ScoreSource::kExact && params.scores != ScoreSource::kCompressedKeys,
      "scores: unknown value ", static_cast<int>(params.scores));
  reasons.AddIf(
      params.correction != SantaCorrection::kRatio && params.correction != SantaCorrection::kNone,
      "correction: unknown value ", static_cast<int>(params.correction));
  reasons.AddIf(params.scores == ScoreSource::kCompressedKeys && params.bernoulli_qk_samples > 0,
                "bernoulli_qk_samples: Bernoulli qK^T estimates scores from K's features; with "
                "compressed-key scores ask for one or the other");
  reasons.AddIf(!(params.uniform_floor >= 0.f && params.uniform_floor < 1.f),
                "uniform_floor must be in [0, 1), got ", params.uniform_floor);
  reasons.AddIf(params.uniform_floor > 0.f && (params.scores != ScoreSource::kCompressedKeys ||
                                               params.correction != SantaCorrection::kRatio),
                "uniform_floor: a floor under the proposal takes compressed-key scores with the "
                "ratio correction");
  return reasons.ToStatus();
}

void ProposalFloor(float a, std::vector<float>* scores) {
  if (a <= 0.f || scores->empty()) return;
  double m = -std::numeric_limits<double>::infinity();
  for (float x : *scores) m = std::max(m, static_cast<double>(x));
  double z = 0.0;
  if (m != -std::numeric_limits<double>::infinity()) {
    for (float x : *scores) z += std::exp(static_cast<double>(x) - m);
  }
  const double floor = static_cast<double>(a) / static_cast<double>(scores->size());
  for (float& x : *scores) {
    const double p = z > 0.0 ? (1.0 - a) * std::exp(static_cast<double>(x) - m) / z : 0.0;
    x = static_cast<float>(std::log(p + floor));
  }
}

absl::Status PlanSantaHead(absl::Span<const float> scores, const SantaParams& params,
                           SantaHeadPlan* plan) {
  if (absl::Status s = ValidateSantaParams(params); !s.ok()) return s;
  plan->n = static_cast<int32_t>(scores.size());
  plan->allocation = params.allocation;
  plan->budget = 0;
  const int32_t n = plan->n;
  if (n == 0) return absl::OkStatus();
  for (float s : scores) {
    if (std::isnan(s) || s == std::numeric_limits<float>::infinity()) {
      return absl::InvalidArgumentError("scores must not be NaN or +inf");
    }
  }
  const int64_t S = params.samples;
  const float max_score = *std::max_element(scores.begin(), scores.end());
  if (max_score == -std::numeric_limits<float>::infinity()) {
    return absl::InvalidArgumentError("scores are all -inf");
  }
  if (params.allocation == SantaAllocation::kGlobal) {
    const float m = max_score;
    plan->cum.resize(n);
    double c = 0.0;
    plan->last_positive = -1;
    for (int32_t j = 0; j < n; ++j) {
      const double u = std::exp(static_cast<double>(scores[j]) - m);
      c += u;
      plan->cum[j] = c;
      if (u > 0.0) plan->last_positive = j;
    }
    plan->budget = S;
    return absl::OkStatus();
  }
  plan->tile_size = params.tile_size;
  TileStatistics(scores, plan);
  const int32_t tiles = plan->num_tiles;
  plan->tile_budget.assign(tiles, 0);
  plan->inv_delta.assign(tiles, 0.f);
  if (params.allocation == SantaAllocation::kProp) {
    // Quotas and their fixed-point prefix sums; the budgets are drawn per sample
    // (PropTileBudgets).
    plan->tile_quota.resize(tiles);
    plan->quota_cum.resize(tiles);
    uint64_t c = 0;
    for (int32_t t = 0; t < tiles; ++t) {
      const double q = static_cast<double>(S) * plan->tile_weight[t];
      plan->tile_quota[t] = q;
      c += static_cast<uint64_t>(std::llround(q * kPropFixedOne));
      plan->quota_cum[t] = c;
    }
    plan->budget = S;
  } else {
    const int64_t s_tile = std::max<int64_t>(1, (S + tiles - 1) / tiles);
    for (int32_t t = 0; t < tiles; ++t) {
      plan->tile_budget[t] = static_cast<int32_t>(s_tile);
      plan->inv_delta[t] =
          plan->tile_sum[t] > 0.f ? static_cast<float>(s_tile) / plan->tile_sum[t] : 0.f;
    }
    plan->budget = s_tile * tiles;
  }
  return absl::OkStatus();
}

void PropTileBudgets(const SantaHeadPlan& plan, float u, std::vector<int32_t>* budgets) {
  const uint64_t off = static_cast<uint64_t>(static_cast<double>(u) * kPropFixedOne);
  budgets->resize(plan.num_tiles);
  uint64_t before = off >> 32;
  for (int32_t t = 0; t < plan.num_tiles; ++t) {
    const uint64_t upto = (plan.quota_cum[t] + off) >> 32;
    (*budgets)[t] = static_cast<int32_t>(upto - before);
    before = upto;
  }
}

float PropRoundingOffset(uint64_t seed, int32_t sequence, int32_t kv_head) {
  return PhiloxStream::Make(seed, RngTag::kPropRounding, static_cast<uint32_t>(sequence),
                            static_cast<uint32_t>(kv_head))
      .Uniform(0);
}

void SampleSantaHead(const SantaHeadPlan& plan, const SantaParams& params, uint64_t seed,
                     int32_t sequence, int32_t head, int32_t kv_head, HeadRows* out,
                     std::vector<int32_t>* scratch) {
  out->Clear();
  out->budget = plan.budget;
  if (plan.n == 0) return;
  const int32_t S = params.samples;
  const float inv_s = 1.f / static_cast<float>(S);
  const uint32_t seq = static_cast<uint32_t>(sequence);
  const uint32_t hd = static_cast<uint32_t>(head);
  switch (plan.allocation) {
    case SantaAllocation::kGlobal: {
      const double total = plan.cum[plan.n - 1];
      auto invert = [&](double t, int32_t from) {
        const auto it = std::upper_bound(plan.cum.begin() + from, plan.cum.end(), t * total);
        const int32_t j = static_cast<int32_t>(it - plan.cum.begin());
        return j >= plan.n ? plan.last_positive : j;
      };
      auto emit = [&](int32_t j) {
        if (!out->tokens.empty() && out->tokens.back() == j) {
          ++out->counts.back();
        } else {
          out->Push(j, 1, 0.f);
        }
      };
      if (params.sampler == SantaSampler::kIid) {
        std::vector<int32_t> local;
        std::vector<int32_t>& js = scratch != nullptr ? *scratch : local;
        js.resize(S);
        const PhiloxStream st = PhiloxStream::Make(seed, RngTag::kSantaIid, seq, hd);
        for (int32_t s = 0; s < S; ++s) js[s] = invert(st.Uniform(s), 0);
        std::sort(js.begin(), js.end());
        for (int32_t j : js) emit(j);
      } else {
        const bool strat = params.sampler == SantaSampler::kStratified;
        const PhiloxStream st = PhiloxStream::Make(
            seed, strat ? RngTag::kSantaStratified : RngTag::kSantaSystematic, seq, hd);
        const double u0 = strat ? 0.0 : static_cast<double>(st.Uniform(0));
        int32_t from = 0;
        for (int32_t m = 0; m < S; ++m) {
          const double u = strat ? static_cast<double>(st.Uniform(m)) : u0;
          const double t = (static_cast<double>(m) + u) / S;
          const int32_t j = invert(t, from);
          from = std::min(j, plan.n - 1);
          emit(j);
        }
      }
      for (size_t i = 0; i < out->tokens.size(); ++i) {
        out->weights[i] = static_cast<float>(out->counts[i]) * inv_s;
      }
      break;
    }
    case SantaAllocation::kProp: {
      std::vector<int32_t> local;
      std::vector<int32_t>& budgets = scratch != nullptr ? *scratch : local;
      PropTileBudgets(plan, PropRoundingOffset(seed, sequence, kv_head), &budgets);
      const PhiloxStream st = PhiloxStream::Make(seed, RngTag::kPropTileOffset, seq, hd);
      for (int32_t t = 0; t < plan.num_tiles; ++t) {
        if (budgets[t] == 0) continue;  // also every tile without mass (Q_t = 0)
        const float inv_delta = static_cast<float>(budgets[t]) / plan.tile_sum[t];
        SystematicTile(
            plan, t, inv_delta, st.Uniform(t),
            [&](int32_t c) { return static_cast<float>(c) * inv_s; }, out);
      }
      break;
    }
    case SantaAllocation::kFlash: {
      const PhiloxStream st = PhiloxStream::Make(seed, RngTag::kFlashTileOffset, seq, hd);
      for (int32_t t = 0; t < plan.num_tiles; ++t) {
        if (plan.inv_delta[t] == 0.f) continue;  // a tile without mass
        const double scale = plan.tile_weight[t] / plan.tile_budget[t];
        SystematicTile(
            plan, t, plan.inv_delta[t], st.Uniform(t),
            [&](int32_t c) { return static_cast<float>(scale * c); }, out);
      }
      break;
    }
  }
}

void SantaExpectedWeights(const SantaHeadPlan& plan, const SantaParams& params,
                          std::vector<double>* out) {
  out->assign(plan.n, 0.0);
  if (plan.n == 0) return;
  if (plan.allocation == SantaAllocation::kGlobal) {
    const double total = plan.cum[plan.n - 1];
    double prev = 0.0;
    for (int32_t j = 0; j < plan.n; ++j) {
      (*out)[j] = (plan.cum[j] - prev) / total;
      prev = plan.cum[j];
    }
    return;
  }
  // Prop: E[S_t] / S = q_t / S = W_t / Z, as flash's tile weight (up to the 2^-32 fixed point).
  for (int32_t t = 0; t < plan.num_tiles; ++t) {
    if (plan.tile_sum[t] == 0.f) continue;  // no mass
    const int32_t lo = t * plan.tile_size, hi = std::min(plan.n, lo + plan.tile_size);
    for (int32_t i = lo; i < hi; ++i) {
      (*out)[i] = plan.tile_weight[t] * static_cast<double>(plan.u[i]) / plan.tile_sum[t];
    }
  }
}

namespace {

// The group mixture proposal for one (sequence, kv head): the G heads' approximate scores, their
// mixture's, one sample of S rows drawn from it (the streams of query head kv_head * G), its
// ratio weights against the mixture, the same rows for every head.
absl::Status SampleGroupMixture(const CompressedKeysView& view, const std::vector<float>& qg,
                                int32_t group, int32_t n, float scale, const SantaParams& params,
                                uint64_t seed, int32_t b, int32_t kvh, SantaHeadPlan* plan,
                                std::vector<HeadRows>* rows, std::vector<int32_t>* scratch) {
  const int32_t d = view.head_dim;
  std::vector<std::vector<float>> heads(group, std::vector<float>(view.length));
  std::vector<const float*> ptrs(group);
  for (int32_t g = 0; g < group; ++g) {
    ApproximateScores(view, &qg[static_cast<size_t>(g) * d], scale, heads[g].data());
    ptrs[g] = heads[g].data();
  }
  std::vector<float> mix;
  GroupMixtureScores(ptrs, n, &mix);
  ProposalFloor(params.uniform_floor, &mix);
  if (absl::Status s = PlanSantaHead(mix, params, plan); !s.ok()) return s;
  SampleSantaHead(*plan, params, seed, b, kvh * group, kvh, &(*rows)[0], scratch);
  ToRatioWeights(mix, &(*rows)[0]);
  for (int32_t g = 1; g < group; ++g) (*rows)[g] = (*rows)[0];
  return absl::OkStatus();
}

}  // namespace

void GroupMixtureScores(absl::Span<const float* const> heads, int32_t n, std::vector<float>* out) {
  const size_t G = heads.size();
  std::vector<double> m(G, -std::numeric_limits<double>::infinity()), z(G, 0.0);
  for (size_t g = 0; g < G; ++g) {
    for (int32_t j = 0; j < n; ++j) m[g] = std::max(m[g], static_cast<double>(heads[g][j]));
    if (m[g] == -std::numeric_limits<double>::infinity()) continue;  // a head with no mass
    for (int32_t j = 0; j < n; ++j) z[g] += std::exp(static_cast<double>(heads[g][j]) - m[g]);
  }
  out->assign(n, -std::numeric_limits<float>::infinity());
  for (int32_t j = 0; j < n; ++j) {
    double pj = 0.0;
    for (size_t g = 0; g < G; ++g) {
      if (z[g] > 0.0) pj += std::exp(static_cast<double>(heads[g][j]) - m[g]) / z[g];
    }
    if (pj > 0.0) (*out)[j] = static_cast<float>(std::log(pj / static_cast<double>(G)));
  }
}

absl::Status SantaSelectCpu(const DecodeProblem& p, const SantaParams& params, uint64_t seed,
                            RowSelection* sel, SantaStats* stats,
                            absl::Span<const CompressedKeysView> keys) {
  if (absl::Status s = ValidateSantaParams(params); !s.ok()) return s;
  const bool compressed = params.scores == ScoreSource::kCompressedKeys;
  if (absl::Status s = ValidateProblemFor(p, ProblemNeeds{true, !compressed, false, false});
      !s.ok()) {
    return s;
  }
  if (compressed && keys.size() != static_cast<size_t>(p.batch) * p.num_kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat("compressed keys: ", keys.size(), " views for ",
                                                   p.batch, " x ", p.num_kv_heads,
                                                   " (sequence, kv head) pairs"));
  }
  const bool ratio = compressed && params.correction == SantaCorrection::kRatio;
  const int32_t group = p.group_size();
  const int d = p.head_dim;
  sel->Reset(ratio ? EstimateKind::kSoftmax : EstimateKind::kLinear, p.batch, p.num_kv_heads,
             group);
  sel->ordered_draws =
      params.allocation != SantaAllocation::kGlobal || params.sampler != SantaSampler::kIid;
  if (stats != nullptr) {
    stats->group = group;
    stats->dim = d;
    stats->key_features_head.assign(static_cast<size_t>(p.batch) * p.num_kv_heads,
                                    static_cast<int64_t>(group) * d);
    stats->key_features_group.assign(static_cast<size_t>(p.batch) * p.num_kv_heads, d);
  }
  const BernoulliQkParams bq{params.bernoulli_qk_samples, params.bernoulli_mode,
                             params.bernoulli_sampler};
  std::vector<float> qg(static_cast<size_t>(group) * d), scores;
  std::vector<HeadRows> rows(group);
  std::vector<int32_t> scratch;
  SantaHeadPlan plan;
  BernoulliQuery bquery;
  for (int32_t b = 0; b < p.batch; ++b) {
    const int32_t n = p.seq_lens[b];
    scores.resize(n);
    for (int32_t kvh = 0; kvh < p.num_kv_heads; ++kvh) {
      const CompressedKeysView* view = compressed ? &keys[b * p.num_kv_heads + kvh] : nullptr;
      if (view != nullptr && (view->length < n || view->head_dim != p.head_dim)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "compressed keys of sequence ", b, ", kv head ", kvh, " hold ", view->length,
            " tokens of dim ", view->head_dim, ", need ", n, " of ", p.head_dim));
      }
      for (int32_t g = 0; g < group; ++g) LoadQuery(p, b, kvh * group + g, &qg[g * d]);
      if (params.bernoulli_qk_samples > 0) {
        if (absl::Status s = SampleBernoulliQuery(qg, group, d, bq, seed, b, kvh, &bquery);
            !s.ok()) {
          return s;
        }
        for (float& x : bquery.q_eff) x = RoundToDType(x, p.dtype);  // q's dtype (bernoulli_qk.h)
        if (stats != nullptr) {
          stats->key_features_head[b * p.num_kv_heads + kvh] = bquery.head_features();
          stats->key_features_group[b * p.num_kv_heads + kvh] = bquery.group_features();
        }
      }
      if (params.proposal == SantaProposal::kGroupMixture) {
        if (absl::Status s = SampleGroupMixture(*view, qg, group, n, p.scale, params, seed, b, kvh,
                                                &plan, &rows, &scratch);
            !s.ok()) {
          return s;
        }
        MergeGroup(rows, &sel->at(b, kvh));
        continue;
      }
      for (int32_t g = 0; g < group; ++g) {
        const int32_t h = kvh * group + g;
        if (params.bernoulli_qk_samples > 0) {
          const float* qe = &bquery.q_eff[static_cast<size_t>(g) * d];
          const std::vector<int32_t>& f = bquery.features[g];
          for (int32_t t = 0; t < n; ++t) {
            scores[t] = SparseDotRow(qe, f.data(), static_cast<int>(f.size()), p.k,
                                     KvRowOffset(p, b, kvh, t), p.dtype) *
                        p.scale;
          }
        } else if (view != nullptr) {
          scores.resize(view->length);
          ApproximateScores(*view, &qg[g * d], p.scale, scores.data());
          scores.resize(n);  // the view may hold more tokens than the step reads
          if (ratio) ProposalFloor(params.uniform_floor, &scores);  // sampled and weighed by it
        } else {
          ComputeScores(p, b, h, &qg[g * d], scores.data());
        }
        if (absl::Status s = PlanSantaHead(scores, params, &plan); !s.ok()) return s;
        SampleSantaHead(plan, params, seed, b, h, kvh, &rows[g], &scratch);
        if (ratio) ToRatioWeights(scores, &rows[g]);
      }
      MergeGroup(rows, &sel->at(b, kvh));
    }
  }
  return absl::OkStatus();
}

absl::Status SantaDecodeCpu(const DecodeProblem& p, const SantaParams& params, uint64_t seed,
                            RowSelection* sel, SantaStats* stats,
                            absl::Span<const CompressedKeysView> keys) {
  RowSelection local;
  RowSelection* s = sel != nullptr ? sel : &local;
  if (absl::Status st = SantaSelectCpu(p, params, seed, s, stats, keys); !st.ok()) return st;
  return EstimateInPlace(p, *s);
}

}  // namespace kvsparse::kernels
