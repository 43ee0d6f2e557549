// Key and query bit signatures (HashAttention): SimHash planes or learned MLPs, made the same
// way by the CPU engine's resident state and the GPU backend's (bit for bit).
#ifndef KVSPARSE_ENGINE_SIGNATURES_H_
#define KVSPARSE_ENGINE_SIGNATURES_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/hash_signatures.h"
#include "kernels/saap.h"
#include "kvstore/types.h"

namespace kvsparse::engine {

// How key and query signatures are made (a deployment setting, not per request).
struct SignatureConfig {
  // SimHash planes seed (the Philox key of RngTag::kSimHashPlane).
  uint64_t simhash_seed = 0x6b767370u;
  // SimHash M of a (sequence, layer, kv head) = norm_margin x the largest key norm present at
  // its first sync; keys appended later with a larger norm get augmentation 0.
  float norm_margin = 1.0f;
  // Learned MLP weights; null = SimHash. The bits of the file must equal the placement's.
  std::shared_ptr<const kernels::LearnedHashWeights> learned;
  // SAAP partitions: a key's signature is then its bucket (one word; signature_bits 32), which
  // the saap method reads; the hash methods are refused (their signatures are not kept).
  std::shared_ptr<const kernels::SaapWeights> saap;
};

// The signature weights a deployment names by file (kvsparse-server's --hash_weights and
// --saap_weights, the op's hash_weights and saap_weights): learned MLP weights or SAAP
// partitions, at most one of them (empty paths: SimHash). INVALID_ARGUMENT naming the setting
// (`hash_name` / `saap_name`) and the reader's reason when a file does not read or both are given.
[[nodiscard]] absl::Status LoadSignatureWeights(const std::string& hash_path,
                                                const std::string& saap_path,
                                                absl::string_view hash_name,
                                                absl::string_view saap_name,
                                                SignatureConfig* config);

// Makes signatures; caches SimHash planes per (layer, head, bits, dim). Thread-safe.
class SignatureMaker {
 public:
  explicit SignatureMaker(SignatureConfig config) : config_(std::move(config)) {}
  bool learned() const { return config_.learned != nullptr; }
  bool saap() const { return config_.saap != nullptr; }
  // Key signature heads for a shape: Hkv for SimHash, the file's key MLPs for learned.
  int32_t KeyHeads(const kvstore::ModelShape& shape) const;
  // Signature of one key (d floats, post-RoPE at token `position`) for signature head
  // `sig_head`; with SAAP partitions, word 0 is its bucket and the others 0.
  void Key(int32_t layer, int32_t sig_head, int32_t bits, int32_t dim, int64_t position,
           const float* k, float max_norm, uint32_t* out, std::vector<float>* scratch);
  // Signature of query head h (dim floats) of a model with group size G.
  void Query(int32_t layer, int32_t h, int32_t group, int32_t bits, int32_t dim, const float* q,
             uint32_t* out, std::vector<float>* scratch);
  const SignatureConfig& config() const { return config_; }

 private:
  const kernels::SimHashPlanes& Planes(int32_t layer, int32_t head, int32_t bits, int32_t dim);
  const SignatureConfig config_;
  std::mutex mu_;
  std::map<std::tuple<int32_t, int32_t, int32_t, int32_t>, std::unique_ptr<kernels::SimHashPlanes>>
      planes_;
};

// Largest key norm of each kv head over n tokens of K rows (the sequence's dtype), laid out
// token-major ([n][Hkv][d]) or head-major ([Hkv][n][d]); norms summed in fp32 in order, as
// SimHashKey's. Times SignatureConfig::norm_margin, it is a layer's SimHash M.
std::vector<float> MaxKeyNorms(const uint8_t* k, const kvstore::ModelShape& shape, uint64_t n,
                               bool token_major);

}  // namespace kvsparse::engine

#endif  // KVSPARSE_ENGINE_SIGNATURES_H_
