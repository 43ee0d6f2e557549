// SAAP: sparse attention with asymmetric partitions (Mazare et al., 2025;
// ../shared/seeds/saap-asymmetric-partitions.txt), CPU reference.
//
// Offline (kvsparse.tools.calibrate), per layer:
//   - keys: spherical k-means of the model's keys *before* RoPE into C buckets per kv head (unit
//     centroids c_{l,j,1..C}); a key goes to the bucket of its nearest centroid by cosine;
//   - queries: a classifier per query head, f(x) = W2 relu(W1 x + b1) + b2 (C logits) on the
//     query before RoPE, trained so that softmax(f(q)) matches the share of q's attention mass
//     in each bucket (the paper's KL loss on A H_k), long-range keys only.
// Online, per (sequence, kv head), the query at position p = n - 1 (the newest token):
//   1. un-RoPE each query of the group at p and sum the group's softmax(f(q_h)) (the paper's
//      batched GQA search); the `probes` buckets with the largest sums, ties to the lower index;
//   2. rows: sink [0, min(sink, n)) u window [max(0, n - local), n) u every other token whose
//      key's bucket is one of those (a key's bucket is fixed when it is appended: un-RoPE at its
//      own position, nearest centroid; the caller keeps it as the key's "signature");
//   3. estimate: exact softmax attention of each query head over those rows (kSoftmax, weight 1),
//      the same rows for every head of the group.
// Un-RoPE: the Llama ("rotate half") layout, coordinate pairs (i, i + d/2) rotated by the angle
// p * inv_freq[i] and the whole vector scaled by rope_scale (transformers' attention_scaling);
// inverse: x_i = (y_i cos + y_{i+d/2} sin) / s, x_{i+d/2} = (y_{i+d/2} cos - y_i sin) / s, in
// fp32 with the angle taken in double. The file carries inv_freq (any RoPE scaling folded in).
//
// ---------------------------------------------------------------------------------------------
// SAAP partition file, version 1 (u32 little-endian, f32 IEEE-754 little-endian, no padding):
//   offset 0   char[8]  magic "KVSPSAAP"
//   8          u32      version = 1
//   12         u32      num_layers L >= 1
//   16         u32      num_q_heads H >= 1
//   20         u32      num_kv_heads Hkv >= 1, dividing H
//   24         u32      head_dim d, even, in [2, 1024]
//   28         u32      clusters C in [2, 65536]
//   32         u32      hidden (classifier width) in [1, 65536]
//   36         f32      rope_scale > 0
//   40         f32      inv_freq[d / 2]
//   then for l = 0..L-1, j = 0..Hkv-1: f32 centroids[C][d] (unit norm);
//   then for l = 0..L-1, h = 0..H-1: f32 W1[hidden][d], b1[hidden], W2[C][hidden], b2[C]
//        (row-major as torch.nn.Linear.weight). The file ends there.
#ifndef KVSPARSE_KERNELS_SAAP_H_
#define KVSPARSE_KERNELS_SAAP_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/decode_problem.h"
#include "kernels/row_selection.h"

namespace kvsparse::kernels {

struct SaapWeights {
  int32_t num_layers = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  int32_t clusters = 0, hidden = 0;
  float rope_scale = 1.f;
  std::vector<float> inv_freq;   // [d / 2]
  std::vector<float> centroids;  // [L, Hkv, C, d]
  std::vector<float> w1, b1;     // [L, H, hidden, d], [L, H, hidden]
  std::vector<float> w2, b2;     // [L, H, C, hidden], [L, H, C]

  const float* centroid(int32_t layer, int32_t kv_head, int32_t c) const {
    return centroids.data() +
           ((static_cast<size_t>(layer) * num_kv_heads + kv_head) * clusters + c) * head_dim;
  }
};

// Sizes and values (INVALID_ARGUMENT naming the field).
[[nodiscard]] absl::Status ValidateSaapWeights(const SaapWeights& w);
[[nodiscard]] absl::StatusOr<std::string> SerializeSaapWeights(const SaapWeights& w);
[[nodiscard]] absl::StatusOr<SaapWeights> ParseSaapWeights(std::string_view bytes);
// NOT_FOUND / INTERNAL for I/O, INVALID_ARGUMENT for a malformed file.
[[nodiscard]] absl::Status WriteSaapWeights(const SaapWeights& w, const std::string& path);
[[nodiscard]] absl::StatusOr<SaapWeights> ReadSaapWeights(const std::string& path);

// x [d] (post-RoPE at `position`) -> out [d] (pre-RoPE). out may not alias x.
void SaapUnrope(const SaapWeights& w, int64_t position, const float* x, float* out);
// The bucket of a key (post-RoPE, at `position`) of (layer, kv_head): its nearest centroid by
// cosine (the largest dot product with the unit centroids), ties to the lower index. scratch is
// reused (a key at a time is signed on the engine's append path).
int32_t SaapAssignKey(const SaapWeights& w, int32_t layer, int32_t kv_head, int64_t position,
                      const float* k, std::vector<float>* scratch);
// softmax(f(un-RoPE(q))) of (layer, query head h) into probs [C]; scratch is reused.
void SaapQueryProbs(const SaapWeights& w, int32_t layer, int32_t h, int64_t position,
                    const float* q, float* probs, std::vector<float>* scratch);

struct SaapParams {
  int32_t probes = 8;         // buckets visited per (sequence, kv head), in [1, C]
  int32_t sink_tokens = 128;  // always read, as the other methods' fixed sets
  int32_t local_tokens = 128;
};
[[nodiscard]] absl::Status ValidateSaapParams(const SaapParams& params, const SaapWeights& w);

// Bucket ids of the problem's keys: key of (b, kv head j, token t) at
// buckets[b * batch_stride + j * head_stride + t] (as the engine keeps signatures).
struct SaapBuckets {
  const int32_t* buckets = nullptr;
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
};
// Fills `out` with the buckets of p's keys (b, j, t) at positions t ([B, Hkv, n_max]).
[[nodiscard]] absl::Status ComputeSaapBuckets(const DecodeProblem& p, const SaapWeights& w,
                                              int32_t layer, std::vector<int32_t>* out,
                                              SaapBuckets* view);

// Selection of steps 1-2 for every (b, kv head); HeadStats budgets[g] = the buckets' residual
// rows selected. Reads p.q (the queries, at position seq_lens[b] - 1) and p's shapes, not K/V.
[[nodiscard]] absl::Status SaapSelectCpu(const DecodeProblem& p, const SaapParams& params,
                                         const SaapWeights& w, int32_t layer,
                                         const SaapBuckets& buckets, RowSelection* sel);
// Selection then the estimate, in place.
[[nodiscard]] absl::Status SaapDecodeCpu(const DecodeProblem& p, const SaapParams& params,
                                         const SaapWeights& w, int32_t layer,
                                         const SaapBuckets& buckets, RowSelection* sel = nullptr);

}  // namespace kvsparse::kernels

#endif  // KVSPARSE_KERNELS_SAAP_H_
