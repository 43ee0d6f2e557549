#include "kernels/compressed_keys.h"

#include <algorithm>
#include <bitset>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/key_quantization.h"

namespace kvsparse::kernels {

using keyq::Half;

absl::Status ValidateKeyCompression(const KeyCompression& c, int32_t head_dim) {
  if (c.bits != 1 && c.bits != 2 && c.bits != 4 && c.bits != 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("compressed key bits must be 1, 2, 4 or 8, got ", c.bits));
  }
  if (head_dim <= 0 || (static_cast<int64_t>(head_dim) * c.bits) % 32 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("compressed keys: head_dim ", head_dim, " x ",
                                                   c.bits, " bits is not a multiple of 32"));
  }
  if (c.group_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("compressed key group_tokens must be positive, got ", c.group_tokens));
  }
  if (c.map != nullptr && (c.map->channel.size() != static_cast<size_t>(head_dim) ||
                           c.map->part.size() != static_cast<size_t>(head_dim) || c.bits == 8)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "compressed keys: a channel map of ", c.map->channel.size(), " channels for head_dim ",
        head_dim, " at ", c.bits, " bits (widened channels take twice the bits: 1, 2 or 4)"));
  }
  return absl::OkStatus();
}

size_t KeyGroupBytes(const KeyCompression& c, int32_t head_dim) {
  return static_cast<size_t>(c.group_tokens) * (static_cast<size_t>(head_dim) * c.bits / 8) +
         static_cast<size_t>(head_dim) * 2 * sizeof(uint16_t) +
         static_cast<size_t>(c.group_tokens) * sizeof(uint16_t);
}

namespace {

// Rows of exact-tail capacity for `rows` open-group tokens: steps of 16.
uint64_t TailRows(uint64_t rows) { return (rows + 15) / 16 * 16; }

}  // namespace

size_t CompressedKeyBytes(const KeyCompression& c, int32_t head_dim, size_t row_bytes,
                          uint64_t tokens) {
  const uint64_t groups = tokens / c.group_tokens;
  return groups * KeyGroupBytes(c, head_dim) + TailRows(tokens % c.group_tokens) * row_bytes;
}

size_t CompressedKeysView::bytes_read() const {
  const KeyCompression c{bits, group};
  return static_cast<size_t>(closed / group) * KeyGroupBytes(c, head_dim) +
         static_cast<size_t>(length - closed) * head_dim * DTypeSize(dtype);
}

CompressedKeys::CompressedKeys(KeyCompression c, int32_t head_dim, DType dtype)
    : c_(c),
      d_(head_dim),
      dtype_(dtype),
      row_bytes_(static_cast<size_t>(head_dim) * DTypeSize(dtype)),
      words_(head_dim * c.bits / 32) {}

size_t CompressedKeys::bytes() const { return CompressedKeyBytes(c_, d_, row_bytes_, length_); }

size_t CompressedKeys::bytes_after(uint64_t tokens) const {
  return CompressedKeyBytes(c_, d_, row_bytes_, length_ + tokens);
}

void CompressedKeys::Append(const void* row) {
  const size_t open = static_cast<size_t>(length_ - closed_);
  if ((open + 1) * row_bytes_ > tail_.capacity()) tail_.reserve(TailRows(open + 1) * row_bytes_);
  tail_.resize((open + 1) * row_bytes_);
  std::memcpy(tail_.data() + open * row_bytes_, row, row_bytes_);
  ++length_;
  if (length_ - closed_ == c_.group_tokens) CloseGroup();
}

namespace {

// Model channel of stored channel v, and the part it holds (the identity without a map).
struct Stored {
  int32_t channel;
  StoredPart part;
};
Stored StoredOf(const KeyChannelMap* map, int32_t v) {
  return map == nullptr ? Stored{v, StoredPart::kWhole} : Stored{map->channel[v], map->part[v]};
}

// Each model channel's width under a map (every channel whole without one).
std::vector<ChannelWidth> WidthsOf(const KeyChannelMap* map, int32_t d) {
  std::vector<ChannelWidth> w(d, map == nullptr ? ChannelWidth::kWhole : ChannelWidth::kOut);
  for (int32_t v = 0; map != nullptr && v < d; ++v) {
    w[map->channel[v]] =
        map->part[v] == StoredPart::kWhole ? ChannelWidth::kWhole : ChannelWidth::kWide;
  }
  return w;
}

// The model channels a map leaves out (none without one), without allocating: what a tail
// token's error norm covers (KeyErrorBound, called per token). d <= 256 with a map.
std::bitset<256> LeftOutOf(const KeyChannelMap* map, int32_t d) {
  std::bitset<256> out;
  if (map == nullptr) return out;
  for (int32_t c = 0; c < d; ++c) out.set(c);
  for (int32_t v = 0; v < d; ++v) out.reset(map->channel[v]);
  return out;
}

}  // namespace

