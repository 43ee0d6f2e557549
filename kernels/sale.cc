#include "kernels/sale.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "absl/strings/str_cat.h"

namespace kvsparse::kernels {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Rows of a head-major [heads, tokens, d] tensor as floats.
std::vector<float> HeadsAsFloat(const void* base, int32_t heads, int32_t tokens, int32_t d,
                                DType t) {
  const size_t n = static_cast<size_t>(heads) * tokens * d;
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = LoadAsFloat(base, i, t);
  return out;
}

float Dot(const float* a, const float* b, int32_t d) {
  float s = 0.f;
  for (int32_t e = 0; e < d; ++e) s += a[e] * b[e];
  return s;
}

// The selection pass's int8 operands (the header's quantization).
struct Quantized {
  std::vector<int8_t> q;       // [H, n, d]
  std::vector<float> q_scale;  // [H, n]
  std::vector<float> q_mean;   // [H, n]: q_r . mean_k of the head's kv head
  std::vector<int8_t> k;       // [Hkv, n, d], smoothed
  std::vector<float> k_scale;  // [Hkv, k_blocks]
};

int8_t Round8(float x) { return static_cast<int8_t>(std::clamp(std::nearbyint(x), -127.f, 127.f)); }

Quantized Quantize(const SalePrefill& p, const SaleParams& params, const std::vector<float>& q,
                   const std::vector<float>& k) {
  const int32_t n = p.tokens, d = p.head_dim, H = p.num_q_heads, hkv = p.num_kv_heads;
  const int32_t G = H / hkv, kb = (n + params.block_k - 1) / params.block_k;
  Quantized z;
  z.q.resize(q.size());
  z.q_scale.resize(static_cast<size_t>(H) * n);
  z.q_mean.resize(static_cast<size_t>(H) * n);
  z.k.resize(k.size());
  z.k_scale.resize(static_cast<size_t>(hkv) * kb);
  std::vector<float> mean(static_cast<size_t>(hkv) * d, 0.f), centred(k.size());
  for (int32_t j = 0; j < hkv; ++j) {
    float* m = mean.data() + static_cast<size_t>(j) * d;
    std::vector<double> sum(d, 0.0);
    for (int32_t t = 0; t < n; ++t) {
      const float* row = k.data() + (static_cast<size_t>(j) * n + t) * d;
      for (int32_t e = 0; e < d; ++e) sum[e] += row[e];
    }
    for (int32_t e = 0; e < d; ++e) m[e] = static_cast<float>(sum[e] / n);
    for (int32_t blk = 0; blk < kb; ++blk) {
      const int32_t t0 = blk * params.block_k, t1 = std::min(n, t0 + params.block_k);
      float amax = 0.f;
      for (int32_t t = t0; t < t1; ++t) {
        const size_t o = (static_cast<size_t>(j) * n + t) * d;
        for (int32_t e = 0; e < d; ++e) {
          centred[o + e] = k[o + e] - m[e];
          amax = std::max(amax, std::fabs(centred[o + e]));
        }
      }
      const float s = amax > 0.f ? amax / 127.f : 1.f;
      z.k_scale[static_cast<size_t>(j) * kb + blk] = s;
      for (int32_t t = t0; t < t1; ++t) {
        const size_t o = (static_cast<size_t>(j) * n + t) * d;
        for (int32_t e = 0; e < d; ++e) z.k[o + e] = Round8(centred[o + e] / s);
      }
    }
  }
  for (int32_t h = 0; h < H; ++h) {
    const float* m = mean.data() + static_cast<size_t>(h / G) * d;
    for (int32_t t = 0; t < n; ++t) {
      const size_t r = static_cast<size_t>(h) * n + t;
      const float* row = q.data() + r * d;
      float amax = 0.f;
      for (int32_t e = 0; e < d; ++e) amax = std::max(amax, std::fabs(row[e]));
      const float s = amax > 0.f ? amax / 127.f : 1.f;
      z.q_scale[r] = s;
      z.q_mean[r] = Dot(row, m, d);
      for (int32_t e = 0; e < d; ++e) z.q[r * d + e] = Round8(row[e] / s);
    }
  }
  return z;
}

// The blocks of query block i that the sink and local regions cover: [0, sink_end) and
// [local_first, last] (key block indices; last is the block of the query block's last row).
struct Regions {
  int32_t sink_end = 0, local_first = 0, last = 0;
};
Regions RegionsOf(const SaleParams& params, int32_t n, int32_t i) {
  const int32_t row_end = std::min(n, (i + 1) * params.block_q);
  Regions r;
  r.last = (row_end - 1) / params.block_k;
  r.local_first = std::max(0, r.last + 1 - params.local_tokens / params.block_k);
  r.sink_end = std::min(params.sink_tokens / params.block_k, r.last + 1);
  return r;
}

SaleMask EmptyMask(const SalePrefill& p, const SaleParams& params) {
  SaleMask m;
  m.heads = p.num_q_heads;
  m.q_blocks = (p.tokens + params.block_q - 1) / params.block_q;
  m.k_blocks = (p.tokens + params.block_k - 1) / params.block_k;
  m.selected.assign(static_cast<size_t>(m.heads) * m.q_blocks * m.k_blocks, 0);
  m.causal_blocks.assign(m.heads, SaleCausalBlocks(p.tokens, params));
  m.selected_blocks.assign(m.heads, 0);
  return m;
}

void Set(SaleMask* m, int32_t h, int32_t i, int32_t j) {
  uint8_t& s = m->selected[(static_cast<size_t>(h) * m->q_blocks + i) * m->k_blocks + j];
  if (s == 0) ++m->selected_blocks[h];
  s = 1;
}

}  // namespace

