// HashAttention's learned key signatures on the device (engine/cuda/key_signing.h).
#include <vector>

#include "engine/cuda/key_signing.h"
#include "kernels/cuda/hash_topk.h"

namespace kvsparse::engine::gpu {

namespace kc = kernels::cuda;

bool LearnedSignsOnGpu(const kernels::LearnedHashWeights& w, const SequenceDesc& desc) {
  const kvstore::ModelShape& s = desc.shape;
  return w.num_key_mlps == static_cast<int32_t>(s.num_kv_heads) &&
         w.num_q_heads == static_cast<int32_t>(s.num_q_heads) &&
         w.head_dim() == static_cast<int32_t>(s.head_dim) &&
         w.bits() == static_cast<int32_t>(desc.placement.signature_bits) &&
         w.num_layers >= static_cast<int32_t>(s.num_layers) && kc::LearnedSignSupports(w.dims);
}

LearnedSigning::~LearnedSigning() {
  for (auto& [key, buf] : mlps_) memory_->Free(&buf);
}

absl::StatusOr<const float*> LearnedSigning::Mlps(uint32_t layer) {
  const kernels::LearnedHashWeights& w = *weights_;
  if (static_cast<int32_t>(layer) >= w.num_layers) {
    return absl::FailedPreconditionError("no learned hash weights for this layer");
  }
  DevBuf& slot = mlps_[layer];
  if (slot.ptr == nullptr) {
    std::vector<float> all;
    for (int32_t h = 0; h < w.num_q_heads; ++h) {
      kc::AppendPackedMlp(w.query(static_cast<int32_t>(layer), h), &all);
    }
    for (int32_t j = 0; j < w.num_key_mlps; ++j) {
      kc::AppendPackedMlp(w.key(static_cast<int32_t>(layer), j), &all);
    }
    if (absl::Status s = UploadTable(memory_, &slot, all, "learned MLPs upload"); !s.ok()) {
      return s;
    }
  }
  return slot.as<const float>();
}

absl::Status LearnedSigning::Sign(DeviceSequence*, DeviceLayer* l, uint32_t layer,
                                  const SequenceDesc& desc, const KeyChunk& keys, BusySequences) {
  const kernels::LearnedHashWeights& w = *weights_;
  const int32_t words = static_cast<int32_t>(desc.placement.signature_bits / 32);
  absl::StatusOr<const float*> mlps = Mlps(layer);
  if (!mlps.ok()) return mlps.status();
  const int32_t n_lin = static_cast<int32_t>(w.dims.size()) - 1;
  const int64_t per_mlp = kc::LearnedMlpFloats(w.dims.data(), n_lin);
  for (size_t j = 0; j < desc.shape.num_kv_heads; ++j) {
    kc::LearnedSignParams lp;
    lp.num_seqs = static_cast<int32_t>(keys.cnt);
    lp.heads = 1;
    lp.num_linear = n_lin;
    for (int32_t i = 0; i <= n_lin; ++i) lp.dims[i] = w.dims[i];
    lp.dtype = desc.shape.dtype;
    lp.x = keys.k + j * keys.head_stride;
    lp.mlps = *mlps + (w.num_q_heads + static_cast<int64_t>(j)) * per_mlp;
    lp.out = l->sig.as<uint32_t>() + (j * l->capacity + keys.t0) * words;
    lp.out_batch_stride = words;
    KVS_CUDA_OK(kc::LearnedSign(lp, memory_->stream()), "LearnedSign (keys)");
  }
  return absl::OkStatus();
}

}  // namespace kvsparse::engine::gpu
