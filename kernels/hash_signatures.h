// Bit signatures of queries and keys for HashAttention-style top-k (Desai et al., 2025) and
// vAttention's hash predictor. Two sources:
//   SimHash: seeded random hyperplanes over max-norm-augmented vectors (inner product ->
//            cosine), 32..256 bits, regenerable from the Philox mapping.
//   Learned: per-layer, per-head MLPs Linear-SiLU-Linear-SiLU-Linear then sign, as the released
//            HashAttention models, read from the binary format specified below.
//
// Packing (both sources): a signature of `bits` bits is bits/32 uint32 words; bit j is bit
// (j % 32) of word (j / 32), LSB first. Bit j is 1 iff the j-th projection is > 0 (strictly;
// 0 and NaN give 0). Similarity of a query and a key signature: bits - 2 * Hamming(q, k), in
// [-bits, bits].
//
// ---------------------------------------------------------------------------------------------
// SimHash with the max-norm augmentation (Neyshabur & Srebro's "simple LSH" for inner products):
//   key   k in R^d  ->  k' = [k, sqrt(max(M^2 - |k|^2, 0))]   (M = max key norm of the head)
//   query q in R^d  ->  q' = [q, 0]
// so |k'| = M for every key and cos(q', k') = q.k / (|q| M): monotone in q.k. Scaling k' by
// 1/M does not change a sign, so it is omitted. Keys with |k| > M (appended after M was fixed)
// get augmentation 0. M is a per-(layer, kv head) parameter of the signature cache fixed at
// prefill (e.g. the prompt's max key norm times a margin): cached signatures stay valid only
// while M does.
// Plane j (j < bits) has d + 1 coordinates w[j][c]; coordinate c comes from GaussianPair(p =
// c / 2) (z0 for even c, z1 for odd c) of PhiloxStream::Make(seed, RngTag::kSimHashPlane,
// sequence = layer, head = signature head, lane = j) (philox.h). Projection: fp32, ascending c,
// the augmentation coordinate last: dot = sum_{c<d} w[j][c] x[c], then dot += w[j][d] * aug.
//
// ---------------------------------------------------------------------------------------------
// Learned hash weight file, version 1 (all integers uint32 little-endian, floats IEEE-754
// binary32 little-endian, no padding):
//   offset 0   char[8]  magic "KVSPHASH"
//   8          u32      version = 1
//   12         u32      num_layers        L >= 1
//   16         u32      num_q_heads       H >= 1: query MLPs per layer
//   20         u32      num_key_mlps      Hk >= 1: key MLPs per layer; H (one per query head,
//                                         as HashAttention's released models) or Hkv (shared by
//                                         a GQA group)
//   24         u32      num_linear        N >= 1 linear layers per MLP
//   28         u32      dims[N + 1]       dims[0] = head_dim, dims[N] = bits (multiple of 32,
//                                         32..256), every dim in [1, 65536]
//   then, for layer l = 0..L-1: the H query MLPs (h = 0..H-1), then the Hk key MLPs; for each
//   MLP, for linear i = 0..N-1:
//              f32      weight[dims[i+1]][dims[i]]   row-major, as torch.nn.Linear.weight
//              f32      bias[dims[i+1]]
//   The file ends exactly there (the reader rejects trailing bytes).
// MLP: y_0 = x; y_{i+1} = W_i y_i + b_i, followed by SiLU(z) = z / (1 + exp(-z)) for every
// linear but the last; bit j = (y_N[j] > 0). fp32, each output a sum over inputs in ascending
// order (separate multiply and add), bias added last; exp(-z) computed in double and rounded to
// float. The GPU's LearnedSign (kernels/cuda/hash_topk.h) does the same, bit for bit.
#ifndef KVSPARSE_KERNELS_HASH_SIGNATURES_H_
#define KVSPARSE_KERNELS_HASH_SIGNATURES_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvsparse::kernels {

