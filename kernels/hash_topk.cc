#include "kernels/hash_topk.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/cpu_util.h"
#include "kernels/reasons.h"

namespace kvsparse::kernels {

absl::StatusOr<int32_t> ResolveTopK(const FixedSet& f, int32_t n) {
  if (f.top_k < 0) return absl::InvalidArgumentError(absl::StrCat("top_k ", f.top_k, " < 0"));
  if (f.top_k > 0) return std::min(f.top_k, n);  // a short sequence reads what it has
  if (!(f.top_k_fraction >= 0.f && f.top_k_fraction <= 1.f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_k_fraction must be in [0, 1], got ", f.top_k_fraction));
  }
  return static_cast<int32_t>(FixedSetK(f, n));
}

template <typename T>
int32_t SelectSinkLocalTopK(const T* scores, int32_t n, int32_t sink, int32_t local, int32_t k,
                            std::vector<int32_t>* out, std::vector<int32_t>* scratch) {
  out->clear();
  const int32_t s_end = std::min(std::max(sink, 0), n);
  const int32_t w_begin = std::max(s_end, n - std::max(local, 0));
  // rest = [s_end, w_begin)
  scratch->clear();
  for (int32_t t = s_end; t < w_begin; ++t) scratch->push_back(t);
  const int32_t chosen = SinkLocalTopKRest(n, s_end, w_begin, k);
  auto better = [&](int32_t a, int32_t b) {
    return scores[a] != scores[b] ? scores[a] > scores[b] : a < b;
  };
  if (chosen > 0 && chosen < static_cast<int32_t>(scratch->size())) {
    std::nth_element(scratch->begin(), scratch->begin() + (chosen - 1), scratch->end(), better);
  }
  scratch->resize(chosen);
  std::sort(scratch->begin(), scratch->end());
  for (int32_t t = 0; t < s_end; ++t) out->push_back(t);
  out->insert(out->end(), scratch->begin(), scratch->end());
  for (int32_t t = w_begin; t < n; ++t) out->push_back(t);
  return chosen;
}

template int32_t SelectSinkLocalTopK<int32_t>(const int32_t*, int32_t, int32_t, int32_t, int32_t,
                                              std::vector<int32_t>*, std::vector<int32_t>*);
template int32_t SelectSinkLocalTopK<float>(const float*, int32_t, int32_t, int32_t, int32_t,
                                            std::vector<int32_t>*, std::vector<int32_t>*);

absl::Status ValidateFixedSet(const FixedSet& f) {
  Reasons reasons;
  reasons.AddIf(f.sink_tokens < 0, "sink_tokens ", f.sink_tokens, " < 0");
  reasons.AddIf(f.local_tokens < 0, "local_tokens ", f.local_tokens, " < 0");
  reasons.AddIf(f.top_k < 0, "top_k ", f.top_k, " < 0");
  reasons.AddIf(f.top_k == 0 && !(f.top_k_fraction >= 0.f && f.top_k_fraction <= 1.f),
                "top_k_fraction must be in [0, 1], got ", f.top_k_fraction);
  return reasons.ToStatus();
}

absl::Status ValidateHashTopKParams(const HashTopKParams& params) {
  Reasons reasons;
  reasons.Add(ValidateFixedSet(params.fixed));
  reasons.Add(ValidateSignatureBits(params.bits));
  return reasons.ToStatus();
}

namespace {

absl::Status CheckSignatureView(const DecodeProblem& p, const SignatureView& sigs,
                                int32_t want_bits) {
  if (sigs.bits != want_bits) {
    return absl::InvalidArgumentError(
        absl::StrCat("bits: params ask for ", want_bits, " but the signatures have ", sigs.bits));
  }
  if (sigs.key_heads != p.num_kv_heads && sigs.key_heads != p.num_q_heads) {
    return absl::InvalidArgumentError(
        absl::StrCat("signatures: key_heads ", sigs.key_heads, " must be Hkv or H"));
  }
  if (p.batch > 0 && (sigs.q == nullptr || sigs.k == nullptr)) {
    return absl::InvalidArgumentError("signatures: q and k must be non-null");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status HashTopKSelectCpu(const DecodeProblem& p, const HashTopKParams& params,
                               const SignatureView& sigs, RowSelection* sel) {
  if (absl::Status s = ValidateHashTopKParams(params); !s.ok()) return s;
  if (absl::Status s = ValidateProblemFor(p, ProblemNeeds{false, false, false, false}); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckSignatureView(p, sigs, params.bits); !s.ok()) return s;
  const int32_t group = p.group_size();
  const int32_t words = SignatureWords(params.bits);
  sel->Reset(EstimateKind::kSoftmax, p.batch, p.num_kv_heads, group);
  std::vector<int32_t> sim, chosen, scratch;
  std::vector<HeadRows> rows(group);
  for (int32_t b = 0; b < p.batch; ++b) {
    const int32_t n = p.seq_lens[b];
    absl::StatusOr<int32_t> k = ResolveTopK(params.fixed, n);
    if (!k.ok()) return k.status();
    sim.resize(n);
    for (int32_t kvh = 0; kvh < p.num_kv_heads; ++kvh) {
      for (int32_t g = 0; g < group; ++g) {
        const int32_t h = kvh * group + g;
        const int32_t j = sigs.key_heads == p.num_q_heads ? h : kvh;
        const uint32_t* qs = sigs.q + (static_cast<int64_t>(b) * p.num_q_heads + h) * words;
        const uint32_t* ks = sigs.k + b * sigs.batch_stride + j * sigs.head_stride;
        for (int32_t t = 0; t < n; ++t) {
          sim[t] = HammingSimilarity(qs, ks + t * sigs.token_stride, words);
        }
        HeadRows& r = rows[g];
        r.Clear();
        r.budget = SelectSinkLocalTopK(sim.data(), n, params.fixed.sink_tokens,
                                       params.fixed.local_tokens, *k, &chosen, &scratch);
        for (int32_t t : chosen) r.Push(t, 1, 1.f);
      }
      MergeGroup(rows, &sel->at(b, kvh));
    }
  }
  return absl::OkStatus();
}

absl::Status HashTopKDecodeCpu(const DecodeProblem& p, const HashTopKParams& params,
                               const SignatureView& sigs, RowSelection* sel) {
  RowSelection local;
  RowSelection* s = sel != nullptr ? sel : &local;
  if (absl::Status st = HashTopKSelectCpu(p, params, sigs, s); !st.ok()) return st;
  return EstimateInPlace(p, *s);
}

absl::Status ComputeSimHashSignatures(const DecodeProblem& p, const SimHashConfig& config,
                                      Signatures* out) {
  if (absl::Status s = ValidateProblemFor(p, ProblemNeeds{true, true, false, false}); !s.ok()) {
    return s;
  }
  if (absl::Status s = ValidateSignatureBits(config.bits); !s.ok()) return s;
  if (!config.max_key_norm.empty() &&
      config.max_key_norm.size() != static_cast<size_t>(p.num_kv_heads)) {
    return absl::InvalidArgumentError("max_key_norm must be empty or have Hkv entries");
  }
  const int32_t words = SignatureWords(config.bits);
  const int d = p.head_dim;
  const int32_t group = p.group_size();
  int32_t n_max = 0;
  for (int32_t b = 0; b < p.batch; ++b) n_max = std::max(n_max, p.seq_lens[b]);
  out->q.assign(static_cast<size_t>(p.batch) * p.num_q_heads * words, 0);
  out->k.assign(static_cast<size_t>(p.batch) * p.num_kv_heads * n_max * words, 0);
  out->view = SignatureView{config.bits,
                            out->q.data(),
                            out->k.data(),
                            static_cast<int64_t>(p.num_kv_heads) * n_max * words,
                            static_cast<int64_t>(n_max) * words,
                            words,
                            p.num_kv_heads};
  std::vector<float> row(d);
  SimHashPlanes planes;
  for (int32_t kvh = 0; kvh < p.num_kv_heads; ++kvh) {
    if (absl::Status s = MakeSimHashPlanes(config.seed, config.layer, kvh, config.bits, d, &planes);
        !s.ok()) {
      return s;
    }
    for (int32_t b = 0; b < p.batch; ++b) {
      const int32_t n = p.seq_lens[b];
      float m = 0.f;
      if (config.max_key_norm.empty()) {
        for (int32_t t = 0; t < n; ++t) {
          LoadRowAsFloat(p.k, KvRowOffset(p, b, kvh, t), d, p.dtype, row.data());
          float n2 = 0.f;
          for (int i = 0; i < d; ++i) n2 += row[i] * row[i];
          m = std::max(m, std::sqrt(n2));
        }
      } else {
        m = config.max_key_norm[kvh];
      }
      for (int32_t t = 0; t < n; ++t) {
        LoadRowAsFloat(p.k, KvRowOffset(p, b, kvh, t), d, p.dtype, row.data());
        SimHashKey(planes, row.data(), m,
                   &out->k[b * out->view.batch_stride + kvh * out->view.head_stride + t * words]);
      }
      for (int32_t g = 0; g < group; ++g) {
        const int32_t h = kvh * group + g;
        LoadQuery(p, b, h, row.data());
        SimHashQuery(planes, row.data(),
                     &out->q[(static_cast<size_t>(b) * p.num_q_heads + h) * words]);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ComputeLearnedSignatures(const DecodeProblem& p, const LearnedHashWeights& weights,
                                      int32_t layer, Signatures* out) {
  if (absl::Status s = ValidateProblemFor(p, ProblemNeeds{true, true, false, false}); !s.ok()) {
    return s;
  }
  if (absl::Status s = ValidateLearnedHashWeights(weights); !s.ok()) return s;
  if (layer < 0 || layer >= weights.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " outside the weights' ", weights.num_layers, " layers"));
  }
  if (weights.num_q_heads != p.num_q_heads || weights.head_dim() != p.head_dim ||
      (weights.num_key_mlps != p.num_q_heads && weights.num_key_mlps != p.num_kv_heads)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "learned weights (H=", weights.num_q_heads, ", key MLPs=", weights.num_key_mlps,
        ", d=", weights.head_dim(), ") do not match the problem (H=", p.num_q_heads,
        ", Hkv=", p.num_kv_heads, ", d=", p.head_dim, ")"));
  }
  const int32_t bits = weights.bits();
  const int32_t words = SignatureWords(bits);
  const int d = p.head_dim;
  const int32_t kh = weights.num_key_mlps;
  const int32_t per_kv = kh / p.num_kv_heads;  // key MLPs per kv head: 1 or G
  int32_t n_max = 0;
  for (int32_t b = 0; b < p.batch; ++b) n_max = std::max(n_max, p.seq_lens[b]);
  out->q.assign(static_cast<size_t>(p.batch) * p.num_q_heads * words, 0);
  out->k.assign(static_cast<size_t>(p.batch) * kh * n_max * words, 0);
  out->view = SignatureView{bits,
                            out->q.data(),
                            out->k.data(),
                            static_cast<int64_t>(kh) * n_max * words,
                            static_cast<int64_t>(n_max) * words,
                            words,
                            kh};
  std::vector<float> row(d), scratch;
  for (int32_t b = 0; b < p.batch; ++b) {
    for (int32_t h = 0; h < p.num_q_heads; ++h) {
      LoadQuery(p, b, h, row.data());
      weights.query(layer, h).Sign(
          row.data(), &out->q[(static_cast<size_t>(b) * p.num_q_heads + h) * words], &scratch);
    }
    for (int32_t j = 0; j < kh; ++j) {
      const int32_t kvh = j / per_kv;
      const HashMlp& mlp = weights.key(layer, j);
      for (int32_t t = 0; t < p.seq_lens[b]; ++t) {
        LoadRowAsFloat(p.k, KvRowOffset(p, b, kvh, t), d, p.dtype, row.data());
        mlp.Sign(row.data(),
                 &out->k[b * out->view.batch_stride + j * out->view.head_stride + t * words],
                 &scratch);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvsparse::kernels
