// kvsparse_accuracy: relative L2 error against dense attention and the fraction of K / V rows
// each sparse method touches, for every method and budget, on synthetic score distributions
// (kernels/synthetic.h) with Llama-3.1-8B decode shapes (H = 32, Hkv = 8, d = 128, bf16).
// The table (markdown) goes to stdout, progress to stderr. docs/ACCURACY.md quotes it.
//
//   build-kernels/bin/kvsparse_accuracy --lengths=8192,32768 --trials=2 > table.md
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kernels/cpu_util.h"
#include "kernels/dense.h"
#include "kernels/hash_topk.h"
#include "kernels/row_selection.h"
#include "kernels/santa.h"
#include "kernels/score_topk.h"
#include "kernels/synthetic.h"
#include "kernels/vattention.h"

ABSL_FLAG(std::string, lengths, "8192,32768", "comma-separated sequence lengths");
ABSL_FLAG(std::string, families, "near_uniform,peaked,zipf",
          "comma-separated score families (near_uniform, peaked, zipf)");
ABSL_FLAG(std::string, methods, "all",
          "comma-separated method groups: santa, prop, flash, bernoulli, topk, hash, vattention, "
          "or all");
ABSL_FLAG(int32_t, trials, 2, "seeds per configuration (errors are averaged)");
ABSL_FLAG(int32_t, heads, 32, "query heads H");
ABSL_FLAG(int32_t, kv_heads, 8, "kv heads Hkv");
ABSL_FLAG(int32_t, head_dim, 128, "head dim d");
ABSL_FLAG(uint64_t, seed, 1, "seed of the synthetic data (method seeds are 1000 + trial)");

