// Key widths: the channels of a kv head's compressed keys at different widths, the same bytes as
// the uniform format (kernels/compressed_keys.h). A calibration ranks each channel by the score
// error it can carry, E[q_c^2] times its squared range (the model's queries decide: ranked by the
// keys' ranges alone it is worse than uniform widths), and gives the first channels twice the
// bits, the middle ones the format's bits and leaves the last out, as many left out as widened
// (docs/ACCURACY.md, "Key widths per channel ranked by the queries").
//
// Stored as the uniform format: a widened channel is two stored channels, its code at 2 bits'
// width split in two digits: high (lo, step * 2^bits, code >> bits) and low (0, step, code mod
// 2^bits), whose sum is lo + step * code; a left-out channel is no stored channel (its term
// q_c k_c is left out of every score: nearly the same for every token, it moves the softmax
// little, and its whole value counts in the token's stored error norm). So a block keeps its
// layout and the scorers read q through the map (q'_v = q_{channel[v]}).
#ifndef KVSPARSE_KERNELS_KEY_WIDTHS_H_
#define KVSPARSE_KERNELS_KEY_WIDTHS_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvsparse::kernels {

// How a model channel is kept: left out, at the format's bits, or at twice them.
enum class ChannelWidth : uint8_t { kOut = 0, kWhole = 1, kWide = 2 };
// What a stored channel holds of its model channel.
enum class StoredPart : uint8_t { kWhole = 0, kHigh = 1, kLow = 2 };

// One (layer, kv head)'s map: stored channel v holds part[v] of model channel channel[v]; the
// model channels in ascending order, a wide one as its high then its low part.
struct KeyChannelMap {
  std::vector<uint8_t> channel;  // [d]
  std::vector<StoredPart> part;  // [d]
};

// The map of per-channel widths ([d]). INVALID_ARGUMENT unless the widths store exactly d channels
// (as many left out as wide), d <= 256.
[[nodiscard]] absl::StatusOr<KeyChannelMap> ChannelMapOf(const std::vector<ChannelWidth>& widths);

// A model's key widths, one map per (layer, kv head), for compressed keys of `bits`.
struct KeyWidths {
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t bits = 0;
  std::vector<std::vector<ChannelWidth>> widths;  // [layer * Hkv + j][d]
  std::vector<KeyChannelMap> maps;                // the same, as maps

  const KeyChannelMap& map(int32_t layer, int32_t kv_head) const {
    return maps[static_cast<size_t>(layer) * num_kv_heads + kv_head];
  }
};

// KeyWidths from per-(layer, kv head) widths; INVALID_ARGUMENT naming the layer and kv head of
// a map that does not store d channels, or bad counts.
[[nodiscard]] absl::StatusOr<KeyWidths> MakeKeyWidths(
    int32_t num_layers, int32_t num_kv_heads, int32_t head_dim, int32_t bits,
    std::vector<std::vector<ChannelWidth>> widths);

// The file (little-endian): "KVSPKWID", version 1, num_layers, num_kv_heads, head_dim, bits
// (u32 each), then per (layer, kv head) d bytes of ChannelWidth. What
// kvsparse.tools.key_widths writes (write_key_widths). Parse: INVALID_ARGUMENT for a bad file.
[[nodiscard]] std::string SerializeKeyWidths(const KeyWidths& w);
[[nodiscard]] absl::StatusOr<KeyWidths> ParseKeyWidths(std::string_view bytes);
[[nodiscard]] absl::StatusOr<KeyWidths> ReadKeyWidths(const std::string& path);

}  // namespace kvsparse::kernels

#endif  // KVSPARSE_KERNELS_KEY_WIDTHS_H_
