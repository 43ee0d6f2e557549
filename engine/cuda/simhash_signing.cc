// SimHash key signatures on the device (engine/cuda/key_signing.h).
#include <vector>

#include "engine/cuda/key_signing.h"
#include "engine/signatures.h"
#include "kernels/cuda/hash_topk.h"

namespace kvsparse::engine::gpu {

namespace kc = kernels::cuda;

absl::Status UploadTable(DeviceMemory* memory, DevBuf* slot, const std::vector<float>& host,
                         const char* what) {
  if (absl::Status s = memory->Alloc(slot, host.size() * sizeof(float)); !s.ok()) return s;
  KVS_CUDA_OK(cudaMemcpyAsync(slot->ptr, host.data(), slot->bytes, cudaMemcpyHostToDevice,
                              memory->stream()),
              what);
  KVS_CUDA_OK(cudaStreamSynchronize(memory->stream()), what);  // `host` goes out of scope after
  return absl::OkStatus();
}

SimHashSigning::~SimHashSigning() {
  for (auto& [key, buf] : planes_) memory_->Free(&buf);
}

absl::StatusOr<const float*> SimHashSigning::Planes(uint32_t layer, int32_t hkv, int32_t bits,
                                                    int32_t d) {
  DevBuf& slot = planes_[{layer, bits, d}];
  if (slot.ptr == nullptr) {
    std::vector<float> all;
    for (int32_t j = 0; j < hkv; ++j) {
      kernels::SimHashPlanes pl;
      if (absl::Status s =
              kernels::MakeSimHashPlanes(seed_, static_cast<int32_t>(layer), j, bits, d, &pl);
          !s.ok()) {
        return s;
      }
      all.insert(all.end(), pl.w.begin(), pl.w.end());
    }
    if (absl::Status s = UploadTable(memory_, &slot, all, "planes upload"); !s.ok()) return s;
  }
  return slot.as<const float>();
}

absl::Status SimHashSigning::Sign(DeviceSequence* e, DeviceLayer* l, uint32_t layer,
                                  const SequenceDesc& desc, const KeyChunk& keys,
                                  BusySequences busy) {
  const kvstore::ModelShape& shape = desc.shape;
  const int32_t words = static_cast<int32_t>(desc.placement.signature_bits / 32);
  const size_t hkv = shape.num_kv_heads;
  const int32_t d = static_cast<int32_t>(shape.head_dim);
  const cudaStream_t stream = memory_->stream();
  if (l->norms.ptr == nullptr) {
    // M, fixed now: the largest key norm of this first batch, times the margin (as
    // ResidentCache does, so both engines sign with the same M). Copied from pageable memory:
    // the copy has read max_norm when it returns.
    std::vector<float> max_norm = MaxKeyNorms(keys.k_host, shape, keys.cnt, /*token_major=*/false);
    for (float& m : max_norm) m *= norm_margin_;
    if (absl::Status s = memory_->Regrow(e, &l->norms, hkv * sizeof(float), busy, NoCopy);
        !s.ok()) {
      return s;
    }
    KVS_CUDA_OK(cudaMemcpyAsync(l->norms.ptr, max_norm.data(), hkv * sizeof(float),
                                cudaMemcpyHostToDevice, stream),
                "norm upload");
  }
  absl::StatusOr<const float*> planes = Planes(layer, static_cast<int32_t>(hkv), words * 32, d);
  if (!planes.ok()) return planes.status();
  for (size_t j = 0; j < hkv; ++j) {  // SimHashSign: bit for bit the CPU's SimHashKey
    kc::SimHashSignParams sp;
    sp.num_seqs = static_cast<int32_t>(keys.cnt);
    sp.heads = 1;
    sp.group = 1;
    sp.dim = d;
    sp.bits = words * 32;
    sp.dtype = shape.dtype;
    sp.x = keys.k + j * keys.head_stride;
    sp.planes = *planes + j * static_cast<size_t>(words) * 32 * (d + 1);
    sp.max_norm = l->norms.as<float>() + j;
    sp.out = l->sig.as<uint32_t>() + (j * l->capacity + keys.t0) * words;
    sp.out_batch_stride = words;
    KVS_CUDA_OK(kc::SimHashSign(sp, stream), "SimHashSign (keys)");
  }
  return absl::OkStatus();
}

}  // namespace kvsparse::engine::gpu
