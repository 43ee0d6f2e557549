// Key signatures on the device, one class per signature kind, each with its per-layer tables
// (uploaded once, not charged to a sequence) and its signing of a chunk of keys as the rows are
// synced (DeviceState::Sync) into the layer's `sig` buffer, [Hkv][capacity][words]:
//   SimHashSigning  SimHashSign with the seeded planes and the layer's M (bit for bit the CPU
//                   engine's SignatureMaker); also the planes the query signing reads;
//   LearnedSigning  HashAttention's learned MLPs (kernels::cuda::LearnedSign);
//   SaapSigning     SAAP partitions: a key's signature is its bucket (one word), which the saap
//                   runner reads with the partitions.
// A sequence whose shape a kind cannot serve on the GPU (OnGpu false) is not signed here: its
// calls of that kind run on the CPU engine, which keeps its own signatures.
#ifndef KVSPARSE_ENGINE_CUDA_KEY_SIGNING_H_
#define KVSPARSE_ENGINE_CUDA_KEY_SIGNING_H_

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cuda/device_memory.h"
#include "kernels/cuda/saap.h"
#include "kernels/hash_signatures.h"
#include "kernels/saap.h"

namespace kvsparse::engine::gpu {

// Whether the GPU signs a sequence's keys and queries with the learned MLPs `w`: one key MLP per
// kv head, its shape and bits, and dims within LearnedSign's limits. Otherwise (e.g. one key MLP
// per query head) its learned-signature calls run on the CPU engine.
bool LearnedSignsOnGpu(const kernels::LearnedHashWeights& w, const SequenceDesc& desc);
// Whether the GPU assigns (and the saap runner reads) SAAP buckets for a sequence: the
// partitions fit its model (layers, heads, head dim), it keeps one-word signatures, and the
// kernels take the partitions' sizes. Otherwise its saap calls run on the CPU engine.
bool SaapOnGpu(const kernels::SaapWeights& w, const SequenceDesc& desc);

// Tokens [t0, t0 + cnt) of one layer's keys: on the device, kv head j's rows at
// k + j * head_stride, and the same rows in host memory (head-major, cnt rows per head).
struct KeyChunk {
  const uint8_t* k = nullptr;
  int64_t head_stride = 0;
  const uint8_t* k_host = nullptr;
  uint64_t t0 = 0, cnt = 0;
};

class KeySigning {
 public:
  virtual ~KeySigning() = default;
  virtual bool OnGpu(const SequenceDesc& desc) const = 0;
  // Writes the chunk's signatures into l->sig (grown to hold them: DeviceState::Sync).
  virtual absl::Status Sign(DeviceSequence* e, DeviceLayer* l, uint32_t layer,
                            const SequenceDesc& desc, const KeyChunk& keys, BusySequences busy) = 0;
};

class SimHashSigning final : public KeySigning {
 public:
  // REQUIRES: memory outlives it.
  SimHashSigning(uint64_t seed, float norm_margin, DeviceMemory* memory)
      : seed_(seed), norm_margin_(norm_margin), memory_(memory) {}
  ~SimHashSigning() override;
  bool OnGpu(const SequenceDesc&) const override { return true; }
  // The first chunk of a layer fixes its M per kv head (l->norms): the largest key norm of the
  // chunk times the margin, as the CPU engine's ResidentCache does.
  absl::Status Sign(DeviceSequence* e, DeviceLayer* l, uint32_t layer, const SequenceDesc& desc,
                    const KeyChunk& keys, BusySequences busy) override;
  // The planes of every kv head of a layer on the device: [Hkv][bits][d + 1].
  absl::StatusOr<const float*> Planes(uint32_t layer, int32_t hkv, int32_t bits, int32_t d);

 private:
  const uint64_t seed_;
  const float norm_margin_;
  DeviceMemory* const memory_;
  std::map<std::tuple<uint32_t, int32_t, int32_t>, DevBuf> planes_;
};

class LearnedSigning final : public KeySigning {
 public:
  // REQUIRES: memory outlives it.
  LearnedSigning(std::shared_ptr<const kernels::LearnedHashWeights> weights, DeviceMemory* memory)
      : weights_(std::move(weights)), memory_(memory) {}
  ~LearnedSigning() override;
  bool OnGpu(const SequenceDesc& desc) const override { return LearnedSignsOnGpu(*weights_, desc); }
  absl::Status Sign(DeviceSequence* e, DeviceLayer* l, uint32_t layer, const SequenceDesc& desc,
                    const KeyChunk& keys, BusySequences busy) override;
  // The MLPs of a layer on the device (kernels::cuda::LearnedSign's packing): the H query MLPs,
  // then the key MLPs.
  absl::StatusOr<const float*> Mlps(uint32_t layer);
  const kernels::LearnedHashWeights& weights() const { return *weights_; }

 private:
  const std::shared_ptr<const kernels::LearnedHashWeights> weights_;
  DeviceMemory* const memory_;
  std::map<uint32_t, DevBuf> mlps_;  // per layer
};

class SaapSigning final : public KeySigning {
 public:
  // REQUIRES: memory outlives it.
  SaapSigning(std::shared_ptr<const kernels::SaapWeights> weights, DeviceMemory* memory)
      : weights_(std::move(weights)), memory_(memory) {}
  ~SaapSigning() override;
  bool OnGpu(const SequenceDesc& desc) const override { return SaapOnGpu(*weights_, desc); }
  // Each key's bucket, as the CPU engine's SaapAssignKey.
  absl::Status Sign(DeviceSequence* e, DeviceLayer* l, uint32_t layer, const SequenceDesc& desc,
                    const KeyChunk& keys, BusySequences busy) override;
  // A layer of the partitions on the device (kernels::cuda::PackSaapLayer's packing).
  absl::StatusOr<kernels::cuda::SaapLayerWeights> Layer(uint32_t layer);

 private:
  const std::shared_ptr<const kernels::SaapWeights> weights_;
  DeviceMemory* const memory_;
  std::map<uint32_t, DevBuf> layers_;
};

// Allocates *slot and copies `host` into it, waiting for the copy: a layer's table, uploaded
// once.
absl::Status UploadTable(DeviceMemory* memory, DevBuf* slot, const std::vector<float>& host,
                         const char* what);

}  // namespace kvsparse::engine::gpu

#endif  // KVSPARSE_ENGINE_CUDA_KEY_SIGNING_H_