absl::Status ValidateSaleParams(const SaleParams& p) {
  if (p.block_k <= 0) return absl::InvalidArgumentError("block_k must be positive");
  if (p.block_q <= 0 || p.block_q % p.block_k != 0) {
    return absl::InvalidArgumentError("block_q must be a positive multiple of block_k");
  }
  if (p.sink_tokens < 0 || p.sink_tokens % p.block_k != 0) {
    return absl::InvalidArgumentError("sink_tokens must be a non-negative multiple of block_k");
  }
  if (p.local_tokens < p.block_q || p.local_tokens % p.block_k != 0) {
    return absl::InvalidArgumentError(
        "local_tokens must be a multiple of block_k and at least block_q");
  }
  return absl::OkStatus();
}

absl::Status ValidateSalePrefill(const SalePrefill& p) {
  if (p.tokens < 0 || p.num_q_heads <= 0 || p.num_kv_heads <= 0 || p.head_dim <= 0 ||
      p.num_q_heads % p.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("bad prefill shape: tokens ", p.tokens,
                                                   ", heads ", p.num_q_heads, "/", p.num_kv_heads,
                                                   ", head_dim ", p.head_dim));
  }
  if (!std::isfinite(p.scale) || p.scale <= 0.f) {
    return absl::InvalidArgumentError("scale must be positive and finite");
  }
  if (p.tokens > 0 && (p.q == nullptr || p.k == nullptr)) {
    return absl::InvalidArgumentError("q and k must be set");
  }
  return absl::OkStatus();
}

double SaleMask::sparsity() const {
  int64_t causal = 0, sel = 0;
  for (size_t h = 0; h < causal_blocks.size(); ++h) {
    causal += causal_blocks[h];
    sel += selected_blocks[h];
  }
  return causal > 0 ? 1.0 - static_cast<double>(sel) / static_cast<double>(causal) : 0.0;
}

int64_t SaleCausalBlocks(int32_t tokens, const SaleParams& params) {
  int64_t blocks = 0;
  for (int32_t i = 0; i * params.block_q < tokens; ++i)
    blocks += RegionsOf(params, tokens, i).last + 1;
  return blocks;
}

