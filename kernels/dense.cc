#include "kernels/dense.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace kvsparse::kernels {
namespace {

template <typename T>
absl::Status DenseDecodeTyped(const DecodeProblem& p) {
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  T* out = static_cast<T*>(p.out);
  const int d = p.head_dim;
  const int group = p.group_size();
  std::vector<float> qf(d), acc(d);
  for (int32_t b = 0; b < p.batch; ++b) {
    const int32_t n = p.seq_lens[b];
    for (int32_t h = 0; h < p.num_q_heads; ++h) {
      const int32_t kvh = h / group;
      const T* qrow = q + (static_cast<int64_t>(b) * p.num_q_heads + h) * d;
      for (int i = 0; i < d; ++i) qf[i] = ToFloat(qrow[i]);
      std::fill(acc.begin(), acc.end(), 0.f);
      float m = -std::numeric_limits<float>::infinity();
      float l = 0.f;
      const int64_t base = b * p.kv_layout.batch_stride + kvh * p.kv_layout.head_stride;
      for (int32_t t = 0; t < n; ++t) {
        const int64_t off = base + t * p.kv_layout.token_stride;
        float s = 0.f;
        for (int i = 0; i < d; ++i) s += qf[i] * ToFloat(k[off + i]);
        s *= p.scale;
        if (s > m) {  // rescale what was accumulated under the old max
          const float c = std::isinf(m) ? 0.f : std::exp(m - s);
          l *= c;
          for (int i = 0; i < d; ++i) acc[i] *= c;
          m = s;
        }
        const float w = std::exp(s - m);
        l += w;
        for (int i = 0; i < d; ++i) acc[i] += w * ToFloat(v[off + i]);
      }
      T* orow = out + (static_cast<int64_t>(b) * p.num_q_heads + h) * d;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      for (int i = 0; i < d; ++i) orow[i] = FromFloat<T>(acc[i] * inv);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status DenseDecodeCpu(const DecodeProblem& p) {
  if (absl::Status s = ValidateDecodeProblem(p); !s.ok()) return s;
  switch (p.dtype) {
    case DType::kFp32:
      return DenseDecodeTyped<float>(p);
    case DType::kFp16:
      return DenseDecodeTyped<Fp16>(p);
    case DType::kBf16:
      return DenseDecodeTyped<Bf16>(p);
  }
  return absl::InvalidArgumentError("unknown dtype");
}

absl::Status DenseDecodeFloat64(const DecodeProblem& p, std::vector<double>* out) {
  if (absl::Status s = ValidateDecodeProblem(p); !s.ok()) return s;
  const int d = p.head_dim;
  const int group = p.group_size();
  out->assign(static_cast<size_t>(p.batch) * p.num_q_heads * d, 0.0);
  const size_t es = DTypeSize(p.dtype);
  const auto* q = static_cast<const uint8_t*>(p.q);
  const auto* k = static_cast<const uint8_t*>(p.k);
  const auto* v = static_cast<const uint8_t*>(p.v);
  std::vector<double> s;
  for (int32_t b = 0; b < p.batch; ++b) {
    const int32_t n = p.seq_lens[b];
    for (int32_t h = 0; h < p.num_q_heads; ++h) {
      const int32_t kvh = h / group;
      const uint8_t* qrow = q + (static_cast<size_t>(b) * p.num_q_heads + h) * d * es;
      const int64_t base = b * p.kv_layout.batch_stride + kvh * p.kv_layout.head_stride;
      s.assign(n, 0.0);
      double m = -std::numeric_limits<double>::infinity();
      for (int32_t t = 0; t < n; ++t) {
        const uint8_t* krow = k + (base + t * p.kv_layout.token_stride) * es;
        double dot = 0.0;
        for (int i = 0; i < d; ++i) {
          dot += static_cast<double>(LoadAsFloat(qrow, i, p.dtype)) * LoadAsFloat(krow, i, p.dtype);
        }
        s[t] = dot * p.scale;
        m = std::max(m, s[t]);
      }
      double z = 0.0;
      for (int32_t t = 0; t < n; ++t) z += std::exp(s[t] - m);
      double* orow = out->data() + (static_cast<size_t>(b) * p.num_q_heads + h) * d;
      for (int32_t t = 0; t < n; ++t) {
        const double w = std::exp(s[t] - m) / z;
        const uint8_t* vrow = v + (base + t * p.kv_layout.token_stride) * es;
        for (int i = 0; i < d; ++i) orow[i] += w * LoadAsFloat(vrow, i, p.dtype);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvsparse::kernels