void CompressKeyGroup(const KeyCompression& c, int32_t head_dim, DType dtype, const void* rows,
                      uint8_t* block) {
  const int32_t G = c.group_tokens, d = head_dim;
  const int32_t words = d * c.bits / 32;
  const size_t row_bytes = static_cast<size_t>(d) * DTypeSize(dtype);
  const uint32_t levels = (1u << c.bits) - 1, wide_levels = (1u << (2 * c.bits)) - 1;
  std::vector<float> k(static_cast<size_t>(G) * d);
  for (int32_t t = 0; t < G; ++t) {
    for (int32_t ch = 0; ch < d; ++ch) {
      k[t * d + ch] = LoadAsFloat(static_cast<const uint8_t*>(rows) + t * row_bytes, ch, dtype);
    }
  }
  std::memset(block, 0, KeyGroupBytes(c, d));
  uint32_t* codes = reinterpret_cast<uint32_t*>(block);
  uint16_t* lo16 = reinterpret_cast<uint16_t*>(block + static_cast<size_t>(G) * words * 4);
  uint16_t* step16 = lo16 + d;
  uint16_t* err16 = lo16 + 2 * d;
  // Each model channel's scale at its width (a left-out channel has none).
  const std::vector<ChannelWidth> width = WidthsOf(c.map, d);
  std::vector<uint32_t> top(d);
  std::vector<keyq::ChannelScale> scale(d);
  for (int32_t ch = 0; ch < d; ++ch) {
    top[ch] = width[ch] == ChannelWidth::kWide ? wide_levels : levels;
    if (width[ch] == ChannelWidth::kOut) continue;
    float mn = k[ch], mx = k[ch];
    for (int32_t t = 1; t < G; ++t) {
      mn = std::min(mn, k[t * d + ch]);
      mx = std::max(mx, k[t * d + ch]);
    }
    scale[ch] = keyq::ScaleOf(mn, mx, top[ch]);
  }
  // The stored channels' scales: a wide channel's high part steps 2^bits of its low part.
  for (int32_t v = 0; v < d; ++v) {
    const Stored st = StoredOf(c.map, v);
    const keyq::ChannelScale& sc = scale[st.channel];
    lo16[v] = st.part == StoredPart::kLow ? uint16_t{0} : sc.lo16;
    step16[v] = st.part == StoredPart::kHigh
                    ? keyq::HalfNearest(Half(sc.step16) * static_cast<float>(1u << c.bits))
                    : sc.step16;
  }
  std::vector<uint32_t> code(d);
  std::vector<float> kq(d);  // what a widened channel's two stored parts give back
  for (int32_t t = 0; t < G; ++t) {
    const float* x = &k[static_cast<size_t>(t) * d];
    for (int32_t ch = 0; ch < d; ++ch) {
      code[ch] = width[ch] == ChannelWidth::kOut
                     ? 0
                     : keyq::CodeOf(x[ch], Half(scale[ch].lo16), Half(scale[ch].step16), top[ch]);
    }
    uint32_t* w = codes + static_cast<size_t>(t) * words;
    std::fill(kq.begin(), kq.end(), 0.f);
    for (int32_t v = 0; v < d; ++v) {
      const Stored st = StoredOf(c.map, v);
      const uint32_t cv = st.part == StoredPart::kWhole  ? code[st.channel]
                          : st.part == StoredPart::kHigh ? code[st.channel] >> c.bits
                                                         : code[st.channel] & levels;
      const int64_t bit = static_cast<int64_t>(v) * c.bits;
      w[bit / 32] |= cv << (bit % 32);
      if (st.part != StoredPart::kWhole) {
        kq[st.channel] += Half(lo16[v]) + Half(step16[v]) * static_cast<float>(cv);
      }
    }
    double err2 = 0;
    for (int32_t ch = 0; ch < d; ++ch) {  // over the model's channels (a left-out one whole)
      err2 = width[ch] == ChannelWidth::kWhole
                 ? keyq::AddSquaredError(err2, x[ch], Half(scale[ch].lo16), Half(scale[ch].step16),
                                         code[ch])
                 : keyq::AddSquaredError(err2, x[ch], kq[ch], 0.f, 0);
    }
    err16[t] = keyq::HalfBound(keyq::Sqrt(err2));
  }
}

