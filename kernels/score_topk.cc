#include "kernels/score_topk.h"

#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu_util.h"
#include "kernels/hash_topk.h"

namespace kvsparse::kernels {

absl::Status ValidateScoreTopKParams(const ScoreTopKParams& params) {
  return ValidateFixedSet(params.fixed);
}

absl::Status ScoreTopKSelectCpu(const DecodeProblem& p, const ScoreTopKParams& params,
                                absl::Span<const CompressedKeysView> keys, RowSelection* sel,
                                std::vector<double>* log_left_out) {
  if (absl::Status s = ValidateScoreTopKParams(params); !s.ok()) return s;
  const bool exact = params.source == ScoreSource::kExact;
  if (absl::Status s = ValidateProblemFor(p, ProblemNeeds{true, exact, false, false}); !s.ok()) {
    return s;
  }
  if (!exact && keys.size() != static_cast<size_t>(p.batch) * p.num_kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat("compressed keys: ", keys.size(), " views for ",
                                                   p.batch, " x ", p.num_kv_heads,
                                                   " (sequence, kv head) pairs"));
  }
  const int32_t group = p.group_size();
  sel->Reset(EstimateKind::kSoftmax, p.batch, p.num_kv_heads, group);
  std::vector<float> q(p.head_dim), scores;
  std::vector<double> upper;
  std::vector<int32_t> chosen, scratch;
  if (log_left_out != nullptr) {
    log_left_out->assign(static_cast<size_t>(p.batch) * p.num_q_heads,
                         exact ? std::numeric_limits<double>::quiet_NaN() : 0.0);
  }
  std::vector<HeadRows> rows(group);
  for (int32_t b = 0; b < p.batch; ++b) {
    const int32_t n = p.seq_lens[b];
    absl::StatusOr<int32_t> k = ResolveTopK(params.fixed, n);
    if (!k.ok()) return k.status();
    for (int32_t kvh = 0; kvh < p.num_kv_heads; ++kvh) {
      const CompressedKeysView* view = exact ? nullptr : &keys[b * p.num_kv_heads + kvh];
      if (view != nullptr && (view->length < n || view->head_dim != p.head_dim)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "compressed keys of sequence ", b, ", kv head ", kvh, " hold ", view->length,
            " tokens of dim ", view->head_dim, ", need ", n, " of ", p.head_dim));
      }
      for (int32_t g = 0; g < group; ++g) {
        const int32_t h = kvh * group + g;
        LoadQuery(p, b, h, q.data());
        if (exact) {
          scores.resize(n);
          ComputeScores(p, b, h, q.data(), scores.data());
        } else {
          scores.resize(view->length);
          ApproximateScores(*view, q.data(), p.scale, scores.data());
        }
        rows[g].Clear();
        rows[g].budget = SelectSinkLocalTopK(scores.data(), n, params.fixed.sink_tokens,
                                             params.fixed.local_tokens, *k, &chosen, &scratch);
        for (int32_t t : chosen) rows[g].Push(t, 1, 1.f);
        if (log_left_out != nullptr && !exact) {
          upper.resize(view->length);
          UpperScores(*view, q.data(), p.scale, scores.data(), upper.data());
          (*log_left_out)[static_cast<size_t>(b) * p.num_q_heads + h] =
              LogSumExpOutside(upper.data(), n, rows[g].tokens);
        }
      }
      MergeGroup(rows, &sel->at(b, kvh));
    }
  }
  return absl::OkStatus();
}

absl::Status ScoreTopKDecodeCpu(const DecodeProblem& p, const ScoreTopKParams& params,
                                absl::Span<const CompressedKeysView> keys, RowSelection* sel) {
  RowSelection local;
  RowSelection* s = sel != nullptr ? sel : &local;
  if (absl::Status st = ScoreTopKSelectCpu(p, params, keys, s); !st.ok()) return st;
  return EstimateInPlace(p, *s);
}

}  // namespace kvsparse::kernels
