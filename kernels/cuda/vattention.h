// vAttention on the GPU (CPU reference and the algorithm: kernels/vattention.h), hash predictor:
//   1. fixed set I_f = sink + window + Hamming top-k (HashTopK, hash_topk.h);
//   (k = top_k, or top_k_fraction * n rounded to nearest, as ResolveTopK.)
//   2. base sample: the n_b residual tokens with the smallest Philox keys (RngTag::kVattBase),
//      n_b = min(n_s, max(2, round(base_rate * n_s)));
//   3. statistics of I_f and the base sample (their K and V rows) in float64 and the budget b
//      for (epsilon, delta) (CLT or Hoeffding; denominator, numerator or output target; the
//      output target minimises over the same delta grid as the reference);
//   4. final sample: the b residual tokens with the smallest kVattDynamic keys;
//   5. estimate: out = (sum_{I_f} e^s V + (n_s / b) sum_{I_dyn} e^s V) / (same without V).
// Importance mode (VAttentionLaunchParams::scores set: the compressed predictor with the importance
// sampler, kernels/vattention.h "The importance sampler"): step 1 takes sink + window + the top-k
// by the given scores s~ (ScoreTopK's rule, the CPU's SelectSinkLocalTopK); steps 2 and 4 draw
// i.i.d. from p_t = e^{s~_t} / Z~ over the residual (a float64 cumulative sum per head, then
// binary searches of u_j = (Draw64(j) >> 11) 2^-53 Z~, RngTag kVattImportanceBase / Dynamic),
// lists ascending with repeats; step 3's statistics use the effective logits s_t - s~_t + L
// (L = ln(Z~ / n_s)); b >= n_s reads the residual once with weight 1, otherwise a draw of token
// t weighs (n_s / b) e^{L - s~_t} = 1 / (b p_t). A draw lands on another token than the CPU's
// only where u_j falls within the rounding of the two cumulative sums (summed in another order).
// The sampled sets equal the CPU reference's exactly (same Philox keys, same total order); b
// can differ only where the float64 statistics, summed in another order, put b_raw within
// rounding of an integer. One block per (sequence, query head) for the sampling and statistics
// stages (selection cost, not bandwidth, is what this method spends).
// Rows are read once per GQA group, as the CPU engine reads them: per (sequence, kv head) the
// union A = U_g (I_f u B) of its query heads' lists is copied into a row set (FetchRows) before
// the statistics, and R = U_g I_dyn \ A after the final sample; the statistics and estimate
// kernels read the row set. Rows fetched per (b, kv head): |A| + |R| = |U_g (I_f u B u I_dyn)|.
#ifndef KVSPARSE_KERNELS_CUDA_VATTENTION_H_
#define KVSPARSE_KERNELS_CUDA_VATTENTION_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/decode_params.h"
#include "kernels/sink_local_topk.h"