constexpr int32_t kMaxSignatureBits = 256;

// OK iff bits is a multiple of 32 in [32, 256]; INVALID_ARGUMENT naming `field` otherwise.
[[nodiscard]] absl::Status ValidateSignatureBits(int32_t bits, const char* field = "bits");

inline int32_t SignatureWords(int32_t bits) { return bits / 32; }

// bits - 2 * popcount(a ^ b) over `words` words.
int32_t HammingSimilarity(const uint32_t* a, const uint32_t* b, int32_t words);

// ---- SimHash ----------------------------------------------------------------------------------

struct SimHashPlanes {
  int32_t bits = 0;
  int32_t dim = 0;       // d; planes have d + 1 coordinates
  std::vector<float> w;  // [bits, d + 1]
};

// Generates the planes of one (layer, signature head) from the Philox mapping above.
[[nodiscard]] absl::Status MakeSimHashPlanes(uint64_t seed, int32_t layer, int32_t head,
                                             int32_t bits, int32_t dim, SimHashPlanes* out);

// Signature of [x, aug]. x: [dim] floats. out: [bits / 32] words.
void SimHashSign(const SimHashPlanes& planes, const float* x, float aug, uint32_t* out);
// Key: aug = sqrt(max(M^2 - |k|^2, 0)) with |k|^2 summed in fp32 ascending.
void SimHashKey(const SimHashPlanes& planes, const float* k, float max_norm, uint32_t* out);
// Query: aug = 0.
void SimHashQuery(const SimHashPlanes& planes, const float* q, uint32_t* out);

// ---- Learned MLPs -----------------------------------------------------------------------------

struct HashMlp {
  std::vector<int32_t> dims;                // [N + 1]
  std::vector<std::vector<float>> weights;  // [N] of [dims[i+1], dims[i]]
  std::vector<std::vector<float>> biases;   // [N] of [dims[i+1]]

  // Signature of x ([dims[0]] floats) into out ([dims[N] / 32] words). scratch is reused.
  void Sign(const float* x, uint32_t* out, std::vector<float>* scratch) const;
};

struct LearnedHashWeights {
  int32_t num_layers = 0;
  int32_t num_q_heads = 0;
  int32_t num_key_mlps = 0;
  std::vector<int32_t> dims;        // [N + 1], shared by every MLP
  std::vector<HashMlp> query_mlps;  // [L * H], index l * H + h
  std::vector<HashMlp> key_mlps;    // [L * Hk], index l * Hk + j

  int32_t head_dim() const { return dims.empty() ? 0 : dims.front(); }
  int32_t bits() const { return dims.empty() ? 0 : dims.back(); }
  const HashMlp& query(int32_t layer, int32_t h) const {
    return query_mlps[static_cast<size_t>(layer) * num_q_heads + h];
  }
  const HashMlp& key(int32_t layer, int32_t j) const {
    return key_mlps[static_cast<size_t>(layer) * num_key_mlps + j];
  }
};

// Checks shapes and dims (INVALID_ARGUMENT naming the field).
[[nodiscard]] absl::Status ValidateLearnedHashWeights(const LearnedHashWeights& w);

// Serialises to / parses from the version-1 byte format above.
[[nodiscard]] absl::StatusOr<std::string> SerializeLearnedHashWeights(const LearnedHashWeights& w);
[[nodiscard]] absl::StatusOr<LearnedHashWeights> ParseLearnedHashWeights(std::string_view bytes);

// File helpers: NOT_FOUND / INTERNAL for I/O errors, INVALID_ARGUMENT for a malformed file.
[[nodiscard]] absl::Status WriteLearnedHashWeights(const LearnedHashWeights& w,
                                                   const std::string& path);
[[nodiscard]] absl::StatusOr<LearnedHashWeights> ReadLearnedHashWeights(const std::string& path);

}  // namespace kvsparse::kernels

#endif  // KVSPARSE_KERNELS_HASH_SIGNATURES_H_
