#include "kernels/key_widths.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/binary_io.h"

namespace kvsparse::kernels {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'S', 'P', 'K', 'W', 'I', 'D'};
constexpr uint32_t kVersion = 1;

}  // namespace

absl::StatusOr<KeyChannelMap> ChannelMapOf(const std::vector<ChannelWidth>& widths) {
  const size_t d = widths.size();
  if (d == 0 || d > 256) {
    return absl::InvalidArgumentError(absl::StrCat("key widths: head_dim ", d, " not in 1..256"));
  }
  KeyChannelMap m;
  for (size_t c = 0; c < d; ++c) {
    const auto ch = static_cast<uint8_t>(c);
    switch (widths[c]) {
      case ChannelWidth::kOut:
        break;
      case ChannelWidth::kWhole:
        m.channel.push_back(ch);
        m.part.push_back(StoredPart::kWhole);
        break;
      case ChannelWidth::kWide:
        m.channel.insert(m.channel.end(), {ch, ch});
        m.part.insert(m.part.end(), {StoredPart::kHigh, StoredPart::kLow});
        break;
      default:
        return absl::InvalidArgumentError(absl::StrCat(
            "key widths: channel ", c, " has width class ", static_cast<int>(widths[c])));
    }
  }
  if (m.channel.size() != d) {
    return absl::InvalidArgumentError(
        absl::StrCat("key widths store ", m.channel.size(), " channels, not ", d,
                     ": as many channels must be left out as are widened"));
  }
  return m;
}

absl::StatusOr<KeyWidths> MakeKeyWidths(int32_t num_layers, int32_t num_kv_heads, int32_t head_dim,
                                        int32_t bits,
                                        std::vector<std::vector<ChannelWidth>> widths) {
  if (num_layers < 1 || num_kv_heads < 1 || head_dim < 1 || head_dim > 256 ||
      (bits != 1 && bits != 2 && bits != 4)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key widths: ", num_layers, " layers, ", num_kv_heads, " kv heads, head_dim ", head_dim,
        ", bits ", bits, " (bits 1, 2 or 4: a widened channel takes twice them)"));
  }
  if (widths.size() != static_cast<size_t>(num_layers) * num_kv_heads) {
    return absl::InvalidArgumentError(
        absl::StrCat("key widths: ", widths.size(), " maps for ", num_layers, " x ", num_kv_heads));
  }
  KeyWidths w;
  w.num_layers = num_layers;
  w.num_kv_heads = num_kv_heads;
  w.head_dim = head_dim;
  w.bits = bits;
  for (size_t i = 0; i < widths.size(); ++i) {
    const std::string where =
        absl::StrCat("layer ", i / num_kv_heads, " kv head ", i % num_kv_heads);
    if (widths[i].size() != static_cast<size_t>(head_dim)) {
      return absl::InvalidArgumentError(
          absl::StrCat("key widths, ", where, ": ", widths[i].size(), " channels"));
    }
    absl::StatusOr<KeyChannelMap> m = ChannelMapOf(widths[i]);
    if (!m.ok()) return absl::InvalidArgumentError(absl::StrCat(where, ": ", m.status().message()));
    w.maps.push_back(*std::move(m));
  }
  w.widths = std::move(widths);
  return w;
}

std::string SerializeKeyWidths(const KeyWidths& w) {
  std::string s(kMagic, sizeof(kMagic));
  for (uint32_t x :
       {kVersion, static_cast<uint32_t>(w.num_layers), static_cast<uint32_t>(w.num_kv_heads),
        static_cast<uint32_t>(w.head_dim), static_cast<uint32_t>(w.bits)}) {
    PutU32(&s, x);
  }
  for (const std::vector<ChannelWidth>& m : w.widths) {
    for (ChannelWidth c : m) s.push_back(static_cast<char>(c));
  }
  return s;
}

absl::StatusOr<KeyWidths> ParseKeyWidths(std::string_view bytes) {
  ByteReader r(bytes);
  char magic[8];
  if (!r.Bytes(magic, 8) || std::memcmp(magic, kMagic, 8) != 0) {
    return absl::InvalidArgumentError("key widths: bad magic (want \"KVSPKWID\")");
  }
  uint32_t h[5];
  for (uint32_t& x : h) {
    if (!r.U32(&x)) return absl::InvalidArgumentError("key widths: truncated header");
  }
  if (h[0] != kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("key widths: unsupported version ", h[0]));
  }
  if (h[1] < 1 || h[1] > 4096 || h[2] < 1 || h[2] > 4096 || h[3] < 1 || h[3] > 256) {
    return absl::InvalidArgumentError("key widths: header counts out of range");
  }
  const uint64_t maps = static_cast<uint64_t>(h[1]) * h[2], d = h[3];
  if (r.remaining() != maps * d) {
    return absl::InvalidArgumentError(absl::StrCat("key widths: payload is ", r.remaining(),
                                                   " bytes, header implies ", maps * d));
  }
  std::vector<std::vector<ChannelWidth>> widths(maps, std::vector<ChannelWidth>(d));
  for (std::vector<ChannelWidth>& m : widths) {
    std::vector<char> raw(d);
    r.Bytes(raw.data(), d);
    for (uint64_t c = 0; c < d; ++c) m[c] = static_cast<ChannelWidth>(raw[c]);
  }
  return MakeKeyWidths(static_cast<int32_t>(h[1]), static_cast<int32_t>(h[2]),
                       static_cast<int32_t>(h[3]), static_cast<int32_t>(h[4]), std::move(widths));
}

absl::StatusOr<KeyWidths> ReadKeyWidths(const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadWholeFile(path);
  if (!bytes.ok()) return bytes.status();
  return ParseKeyWidths(*bytes);
}

}  // namespace kvsparse::kernels
