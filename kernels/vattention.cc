#include "kernels/vattention.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/cpu_util.h"
#include "kernels/reasons.h"

namespace kvsparse::kernels {
namespace {

constexpr int kDeltaGrid = 1024;

bool InOpenUnit(float x) { return x > 0.f && x < 1.f; }

double AlphaClt(double delta) { return NormalQuantile(1.0 - delta / 2.0); }
double AlphaHoeffdingScalar(double delta) { return std::sqrt(std::log(2.0 / delta) / 2.0); }
double AlphaHoeffdingVector(double delta) { return std::sqrt(2.0 * std::log(2.0 / delta)); }

}  // namespace

double NormalQuantile(double p) {
  if (!(p > 0.0 && p < 1.0)) {
    return p == 0.0   ? -std::numeric_limits<double>::infinity()
           : p == 1.0 ? std::numeric_limits<double>::infinity()
                      : std::numeric_limits<double>::quiet_NaN();
  }
  // Acklam's algorithm.
  static const double a[] = {-3.969683028665376e+01, 2.209460984245205e+02,  -2.759285104469687e+02,
                             1.383577518672690e+02,  -3.066479806614716e+01, 2.506628277459239e+00};
  static const double b[] = {-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
                             6.680131188771972e+01, -1.328068155288572e+01};
  static const double c[] = {-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
                             -2.549732539343734e+00, 4.374664141464968e+00,  2.938163982698783e+00};
  static const double d[] = {7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
                             3.754408661907416e+00};
  const double plow = 0.02425;
  double x;
  if (p < plow) {
    const double q = std::sqrt(-2 * std::log(p));
    x = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
        ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
  } else if (p <= 1 - plow) {
    const double q = p - 0.5, r = q * q;
    x = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
        (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1);
  } else {
    const double q = std::sqrt(-2 * std::log1p(-p));
    x = -(((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
        ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
  }
  // One Halley step: e = Phi(x) - p.
  const double e = 0.5 * std::erfc(-x / std::sqrt(2.0)) - p;
  const double u = e * 2.5066282746310002 * std::exp(x * x / 2);
  return x - u / (1 + x * u / 2);
}

absl::Status ValidateVAttentionParams(const VAttentionParams& params) {
  Reasons reasons;
  reasons.AddIf(!InOpenUnit(params.epsilon), "epsilon must be in (0, 1), got ", params.epsilon);
  reasons.AddIf(!InOpenUnit(params.delta), "delta must be in (0, 1), got ", params.delta);
  reasons.AddIf(!InOpenUnit(params.base_rate), "base_rate must be in (0, 1), got ",
                params.base_rate);
  reasons.Add(ValidateFixedSet(params.fixed));
  const bool hash = params.predictor == TopKPredictor::kHash;
  reasons.AddIf(!hash && params.predictor != TopKPredictor::kExact &&
                    params.predictor != TopKPredictor::kCompressed,
                "predictor: unknown value");
  reasons.AddIf(params.bound != BudgetBound::kClt && params.bound != BudgetBound::kHoeffding &&
                    params.bound != BudgetBound::kCltRatio,
                "bound: unknown value");
  reasons.AddIf(params.target != VerifyTarget::kDenominator &&
                    params.target != VerifyTarget::kNumerator &&
                    params.target != VerifyTarget::kOutput,
                "target: unknown value");
  const bool importance = params.sampler == ResidualSampler::kImportance;
  reasons.AddIf(!importance && params.sampler != ResidualSampler::kUniform,
                "sampler: unknown value");
  reasons.AddIf(importance && hash,
                "sampler: importance sampling needs a score for every token (predictor exact or "
                "compressed), not the hash predictor");
  reasons.AddIf(importance && params.bound == BudgetBound::kHoeffding,
                "sampler: importance sampling has no Hoeffding range; use bound clt or clt-ratio");
  reasons.AddIf(importance && params.exact_statistics,
                "sampler: importance sampling has no exact_statistics");
  if (hash) reasons.Add(ValidateSignatureBits(params.bits));
  return reasons.ToStatus();
}

VAttentionBudget ComputeVAttentionBudget(const VAttentionStatistics& st,
                                         const VAttentionParams& params) {
  VAttentionBudget out;
  const double inf = std::numeric_limits<double>::infinity();
  if (st.n_s == 0) return out;
  const double eps = params.epsilon, delta = params.delta, ns = static_cast<double>(st.n_s);
  const bool clt = params.bound != BudgetBound::kHoeffding;
  // c / T for each target.
  const double cd = st.d_hat > 0 ? (clt ? st.sigma : st.x_max) / st.d_hat : inf;
  const double cn =
      st.n_hat_norm > 0 ? (clt ? std::sqrt(st.trace_sigma) : 2 * st.y_max) / st.n_hat_norm : inf;
  auto alpha_d = [&](double dl) { return clt ? AlphaClt(dl) : AlphaHoeffdingScalar(dl); };
  auto alpha_n = [&](double dl) { return clt ? AlphaClt(dl) : AlphaHoeffdingVector(dl); };
  switch (params.target) {
    case VerifyTarget::kDenominator: {
      const double v = ns * alpha_d(delta) * cd / eps;
      out.raw = v * v;
      break;
    }
    case VerifyTarget::kNumerator: {
      const double v = ns * alpha_n(delta) * cn / eps;
      out.raw = v * v;
      break;
    }
    case VerifyTarget::kOutput: {
      if (params.bound == BudgetBound::kCltRatio) {
        const double v = st.n_hat_norm > 0 ? ns * AlphaClt(delta) * std::sqrt(st.trace_sigma_z) /
                                                 (eps * st.n_hat_norm)
                                           : inf;
        out.raw = v * v;
        out.delta_split = delta;
        out.eps_split = eps;
        break;
      }
      double best = inf, best_d = 0, best_n = 0;
      int best_j = kDeltaGrid / 2;
      for (int j = 1; j < kDeltaGrid; ++j) {
        const double dl = delta * j / kDeltaGrid;
        const double td = alpha_d(dl) * cd, tn = alpha_n(delta - dl) * cn;
        if (td + tn < best) {
          best = td + tn;
          best_d = td;
          best_n = tn;
          best_j = j;
        }
      }
      const double v = 2 * ns * best / eps;
      out.raw = v * v;
      out.delta_split = delta * best_j / kDeltaGrid;
      out.eps_split =
          best_d + best_n > 0 && std::isfinite(best) ? eps * best_d / (best_d + best_n) : eps / 2;
      break;
    }
  }
  if (std::isnan(out.raw)) out.raw = inf;
  return out;
}

template <typename T>
void VAttentionPlanFixed(const T* scores, int32_t n, int32_t k, const VAttentionParams& params,
                         VAttentionHeadResult* r, std::vector<int32_t>* scratch) {
  r->top_k_chosen = SelectSinkLocalTopK(scores, n, params.fixed.sink_tokens,
                                        params.fixed.local_tokens, k, &r->fixed, scratch);
  r->base.clear();
  r->dyn.clear();
  r->b = 0;
  r->stats = VAttentionStatistics{};
  r->budget = VAttentionBudget{};
}

template void VAttentionPlanFixed<int32_t>(const int32_t*, int32_t, int32_t,
                                           const VAttentionParams&, VAttentionHeadResult*,
                                           std::vector<int32_t>*);
template void VAttentionPlanFixed<float>(const float*, int32_t, int32_t, const VAttentionParams&,
                                         VAttentionHeadResult*, std::vector<int32_t>*);

void SampleWithoutReplacement(const PhiloxStream& stream, int32_t n,
                              const std::vector<int32_t>& excluded, int64_t count,
                              std::vector<int32_t>* out,
                              std::vector<std::pair<uint64_t, int32_t>>* scratch) {
  out->clear();
  scratch->clear();
  if (count <= 0) return;
  size_t e = 0;
  for (int32_t t = 0; t < n; ++t) {  // residual tokens in ascending order with their keys
    if (e < excluded.size() && excluded[e] == t) {
      ++e;
      continue;
    }
    scratch->emplace_back(stream.Draw64(static_cast<uint32_t>(t)), t);
  }
  const size_t m = scratch->size();
  if (count >= static_cast<int64_t>(m)) {
    for (const auto& kt : *scratch) out->push_back(kt.second);
    return;
  }
  // The count-th smallest (key, token) pair is the threshold; emitting every pair <= it in token
  // order gives the sample already sorted.
  const size_t half = m;
  scratch->insert(scratch->end(), scratch->begin(), scratch->end());
  std::nth_element(scratch->begin() + half, scratch->begin() + half + (count - 1), scratch->end());
  const std::pair<uint64_t, int32_t> threshold = (*scratch)[half + count - 1];
  out->reserve(count);
  for (size_t i = 0; i < half; ++i) {
    if ((*scratch)[i] <= threshold) out->push_back((*scratch)[i].second);
  }
}

float ImportanceProposal::Score(int32_t t) const {
  const auto it = std::lower_bound(tokens.begin(), tokens.end(), t);
  return scores[static_cast<size_t>(it - tokens.begin())];
}

void ImportanceProposal::Draw(const PhiloxStream& stream, int64_t count,
                              std::vector<int32_t>* out) const {
  out->clear();
  if (count <= 0 || cdf.empty()) return;
  out->reserve(static_cast<size_t>(count));
  const double total = cdf.back();
  for (int64_t j = 0; j < count; ++j) {
    const double u =
        static_cast<double>(stream.Draw64(static_cast<uint32_t>(j)) >> 11) * kTwoPowMinus53 * total;
    const size_t i =
        std::min(static_cast<size_t>(std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin()),
                 cdf.size() - 1);
    out->push_back(tokens[i]);
  }
  std::sort(out->begin(), out->end());
}

void VAttentionHeadResult::ToHeadRows(HeadRows* out) const {
  out->Clear();
  out->budget = b;
  const bool importance = !proposal.tokens.empty();
  // Per draw: n_s / b (the importance sampler then times e^{L - s~_t}); 1 over an exact residual.
  const double per_draw =
      b > 0 && !residual_exact ? static_cast<double>(stats.n_s) / static_cast<double>(b) : 0.0;
  size_t i = 0, j = 0, k = 0;
  // Three ascending lists (dyn and base with repeats under the importance sampler); fixed is
  // disjoint from both samples.
  while (i < fixed.size() || j < dyn.size() || k < base.size()) {
    const int32_t ti = i < fixed.size() ? fixed[i] : INT32_MAX;
    const int32_t tj = j < dyn.size() ? dyn[j] : INT32_MAX;
    const int32_t tk = k < base.size() ? base[k] : INT32_MAX;
    const int32_t t = std::min({ti, tj, tk});
    int32_t m = 0;  // draws of t in the final sample
    for (; j < dyn.size() && dyn[j] == t; ++j) ++m;
    for (; k < base.size() && base[k] == t; ++k) {
    }
    if (t == ti) {
      out->Push(t, 1, 1.f);
      ++i;
    } else if (m > 0) {
      double w = residual_exact ? 1.0 : m * per_draw;
      if (importance && !residual_exact) {
        w *= std::exp(proposal.log_scale - static_cast<double>(proposal.Score(t)));
      }
      out->Push(t, m, static_cast<float>(w));
    } else {
      out->Push(t, 0, 0.f);  // read for the budget only
    }
  }
}

void VAttentionSampleBase(int32_t n, const VAttentionParams& params, uint64_t seed,
                          int32_t sequence, int32_t head, VAttentionHeadResult* r,
                          const float* scores) {
  r->base.clear();
  r->residual_exact = false;
  ImportanceProposal& prop = r->proposal;
  prop.tokens.clear();
  prop.scores.clear();
  prop.cdf.clear();
  const int64_t n_s = n - static_cast<int64_t>(r->fixed.size());
  if (params.exact_statistics || n_s <= 0) return;
  const int64_t n_b = std::min<int64_t>(
      n_s,
      std::max<int64_t>(
          2, static_cast<int64_t>(std::floor(static_cast<double>(params.base_rate) * n_s + 0.5))));
  if (params.sampler == ResidualSampler::kImportance) {
    float m = -std::numeric_limits<float>::infinity();
    size_t e = 0;
    for (int32_t t = 0; t < n; ++t) {
      if (e < r->fixed.size() && r->fixed[e] == t) {
        ++e;
        continue;
      }
      prop.tokens.push_back(t);
      prop.scores.push_back(scores[t]);
      m = std::max(m, scores[t]);
    }
    double sum = 0;
    prop.cdf.reserve(prop.scores.size());
    for (float sc : prop.scores) {
      sum += std::exp(static_cast<double>(sc) - m);
      prop.cdf.push_back(sum);
    }
    prop.log_scale = m + std::log(sum) - std::log(static_cast<double>(n_s));
    prop.Draw(PhiloxStream::Make(seed, RngTag::kVattImportanceBase, static_cast<uint32_t>(sequence),
                                 static_cast<uint32_t>(head)),
              n_b, &r->base);
    return;
  }
  SampleWithoutReplacement(
      PhiloxStream::Make(seed, RngTag::kVattBase, static_cast<uint32_t>(sequence),
                         static_cast<uint32_t>(head)),
      n, r->fixed, n_b, &r->base, &r->scratch);
}

void VAttentionSampleHead(int32_t n, const VAttentionParams& params,
                          const VAttentionRowAccess& rows, uint64_t seed, int32_t sequence,
                          int32_t head, VAttentionHeadResult* r, const float* scores) {
  VAttentionSampleBase(n, params, seed, sequence, head, r, scores);
  VAttentionBudgetAndSample(n, params, rows, seed, sequence, head, r);
}

void VAttentionBudgetAndSample(int32_t n, const VAttentionParams& params,
                               const VAttentionRowAccess& rows, uint64_t seed, int32_t sequence,
                               int32_t head, VAttentionHeadResult* r) {
  const int64_t n_s = n - static_cast<int64_t>(r->fixed.size());
  VAttentionStatistics& st = r->stats;
  st = VAttentionStatistics{};
  st.n_s = n_s;
  // Residual tokens used for the statistics: the base sample, or every residual token.
  std::vector<int32_t> residual_all;
  const std::vector<int32_t>* stat_rows = &r->base;
  if (params.exact_statistics) {
    size_t e = 0;
    for (int32_t t = 0; t < n; ++t) {
      if (e < r->fixed.size() && r->fixed[e] == t) {
        ++e;
      } else {
        residual_all.push_back(t);
      }
    }
    stat_rows = &residual_all;
  }
  const int32_t dv = rows.dv;
  std::vector<float> logit_f(r->fixed.size()), logit_b(stat_rows->size());
  float c = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < r->fixed.size(); ++i)
    c = std::max(c, logit_f[i] = rows.logit(r->fixed[i]));
  const bool importance = params.sampler == ResidualSampler::kImportance;
  const ImportanceProposal& prop = r->proposal;
  for (size_t i = 0; i < stat_rows->size(); ++i) {
    const int32_t t = (*stat_rows)[i];
    // The importance sampler's effective logit s_t - s~_t + L (the header's derivation).
    logit_b[i] = importance ? static_cast<float>(static_cast<double>(rows.logit(t)) -
                                                 prop.Score(t) + prop.log_scale)
                            : rows.logit(t);
    c = std::max(c, logit_b[i]);
  }
  const bool rmax_known = !importance && !std::isnan(rows.residual_logit_max);
  if (rmax_known) c = std::max(c, rows.residual_logit_max);
  if (!std::isfinite(c)) c = 0.f;
  std::vector<float> v(dv);
  std::vector<double> nf(dv, 0.0), mean_y(dv, 0.0), m2_y(dv, 0.0), c_xy(dv, 0.0);
  double df = 0;
  for (size_t i = 0; i < r->fixed.size(); ++i) {
    const double x = std::exp(static_cast<double>(logit_f[i]) - c);
    rows.load_v(r->fixed[i], v.data());
    df += x;
    for (int32_t a = 0; a < dv; ++a) nf[a] += x * v[a];
  }
  // Welford over the statistics rows.
  double mean_x = 0, m2_x = 0, x_max = 0, y_max = 0, v_max = 0;
  for (size_t i = 0; i < stat_rows->size(); ++i) {
    const double x = std::exp(static_cast<double>(logit_b[i]) - c);
    rows.load_v((*stat_rows)[i], v.data());
    const double cnt = static_cast<double>(i + 1);
    const double dx = x - mean_x;
    mean_x += dx / cnt;
    m2_x += dx * (x - mean_x);
    double vn2 = 0;
    for (int32_t a = 0; a < dv; ++a) {
      const double y = x * v[a];
      const double dy = y - mean_y[a];
      mean_y[a] += dy / cnt;
      m2_y[a] += dy * (y - mean_y[a]);
      c_xy[a] += dx * (y - mean_y[a]);  // co-moment of x and y_a (dx: before x's update)
      vn2 += double{v[a]} * v[a];
    }
    x_max = std::max(x_max, x);
    v_max = std::max(v_max, std::sqrt(vn2));
    y_max = std::max(y_max, x * std::sqrt(vn2));
  }
  const double nb = static_cast<double>(stat_rows->size());
  const double ns = static_cast<double>(n_s);
  st.d_hat = df + ns * mean_x;
  double n2 = 0, tr = 0, tr_z = 0;
  const double var_x = nb > 1 ? m2_x / (nb - 1) : 0.0;
  for (int32_t a = 0; a < dv; ++a) {
    const double na = nf[a] + ns * mean_y[a];
    const double oa = st.d_hat > 0 ? na / st.d_hat : 0.0;  // o^ = N^ / D^
    n2 += na * na;
    if (nb > 1) {
      const double var_y = m2_y[a] / (nb - 1), cov = c_xy[a] / (nb - 1);
      tr += var_y;
      tr_z += var_y - 2 * oa * cov + oa * oa * var_x;
    }
  }
  st.n_hat_norm = std::sqrt(n2);
  st.sigma = std::sqrt(var_x);
  st.trace_sigma = tr;
  st.trace_sigma_z = std::max(tr_z, 0.0);  // rounding can take a zero variance below 0
  if (rmax_known) x_max = std::exp(static_cast<double>(rows.residual_logit_max) - c);
  st.x_max = x_max;
  st.y_max = params.exact_statistics ? y_max : x_max * v_max;
  r->budget = ComputeVAttentionBudget(st, params);
  if (n_s == 0) {
    r->b = 0;
  } else {
    const double lower = params.exact_statistics ? 1.0 : static_cast<double>(r->base.size());
    const double raw = std::isfinite(r->budget.raw) ? std::ceil(r->budget.raw) : ns;
    r->b = static_cast<int64_t>(std::min(ns, std::max(lower, raw)));
  }
  if (importance) {
    r->residual_exact = n_s > 0 && r->b >= n_s;
    if (r->residual_exact) {
      r->dyn = prop.tokens;
    } else {
      prop.Draw(PhiloxStream::Make(seed, RngTag::kVattImportanceDynamic,
                                   static_cast<uint32_t>(sequence), static_cast<uint32_t>(head)),
                r->b, &r->dyn);
    }
    return;
  }
  SampleWithoutReplacement(
      PhiloxStream::Make(seed, RngTag::kVattDynamic, static_cast<uint32_t>(sequence),
                         static_cast<uint32_t>(head)),
      n, r->fixed, r->b, &r->dyn, &r->scratch);
}

float CompressedLogitUpperBound(const CompressedKeysView& v, const float* q, float scale,
                                const float* approx, const std::vector<int32_t>& fixed) {
  std::vector<double> upper(static_cast<size_t>(v.length));
  UpperScores(v, q, scale, approx, upper.data());
  double best = -std::numeric_limits<double>::infinity();
  size_t e = 0;
  for (int64_t t = 0; t < v.length; ++t) {
    if (e < fixed.size() && fixed[e] == t) {
      ++e;
      continue;
    }
    best = std::max(best, upper[static_cast<size_t>(t)]);
  }
  return FloatAtLeast(best);  // the bound survives the conversion
}

absl::Status VAttentionSelectCpu(const DecodeProblem& p, const VAttentionParams& params,
                                 uint64_t seed, const SignatureView* sigs, RowSelection* sel,
                                 VAttentionStats* stats,
                                 absl::Span<const CompressedKeysView> keys) {
  if (absl::Status s = ValidateVAttentionParams(params); !s.ok()) return s;
  if (absl::Status s = ValidateProblemFor(p, ProblemNeeds{true, true, true, false}); !s.ok()) {
    return s;
  }
  const bool hash = params.predictor == TopKPredictor::kHash;
  const bool compressed = params.predictor == TopKPredictor::kCompressed;
  const int32_t words = SignatureWords(params.bits);
  if (compressed) {
    if (keys.size() != static_cast<size_t>(p.batch) * p.num_kv_heads) {
      return absl::InvalidArgumentError(absl::StrCat(
          "predictor: kCompressed needs compressed keys per (sequence, kv head): ", keys.size(),
          " for ", p.batch * p.num_kv_heads));
    }
    for (int32_t b = 0; b < p.batch; ++b) {
      for (int32_t j = 0; j < p.num_kv_heads; ++j) {
        const CompressedKeysView& v = keys[static_cast<size_t>(b) * p.num_kv_heads + j];
        if (v.length < p.seq_lens[b] || v.head_dim != p.head_dim) {
          return absl::InvalidArgumentError("compressed keys: fewer tokens or another head_dim");
        }
      }
    }
  }
  if (hash) {
    if (sigs == nullptr) {
      return absl::InvalidArgumentError("predictor: kHash needs signatures (sigs is null)");
    }
    if (sigs->bits != params.bits) {
      return absl::InvalidArgumentError(absl::StrCat("bits: params ask for ", params.bits,
                                                     " but the signatures have ", sigs->bits));
    }
    if ((sigs->key_heads != p.num_kv_heads && sigs->key_heads != p.num_q_heads) ||
        (p.batch > 0 && (sigs->q == nullptr || sigs->k == nullptr))) {
      return absl::InvalidArgumentError("signatures: bad key_heads or null pointers");
    }
  }
  const int32_t group = p.group_size();
  const int d = p.head_dim;
  sel->Reset(EstimateKind::kSoftmax, p.batch, p.num_kv_heads, group);
  if (stats != nullptr) stats->heads.assign(static_cast<size_t>(p.batch) * p.num_q_heads, {});
  std::vector<float> q(d), logits;
  std::vector<int32_t> sim, scratch;
  std::vector<HeadRows> rows(group);
  VAttentionHeadResult res;
  for (int32_t b = 0; b < p.batch; ++b) {
    const int32_t n = p.seq_lens[b];
    absl::StatusOr<int32_t> k = ResolveTopK(params.fixed, n);
    if (!k.ok()) return k.status();
    for (int32_t kvh = 0; kvh < p.num_kv_heads; ++kvh) {
      for (int32_t g = 0; g < group; ++g) {
        const int32_t h = kvh * group + g;
        LoadQuery(p, b, h, q.data());
        VAttentionRowAccess access;
        access.dv = d;
        access.load_v = [&](int32_t t, float* out) {
          LoadRowAsFloat(p.v, KvRowOffset(p, b, kvh, t), d, p.dtype, out);
        };
        if (hash) {
          const int32_t j = sigs->key_heads == p.num_q_heads ? h : kvh;
          const uint32_t* qs = sigs->q + (static_cast<int64_t>(b) * p.num_q_heads + h) * words;
          const uint32_t* ks = sigs->k + b * sigs->batch_stride + j * sigs->head_stride;
          sim.resize(n);
          for (int32_t t = 0; t < n; ++t) {
            sim[t] = HammingSimilarity(qs, ks + t * sigs->token_stride, words);
          }
          VAttentionPlanFixed(sim.data(), n, *k, params, &res, &scratch);
          access.logit = [&](int32_t t) {
            return DotRow(q.data(), p.k, KvRowOffset(p, b, kvh, t), d, p.dtype) * p.scale;
          };
        } else if (compressed) {
          CompressedKeysView head = keys[static_cast<size_t>(b) * p.num_kv_heads + kvh];
          head.length = n;  // its first seq_lens[b] tokens
          head.closed = std::min<int64_t>(head.closed, n / head.group * head.group);
          logits.resize(n);
          ApproximateScores(head, q.data(), p.scale, logits.data());
          VAttentionPlanFixed(logits.data(), n, *k, params, &res, &scratch);
          access.logit = [&](int32_t t) {
            return DotRow(q.data(), p.k, KvRowOffset(p, b, kvh, t), d, p.dtype) * p.scale;
          };
          const float bound =
              CompressedLogitUpperBound(head, q.data(), p.scale, logits.data(), res.fixed);
          if (std::isfinite(bound)) access.residual_logit_max = bound;
        } else {
          logits.resize(n);
          ComputeScores(p, b, h, q.data(), logits.data());
          VAttentionPlanFixed(logits.data(), n, *k, params, &res, &scratch);
          access.logit = [&](int32_t t) { return logits[t]; };
          float rmax = -std::numeric_limits<float>::infinity();
          size_t e = 0;
          for (int32_t t = 0; t < n; ++t) {
            if (e < res.fixed.size() && res.fixed[e] == t) {
              ++e;
            } else {
              rmax = std::max(rmax, logits[t]);
            }
          }
          if (std::isfinite(rmax)) access.residual_logit_max = rmax;
        }
        VAttentionSampleHead(n, params, access, seed, b, h, &res, hash ? nullptr : logits.data());
        res.ToHeadRows(&rows[g]);
        if (stats != nullptr) stats->heads[static_cast<size_t>(b) * p.num_q_heads + h] = res;
      }
      MergeGroup(rows, &sel->at(b, kvh));
    }
  }
  return absl::OkStatus();
}

absl::Status VAttentionDecodeCpu(const DecodeProblem& p, const VAttentionParams& params,
                                 uint64_t seed, const SignatureView* sigs, RowSelection* sel,
                                 VAttentionStats* stats,
                                 absl::Span<const CompressedKeysView> keys) {
  RowSelection local;
  RowSelection* s = sel != nullptr ? sel : &local;
  if (absl::Status st = VAttentionSelectCpu(p, params, seed, sigs, s, stats, keys); !st.ok()) {
    return st;
  }
  return EstimateInPlace(p, *s);
}

}  // namespace kvsparse::kernels
