#include "kernels/synthetic.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "kernels/cpu_util.h"

namespace kvsparse::kernels {

int StatisticalRepeats(int n) {
  const char* env = std::getenv("KVSPARSE_TEST_REPEAT_DIVISOR");
  const int divisor = env != nullptr ? std::max(1, std::atoi(env)) : 1;
  return std::max(std::min(n, 2), n / divisor);
}

double BinomialUpperTail(int k, int n, double p) {
  if (k <= 0) return 1.0;
  double sum = 0;
  for (int i = k; i <= n; ++i) {
    sum += std::exp(std::lgamma(n + 1.0) - std::lgamma(i + 1.0) - std::lgamma(n - i + 1.0) +
                    i * std::log(p) + (n - i) * std::log1p(-p));
  }
  return std::min(1.0, sum);
}

const char* ScoreFamilyName(ScoreFamily f) {
  switch (f) {
    case ScoreFamily::kNearUniform:
      return "near_uniform";
    case ScoreFamily::kPeaked:
      return "peaked";
    case ScoreFamily::kZipf:
      return "zipf";
  }
  return "?";
}

std::vector<float> MakeScores(ScoreFamily family, int32_t n, uint64_t seed) {
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + 17);
  std::vector<float> s(n);
  std::normal_distribution<float> normal(0.f, 1.f);
  switch (family) {
    case ScoreFamily::kNearUniform:
      for (float& x : s) x = 0.5f * normal(rng);
      break;
    case ScoreFamily::kPeaked: {
      for (float& x : s) x = normal(rng);
      const float sinks[4] = {9.f, 7.f, 6.f, 5.f};
      for (int i = 0; i < 4 && i < n; ++i) s[i] = sinks[i];
      for (int32_t i = std::max(4, n - 64); i < n; ++i) s[i] = 4.f + normal(rng);
      if (n > 80) {
        std::uniform_int_distribution<int32_t> pos(4, n - 65);
        for (int i = 0; i < 8; ++i) s[pos(rng)] = 8.f;
      }
      break;
    }
    case ScoreFamily::kZipf: {
      std::vector<int32_t> rank(n);
      std::iota(rank.begin(), rank.end(), 0);
      std::shuffle(rank.begin(), rank.end(), rng);
      for (int32_t i = 0; i < n; ++i) s[i] = -std::log(static_cast<float>(rank[i] + 1));
      break;
    }
  }
  return s;
}

SyntheticProblem& SyntheticProblem::operator=(SyntheticProblem&& o) noexcept {
  q = std::move(o.q);
  k = std::move(o.k);
  v = std::move(o.v);
  out = std::move(o.out);
  seq_lens = std::move(o.seq_lens);
  problem = o.problem;
  problem.q = q.data();
  problem.k = k.data();
  problem.v = v.data();
  problem.out = out.data();
  problem.seq_lens = seq_lens.data();
  return *this;
}

namespace {

// Points sp->problem at sp's buffers with this shape and layout (scale 1/sqrt(d)).
void Bind(SyntheticProblem* sp, int32_t batch, int32_t q_heads, int32_t kv_heads, int32_t d,
          DType dtype, KvLayout layout) {
  DecodeProblem& p = sp->problem;
  p.batch = batch;
  p.num_q_heads = q_heads;
  p.num_kv_heads = kv_heads;
  p.head_dim = d;
  p.dtype = dtype;
  p.kv_layout = layout;
  p.scale = 1.f / std::sqrt(static_cast<float>(d));
  p.q = sp->q.data();
  p.k = sp->k.data();
  p.v = sp->v.data();
  p.out = sp->out.data();
  p.seq_lens = sp->seq_lens.data();
}

}  // namespace

std::vector<uint8_t> SyntheticProblem::LayerRows(const std::vector<uint8_t>& kv, int32_t b,
                                                 uint32_t layers) const {
  const size_t es = DTypeSize(problem.dtype);
  const size_t bytes =
      static_cast<size_t>(seq_lens[b]) * problem.num_kv_heads * problem.head_dim * es;
  const uint8_t* first = kv.data() + b * problem.kv_layout.batch_stride * es;
  std::vector<uint8_t> out(layers * bytes);
  for (uint32_t l = 0; l < layers; ++l) std::memcpy(out.data() + l * bytes, first, bytes);
  return out;
}

