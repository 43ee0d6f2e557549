// Top-k by scores: per query head, sink + local window + the k tokens of highest score, then
// exact attention over the union of the GQA group's rows (kind kSoftmax, every weight 1), with
// the selection rule of kernels/hash_topk.h (SelectSinkLocalTopK: ties to the lower index).
// The scores come from one of two sources:
//   kExact           scale * q . K_t over every key: the *oracle* top-k, the ceiling of every
//                    top-k predictor (it reads every key: K resident, or every K row fetched);
//   kCompressedKeys  scale * q . k~_t over the compressed keys of kernels/compressed_keys.h
//                    (exact for the keys of the still-filling group): a few bits per key on the
//                    device give near-exact scores, and only the chosen K and V rows cross.
// budgets[g] = the number of top-k rows chosen for query head g (sink and window excluded).
#ifndef KVSPARSE_KERNELS_SCORE_TOPK_H_
#define KVSPARSE_KERNELS_SCORE_TOPK_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/compressed_keys.h"
#include "kernels/decode_problem.h"
#include "kernels/row_selection.h"
#include "kernels/sink_local_topk.h"

namespace kvsparse::kernels {

struct ScoreTopKParams {
  FixedSet fixed;
  ScoreSource source = ScoreSource::kCompressedKeys;
};

[[nodiscard]] absl::Status ValidateScoreTopKParams(const ScoreTopKParams& params);

// Selection stage. kExact reads p.q and p.k; kCompressedKeys reads p.q and keys ([B * Hkv],
// index b * Hkv + kv_head, each holding at least seq_lens[b] tokens; its first seq_lens[b] are
// scored). Fills `sel`. log_left_out (optional, kCompressedKeys only; [B * H] on return, index
// b * H + h): per query head, LogSumExpOutside of the UpperScores of the tokens it did not
// select (kernels/compressed_keys.h); with the log-sum-exp of the exact logits of those it
// selected, MissedMassBound bounds the attention mass its output leaves out.
[[nodiscard]] absl::Status ScoreTopKSelectCpu(const DecodeProblem& p, const ScoreTopKParams& params,
                                              absl::Span<const CompressedKeysView> keys,
                                              RowSelection* sel,
                                              std::vector<double>* log_left_out = nullptr);

// Selection then EstimateInPlace (reads p.k and p.v, writes p.out). `sel` may be null.
[[nodiscard]] absl::Status ScoreTopKDecodeCpu(const DecodeProblem& p, const ScoreTopKParams& params,
                                              absl::Span<const CompressedKeysView> keys,
                                              RowSelection* sel = nullptr);

}  // namespace kvsparse::kernels

#endif  // KVSPARSE_KERNELS_SCORE_TOPK_H_
