// SAAP bucket assignment of keys on the device (engine/cuda/key_signing.h).
#include <vector>

#include "engine/cuda/key_signing.h"

namespace kvsparse::engine::gpu {

namespace kc = kernels::cuda;

bool SaapOnGpu(const kernels::SaapWeights& w, const SequenceDesc& desc) {
  const kvstore::ModelShape& s = desc.shape;
  return desc.placement.signature_bits == 32 &&
         w.num_layers >= static_cast<int32_t>(s.num_layers) &&
         w.num_q_heads == static_cast<int32_t>(s.num_q_heads) &&
         w.num_kv_heads == static_cast<int32_t>(s.num_kv_heads) &&
         w.head_dim == static_cast<int32_t>(s.head_dim) && kc::SaapSupports(w);
}

SaapSigning::~SaapSigning() {
  for (auto& [key, buf] : layers_) memory_->Free(&buf);
}

absl::StatusOr<kc::SaapLayerWeights> SaapSigning::Layer(uint32_t layer) {
  if (static_cast<int32_t>(layer) >= weights_->num_layers) {
    return absl::FailedPreconditionError("no SAAP partitions for this layer");
  }
  DevBuf& slot = layers_[layer];
  if (slot.ptr == nullptr) {
    std::vector<float> packed;
    kc::PackSaapLayer(*weights_, static_cast<int32_t>(layer), &packed);
    if (absl::Status s = UploadTable(memory_, &slot, packed, "SAAP partitions upload"); !s.ok()) {
      return s;
    }
  }
  return kc::SaapLayerView(*weights_, slot.as<const float>());
}

absl::Status SaapSigning::Sign(DeviceSequence*, DeviceLayer* l, uint32_t layer,
                               const SequenceDesc& desc, const KeyChunk& keys, BusySequences) {
  absl::StatusOr<kc::SaapLayerWeights> w = Layer(layer);
  if (!w.ok()) return w.status();
  for (size_t j = 0; j < desc.shape.num_kv_heads; ++j) {
    kc::SaapAssignParams ap;
    ap.w = *w;
    ap.kv_head = static_cast<int32_t>(j);
    ap.num_keys = static_cast<int32_t>(keys.cnt);
    ap.first_position = static_cast<int64_t>(keys.t0);
    ap.dtype = desc.shape.dtype;
    ap.x = keys.k + j * keys.head_stride;
    ap.out = l->sig.as<uint32_t>() + j * l->capacity + keys.t0;
    KVS_CUDA_OK(kc::SaapAssignKeys(ap, memory_->stream()), "SaapAssignKeys");
  }
  return absl::OkStatus();
}

}  // namespace kvsparse::engine::gpu
