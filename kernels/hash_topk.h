// HashAttention top-k decode (Desai et al., 2025): per query head, attention sink tokens + a
// local window + the k tokens whose key signatures are most similar to the query's signature
// (similarity = bits - 2 * Hamming), then exact attention over that set.
//
// Selection rule per query head h of a sequence with n tokens (shared with vAttention):
//   sink   = [0, min(sink_tokens, n))
//   window = [max(0, n - local_tokens), n)
//   k      = min(top_k, n) if top_k > 0, else floor(double(top_k_fraction) * n + 0.5) (the
//            fraction of n rounded to nearest: a float fraction like 0.02f is slightly below
//            0.02, and a floor would lose a token); a short sequence reads what it has;
//   top-k  = the min(k, #rest) tokens of rest = [0, n) \ (sink u window) with the highest
//            score; ties: higher score first, then the LOWER token index (a total order, so the
//            GPU selection must return exactly this set);
//   never empty: where sink, window and top-k would select no row of a sequence that has one
//            (all three 0, or a fraction that rounds to 0 without sink and window), top-k takes
//            the one highest-scoring token (kernels/sink_local_topk.h): an output is always an
//            estimate of attention.
// Stages: selection needs only signatures (and seq_lens); the estimate (EstimateInPlace or
// EstimateFromGathered, kind kSoftmax, every weight 1) needs the K and V rows of the union.
// budgets[g] = number of top-k rows chosen for query head g (excluding sink and window).
// With k >= n (or sink + window covering the sequence) every row is selected and the output
// is dense attention (up to fp32 summation order).
#ifndef KVSPARSE_KERNELS_HASH_TOPK_H_
#define KVSPARSE_KERNELS_HASH_TOPK_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/decode_problem.h"
#include "kernels/hash_signatures.h"
#include "kernels/row_selection.h"
#include "kernels/sink_local_topk.h"

namespace kvsparse::kernels {

struct HashTopKParams {
  FixedSet fixed;
  int32_t bits = 32;  // signature bits: multiple of 32 in [32, 256]
};

// k of a fixed set for a sequence of n tokens (see the header comment): a top_k above n is n.
// INVALID_ARGUMENT naming top_k or top_k_fraction when top_k < 0 or the fraction is outside
// [0, 1].
[[nodiscard]] absl::StatusOr<int32_t> ResolveTopK(const FixedSet& f, int32_t n);

// INVALID_ARGUMENT naming the field when a count of the fixed set is negative or the fraction
// (used when top_k == 0) is outside [0, 1]: what every sink + window + top-k method checks.
[[nodiscard]] absl::Status ValidateFixedSet(const FixedSet& f);

// Rows a fixed set can hold per query head for sequences of up to max_seq_len tokens (the output
// stride of the GPU selections). Inline: the CUDA launchers use it without linking the CPU
// references.
inline int32_t MaxFixedSetRows(const FixedSet& f, int32_t max_seq_len) {
  const int64_t k = FixedSetK(f, max_seq_len);
  const int64_t total = static_cast<int64_t>(std::max(f.sink_tokens, 0)) +
                        std::max(f.local_tokens, 0) +
                        std::max<int64_t>(k, 1);  // never empty: at least one top-k row
  return static_cast<int32_t>(std::min<int64_t>(total, max_seq_len));
}

// Sink + window + top-k of `scores` ([n]) as above; the chosen tokens go to `out` ascending.
// Returns the number of top-k tokens chosen. T is int32_t (Hamming similarity) or float.
template <typename T>
int32_t SelectSinkLocalTopK(const T* scores, int32_t n, int32_t sink, int32_t local, int32_t k,
                            std::vector<int32_t>* out, std::vector<int32_t>* scratch);

// Signatures of a decode step. words = bits / 32.
//   q: query signature of (b, h) at q + (b * H + h) * words.
//   k: key signature of (b, j, t) at k + b * batch_stride + j * head_stride + t * token_stride,
//      j = the signature head: h / G when key_heads == Hkv (one signature per kv head: SimHash,
//      or learned key MLPs shared by the group), h when key_heads == H (learned key MLPs per
//      query head, as HashAttention's released models).
struct SignatureView {
  int32_t bits = 0;
  const uint32_t* q = nullptr;
  const uint32_t* k = nullptr;
  int64_t batch_stride = 0;  // in words
  int64_t head_stride = 0;
  int64_t token_stride = 0;
  int32_t key_heads = 0;  // Hkv or H
};

// Owning signatures for a whole problem (tests, accuracy tool). k layout [B, key_heads, n_max,
// words].
struct Signatures {
  std::vector<uint32_t> q;
  std::vector<uint32_t> k;
  SignatureView view;
};

struct SimHashConfig {
  uint64_t seed = 0;  // signature seed (fixed per model, not the request seed)
  int32_t layer = 0;  // Philox `sequence` field of the planes
  int32_t bits = 32;
  // M per kv head, shape [Hkv]; empty: each (sequence, kv head) uses the max norm of its own keys.
  std::vector<float> max_key_norm;
};

// SimHash signatures of every query and key of p (planes per kv head, key_heads = Hkv).
[[nodiscard]] absl::Status ComputeSimHashSignatures(const DecodeProblem& p,
                                                    const SimHashConfig& config, Signatures* out);

// Learned-MLP signatures of every query and key of p for one layer. key_heads = the file's
// num_key_mlps, which must be H or Hkv; num_q_heads must be H and head_dim d.
[[nodiscard]] absl::Status ComputeLearnedSignatures(const DecodeProblem& p,
                                                    const LearnedHashWeights& weights,
                                                    int32_t layer, Signatures* out);

[[nodiscard]] absl::Status ValidateHashTopKParams(const HashTopKParams& params);

// Selection stage: reads signatures and p's shapes and seq_lens only (q, k, v may be null).
// Fills `sel` (kind kSoftmax, weights 1).
[[nodiscard]] absl::Status HashTopKSelectCpu(const DecodeProblem& p, const HashTopKParams& params,
                                             const SignatureView& sigs, RowSelection* sel);

// Selection then EstimateInPlace (writes p.out). `sel` may be null.
[[nodiscard]] absl::Status HashTopKDecodeCpu(const DecodeProblem& p, const HashTopKParams& params,
                                             const SignatureView& sigs,
                                             RowSelection* sel = nullptr);

}  // namespace kvsparse::kernels

#endif  // KVSPARSE_KERNELS_HASH_TOPK_H_
