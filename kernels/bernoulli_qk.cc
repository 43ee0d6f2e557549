#include "kernels/bernoulli_qk.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/philox.h"

namespace kvsparse::kernels {

int64_t BernoulliQuery::head_features() const {
  int64_t s = 0;
  for (uint8_t x : head_touched) s += x;
  return s;
}

int64_t BernoulliQuery::group_features() const {
  int64_t s = 0;
  for (uint8_t x : group_touched) s += x;
  return s;
}

double BernoulliQuery::head_fraction() const {
  if (group == 0 || dim == 0) return 0.0;
  return static_cast<double>(head_features()) / (static_cast<double>(group) * dim);
}

double BernoulliQuery::group_fraction() const {
  if (dim == 0) return 0.0;
  return static_cast<double>(group_features()) / dim;
}

absl::Status ValidateBernoulliQkParams(const BernoulliQkParams& params) {
  if (params.samples < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("bernoulli_qk_samples must be >= 1, got ", params.samples));
  }
  return absl::OkStatus();
}

absl::Status SampleBernoulliQuery(absl::Span<const float> q, int32_t group, int32_t dim,
                                  const BernoulliQkParams& params, uint64_t seed, int32_t sequence,
                                  int32_t kv_head, BernoulliQuery* out) {
  if (absl::Status s = ValidateBernoulliQkParams(params); !s.ok()) return s;
  if (group <= 0 || dim <= 0 || q.size() != static_cast<size_t>(group) * dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("q must be [G, d] = [", group, ", ", dim, "], got ", q.size(), " elements"));
  }
  out->group = group;
  out->dim = dim;
  out->q_eff.assign(static_cast<size_t>(group) * dim, 0.f);
  out->head_touched.assign(static_cast<size_t>(group) * dim, 0);
  out->group_touched.assign(dim, 0);
  out->features.assign(group, {});
  const float fb = static_cast<float>(params.samples);
  if (params.mode == BernoulliQkMode::kPerHead) {
    for (int32_t g = 0; g < group; ++g) {
      const float* qg = q.data() + static_cast<size_t>(g) * dim;
      float norm = 0.f;
      for (int32_t i = 0; i < dim; ++i) norm = std::max(norm, std::fabs(qg[i]));
      if (!(norm > 0.f)) continue;
      const PhiloxStream base = PhiloxStream::Make(seed, RngTag::kBernoulliHead, sequence,
                                                   static_cast<uint32_t>(kv_head * group + g));
      for (int32_t i = 0; i < dim; ++i) {
        const float p = std::fabs(qg[i]) / norm;
        const int32_t c = BernoulliCountOnes(base.WithLane(i), p, params.samples, params.sampler);
        if (c == 0) continue;
        const float mag = norm * static_cast<float>(c) / fb;
        out->q_eff[static_cast<size_t>(g) * dim + i] = qg[i] < 0.f ? -mag : mag;
        out->head_touched[static_cast<size_t>(g) * dim + i] = 1;
        out->group_touched[i] = 1;
        out->features[g].push_back(i);
      }
    }
    return absl::OkStatus();
  }
  // Mean group query.
  std::vector<float> m(dim, 0.f);
  float norm = 0.f;
  for (int32_t i = 0; i < dim; ++i) {
    float s = 0.f;
    for (int32_t g = 0; g < group; ++g) s += std::fabs(q[static_cast<size_t>(g) * dim + i]);
    m[i] = s / static_cast<float>(group);
    norm = std::max(norm, m[i]);
  }
  if (!(norm > 0.f)) return absl::OkStatus();
  const PhiloxStream base =
      PhiloxStream::Make(seed, RngTag::kBernoulliGroup, sequence, static_cast<uint32_t>(kv_head));
  for (int32_t i = 0; i < dim; ++i) {
    if (!(m[i] > 0.f)) continue;
    const float p = m[i] / norm;
    const int32_t c = BernoulliCountOnes(base.WithLane(i), p, params.samples, params.sampler);
    if (c == 0) continue;
    const float m_hat = norm * static_cast<float>(c) / fb;
    out->group_touched[i] = 1;
    for (int32_t g = 0; g < group; ++g) {
      const size_t gi = static_cast<size_t>(g) * dim + i;
      out->q_eff[gi] = m_hat * q[gi] / m[i];
      out->head_touched[gi] = 1;
      out->features[g].push_back(i);
    }
  }
  return absl::OkStatus();
}

}  // namespace kvsparse::kernels
