#include "kernels/row_selection.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/cpu_util.h"

namespace kvsparse::kernels {

int64_t KvHeadSelection::rows_selected() const {
  int64_t s = 0;
  for (int32_t c : counts) s += c;
  return s;
}

void RowSelection::Reset(EstimateKind k, int32_t b, int32_t hkv, int32_t g) {
  kind = k;
  ordered_draws = false;
  batch = b;
  num_kv_heads = hkv;
  group_size = g;
  heads.assign(static_cast<size_t>(b) * hkv, KvHeadSelection{});
}

void MergeGroup(absl::Span<const HeadRows> heads, KvHeadSelection* out) {
  const size_t g_count = heads.size();
  out->tokens.clear();
  for (const HeadRows& h : heads) {
    out->tokens.insert(out->tokens.end(), h.tokens.begin(), h.tokens.end());
  }
  std::sort(out->tokens.begin(), out->tokens.end());
  out->tokens.erase(std::unique(out->tokens.begin(), out->tokens.end()), out->tokens.end());
  const size_t r_count = out->tokens.size();
  out->counts.assign(r_count, 0);
  out->head_counts.assign(g_count * r_count, 0);
  out->weights.assign(g_count * r_count, 0.f);
  out->budgets.assign(g_count, 0);
  for (size_t g = 0; g < g_count; ++g) {
    const HeadRows& h = heads[g];
    out->budgets[g] = h.budget;
    size_t r = 0;  // both lists ascending: one merge walk
    for (size_t i = 0; i < h.tokens.size(); ++i) {
      while (out->tokens[r] != h.tokens[i]) ++r;
      out->head_counts[g * r_count + r] = h.counts[i];
      out->weights[g * r_count + r] = h.weights[i];
      out->counts[r] += h.counts[i];
    }
  }
}

absl::Status SelectAllRows(const DecodeProblem& p, RowSelection* sel) {
  if (absl::Status s = ValidateProblemFor(p, ProblemNeeds{false, false, false, false}); !s.ok()) {
    return s;
  }
  const int32_t group = p.group_size();
  sel->Reset(EstimateKind::kSoftmax, p.batch, p.num_kv_heads, group);
  for (int32_t b = 0; b < p.batch; ++b) {
    const int32_t n = p.seq_lens[b];
    for (int32_t kvh = 0; kvh < p.num_kv_heads; ++kvh) {
      KvHeadSelection& h = sel->at(b, kvh);
      h.tokens.resize(n);
      for (int32_t t = 0; t < n; ++t) h.tokens[t] = t;
      h.counts.assign(n, group);
      h.head_counts.assign(static_cast<size_t>(group) * n, 1);
      h.weights.assign(static_cast<size_t>(group) * n, 1.f);
      h.budgets.assign(group, n);
    }
  }
  return absl::OkStatus();
}

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// The relative standard error of one query head's estimate `out` (d floats), its used rows taken
// as draws (EstimateFromGathered in the header). e[r]: kSoftmax's e^{s_r - m} of row r (not read
// for kLinear).
template <typename RowFn>
float DrawStandardError(const DecodeProblem& p, const RowSelection& sel, const KvHeadSelection& hs,
                        int32_t b, int32_t kvh, int g, const float* e, const float* out,
                        RowFn row_of) {
  const int d = p.head_dim;
  const size_t r_count = hs.tokens.size();
  const int32_t* c = hs.head_counts.data() + g * r_count;
  const float* w = hs.weights.data() + g * r_count;
  const bool linear = sel.kind == EstimateKind::kLinear;
  double m = 0, mass = 0;
  for (size_t r = 0; r < r_count; ++r) {
    if (c[r] <= 0) continue;
    m += c[r];
    mass += linear ? double{w[r]} : double{w[r]} * e[r];
  }
  double out2 = 0;
  for (int i = 0; i < d; ++i) out2 += double{out[i]} * out[i];
  if (m < 2) return out2 > 0 ? kInf : 0.f;
  if (mass <= 0) return 0.f;
  // Each draw's value z, whose mean over the m draws is the output's deviation from out: kLinear
  // m a V - out (a = w / c), kSoftmax m a (V - out) / L (a = w e^{s} / c, L their sum: the
  // ratio's linearisation).
  std::vector<float> v(d);
  std::vector<double> z(d), prev(d);
  bool first = true;
  double sum2 = 0;
  for (size_t r = 0; r < r_count; ++r) {
    if (c[r] <= 0) continue;
    const auto [vbase, voff] = row_of(b, kvh, r, /*is_k=*/false);
    LoadRowAsFloat(vbase, voff, d, p.dtype, v.data());
    const double a = (linear ? double{w[r]} : double{w[r]} * e[r]) / c[r];
    for (int i = 0; i < d; ++i) {
      z[i] = linear ? m * a * v[i] - out[i] : m * a * (v[i] - double{out[i]}) / mass;
    }
    if (!sel.ordered_draws) {
      double z2 = 0;
      for (int i = 0; i < d; ++i) z2 += z[i] * z[i];
      sum2 += c[r] * z2;  // linear: |z - mean z|^2 with mean 0; the ratio's mean is 0 too
    } else {
      // Successive differences in token order; a row drawn c times adds c - 1 zero ones.
      double dz2 = 0;
      for (int i = 0; i < d; ++i) dz2 += (z[i] - prev[i]) * (z[i] - prev[i]);
      if (!first) sum2 += dz2 / 2;
      prev = z;
      first = false;
    }
  }
  // i.i.d.: sum |z|^2 / (m (m - 1)); ordered: sum |dz|^2 / 2 over the m - 1 differences, the same.
  const double var = sum2 / (m * (m - 1));
  if (out2 <= 0) return var > 0 ? kInf : 0.f;
  return static_cast<float>(std::sqrt(var / out2));
}

// rel_se: nullptr, or [B * H] filled with each query head's DrawStandardError.
template <typename RowFn>
absl::Status Estimate(const DecodeProblem& p, const RowSelection& sel, RowFn row_of,
                      std::vector<float>* rel_se = nullptr) {
  if (sel.batch != p.batch || sel.num_kv_heads != p.num_kv_heads ||
      sel.group_size != p.group_size() ||
      sel.heads.size() != static_cast<size_t>(p.batch) * p.num_kv_heads) {
    return absl::InvalidArgumentError(
        absl::StrCat("selection shape (B=", sel.batch, ", Hkv=", sel.num_kv_heads,
                     ", G=", sel.group_size, ") does not match the problem (B=", p.batch,
                     ", Hkv=", p.num_kv_heads, ", G=", p.group_size(), ")"));
  }
  const int d = p.head_dim;
  const int group = p.group_size();
  if (rel_se != nullptr) rel_se->assign(static_cast<size_t>(p.batch) * p.num_q_heads, 0.f);
  std::vector<float> q(d), acc(d), s;
  for (int32_t b = 0; b < p.batch; ++b) {
    for (int32_t kvh = 0; kvh < p.num_kv_heads; ++kvh) {
      const KvHeadSelection& hs = sel.at(b, kvh);
      const size_t r_count = hs.tokens.size();
      if (hs.weights.size() != r_count * group) {
        return absl::InvalidArgumentError(
            absl::StrCat("selection (", b, ", ", kvh, "): weights must be [G, R]"));
      }
      for (int g = 0; g < group; ++g) {
        const int32_t h = kvh * group + g;
        const float* w = hs.weights.data() + g * r_count;
        std::fill(acc.begin(), acc.end(), 0.f);
        float norm = 1.f;
        if (sel.kind == EstimateKind::kLinear) {
          for (size_t r = 0; r < r_count; ++r) {
            if (w[r] == 0.f) continue;
            const auto [vbase, voff] = row_of(b, kvh, r, /*is_k=*/false);
            AxpyRow(w[r], vbase, voff, d, p.dtype, acc.data());
          }
        } else {
          LoadQuery(p, b, h, q.data());
          s.assign(r_count, 0.f);
          float m = -std::numeric_limits<float>::infinity();
          for (size_t r = 0; r < r_count; ++r) {
            if (w[r] == 0.f) continue;
            const auto [kbase, koff] = row_of(b, kvh, r, /*is_k=*/true);
            s[r] = DotRow(q.data(), kbase, koff, d, p.dtype) * p.scale;
            m = std::max(m, s[r]);
          }
          float l = 0.f;
          for (size_t r = 0; r < r_count; ++r) {
            if (w[r] == 0.f) continue;
            s[r] = std::exp(s[r] - m);  // kept for DrawStandardError (unused rows stay 0)
            const float e = w[r] * s[r];
            l += e;
            const auto [vbase, voff] = row_of(b, kvh, r, /*is_k=*/false);
            AxpyRow(e, vbase, voff, d, p.dtype, acc.data());
          }
          norm = l > 0.f ? 1.f / l : 0.f;
        }
        const int64_t o = (static_cast<int64_t>(b) * p.num_q_heads + h) * d;
        for (int i = 0; i < d; ++i) StoreFromFloat(p.out, o + i, p.dtype, acc[i] * norm);
        if (rel_se != nullptr) {
          for (int i = 0; i < d; ++i) acc[i] *= norm;  // the output, for the spread around it
          (*rel_se)[static_cast<size_t>(b) * p.num_q_heads + h] =
              DrawStandardError(p, sel, hs, b, kvh, g, s.data(), acc.data(), row_of);
        }
      }
    }
  }
  return absl::OkStatus();
}

struct RowRef {
  const void* base;
  int64_t offset;
};

}  // namespace