namespace kvsparse::kernels {
namespace {

struct Row {
  int32_t n;
  std::string family, method, budget;
  double rel_l2 = 0, v_rows = 0, k_rows = 0;
  std::string note;
};

// One method configuration: fills sel and p.out; returns extra notes and the K-row fraction
// when it is not the selection's (e.g. 1.0 when the method reads every K row).
struct Config {
  std::string group, method, budget;
  // Runs one trial. k_all: the method reads every K row (scores over all tokens).
  using Run = std::function<absl::Status(const DecodeProblem&, uint64_t seed, RowSelection* sel,
                                         std::string* note)>;
  Run run;
  bool k_all = false;  // reads every K row (scores over all tokens)
  float eps = 0.f;     // > 0: also report the fraction of query heads with error > eps
};

std::vector<std::string> Split(const std::string& s) {
  return absl::StrSplit(s, ',', absl::SkipEmpty());
}

bool Wanted(const std::vector<std::string>& groups, const std::string& g) {
  return std::find(groups.begin(), groups.end(), "all") != groups.end() ||
         std::find(groups.begin(), groups.end(), g) != groups.end();
}

// Oracle top-k: sink + window + the k best tokens by exact logits (kernels/score_topk.h).
absl::Status OracleTopK(const DecodeProblem& p, int32_t sink, int32_t local, float fraction,
                        RowSelection* sel) {
  ScoreTopKParams params;
  params.fixed.sink_tokens = sink;
  params.fixed.local_tokens = local;
  params.fixed.top_k_fraction = fraction;
  params.source = ScoreSource::kExact;
  return ScoreTopKSelectCpu(p, params, {}, sel);
}

// One trial of SANTA / S2ANTA with `params`, noting Bernoulli qK^T's K-feature reads.
Config::Run SantaRun(SantaParams params) {
  return [params](const DecodeProblem& p, uint64_t seed, RowSelection* sel, std::string* note) {
    SantaStats stats;
    absl::Status s = SantaDecodeCpu(p, params, seed, sel, &stats);
    if (s.ok() && params.bernoulli_qk_samples > 0) {
      double fh = 0, fg = 0;
      const size_t n = stats.key_features_head.size();
      for (size_t i = 0; i < n; ++i) {
        fh += stats.head_fraction(i) / n;
        fg += stats.group_fraction(i) / n;
      }
      *note = absl::StrFormat("K features read: %.2f per head, %.2f per group", fh, fg);
    }
    return s;
  };
}

// The SANTA / S2ANTA groups: santa (global allocation), prop, flash, bernoulli.
void SantaConfigs(const std::vector<std::string>& groups, std::vector<Config>* c) {
  if (Wanted(groups, "santa")) {
    const std::pair<SantaSampler, const char*> samplers[] = {
        {SantaSampler::kIid, "SANTA iid (global)"},
        {SantaSampler::kStratified, "S2ANTA-strat (global)"},
        {SantaSampler::kSystematic, "S2ANTA-sys (global)"}};
    for (const auto& [sampler, name] : samplers) {
      for (int32_t S : {64, 256, 1024}) {
        SantaParams p;
        p.allocation = SantaAllocation::kGlobal;
        p.sampler = sampler;
        p.samples = S;
        c->push_back({"santa", name, absl::StrCat("S=", S), SantaRun(p), true});
      }
    }
  }
  if (Wanted(groups, "prop")) {
    for (int32_t S : {64, 128, 256, 1024}) {
      SantaParams p;
      p.allocation = SantaAllocation::kProp;
      p.samples = S;
      p.tile_size = 256;
      c->push_back({"prop", "S2ANTA-prop (tile 256)", absl::StrCat("S=", S), SantaRun(p), true});
    }
  }
  if (Wanted(groups, "flash")) {
    for (int32_t S : {256, 1024, 2048}) {
      SantaParams p;
      p.allocation = SantaAllocation::kFlash;
      p.samples = S;
      p.tile_size = 256;
      c->push_back({"flash", "S2ANTA-flash (tile 256)", absl::StrCat("S=", S), SantaRun(p), true});
    }
  }
  if (Wanted(groups, "bernoulli")) {
    for (int32_t B : {4, 16}) {
      SantaParams p;
      p.allocation = SantaAllocation::kGlobal;
      p.sampler = SantaSampler::kSystematic;
      p.samples = 1024;
      p.bernoulli_qk_samples = B;
      c->push_back({"bernoulli", "S2ANTA-sys + Bernoulli qK^T (mean group)",
                    absl::StrCat("S=1024, B=", B), SantaRun(p), true});
    }
  }
}

// Top-k by exact scores (the oracle) and HashAttention top-k over SimHash signatures.
void TopKConfigs(const std::vector<std::string>& groups, const Signatures* sig32,
                 const Signatures* sig128, std::vector<Config>* c) {
  if (Wanted(groups, "topk")) {
    for (float f : {0.01f, 0.05f, 0.10f}) {
      c->push_back({"topk", "oracle top-k (exact scores)",
                    absl::StrFormat("sink+local 128, k=%.0f%%", 100 * f),
                    [f](const DecodeProblem& p, uint64_t, RowSelection* sel, std::string*) {
                      absl::Status s = OracleTopK(p, 128, 128, f, sel);
                      return s.ok() ? EstimateInPlace(p, *sel) : s;
                    },
                    true});
    }
  }
  if (Wanted(groups, "hash")) {
    for (const auto& [sig, bits] : {std::pair{sig32, 32}, std::pair{sig128, 128}}) {
      for (float f : {0.01f, 0.05f, 0.10f}) {
        HashTopKParams hp;
        hp.fixed.sink_tokens = 128;
        hp.fixed.local_tokens = 128;
        hp.fixed.top_k_fraction = f;
        hp.bits = bits;
        c->push_back({"hash", absl::StrCat("HashAttention top-k (SimHash ", bits, " bits)"),
                      absl::StrFormat("sink+local 128, k=%.0f%%", 100 * f),
                      [hp, sig](const DecodeProblem& p, uint64_t, RowSelection* sel, std::string*) {
                        return HashTopKDecodeCpu(p, hp, sig->view, sel);
                      }});
      }
    }
  }
}

// vAttention with the hash and exact predictors, CLT and Hoeffding bounds.
void VAttentionConfigs(const std::vector<std::string>& groups, const Signatures* sig32,
                       std::vector<Config>* c) {
  if (Wanted(groups, "vattention")) {
    struct V {
      TopKPredictor pred;
      BudgetBound bound;
      VerifyTarget target;
      float eps;
    };
    const V vs[] = {
        {TopKPredictor::kHash, BudgetBound::kClt, VerifyTarget::kOutput, 0.05f},
        {TopKPredictor::kHash, BudgetBound::kClt, VerifyTarget::kOutput, 0.1f},
        {TopKPredictor::kHash, BudgetBound::kClt, VerifyTarget::kOutput, 0.2f},
        {TopKPredictor::kExact, BudgetBound::kClt, VerifyTarget::kOutput, 0.05f},
        {TopKPredictor::kExact, BudgetBound::kClt, VerifyTarget::kOutput, 0.1f},
        {TopKPredictor::kExact, BudgetBound::kClt, VerifyTarget::kDenominator, 0.05f},
        {TopKPredictor::kExact, BudgetBound::kHoeffding, VerifyTarget::kDenominator, 0.05f},
    };
    for (const V& v : vs) {
      VAttentionParams vp;
      vp.epsilon = v.eps;
      vp.delta = 0.05f;
      vp.fixed.sink_tokens = 128;
      vp.fixed.local_tokens = 128;
      vp.fixed.top_k_fraction = 0.025f;
      vp.base_rate = 0.025f;
      vp.predictor = v.pred;
      vp.bound = v.bound;
      vp.target = v.target;
      vp.bits = 32;
      const std::string name =
          absl::StrCat("vAttention (", v.pred == TopKPredictor::kHash ? "hash 32 bits" : "exact",
                       " top-k, ", v.bound == BudgetBound::kClt ? "CLT" : "Hoeffding", ", ",
                       v.target == VerifyTarget::kOutput ? "output" : "denominator", ")");
      c->push_back({"vattention", name, absl::StrFormat("eps=%.2f delta=0.05", v.eps),
                    [vp, sig32](const DecodeProblem& p, uint64_t seed, RowSelection* sel,
                                std::string* note) {
                      VAttentionStats stats;
                      absl::Status s = VAttentionDecodeCpu(p, vp, seed, &sig32->view, sel, &stats);
                      if (!s.ok()) return s;
                      double b = 0, ns = 0;
                      for (const VAttentionHeadResult& r : stats.heads) {
                        b += static_cast<double>(r.b) / stats.heads.size();
                        ns += static_cast<double>(r.stats.n_s) / stats.heads.size();
                      }
                      *note = absl::StrFormat("mean b = %.0f of n_s = %.0f", b, ns);
                      return s;
                    },
                    v.pred == TopKPredictor::kExact,
                    v.target == VerifyTarget::kOutput ? v.eps : 0.f});
    }
  }
}

std::vector<Config> MakeConfigs(const std::vector<std::string>& groups, const Signatures* sig32,
                                const Signatures* sig128) {
  std::vector<Config> c;
  SantaConfigs(groups, &c);
  TopKConfigs(groups, sig32, sig128, &c);
  VAttentionConfigs(groups, sig32, &c);
  return c;
}

int Main() {
  const int32_t H = absl::GetFlag(FLAGS_heads), Hkv = absl::GetFlag(FLAGS_kv_heads),
                d = absl::GetFlag(FLAGS_head_dim), trials = absl::GetFlag(FLAGS_trials);
  const std::vector<std::string> groups = Split(absl::GetFlag(FLAGS_methods));
  std::vector<int32_t> lengths;
  for (const std::string& s : Split(absl::GetFlag(FLAGS_lengths))) {
    int32_t n;
    if (!absl::SimpleAtoi(s, &n) || n <= 0) {
      std::fprintf(stderr, "bad --lengths entry '%s'\n", s.c_str());
      return 2;
    }
    lengths.push_back(n);
  }
  std::vector<ScoreFamily> families;
  for (const std::string& s : Split(absl::GetFlag(FLAGS_families))) {
    bool found = false;
    for (ScoreFamily f : {ScoreFamily::kNearUniform, ScoreFamily::kPeaked, ScoreFamily::kZipf}) {
      if (s == ScoreFamilyName(f)) {
        families.push_back(f);
        found = true;
      }
    }
    if (!found) {
      std::fprintf(stderr, "bad --families entry '%s'\n", s.c_str());
      return 2;
    }
  }
  if (trials < 1 || H <= 0 || Hkv <= 0 || H % Hkv != 0 || d <= 0) {
    std::fprintf(stderr, "bad --trials / --heads / --kv_heads / --head_dim\n");
    return 2;
  }
  const auto t_start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  };
  std::printf(
      "| n | family | method | budget | rel. L2 error | V rows read | K rows read | "
      "notes |\n|---|---|---|---|---|---|---|---|\n");
  for (int32_t n : lengths) {
    for (ScoreFamily family : families) {
      SyntheticOptions o;
      o.family = family;
      o.num_q_heads = H;
      o.num_kv_heads = Hkv;
      o.head_dim = d;
      o.seq_lens = {n};
      o.dtype = DType::kBf16;
      o.seed = absl::GetFlag(FLAGS_seed) + n;
      std::fprintf(stderr, "[%6.1fs] n=%d %s: building problem and dense reference\n", elapsed(), n,
                   ScoreFamilyName(family));
      SyntheticProblem sp = SyntheticProblem::Make(o);
      DecodeProblem& p = sp.problem;
      std::vector<double> dense;
      if (absl::Status s = DenseDecodeFloat64(p, &dense); !s.ok()) {
        std::fprintf(stderr, "dense: %s\n", s.ToString().c_str());
        return 1;
      }
      // Floor: dense attention itself with bf16 output.
      if (absl::Status s = DenseDecodeCpu(p); !s.ok()) return 1;
      std::printf(
          "| %d | %s | dense (fp32 accumulation, bf16 output) | - | %.2e | 1.000 | 1.000 "
          "| rounding floor |\n",
          n, ScoreFamilyName(family), RelativeL2(dense, OutputAsDouble(p)));
      Signatures sig32, sig128;
      if (Wanted(groups, "hash") || Wanted(groups, "vattention")) {
        std::fprintf(stderr, "[%6.1fs]   SimHash signatures (32 and 128 bits)\n", elapsed());
        if (!ComputeSimHashSignatures(p, SimHashConfig{7, 0, 32, {}}, &sig32).ok() ||
            !ComputeSimHashSignatures(p, SimHashConfig{7, 0, 128, {}}, &sig128).ok()) {
          return 1;
        }
      }
      for (const Config& c : MakeConfigs(groups, &sig32, &sig128)) {
        std::fprintf(stderr, "[%6.1fs]   %s %s\n", elapsed(), c.method.c_str(), c.budget.c_str());
        Row row{n, ScoreFamilyName(family), c.method, c.budget, 0, 0, 0, ""};
        std::string note;
        double heads_over = 0;
        for (int32_t trial = 0; trial < trials; ++trial) {
          RowSelection sel;
          if (absl::Status s = c.run(p, 1000 + trial, &sel, &note); !s.ok()) {
            std::fprintf(stderr, "%s: %s\n", c.method.c_str(), s.ToString().c_str());
            return 1;
          }
          const std::vector<double> out = OutputAsDouble(p);
          row.rel_l2 += RelativeL2(dense, out) / trials;
          if (c.eps > 0.f) {
            for (int32_t h = 0; h < H; ++h) {
              const std::vector<double> ref(dense.begin() + h * d, dense.begin() + (h + 1) * d);
              const std::vector<double> got(out.begin() + h * d, out.begin() + (h + 1) * d);
              heads_over += RelativeL2(ref, got) > c.eps ? 1.0 / (H * trials) : 0.0;
            }
          }
          double rows = 0;
          for (const KvHeadSelection& h : sel.heads) rows += h.num_rows();
          rows /= static_cast<double>(sel.heads.size()) * n;
          row.v_rows += rows / trials;
          row.k_rows += (c.k_all ? 1.0 : rows) / trials;
        }
        if (c.eps > 0.f) {
          note = absl::StrFormat("%s; heads with error > eps: %.0f%%", note, 100 * heads_over);
        }
        std::printf("| %d | %s | %s | %s | %.4f | %.3f | %.3f | %s |\n", row.n, row.family.c_str(),
                    row.method.c_str(), row.budget.c_str(), row.rel_l2, row.v_rows, row.k_rows,
                    note.c_str());
        std::fflush(stdout);
      }
    }
  }
  std::fprintf(stderr, "[%6.1fs] done\n", elapsed());
  return 0;
}

}  // namespace
}  // namespace kvsparse::kernels

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return kvsparse::kernels::Main();
}
