#include "kvstore/types.h"

#include "absl/strings/str_cat.h"

namespace kvsparse::kvstore {

absl::string_view TierName(Tier t) {
  switch (t) {
    case Tier::kHost:
      return "host";
    case Tier::kDevice:
      return "device";
    case Tier::kRemote:
      return "remote";
  }
  return "?";
}

absl::string_view CapacityPolicyName(CapacityPolicy p) {
  return p == CapacityPolicy::kReject ? "reject" : "evict-lru";
}

absl::StatusOr<CapacityPolicy> ParseCapacityPolicy(absl::string_view name) {
  if (name == "reject") return CapacityPolicy::kReject;
  if (name == "evict-lru") return CapacityPolicy::kEvictLru;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown capacity policy '", name, "' (want reject or evict-lru)"));
}

absl::Status ValidateSequenceId(absl::string_view id) {
  if (id.empty() || id.size() > kMaxSequenceIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence_id must be 1..", kMaxSequenceIdBytes, " bytes, got ", id.size()));
  }
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == ':' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("sequence_id may hold only [A-Za-z0-9._:-]; got byte 0x",
                       absl::Hex(static_cast<unsigned char>(c))));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateModelShape(const ModelShape& s) {
  if (s.num_layers == 0 || s.num_layers > kMaxLayers) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_layers must be 1..", kMaxLayers, ", got ", s.num_layers));
  }
  if (s.num_kv_heads == 0 || s.num_kv_heads > kMaxHeads) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_kv_heads must be 1..", kMaxHeads, ", got ", s.num_kv_heads));
  }
  if (s.num_q_heads == 0 || s.num_q_heads > kMaxHeads || s.num_q_heads % s.num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_q_heads must be a multiple of num_kv_heads ", s.num_kv_heads, " up to ",
                     kMaxHeads, ", got ", s.num_q_heads));
  }
  if (s.head_dim == 0 || s.head_dim > kMaxHeadDim || s.head_dim % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim must be a multiple of 8 in 8..", kMaxHeadDim, ", got ", s.head_dim));
  }
  return absl::OkStatus();
}

absl::Status ValidatePlacement(const Placement& p, const ModelShape& shape) {
  if (p.signature_bits % 32 != 0 || p.signature_bits > 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "signature_bits must be 0 or a multiple of 32 up to 256, got ", p.signature_bits));
  }
  const uint32_t cb = p.compressed_key_bits;
  if (cb != 0 && cb != 1 && cb != 2 && cb != 4 && cb != 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("compressed_key_bits must be 0, 1, 2, 4 or 8, got ", cb));
  }
  if (static_cast<uint64_t>(shape.head_dim) * cb % 32 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("compressed_key_bits ", cb, " x head_dim ", shape.head_dim,
                     " must be a multiple of 32 (whole 32-bit words of codes per key)"));
  }
  // The store always holds every row in its host tier; a placement says where the decode
  // worker keeps its own copy (device) or reads through the store (host).
  for (Tier t : {p.k_tier, p.v_tier}) {
    if (t == Tier::kRemote) {
      return absl::InvalidArgumentError(
          "placement tiers are host or device (where the decode worker keeps rows); remote is "
          "where a worker reaches a store, not a placement");
    }
  }
  return absl::OkStatus();
}

}  // namespace kvsparse::kvstore