SyntheticProblem SyntheticProblem::Make(const SyntheticOptions& o) {
  SyntheticProblem sp;
  const int d = o.head_dim;
  const int32_t hkv = o.num_kv_heads;
  const int32_t group = o.num_q_heads / o.num_kv_heads;
  const int32_t n_max =
      o.seq_lens.empty() ? 0 : *std::max_element(o.seq_lens.begin(), o.seq_lens.end());
  const size_t es = DTypeSize(o.dtype);
  sp.seq_lens = o.seq_lens;
  sp.q.assign(static_cast<size_t>(o.batch) * o.num_q_heads * d * es, 0);
  sp.k.assign(static_cast<size_t>(o.batch) * n_max * hkv * d * es, 0);
  sp.v.assign(sp.k.size(), 0);
  sp.out.assign(sp.q.size(), 0);
  DecodeProblem& p = sp.problem;
  Bind(&sp, o.batch, o.num_q_heads, hkv, d, o.dtype,
       {static_cast<int64_t>(n_max) * hkv * d, d, static_cast<int64_t>(hkv) * d});

  std::mt19937_64 rng(o.seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> qa(d), eta(d), mean(d), row(d);
  for (int32_t b = 0; b < o.batch; ++b) {
    const int32_t n = o.seq_lens[b];
    for (int32_t j = 0; j < hkv; ++j) {
      // Anchor query, |q_a| ~ sqrt(d).
      double qn2 = 0;
      for (int i = 0; i < d; ++i) {
        qa[i] = normal(rng);
        qn2 += double{qa[i]} * qa[i];
      }
      const float qn = static_cast<float>(std::sqrt(qn2));
      for (int32_t g = 0; g < group; ++g) {
        double en2 = 0;
        for (int i = 0; i < d; ++i) {
          eta[i] = normal(rng);
          en2 += double{eta[i]} * eta[i];
        }
        const float c = g == 0 ? 0.f : o.head_noise * qn / static_cast<float>(std::sqrt(en2));
        const int64_t off = (static_cast<int64_t>(b) * o.num_q_heads + j * group + g) * d;
        for (int i = 0; i < d; ++i)
          StoreFromFloat(sp.q.data(), off + i, o.dtype, qa[i] + c * eta[i]);
      }
      for (int i = 0; i < d; ++i) mean[i] = o.v_mean * normal(rng);
      const std::vector<float> s = MakeScores(o.family, n, rng());
      for (int32_t t = 0; t < n; ++t) {
        // eta orthogonal to q_a, then the component along q_a that gives logit s[t].
        double dot = 0;
        for (int i = 0; i < d; ++i) {
          eta[i] = normal(rng);
          dot += double{eta[i]} * qa[i];
        }
        const float a = static_cast<float>(s[t] / (p.scale * qn));
        const int64_t off =
            (static_cast<int64_t>(b) * n_max + t) * hkv * d + static_cast<int64_t>(j) * d;
        for (int i = 0; i < d; ++i) {
          const float along = static_cast<float>(a - dot / qn) * qa[i] / qn;
          StoreFromFloat(sp.k.data(), off + i, o.dtype, eta[i] + along);
          StoreFromFloat(sp.v.data(), off + i, o.dtype, mean[i] + normal(rng));
        }
      }
    }
  }
  return sp;
}

std::vector<double> OutputAsDouble(const DecodeProblem& p) {
  std::vector<double> r(static_cast<size_t>(p.batch) * p.num_q_heads * p.head_dim);
  for (size_t i = 0; i < r.size(); ++i) r[i] = LoadAsFloat(p.out, i, p.dtype);
  return r;
}

double RelativeL2(const std::vector<double>& ref, const std::vector<double>& got) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size() && i < got.size(); ++i) {
    num += (ref[i] - got[i]) * (ref[i] - got[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

SaapWeights RandomSaapWeights(int32_t layers, int32_t q_heads, int32_t kv_heads, int32_t head_dim,
                              int32_t clusters, int32_t hidden, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  SaapWeights w;
  w.num_layers = layers;
  w.num_q_heads = q_heads;
  w.num_kv_heads = kv_heads;
  w.head_dim = head_dim;
  w.clusters = clusters;
  w.hidden = hidden;
  w.rope_scale = 1.f;
  const size_t d = head_dim;
  for (size_t i = 0; i < d / 2; ++i) w.inv_freq.push_back(std::pow(10000.f, -2.f * i / d));
  w.centroids.resize(static_cast<size_t>(layers) * kv_heads * clusters * d);
  for (size_t r = 0; r < w.centroids.size() / d; ++r) {
    float n2 = 0.f;
    for (size_t i = 0; i < d; ++i) {
      const float x = normal(rng);
      w.centroids[r * d + i] = x;
      n2 += x * x;
    }
    for (size_t i = 0; i < d; ++i) w.centroids[r * d + i] /= std::sqrt(n2);
  }
  const size_t lq = static_cast<size_t>(layers) * q_heads;
  auto fill = [&](std::vector<float>* a, size_t n) {
    for (size_t i = 0; i < n; ++i) a->push_back(0.1f * normal(rng));
  };
  fill(&w.w1, lq * hidden * d);
  fill(&w.b1, lq * hidden);
  fill(&w.w2, lq * clusters * hidden);
  fill(&w.b2, lq * clusters);
  return w;
}

std::vector<CompressedKeys> CompressProblemKeys(const DecodeProblem& p, int32_t bits) {
  std::vector<CompressedKeys> out;
  const size_t es = DTypeSize(p.dtype);
  for (int32_t b = 0; b < p.batch; ++b) {
    for (int32_t j = 0; j < p.num_kv_heads; ++j) {
      out.emplace_back(KeyCompression{bits, kKeyGroupTokens}, p.head_dim, p.dtype);
      for (int32_t t = 0; t < p.seq_lens[b]; ++t) {
        out.back().Append(static_cast<const uint8_t*>(p.k) + KvRowOffset(p, b, j, t) * es);
      }
    }
  }
  return out;
}

std::vector<CompressedKeysView> ViewsOf(const std::vector<CompressedKeys>& keys) {
  std::vector<CompressedKeysView> v;
  for (const CompressedKeys& x : keys) v.push_back(x.view());
  return v;
}

const char* AdversarialKeysName(AdversarialKeys family) {
  return family == AdversarialKeys::kHiddenNeedle ? "hidden_needle" : "range_stretcher";
}

std::vector<float> AdversarialHead::Scores() const {
  std::vector<float> s(n);
  for (int32_t t = 0; t < n; ++t) {
    float acc = 0.f;
    for (int32_t c = 0; c < d; ++c) acc += q[c] * k[static_cast<size_t>(t) * d + c];
    s[t] = scale * acc;
  }
  return s;
}

namespace {

constexpr int32_t kAdvHigh = 8;  // channels [0, 8) of high magnitude; the rest low

// Moves token `needle`'s low channels inside its group's rounding bins toward the query's sign
// (module comment of AdversarialKeys::kHiddenNeedle).
void HideNeedle(AdversarialHead* a, int32_t bits) {
  const int32_t d = a->d, g0 = a->needle / kKeyGroupTokens * kKeyGroupTokens;
  CompressedKeys group({bits, kKeyGroupTokens}, d, DType::kFp32);
  for (int32_t t = g0; t < g0 + kKeyGroupTokens; ++t)
    group.Append(&a->k[static_cast<size_t>(t) * d]);
  const CompressedKeysView view = group.view();
  const int32_t top = (1 << bits) - 1;
  float* needle = &a->k[static_cast<size_t>(a->needle) * d];
  const float* neighbour = needle - d;
  for (int32_t c = kAdvHigh; c < d; ++c) {
    const float lo = Fp16ToFloat(Fp16{view.lo(0)[c]}), step = Fp16ToFloat(Fp16{view.step(0)[c]});
    float mn = lo, mx = lo;
    for (int32_t t = g0; t < g0 + kKeyGroupTokens; ++t) {
      mn = std::min(mn, a->k[static_cast<size_t>(t) * d + c]);
      mx = std::max(mx, a->k[static_cast<size_t>(t) * d + c]);
    }
    const float code =
        std::clamp(std::nearbyint((neighbour[c] - lo) / step), 0.f, static_cast<float>(top));
    const float moved = lo + step * code + (a->q[c] > 0 ? 0.45f : -0.45f) * step;
    needle[c] = std::clamp(moved, mn, mx);
  }
}

}  // namespace

AdversarialHead MakeAdversarialHead(AdversarialKeys family, int32_t n, int32_t bits,
                                    uint64_t seed) {
  AdversarialHead a;
  a.n = n;
  a.d = 64;
  a.dv = 32;
  a.scale = 0.125f;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  a.q.resize(a.d);
  for (int32_t c = 0; c < a.d; ++c) {
    const float sign = rng() & 1 ? 1.f : -1.f;
    a.q[c] = sign * (c < kAdvHigh ? 0.5f : 9.f);  // logits ~ N(0, 2.2^2)
  }
  a.k.resize(static_cast<size_t>(n) * a.d);
  for (int32_t t = 0; t < n; ++t) {
    for (int32_t c = 0; c < a.d; ++c) {
      a.k[static_cast<size_t>(t) * a.d + c] = (c < kAdvHigh ? 2.f : 0.25f) * normal(rng);
    }
  }
  std::vector<float> mu(a.dv);
  for (float& m : mu) m = normal(rng);
  a.v.resize(static_cast<size_t>(n) * a.dv);
  for (size_t i = 0; i < a.v.size(); ++i) a.v[i] = mu[i % a.dv] + 0.5f * normal(rng);
  if (family == AdversarialKeys::kHiddenNeedle) {
    // Away from the sink and the window, not a group's first token (its neighbour shares its
    // group), and next to a token of ordinary logit (within half a standard deviation of 0), so
    // that no ranking by approximate score picks it: its moves inside the bins add about 5.8
    // standard deviations, enough for it to hold most of the attention.
    const int32_t groups = n / kKeyGroupTokens;
    const std::vector<float> s = a.Scores();
    do {
      const int32_t g = 1 + static_cast<int32_t>(rng() % static_cast<uint64_t>(groups - 2));
      a.needle = g * kKeyGroupTokens + 1 + static_cast<int32_t>(rng() % (kKeyGroupTokens - 1));
    } while (std::fabs(s[a.needle - 1]) > 1.1f);
    std::copy_n(&a.k[static_cast<size_t>(a.needle - 1) * a.d], a.d,
                &a.k[static_cast<size_t>(a.needle) * a.d]);
    HideNeedle(&a, bits);
    for (int32_t c = 0; c < a.dv; ++c) a.v[static_cast<size_t>(a.needle) * a.dv + c] -= 2.f * mu[c];
  } else {
    for (int32_t g0 = 0; g0 < n; g0 += kKeyGroupTokens) {
      float* delim = &a.k[static_cast<size_t>(g0 + 5) * a.d];
      for (int32_t c = kAdvHigh; c < a.d; ++c) delim[c] = (a.q[c] > 0 ? -12.f : 12.f) * 0.25f;
    }
  }
  return a;
}

std::vector<float> RealAttention::Scores(int32_t i, int32_t g) const {
  const int32_t keys = Keys(i);
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const float* qi = q.data() + (static_cast<size_t>(i) * group + g) * d;
  std::vector<float> s(keys);
  for (int32_t t = 0; t < keys; ++t) {
    double dot = 0;
    for (int32_t a = 0; a < d; ++a) dot += double{qi[a]} * k[static_cast<size_t>(t) * d + a];
    s[t] = static_cast<float>(dot) * scale;
  }
  return s;
}

std::string RealAttentionPath(int32_t layer) {
  return absl::StrCat(KVSPARSE_REAL_ATTENTION_DIR, "/realattn-n8192-L", layer, "-kv0.bin");
}

absl::StatusOr<RealAttention> LoadRealAttention(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  char magic[8];
  uint32_t h[6];
  f.read(magic, 8);
  f.read(reinterpret_cast<char*>(h), sizeof(h));
  if (!f || std::string(magic, 8) != "KVSPQKV1") {
    return absl::DataLossError(absl::StrCat(path, ": not a KVSPQKV1 file"));
  }
  RealAttention r;
  r.n = static_cast<int32_t>(h[0]);
  r.d = static_cast<int32_t>(h[1]);
  r.group = static_cast<int32_t>(h[2]);
  r.queries = static_cast<int32_t>(h[3]);
  r.layer = static_cast<int32_t>(h[4]);
  r.kv_head = static_cast<int32_t>(h[5]);
  if (r.n <= 0 || r.n > (1 << 22) || r.d <= 0 || r.d > 1024 || r.group <= 0 || r.group > 64 ||
      r.queries <= 0 || r.queries > r.n) {
    return absl::DataLossError(absl::StrCat(path, ": bad header"));
  }
  auto read = [&](size_t count, std::vector<float>* out) {
    std::vector<uint16_t> bits(count);
    f.read(reinterpret_cast<char*>(bits.data()), static_cast<std::streamsize>(count * 2));
    out->resize(count);
    for (size_t i = 0; i < count; ++i) (*out)[i] = LoadAsFloat(bits.data(), i, DType::kBf16);
  };
  read(static_cast<size_t>(r.queries) * r.group * r.d, &r.q);
  read(static_cast<size_t>(r.n) * r.d, &r.k);
  read(static_cast<size_t>(r.n) * r.d, &r.v);
  if (!f || f.peek() != std::char_traits<char>::eof()) {
    return absl::DataLossError(absl::StrCat(path, ": truncated or trailing bytes"));
  }
  return r;
}

SyntheticProblem RealAttentionProblem(const RealAttention& r, DType dtype) {
  SyntheticProblem sp;
  const int32_t d = r.d, B = r.queries;
  const size_t es = DTypeSize(dtype);
  sp.seq_lens.resize(B);
  for (int32_t i = 0; i < B; ++i) sp.seq_lens[i] = r.Keys(i);
  sp.q.resize(r.q.size() * es);
  sp.k.resize(r.k.size() * es);
  sp.v.resize(r.v.size() * es);
  sp.out.assign(sp.q.size(), 0);
  for (size_t i = 0; i < r.q.size(); ++i) StoreFromFloat(sp.q.data(), i, dtype, r.q[i]);
  for (size_t i = 0; i < r.k.size(); ++i) StoreFromFloat(sp.k.data(), i, dtype, r.k[i]);
  for (size_t i = 0; i < r.v.size(); ++i) StoreFromFloat(sp.v.data(), i, dtype, r.v[i]);
  Bind(&sp, B, r.group, 1, d, dtype, {0, 0, d});  // every sequence reads the same rows
  return sp;
}

}  // namespace kvsparse::kernels
