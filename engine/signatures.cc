#include "engine/signatures.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"

namespace kvsparse::engine {

absl::Status LoadSignatureWeights(const std::string& hash_path, const std::string& saap_path,
                                  absl::string_view hash_name, absl::string_view saap_name,
                                  SignatureConfig* config) {
  if (!hash_path.empty() && !saap_path.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(hash_name, " and ", saap_name, " exclude each other"));
  }
  if (!hash_path.empty()) {
    absl::StatusOr<kernels::LearnedHashWeights> w = kernels::ReadLearnedHashWeights(hash_path);
    if (!w.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(hash_name, ": ", w.status().ToString()));
    }
    config->learned = std::make_shared<const kernels::LearnedHashWeights>(std::move(*w));
  }
  if (!saap_path.empty()) {
    absl::StatusOr<kernels::SaapWeights> w = kernels::ReadSaapWeights(saap_path);
    if (!w.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(saap_name, ": ", w.status().ToString()));
    }
    config->saap = std::make_shared<const kernels::SaapWeights>(std::move(*w));
  }
  return absl::OkStatus();
}

int32_t SignatureMaker::KeyHeads(const kvstore::ModelShape& shape) const {
  return learned() ? config_.learned->num_key_mlps : static_cast<int32_t>(shape.num_kv_heads);
}

const kernels::SimHashPlanes& SignatureMaker::Planes(int32_t layer, int32_t head, int32_t bits,
                                                     int32_t dim) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = planes_[{layer, head, bits, dim}];
  if (slot == nullptr) {
    slot = std::make_unique<kernels::SimHashPlanes>();
    // Arguments were validated by the engine (bits, dim); planes cannot fail for them.
    (void)kernels::MakeSimHashPlanes(config_.simhash_seed, layer, head, bits, dim, slot.get());
  }
  return *slot;
}

void SignatureMaker::Key(int32_t layer, int32_t sig_head, int32_t bits, int32_t dim,
                         int64_t position, const float* k, float max_norm, uint32_t* out,
                         std::vector<float>* scratch) {
  if (saap()) {
    for (int32_t w = 0; w < bits / 32; ++w) out[w] = 0;
    if (layer < config_.saap->num_layers && dim == config_.saap->head_dim &&
        sig_head < config_.saap->num_kv_heads) {
      out[0] = static_cast<uint32_t>(
          kernels::SaapAssignKey(*config_.saap, layer, sig_head, position, k, scratch));
    }
    return;
  }
  if (learned()) {
    config_.learned->key(layer, sig_head).Sign(k, out, scratch);
    return;
  }
  kernels::SimHashKey(Planes(layer, sig_head, bits, dim), k, max_norm, out);  // per kv head
}

void SignatureMaker::Query(int32_t layer, int32_t h, int32_t group, int32_t bits, int32_t dim,
                           const float* q, uint32_t* out, std::vector<float>* scratch) {
  if (learned()) {
    config_.learned->query(layer, h).Sign(q, out, scratch);
    return;
  }
  kernels::SimHashQuery(Planes(layer, h / group, bits, dim), q, out);
}

std::vector<float> MaxKeyNorms(const uint8_t* k, const kvstore::ModelShape& shape, uint64_t n,
                               bool token_major) {
  const size_t hkv = shape.num_kv_heads, row = shape.row_bytes();
  std::vector<float> norms(hkv, 0.f);
  for (uint64_t t = 0; t < n; ++t) {
    for (size_t h = 0; h < hkv; ++h) {
      const uint8_t* kr = k + (token_major ? t * hkv + h : h * n + t) * row;
      float sq = 0.f;
      for (uint32_t i = 0; i < shape.head_dim; ++i) {
        const float x = kernels::LoadAsFloat(kr, i, shape.dtype);
        sq += x * x;
      }
      norms[h] = std::max(norms[h], std::sqrt(sq));
    }
  }
  return norms;
}

}  // namespace kvsparse::engine