absl::Status EstimateFromGathered(const DecodeProblem& p, const RowSelection& sel,
                                  absl::Span<const GatheredRows> rows,
                                  std::vector<float>* draw_standard_errors) {
  if (absl::Status s =
          ValidateProblemFor(p, ProblemNeeds{/*q=*/true, /*k=*/false, /*v=*/false, /*out=*/true});
      !s.ok()) {
    return s;
  }
  if (rows.size() != static_cast<size_t>(p.batch) * p.num_kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rows: expected B*Hkv = ", p.batch * p.num_kv_heads, " entries, got ", rows.size()));
  }
  for (size_t i = 0; i < rows.size(); ++i) {
    const bool any = i < sel.heads.size() && !sel.heads[i].tokens.empty();
    if (!any) continue;
    if (rows[i].v == nullptr || (sel.needs_k_rows() && rows[i].k == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("rows[", i, "]: missing ", rows[i].v == nullptr ? "v" : "k", " rows"));
    }
    if (rows[i].row_stride < p.head_dim) {
      return absl::InvalidArgumentError(
          absl::StrCat("rows[", i, "].row_stride ", rows[i].row_stride, " < head_dim"));
    }
  }
  return Estimate(
      p, sel,
      [&](int32_t b, int32_t kvh, size_t r, bool is_k) {
        const GatheredRows& g = rows[static_cast<size_t>(b) * p.num_kv_heads + kvh];
        return RowRef{is_k ? g.k : g.v, static_cast<int64_t>(r) * g.row_stride};
      },
      draw_standard_errors);
}

