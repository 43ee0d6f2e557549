// Value types shared by the store's API: model shape, placement, tiers, row kinds, policies.
#ifndef KVSPARSE_KVSTORE_TYPES_H_
#define KVSPARSE_KVSTORE_TYPES_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/dtype.h"

namespace kvsparse::kvstore {

using kernels::DType;

// Memory tiers. The store engine implements kHost; kDevice and kRemote are the seams the decode
// worker and the split deployment plug into.
enum class Tier : uint8_t { kHost = 0, kDevice = 1, kRemote = 2 };
inline constexpr int kNumTiers = 3;
absl::string_view TierName(Tier t);

enum class RowKind : uint8_t { kK = 1, kV = 2, kKV = 3 };
// The rows to read: K, V or both. REQUIRES: k || v.
constexpr RowKind RowKindOf(bool k, bool v) {
  return static_cast<RowKind>((k ? 1 : 0) | (v ? 2 : 0));
}

struct ModelShape {
  uint32_t num_layers = 0;    // L
  uint32_t num_q_heads = 0;   // H, a multiple of num_kv_heads
  uint32_t num_kv_heads = 0;  // Hkv
  uint32_t head_dim = 0;      // d
  DType dtype = DType::kBf16;

  // Bytes of one K (or one V) row.
  size_t row_bytes() const { return static_cast<size_t>(head_dim) * kernels::DTypeSize(dtype); }
};

// Where the decode worker keeps a sequence's rows. The store holds every row in its host tier
// regardless; kDevice means the worker also keeps that half resident on its GPU (only selected
// rows of a kHost half cross the boundary), signature_bits > 0 means it keeps HashAttention
// signatures of every key on the GPU, and compressed_key_bits > 0 every key quantized to that
// many bits per channel (kernels/compressed_keys.h).
struct Placement {
  Tier k_tier = Tier::kHost;    // kHost or kDevice
  Tier v_tier = Tier::kHost;    // kHost or kDevice
  uint32_t signature_bits = 0;  // 0, or a multiple of 32 up to 256
  uint32_t compressed_key_bits = 0;  // 0, 1, 2, 4 or 8 (head_dim * bits a multiple of 32)
};

// What the store does when an append needs more bytes than its capacity allows.
enum class CapacityPolicy : uint8_t {
  kReject = 0,    // the append fails with RESOURCE_EXHAUSTED; reads and drops keep working
  kEvictLru = 1,  // evict whole idle sequences, least recently used first
};
absl::string_view CapacityPolicyName(CapacityPolicy p);
// Parses "reject" or "evict-lru". INVALID_ARGUMENT otherwise.
absl::StatusOr<CapacityPolicy> ParseCapacityPolicy(absl::string_view name);

// Limits on shapes, checked by CreateSequence.
inline constexpr uint32_t kMaxLayers = 1024;
inline constexpr uint32_t kMaxHeads = 1024;
inline constexpr uint32_t kMaxHeadDim = 1024;
inline constexpr size_t kMaxSequenceIdBytes = 128;

// INVALID_ARGUMENT unless 1..128 bytes of [A-Za-z0-9._:-].
[[nodiscard]] absl::Status ValidateSequenceId(absl::string_view id);
// INVALID_ARGUMENT for a shape the store cannot hold (zero or too large dims, H % Hkv != 0).
[[nodiscard]] absl::Status ValidateModelShape(const ModelShape& shape);
// INVALID_ARGUMENT for bad signature or compressed key bits (for this shape) or a remote tier.
[[nodiscard]] absl::Status ValidatePlacement(const Placement& placement, const ModelShape& shape);

}  // namespace kvsparse::kvstore

#endif  // KVSPARSE_KVSTORE_TYPES_H_