void CompressedKeys::CloseGroup() {
  std::unique_ptr<uint8_t[]> block(new uint8_t[KeyGroupBytes(c_, d_)]);
  CompressKeyGroup(c_, d_, dtype_, tail_.data(), block.get());
  block_ptrs_.push_back(block.get());
  blocks_.push_back(std::move(block));
  closed_ += c_.group_tokens;
  tail_.clear();
  tail_.shrink_to_fit();
}

CompressedKeysView CompressedKeys::view() const {
  CompressedKeysView v;
  v.bits = c_.bits;
  v.group = c_.group_tokens;
  v.head_dim = d_;
  v.dtype = dtype_;
  v.length = length_;
  v.closed = closed_;
  v.groups = block_ptrs_.data();
  v.tail = tail_.data();
  v.map = c_.map;
  return v;
}

float KeyErrorBound(const CompressedKeysView& v, int64_t t) {
  if (t < v.closed) return Half(v.err(t / v.group)[t % v.group]);
  if (v.map == nullptr) return 0.f;
  const std::bitset<256> out = LeftOutOf(v.map, v.head_dim);
  const uint8_t* row = v.tail + (t - v.closed) * v.head_dim * DTypeSize(v.dtype);
  double err2 = 0;  // the left-out channels: the tail's score leaves them out
  for (int32_t c = 0; c < v.head_dim; ++c) {
    if (out[c]) {
      err2 = keyq::AddSquaredError(err2, LoadAsFloat(row, c, v.dtype), 0.f, 0.f, 0);
    }
  }
  return err2 > 0 ? Half(keyq::HalfBound(keyq::Sqrt(err2))) : 0.f;
}

void DecompressKey(const CompressedKeysView& v, int64_t t, float* out) {
  const int32_t d = v.head_dim;
  if (t >= v.closed) {
    const uint8_t* row = v.tail + (t - v.closed) * d * DTypeSize(v.dtype);
    for (int32_t c = 0; c < d; ++c) out[c] = LoadAsFloat(row, c, v.dtype);
    return;
  }
  const int64_t g = t / v.group;
  const uint32_t* w = v.codes(g) + (t % v.group) * v.words();
  const uint16_t *lo = v.lo(g), *step = v.step(g);
  const uint32_t mask = (1u << v.bits) - 1;
  for (int32_t c = 0; c < d; ++c) out[c] = 0.f;
  for (int32_t c = 0; c < d; ++c) {
    const int64_t bit = static_cast<int64_t>(c) * v.bits;
    const uint32_t code = (w[bit / 32] >> (bit % 32)) & mask;
    out[StoredOf(v.map, c).channel] += Half(lo[c]) + Half(step[c]) * static_cast<float>(code);
  }
}