absl::Status EstimateInPlace(const DecodeProblem& p, const RowSelection& sel,
                             std::vector<float>* draw_standard_errors) {
  if (absl::Status s = ValidateProblemFor(
          p, ProblemNeeds{/*q=*/true, /*k=*/sel.needs_k_rows(), /*v=*/true, /*out=*/true});
      !s.ok()) {
    return s;
  }
  for (int32_t b = 0; b < p.batch && static_cast<size_t>(b) * p.num_kv_heads < sel.heads.size();
       ++b) {
    for (int32_t kvh = 0; kvh < p.num_kv_heads; ++kvh) {
      for (int32_t t : sel.at(b, kvh).tokens) {
        if (t < 0 || t >= p.seq_lens[b]) {
          return absl::InvalidArgumentError(absl::StrCat("selection (", b, ", ", kvh,
                                                         ") holds token ", t, " outside [0, ",
                                                         p.seq_lens[b], ")"));
        }
      }
    }
  }
  return Estimate(
      p, sel,
      [&](int32_t b, int32_t kvh, size_t r, bool is_k) {
        const int32_t t = sel.at(b, kvh).tokens[r];
        return RowRef{is_k ? p.k : p.v, KvRowOffset(p, b, kvh, t)};
      },
      draw_standard_errors);
}

}  // namespace kvsparse::kernels