namespace kvsparse::kernels::cuda {

struct VAttentionLaunchParams {
  DecodeShape shape;  // max_seq_len <= 2^22
  uint64_t seed = 0;
  // Optional, device, shape: [B]: sequence b draws its random numbers from seeds[b] as a batch-1
  // problem would (streams (seeds[b], tag, 0, head)) instead of (seed, tag, b, head).
  const uint64_t* seeds = nullptr;
  float epsilon = 0.05f;               // (0, 1)
  float delta = 0.05f;                 // (0, 1)
  FixedSet fixed{128, 128, 0, 0.05f};  // kernels/sink_local_topk.h
  float base_rate = 0.05f;             // (0, 1)
  int32_t bound = 1;   // 1 = CLT, 2 = Hoeffding, 3 = CLT on the ratio (kernels::BudgetBound)
  int32_t target = 3;  // 1 = denominator, 2 = numerator, 3 = output (VerifyTarget)
  // Signatures (hash_topk.h): q_sigs [B, H, bits / 32]; key signature of (b, j, t) at
  // k_sigs + b * k_batch_stride + j * k_head_stride + t * k_token_stride, j = h / G when
  // key_heads == Hkv, h when key_heads == H.
  int32_t bits = 32;
  const uint32_t* q_sigs = nullptr;
  const uint32_t* k_sigs = nullptr;
  const uint32_t* const* k_sig_heads = nullptr;  // optional, as HashTopKLaunchParams::k_sig_heads
  int64_t k_batch_stride = 0;
  int64_t k_head_stride = 0;
  int64_t k_token_stride = 0;
  int32_t key_heads = 0;
  // Importance mode (above) is scores_stride > 0 (VAttentionImportance): scores is then device
  // [B * H, scores_stride] (scores_stride >= max_seq_len), the predictor's logits s~ of every
  // token, scale included (CompressedScores' output). The signatures are then unused; bound must
  // be 1 or 3 (a sample gives no Hoeffding range). The mode is the stride's, not the pointer's:
  // a sizing pass (VAttentionWorkspaceBytes before the scores are carved) may leave scores null
  // and still sizes the importance workspace; a call needs both or neither.
  const float* scores = nullptr;
  int64_t scores_stride = 0;
};

// Whether p runs in importance mode (VAttentionLaunchParams::scores_stride).
inline bool VAttentionImportance(const VAttentionLaunchParams& p) { return p.scores_stride > 0; }

// The workspace holds, besides the lists, a row set of max_seq_len K and V rows per (b, kv head).
size_t VAttentionWorkspaceBytes(const VAttentionLaunchParams& p);
// Every stage, K and V read through p.shape's addressing.
cudaError_t VAttentionDecode(const VAttentionLaunchParams& p, void* workspace,
                             size_t workspace_bytes, cudaStream_t stream);

// The same in three calls, for a caller that stages the rows of each part itself (a store the
// GPU cannot read): after VAttentionSelect the tokens of A are listed (VAttentionSelectionView's
// union_a), after VAttentionVerify (statistics, budget, final sample) those of R; each call fetches
// its part from `src` (default: p.shape; by_position: row r of (b, j)'s list is row r of src's
// per-head addressing, as FetchRowsParams::source_by_position).
struct VAttentionRowSource {
  const DecodeShape* shape = nullptr;
  bool by_position = false;
};
cudaError_t VAttentionSelect(const VAttentionLaunchParams& p, void* workspace,
                             size_t workspace_bytes, cudaStream_t stream);
cudaError_t VAttentionVerify(const VAttentionLaunchParams& p, const VAttentionRowSource& src,
                             void* workspace, size_t workspace_bytes, cudaStream_t stream);
cudaError_t VAttentionEstimate(const VAttentionLaunchParams& p, const VAttentionRowSource& src,
                               void* workspace, size_t workspace_bytes, cudaStream_t stream);

// Where the selection lives in the workspace after VAttentionDecode (device pointers), for tests
// and for a worker that gathers the rows itself. Per (b, h) = i: the lists hold ascending tokens.
struct VAttentionSelectionView {
  int32_t max_list = 0;            // capacity of the base and dyn lists
  int32_t fixed_stride = 0;        // capacity of the fixed lists
  const int32_t* fixed = nullptr;  // [B * H, fixed_stride], fixed_count[i] used
  const int32_t* fixed_count = nullptr;
  const int32_t* base = nullptr;  // [B * H, max_list]
  const int32_t* base_count = nullptr;
  const int32_t* dyn = nullptr;  // [B * H, max_list]
  const int32_t* dyn_count = nullptr;
  const int64_t* budget = nullptr;  // [B * H]: b
  // [B * H]: the relative error of the output the final sample promises at probability
  // 1 - delta, epsilon sqrt(min(b_raw, b) / b) (b_raw the bound's budget before the base-rate
  // floor and the rounding); 0 where the residual is read whole (b = n_s).
  const float* epsilon = nullptr;
  // Per (b, kv head) = k: the union parts, ascending tokens at k * max_list, and |A| + |R|.
  const int32_t* union_a = nullptr;
  const int32_t* union_a_count = nullptr;
  const int32_t* union_r = nullptr;
  const int32_t* union_r_count = nullptr;
  const int32_t* fetched = nullptr;
};
VAttentionSelectionView VAttentionSelection(const VAttentionLaunchParams& p, const void* workspace);

}  // namespace kvsparse::kernels::cuda

#endif  // KVSPARSE_KERNELS_CUDA_VATTENTION_H_
