#include "kernels/saap.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "kernels/binary_io.h"
#include "kernels/cpu_util.h"
#include "kernels/reasons.h"

namespace kvsparse::kernels {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'S', 'P', 'S', 'A', 'A', 'P'};
constexpr uint32_t kVersion = 1;

size_t PerLayerHeads(const SaapWeights& w, int32_t heads) {
  return static_cast<size_t>(w.num_layers) * heads;
}

}  // namespace

absl::Status ValidateSaapWeights(const SaapWeights& w) {
  if (w.num_layers < 1 || w.num_q_heads < 1 || w.num_kv_heads < 1) {
    return absl::InvalidArgumentError("saap: num_layers, num_q_heads, num_kv_heads must be >= 1");
  }
  if (w.num_q_heads % w.num_kv_heads != 0) {
    return absl::InvalidArgumentError("saap: num_kv_heads must divide num_q_heads");
  }
  if (w.head_dim < 2 || w.head_dim > 1024 || w.head_dim % 2 != 0) {
    return absl::InvalidArgumentError("saap: head_dim must be even, in [2, 1024]");
  }
  if (w.clusters < 2 || w.clusters > 65536) {
    return absl::InvalidArgumentError("saap: clusters must be in [2, 65536]");
  }
  if (w.hidden < 1 || w.hidden > 65536) {
    return absl::InvalidArgumentError("saap: hidden must be in [1, 65536]");
  }
  if (!(w.rope_scale > 0.f) || !std::isfinite(w.rope_scale)) {
    return absl::InvalidArgumentError("saap: rope_scale must be positive");
  }
  const size_t d = w.head_dim, c = w.clusters, hid = w.hidden;
  const size_t lk = PerLayerHeads(w, w.num_kv_heads), lq = PerLayerHeads(w, w.num_q_heads);
  if (w.inv_freq.size() != d / 2 || w.centroids.size() != lk * c * d ||
      w.w1.size() != lq * hid * d || w.b1.size() != lq * hid || w.w2.size() != lq * c * hid ||
      w.b2.size() != lq * c) {
    return absl::InvalidArgumentError("saap: an array's size does not match the header");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SerializeSaapWeights(const SaapWeights& w) {
  if (absl::Status s = ValidateSaapWeights(w); !s.ok()) return s;
  std::string out(kMagic, 8);
  for (uint32_t v :
       {kVersion, static_cast<uint32_t>(w.num_layers), static_cast<uint32_t>(w.num_q_heads),
        static_cast<uint32_t>(w.num_kv_heads), static_cast<uint32_t>(w.head_dim),
        static_cast<uint32_t>(w.clusters), static_cast<uint32_t>(w.hidden)}) {
    PutU32(&out, v);
  }
  PutF32(&out, w.rope_scale);
  for (const std::vector<float>* a : {&w.inv_freq, &w.centroids}) {
    for (float f : *a) PutF32(&out, f);
  }
  const size_t hid = w.hidden, d = w.head_dim, c = w.clusters;
  for (size_t i = 0; i < PerLayerHeads(w, w.num_q_heads); ++i) {
    for (size_t x = 0; x < hid * d; ++x) PutF32(&out, w.w1[i * hid * d + x]);
    for (size_t x = 0; x < hid; ++x) PutF32(&out, w.b1[i * hid + x]);
    for (size_t x = 0; x < c * hid; ++x) PutF32(&out, w.w2[i * c * hid + x]);
    for (size_t x = 0; x < c; ++x) PutF32(&out, w.b2[i * c + x]);
  }
  return out;
}

absl::StatusOr<SaapWeights> ParseSaapWeights(std::string_view bytes) {
  ByteReader r(bytes);
  char magic[8];
  if (!r.Bytes(magic, 8) || std::memcmp(magic, kMagic, 8) != 0) {
    return absl::InvalidArgumentError("saap partitions: bad magic (want \"KVSPSAAP\")");
  }
  uint32_t h[7];
  for (uint32_t& x : h) {
    if (!r.U32(&x)) return absl::InvalidArgumentError("saap partitions: truncated header");
  }
  if (h[0] != kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("saap partitions: unsupported version ", h[0]));
  }
  SaapWeights w;
  w.num_layers = static_cast<int32_t>(std::min<uint32_t>(h[1], 1u << 20));
  w.num_q_heads = static_cast<int32_t>(std::min<uint32_t>(h[2], 1u << 20));
  w.num_kv_heads = static_cast<int32_t>(std::min<uint32_t>(h[3], 1u << 20));
  w.head_dim = static_cast<int32_t>(std::min<uint32_t>(h[4], 1u << 20));
  w.clusters = static_cast<int32_t>(std::min<uint32_t>(h[5], 1u << 20));
  w.hidden = static_cast<int32_t>(std::min<uint32_t>(h[6], 1u << 20));
  if (w.num_layers > 4096 || w.num_q_heads > 4096 || w.num_kv_heads > 4096) {
    return absl::InvalidArgumentError("saap partitions: header counts out of range");
  }
  if (!r.F32s(&w.rope_scale, 1)) return absl::InvalidArgumentError("saap partitions: truncated");
  // Sizes from the header, checked against the payload before anything is allocated.
  if (w.head_dim < 2 || w.head_dim > 1024 || w.head_dim % 2 != 0 || w.clusters < 2 ||
      w.clusters > 65536 || w.hidden < 1 || w.hidden > 65536) {
    return absl::InvalidArgumentError("saap partitions: head_dim, clusters or hidden out of range");
  }
  const uint64_t d = w.head_dim, c = w.clusters, hid = w.hidden;
  const uint64_t lk = PerLayerHeads(w, w.num_kv_heads), lq = PerLayerHeads(w, w.num_q_heads);
  const uint64_t floats = d / 2 + lk * c * d + lq * (hid * d + hid + c * hid + c);
  if (r.remaining() != floats * 4) {
    return absl::InvalidArgumentError(absl::StrCat("saap partitions: payload is ", r.remaining(),
                                                   " bytes, header implies ", floats * 4));
  }
  w.inv_freq.resize(d / 2);
  w.centroids.resize(lk * c * d);
  w.w1.resize(lq * hid * d);
  w.b1.resize(lq * hid);
  w.w2.resize(lq * c * hid);
  w.b2.resize(lq * c);
  r.F32s(w.inv_freq.data(), w.inv_freq.size());
  r.F32s(w.centroids.data(), w.centroids.size());
  for (uint64_t i = 0; i < lq; ++i) {
    r.F32s(&w.w1[i * hid * d], hid * d);
    r.F32s(&w.b1[i * hid], hid);
    r.F32s(&w.w2[i * c * hid], c * hid);
    r.F32s(&w.b2[i * c], c);
  }
  if (absl::Status s = ValidateSaapWeights(w); !s.ok()) return s;
  return w;
}

absl::Status WriteSaapWeights(const SaapWeights& w, const std::string& path) {
  absl::StatusOr<std::string> bytes = SerializeSaapWeights(w);
  if (!bytes.ok()) return bytes.status();
  return WriteWholeFile(path, *bytes);
}

absl::StatusOr<SaapWeights> ReadSaapWeights(const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadWholeFile(path);
  if (!bytes.ok()) return bytes.status();
  return ParseSaapWeights(*bytes);
}

void SaapUnrope(const SaapWeights& w, int64_t position, const float* x, float* out) {
  const int32_t half = w.head_dim / 2;
  const float inv_s = 1.f / w.rope_scale;
  for (int32_t i = 0; i < half; ++i) {
    const double a = static_cast<double>(position) * w.inv_freq[i];
    const float c = static_cast<float>(std::cos(a)), s = static_cast<float>(std::sin(a));
    const float y1 = x[i], y2 = x[i + half];
    out[i] = (y1 * c + y2 * s) * inv_s;
    out[i + half] = (y2 * c - y1 * s) * inv_s;
  }
}

int32_t SaapAssignKey(const SaapWeights& w, int32_t layer, int32_t kv_head, int64_t position,
                      const float* k, std::vector<float>* scratch) {
  scratch->resize(w.head_dim);
  float* x = scratch->data();
  SaapUnrope(w, position, k, x);
  int32_t best = 0;
  float best_dot = -INFINITY;
  for (int32_t c = 0; c < w.clusters; ++c) {
    const float* ce = w.centroid(layer, kv_head, c);
    float dot = 0.f;
    for (int32_t i = 0; i < w.head_dim; ++i) dot += ce[i] * x[i];
    if (dot > best_dot) {  // strict: ties to the lower index
      best_dot = dot;
      best = c;
    }
  }
  return best;
}

void SaapQueryProbs(const SaapWeights& w, int32_t layer, int32_t h, int64_t position,
                    const float* q, float* probs, std::vector<float>* scratch) {
  const size_t d = w.head_dim, hid = w.hidden, c = w.clusters;
  scratch->resize(d + hid);
  float* x = scratch->data();
  float* hidden = x + d;
  SaapUnrope(w, position, q, x);
  const size_t head = static_cast<size_t>(layer) * w.num_q_heads + h;
  const float* w1 = &w.w1[head * hid * d];
  const float* b1 = &w.b1[head * hid];
  const float* w2 = &w.w2[head * c * hid];
  const float* b2 = &w.b2[head * c];
  for (size_t o = 0; o < hid; ++o) {
    float z = 0.f;
    for (size_t i = 0; i < d; ++i) z += w1[o * d + i] * x[i];
    hidden[o] = std::max(0.f, z + b1[o]);
  }
  float mx = -INFINITY;
  for (size_t o = 0; o < c; ++o) {
    float z = 0.f;
    for (size_t i = 0; i < hid; ++i) z += w2[o * hid + i] * hidden[i];
    probs[o] = z + b2[o];
    mx = std::max(mx, probs[o]);
  }
  double sum = 0;
  for (size_t o = 0; o < c; ++o) sum += probs[o] = std::exp(probs[o] - mx);
  for (size_t o = 0; o < c; ++o) probs[o] = static_cast<float>(probs[o] / sum);
}

absl::Status ValidateSaapParams(const SaapParams& params, const SaapWeights& w) {
  Reasons reasons;
  reasons.AddIf(params.probes < 1 || params.probes > w.clusters, "probes must be in [1, ",
                w.clusters, "] (the partition's buckets), got ", params.probes);
  reasons.AddIf(params.sink_tokens < 0, "sink_tokens ", params.sink_tokens, " < 0");
  reasons.AddIf(params.local_tokens < 0, "local_tokens ", params.local_tokens, " < 0");
  return reasons.ToStatus();
}

absl::Status ComputeSaapBuckets(const DecodeProblem& p, const SaapWeights& w, int32_t layer,
                                std::vector<int32_t>* out, SaapBuckets* view) {
  if (absl::Status s = ValidateProblemFor(p, ProblemNeeds{false, true, false, false}); !s.ok()) {
    return s;
  }
  if (p.head_dim != w.head_dim || p.num_kv_heads != w.num_kv_heads || layer < 0 ||
      layer >= w.num_layers) {
    return absl::InvalidArgumentError("saap: the partitions do not fit the problem or layer");
  }
  int32_t n_max = 0;
  for (int32_t b = 0; b < p.batch; ++b) n_max = std::max(n_max, p.seq_lens[b]);
  out->assign(static_cast<size_t>(p.batch) * p.num_kv_heads * n_max, 0);
  *view = SaapBuckets{out->data(), static_cast<int64_t>(p.num_kv_heads) * n_max, n_max};
  std::vector<float> k(p.head_dim), scratch;
  for (int32_t b = 0; b < p.batch; ++b) {
    for (int32_t j = 0; j < p.num_kv_heads; ++j) {
      for (int32_t t = 0; t < p.seq_lens[b]; ++t) {
        LoadRowAsFloat(p.k, KvRowOffset(p, b, j, t), p.head_dim, p.dtype, k.data());
        (*out)[b * view->batch_stride + j * view->head_stride + t] =
            SaapAssignKey(w, layer, j, t, k.data(), &scratch);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status SaapSelectCpu(const DecodeProblem& p, const SaapParams& params, const SaapWeights& w,
                           int32_t layer, const SaapBuckets& buckets, RowSelection* sel) {
  if (absl::Status s = ValidateSaapParams(params, w); !s.ok()) return s;
  if (absl::Status s = ValidateProblemFor(p, ProblemNeeds{true, false, false, false}); !s.ok()) {
    return s;
  }
  if (p.head_dim != w.head_dim || p.num_q_heads != w.num_q_heads ||
      p.num_kv_heads != w.num_kv_heads || layer < 0 || layer >= w.num_layers) {
    return absl::InvalidArgumentError("saap: the partitions do not fit the problem or layer");
  }
  if (buckets.buckets == nullptr && p.batch > 0) {
    return absl::InvalidArgumentError("saap: key buckets are null");
  }
  const int32_t group = p.group_size(), c = w.clusters;
  sel->Reset(EstimateKind::kSoftmax, p.batch, p.num_kv_heads, group);
  std::vector<float> q(p.head_dim), probs(c), scratch;
  std::vector<double> mass(c);
  std::vector<int32_t> order(c);
  std::vector<char> visit(c);
  for (int32_t b = 0; b < p.batch; ++b) {
    const int32_t n = p.seq_lens[b];
    const int64_t position = std::max(0, n - 1);
    for (int32_t j = 0; j < p.num_kv_heads; ++j) {
      std::fill(mass.begin(), mass.end(), 0.0);
      for (int32_t g = 0; g < group; ++g) {
        LoadQuery(p, b, j * group + g, q.data());
        SaapQueryProbs(w, layer, j * group + g, position, q.data(), probs.data(), &scratch);
        for (int32_t x = 0; x < c; ++x) mass[x] += probs[x];
      }
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + params.probes, order.end(),
                        [&](int32_t a, int32_t bb) {
                          return mass[a] > mass[bb] || (mass[a] == mass[bb] && a < bb);
                        });
      std::fill(visit.begin(), visit.end(), 0);
      for (int32_t i = 0; i < params.probes; ++i) visit[order[i]] = 1;
      KvHeadSelection& ks = sel->at(b, j);
      const int32_t sink_end = std::min(params.sink_tokens, n);
      const int32_t win_begin = std::max(sink_end, n - params.local_tokens);
      const int32_t* kb = buckets.buckets + b * buckets.batch_stride + j * buckets.head_stride;
      int64_t from_buckets = 0;
      for (int32_t t = 0; t < n; ++t) {
        const bool fixed = t < sink_end || t >= win_begin;
        if (!fixed && !visit[kb[t]]) continue;
        from_buckets += !fixed;
        ks.tokens.push_back(t);
        ks.counts.push_back(group);
      }
      const size_t rows = ks.tokens.size();
      ks.head_counts.assign(static_cast<size_t>(group) * rows, 1);
      ks.weights.assign(static_cast<size_t>(group) * rows, 1.f);
      ks.budgets.assign(group, from_buckets);
    }
  }
  return absl::OkStatus();
}

absl::Status SaapDecodeCpu(const DecodeProblem& p, const SaapParams& params, const SaapWeights& w,
                           int32_t layer, const SaapBuckets& buckets, RowSelection* sel) {
  RowSelection local;
  RowSelection* s = sel != nullptr ? sel : &local;
  if (absl::Status st = SaapSelectCpu(p, params, w, layer, buckets, s); !st.ok()) return st;
  return EstimateInPlace(p, *s);
}

}  // namespace kvsparse::kernels