SaleMask SaleFullMask(const SalePrefill& p, const SaleParams& params) {
  SaleMask m = EmptyMask(p, params);
  for (int32_t h = 0; h < m.heads; ++h) {
    for (int32_t i = 0; i < m.q_blocks; ++i) {
      const int32_t last = RegionsOf(params, p.tokens, i).last;
      for (int32_t j = 0; j <= last; ++j) Set(&m, h, i, j);
    }
  }
  return m;
}

absl::Status SaleSelect(const SalePrefill& p, const SaleParams& params, absl::Span<const float> tau,
                        SaleMask* mask) {
  if (absl::Status s = ValidateSaleParams(params); !s.ok()) return s;
  if (absl::Status s = ValidateSalePrefill(p); !s.ok()) return s;
  if (static_cast<int32_t>(tau.size()) != p.num_q_heads) {
    return absl::InvalidArgumentError(
        absl::StrCat("tau: one threshold per query head (", p.num_q_heads, "), got ", tau.size()));
  }
  for (float t : tau) {
    if (!(t >= 0.f && t < 1.f)) return absl::InvalidArgumentError("tau must be in [0, 1)");
  }
  const int32_t n = p.tokens, d = p.head_dim, H = p.num_q_heads, hkv = p.num_kv_heads;
  const int32_t G = H / hkv, bq = params.block_q, bk = params.block_k;
  *mask = EmptyMask(p, params);
  if (n == 0) return absl::OkStatus();
  const std::vector<float> q = HeadsAsFloat(p.q, H, n, d, p.dtype);
  const std::vector<float> k = HeadsAsFloat(p.k, hkv, n, d, p.dtype);
  const Quantized z = Quantize(p, params, q, k);
  const int32_t kb = mask->k_blocks;
  std::vector<float> m(bq), thr(bq);
  for (int32_t h = 0; h < H; ++h) {
    const int32_t j = h / G;
    for (int32_t i = 0; i < mask->q_blocks; ++i) {
      const Regions rg = RegionsOf(params, n, i);
      const int32_t r0 = i * bq, r1 = std::min(n, r0 + bq);
      auto exact_region = [&](int32_t blk) { return blk < rg.sink_end || blk >= rg.local_first; };
      for (int32_t blk = 0; blk <= rg.last; ++blk) {
        if (exact_region(blk)) Set(mask, h, i, blk);
      }
      // Step 1: m_r and l_r over the sink and local keys c <= r, exact.
      for (int32_t r = r0; r < r1; ++r) {
        const float* qr = q.data() + (static_cast<size_t>(h) * n + r) * d;
        float mr = kNegInf;
        std::vector<float> s;
        for (int32_t blk = 0; blk <= rg.last; ++blk) {
          if (!exact_region(blk)) continue;
          for (int32_t c = blk * bk; c < std::min(r + 1, (blk + 1) * bk); ++c) {
            s.push_back(p.scale * Dot(qr, k.data() + (static_cast<size_t>(j) * n + c) * d, d));
            mr = std::max(mr, s.back());
          }
        }
        double lr = 0.0;
        for (float x : s) lr += std::exp(static_cast<double>(x) - mr);
        m[r - r0] = mr;
        // S~ >= m + ln(tau l): -inf for tau = 0 (every block passes).
        thr[r - r0] = tau[h] > 0.f ? static_cast<float>(mr + std::log(tau[h] * lr)) : kNegInf;
      }
      // Step 2: each middle block, estimated from int8 Q and K.
      for (int32_t blk = rg.sink_end; blk < rg.local_first; ++blk) {
        const float ks = z.k_scale[static_cast<size_t>(j) * kb + blk];
        bool hit = false;
        for (int32_t r = r0; r < r1 && !hit; ++r) {
          const size_t qr = static_cast<size_t>(h) * n + r;
          const int8_t* qq = z.q.data() + qr * d;
          for (int32_t c = blk * bk; c < std::min(n, (blk + 1) * bk) && !hit; ++c) {
            const int8_t* kk = z.k.data() + (static_cast<size_t>(j) * n + c) * d;
            int32_t acc = 0;
            for (int32_t e = 0; e < d; ++e) acc += static_cast<int32_t>(qq[e]) * kk[e];
            hit = SaleEstimatePasses(p.scale, z.q_scale[qr], ks, acc, z.q_mean[qr], thr[r - r0]);
          }
        }
        if (hit) Set(mask, h, i, blk);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status SaleAttend(const SalePrefill& p, const SaleParams& params, const SaleMask& mask) {
  if (absl::Status s = ValidateSaleParams(params); !s.ok()) return s;
  if (absl::Status s = ValidateSalePrefill(p); !s.ok()) return s;
  const int32_t n = p.tokens, d = p.head_dim, H = p.num_q_heads, hkv = p.num_kv_heads;
  if (n > 0 && (p.v == nullptr || p.out == nullptr)) {
    return absl::InvalidArgumentError("v and out must be set");
  }
  const int32_t G = H / hkv, bq = params.block_q, bk = params.block_k;
  if (mask.heads != H || mask.q_blocks != (n + bq - 1) / bq || mask.k_blocks != (n + bk - 1) / bk) {
    return absl::InvalidArgumentError("mask: not this prompt's shape");
  }
  const std::vector<float> q = HeadsAsFloat(p.q, H, n, d, p.dtype);
  const std::vector<float> k = HeadsAsFloat(p.k, hkv, n, d, p.dtype);
  const std::vector<float> v = HeadsAsFloat(p.v, hkv, n, d, p.dtype);
  std::vector<float> s;
  std::vector<int32_t> cols;
  std::vector<double> acc(d);
  for (int32_t h = 0; h < H; ++h) {
    const int32_t j = h / G;
    for (int32_t r = 0; r < n; ++r) {
      const int32_t i = r / bq;
      const float* qr = q.data() + (static_cast<size_t>(h) * n + r) * d;
      s.clear();
      cols.clear();
      float mx = kNegInf;
      for (int32_t c = 0; c <= r; ++c) {
        if (!mask.at(h, i, c / bk)) continue;
        cols.push_back(c);
        s.push_back(p.scale * Dot(qr, k.data() + (static_cast<size_t>(j) * n + c) * d, d));
        mx = std::max(mx, s.back());
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      double den = 0.0;
      for (size_t x = 0; x < cols.size(); ++x) {
        const double w = std::exp(static_cast<double>(s[x]) - mx);
        den += w;
        const float* vr = v.data() + (static_cast<size_t>(j) * n + cols[x]) * d;
        for (int32_t e = 0; e < d; ++e) acc[e] += w * vr[e];
      }
      const size_t o = (static_cast<size_t>(h) * n + r) * d;
      for (int32_t e = 0; e < d; ++e) {
        StoreFromFloat(p.out, o + e, p.dtype, den > 0.0 ? static_cast<float>(acc[e] / den) : 0.f);
      }
    }
  }
  return absl::OkStatus();
}

std::vector<double> SaleHeadL1Error(const SalePrefill& p, absl::Span<const float> a,
                                    absl::Span<const float> b) {
  const size_t per_head = static_cast<size_t>(p.tokens) * p.head_dim;
  std::vector<double> err(p.num_q_heads, 0.0);
  for (int32_t h = 0; h < p.num_q_heads; ++h) {
    double sum = 0.0;
    for (size_t i = h * per_head; i < (h + 1) * per_head; ++i) sum += std::fabs(a[i] - b[i]);
    err[h] = p.tokens > 0 ? sum / p.tokens : 0.0;
  }
  return err;
}

absl::StatusOr<SaleCalibration> SaleHalvingSearch(int32_t num_q_heads, double theta, float tau0,
                                                  int32_t max_halvings, SaleRoundFn round) {
  if (!(theta >= 0.0) || !(tau0 > 0.f && tau0 < 1.f) || max_halvings < 0) {
    return absl::InvalidArgumentError("theta >= 0, tau0 in (0, 1) and max_halvings >= 0");
  }
  const int32_t H = num_q_heads;
  SaleCalibration cal;
  cal.tau.assign(H, tau0);
  cal.error.assign(H, 0.0);
  cal.sparsity.assign(H, 0.0);
  cal.halvings.assign(H, 0);
  std::vector<bool> done(H, false);
  for (int32_t r = 0; r <= max_halvings + 1; ++r) {
    absl::StatusOr<SaleRound> m = round(cal.tau);
    if (!m.ok()) return m.status();
    if (static_cast<int32_t>(m->error.size()) != H ||
        static_cast<int32_t>(m->skipped.size()) != H) {
      return absl::InternalError("a calibration round measured another number of heads");
    }
    bool all = true;
    for (int32_t h = 0; h < H; ++h) {
      if (done[h]) continue;
      cal.error[h] = m->error[h];
      cal.sparsity[h] = m->skipped[h];
      if (m->error[h] <= theta || cal.tau[h] == 0.f) {
        done[h] = true;
        continue;
      }
      all = false;
      if (cal.halvings[h] < max_halvings) {
        cal.tau[h] *= 0.5f;
        ++cal.halvings[h];
      } else {
        cal.tau[h] = 0.f;  // dense: no threshold met theta
      }
    }
    if (all) break;
  }
  return cal;
}

absl::StatusOr<SaleCalibration> SaleCalibrate(absl::Span<const SalePrefill> samples,
                                              const SaleParams& params, double theta, float tau0,
                                              int32_t max_halvings) {
  if (samples.empty()) return absl::InvalidArgumentError("calibration needs a sample");
  const int32_t H = samples[0].num_q_heads;
  for (const SalePrefill& p : samples) {
    if (p.num_q_heads != H || p.head_dim != samples[0].head_dim) {
      return absl::InvalidArgumentError("samples: every sample needs the same heads and head_dim");
    }
  }
  auto outputs = [](const SalePrefill& p) {
    const size_t count = static_cast<size_t>(p.num_q_heads) * p.tokens * p.head_dim;
    std::vector<float> out(count);
    for (size_t i = 0; i < count; ++i) out[i] = LoadAsFloat(p.out, i, p.dtype);
    return out;
  };
  std::vector<std::vector<float>> dense;  // per sample, computed in the first round
  auto round = [&](absl::Span<const float> tau) -> absl::StatusOr<SaleRound> {
    if (dense.empty()) {
      for (const SalePrefill& p : samples) {
        if (absl::Status s = SaleAttend(p, params, SaleFullMask(p, params)); !s.ok()) return s;
        dense.push_back(outputs(p));
      }
    }
    SaleRound m{std::vector<double>(H, 0.0), std::vector<double>(H, 0.0)};
    for (size_t x = 0; x < samples.size(); ++x) {
      const SalePrefill& p = samples[x];
      SaleMask mask;
      if (absl::Status s = SaleSelect(p, params, tau, &mask); !s.ok()) return s;
      if (absl::Status s = SaleAttend(p, params, mask); !s.ok()) return s;
      const std::vector<double> e = SaleHeadL1Error(p, outputs(p), dense[x]);
      for (int32_t h = 0; h < H; ++h) {
        m.error[h] = std::max(m.error[h], e[h]);
        const double causal = static_cast<double>(mask.causal_blocks[h]);
        m.skipped[h] += (causal > 0 ? 1.0 - mask.selected_blocks[h] / causal : 0.0) /
                        static_cast<double>(samples.size());
      }
    }
    return m;
  };
  return SaleHalvingSearch(H, theta, tau0, max_halvings, round);
}

}  // namespace kvsparse::kernels