void ApproximateScores(const CompressedKeysView& v, const float* q, float scale, float* out) {
  const int32_t d = v.head_dim, words = v.words(), bits = v.bits;
  const uint32_t mask = (1u << bits) - 1;
  const int32_t per_word = 32 / bits;
  std::vector<float> qs(d);
  for (int64_t g = 0; g * v.group < v.closed; ++g) {
    // q . k~_t = sum_c q_c lo_c + sum_c (q_c step_c) code_tc: one base per group.
    const uint16_t *lo = v.lo(g), *step = v.step(g);
    float base = 0.f;
    for (int32_t c = 0; c < d; ++c) {  // q through the map: q'_c = q[channel[c]]
      const float qc = q[StoredOf(v.map, c).channel];
      base += qc * Half(lo[c]);
      qs[c] = qc * Half(step[c]);
    }
    const uint32_t* codes = v.codes(g);
    for (int64_t t = g * v.group; t < (g + 1) * v.group; ++t) {
      const uint32_t* w = codes + (t - g * v.group) * words;
      float s = 0.f;
      for (int32_t i = 0; i < words; ++i) {
        uint32_t x = w[i];
        for (int32_t j = 0; j < per_word; ++j, x >>= bits) {
          s += qs[i * per_word + j] * static_cast<float>(x & mask);
        }
      }
      out[t] = (base + s) * scale;
    }
  }
  const size_t row = static_cast<size_t>(d) * DTypeSize(v.dtype);
  for (int64_t t = v.closed; t < v.length; ++t) {
    const uint8_t* r = v.tail + (t - v.closed) * row;
    float s = 0.f;
    for (int32_t c = 0; c < d; ++c) {  // the channels the map keeps, once each
      const Stored st = StoredOf(v.map, c);
      if (st.part != StoredPart::kLow) s += q[st.channel] * LoadAsFloat(r, st.channel, v.dtype);
    }
    out[t] = s * scale;
  }
}

float FloatAtLeast(double x) {
  const float f = static_cast<float>(x);
  return static_cast<double>(f) >= x ? f
                                     : std::nextafter(f, std::numeric_limits<float>::infinity());
}

void UpperScores(const CompressedKeysView& v, const float* q, float scale, const float* approx,
                 double* upper) {
  const int32_t d = v.head_dim;
  double qn = 0;
  for (int32_t c = 0; c < d; ++c) qn += static_cast<double>(q[c]) * q[c];
  qn = std::sqrt(qn);
  const double levels = static_cast<double>((1u << v.bits) - 1);
  const double rounding = 2.0 * (d + 2) * std::ldexp(1.0, -24) * std::fabs(scale);
  for (int64_t g = 0; g * v.group < v.closed; ++g) {
    const uint16_t *lo = v.lo(g), *step = v.step(g);
    double sum = 0;
    for (int32_t c = 0; c < d; ++c) {
      const double l = Half(lo[c]), h = l + levels * Half(step[c]);
      sum += std::fabs(q[StoredOf(v.map, c).channel]) * std::max(std::fabs(l), std::fabs(h));
    }
    const double slack = rounding * sum;
    for (int64_t t = g * v.group; t < (g + 1) * v.group; ++t) {
      upper[t] = approx[t] + std::fabs(scale) * qn * KeyErrorBound(v, t) + slack;
    }
  }
  const size_t row = static_cast<size_t>(d) * DTypeSize(v.dtype);
  for (int64_t t = v.closed; t < v.length; ++t) {      // exact rows: their logit's rounding (and
    const uint8_t* r = v.tail + (t - v.closed) * row;  // the channels a map leaves out)
    double sum = 0;
    for (int32_t c = 0; c < d; ++c) sum += std::fabs(q[c] * LoadAsFloat(r, c, v.dtype));
    upper[t] = approx[t] + rounding * sum + std::fabs(scale) * qn * KeyErrorBound(v, t);
  }
}

double LogSumExpOutside(const double* upper, int64_t n, const std::vector<int32_t>& kept) {
  double m = -std::numeric_limits<double>::infinity();
  size_t e = 0;
  for (int64_t t = 0; t < n; ++t) {
    if (e < kept.size() && kept[e] == t) {
      ++e;
    } else {
      m = std::max(m, upper[t]);
    }
  }
  if (!std::isfinite(m)) return m;
  double sum = 0;
  e = 0;
  for (int64_t t = 0; t < n; ++t) {
    if (e < kept.size() && kept[e] == t) {
      ++e;
    } else {
      sum += std::exp(upper[t] - m);
    }
  }
  return m + std::log(sum);
}

float MissedMassBound(double log_kept, double log_out) {
  if (log_out == -std::numeric_limits<double>::infinity()) return 0.f;
  if (!(log_out < std::numeric_limits<double>::infinity())) return 1.f;
  return std::min(1.f, FloatAtLeast(1.0 / (1.0 + std::exp(log_kept - log_out))));
}

}  // namespace kvsparse::kernels
