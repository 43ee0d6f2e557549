#include "kernels/hash_signatures.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "kernels/binary_io.h"
#include "kernels/philox.h"

namespace kvsparse::kernels {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'S', 'P', 'H', 'A', 'S', 'H'};
constexpr uint32_t kVersion = 1;
constexpr int32_t kMaxDim = 65536;

// exp in double, rounded to float: correctly rounded but in vanishingly rare cases, so the GPU's
// LearnedSign (which does the same) agrees bit for bit.
float Silu(float z) { return z / (1.f + static_cast<float>(std::exp(-static_cast<double>(z)))); }

}  // namespace

absl::Status ValidateSignatureBits(int32_t bits, const char* field) {
  if (bits < 32 || bits > kMaxSignatureBits || bits % 32 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, " must be a multiple of 32 in [32, ",
                                                   kMaxSignatureBits, "], got ", bits));
  }
  return absl::OkStatus();
}

int32_t HammingSimilarity(const uint32_t* a, const uint32_t* b, int32_t words) {
  int32_t ham = 0;
  for (int32_t w = 0; w < words; ++w) ham += __builtin_popcount(a[w] ^ b[w]);
  return 32 * words - 2 * ham;
}

absl::Status MakeSimHashPlanes(uint64_t seed, int32_t layer, int32_t head, int32_t bits,
                               int32_t dim, SimHashPlanes* out) {
  if (absl::Status s = ValidateSignatureBits(bits); !s.ok()) return s;
  if (dim <= 0) return absl::InvalidArgumentError(absl::StrCat("dim must be positive, got ", dim));
  if (head < 0 || head >= 65536 || layer < 0) {
    return absl::InvalidArgumentError("layer must be >= 0 and head in [0, 65536)");
  }
  out->bits = bits;
  out->dim = dim;
  const int32_t cols = dim + 1;
  out->w.resize(static_cast<size_t>(bits) * cols);
  for (int32_t j = 0; j < bits; ++j) {
    const PhiloxStream s =
        PhiloxStream::Make(seed, RngTag::kSimHashPlane, static_cast<uint32_t>(layer),
                           static_cast<uint32_t>(head), static_cast<uint32_t>(j));
    float* row = &out->w[static_cast<size_t>(j) * cols];
    for (int32_t c = 0; c < cols; c += 2) {
      float z0, z1;
      GaussianPair(s, static_cast<uint32_t>(c / 2), &z0, &z1);
      row[c] = z0;
      if (c + 1 < cols) row[c + 1] = z1;
    }
  }
  return absl::OkStatus();
}

void SimHashSign(const SimHashPlanes& planes, const float* x, float aug, uint32_t* out) {
  const int32_t cols = planes.dim + 1;
  const int32_t words = SignatureWords(planes.bits);
  for (int32_t w = 0; w < words; ++w) out[w] = 0;
  for (int32_t j = 0; j < planes.bits; ++j) {
    const float* row = &planes.w[static_cast<size_t>(j) * cols];
    float dot = 0.f;
    for (int32_t c = 0; c < planes.dim; ++c) dot += row[c] * x[c];
    dot += row[planes.dim] * aug;
    if (dot > 0.f) out[j / 32] |= 1u << (j % 32);
  }
}

void SimHashKey(const SimHashPlanes& planes, const float* k, float max_norm, uint32_t* out) {
  float n2 = 0.f;
  for (int32_t c = 0; c < planes.dim; ++c) n2 += k[c] * k[c];
  const float rest = max_norm * max_norm - n2;
  SimHashSign(planes, k, rest > 0.f ? std::sqrt(rest) : 0.f, out);
}

void SimHashQuery(const SimHashPlanes& planes, const float* q, uint32_t* out) {
  SimHashSign(planes, q, 0.f, out);
}

void HashMlp::Sign(const float* x, uint32_t* out, std::vector<float>* scratch) const {
  const size_t layers = weights.size();
  int32_t max_dim = 0;
  for (int32_t d : dims) max_dim = std::max(max_dim, d);
  scratch->resize(2 * static_cast<size_t>(max_dim));
  float* cur = scratch->data();
  float* next = scratch->data() + max_dim;
  std::memcpy(cur, x, sizeof(float) * dims[0]);
  for (size_t i = 0; i < layers; ++i) {
    const int32_t in = dims[i], outd = dims[i + 1];
    const float* w = weights[i].data();
    for (int32_t o = 0; o < outd; ++o) {
      float z = 0.f;
      for (int32_t c = 0; c < in; ++c) z += w[static_cast<size_t>(o) * in + c] * cur[c];
      z += biases[i][o];
      next[o] = i + 1 < layers ? Silu(z) : z;
    }
    std::swap(cur, next);
  }
  const int32_t bits = dims.back();
  for (int32_t w = 0; w < bits / 32; ++w) out[w] = 0;
  for (int32_t j = 0; j < bits; ++j) {
    if (cur[j] > 0.f) out[j / 32] |= 1u << (j % 32);
  }
}

absl::Status ValidateLearnedHashWeights(const LearnedHashWeights& w) {
  if (w.num_layers < 1) return absl::InvalidArgumentError("num_layers must be >= 1");
  if (w.num_q_heads < 1) return absl::InvalidArgumentError("num_q_heads must be >= 1");
  if (w.num_key_mlps < 1) return absl::InvalidArgumentError("num_key_mlps must be >= 1");
  if (w.dims.size() < 2) return absl::InvalidArgumentError("dims needs at least 2 entries");
  for (int32_t d : w.dims) {
    if (d < 1 || d > kMaxDim) {
      return absl::InvalidArgumentError(absl::StrCat("dims: entry ", d, " outside [1, 65536]"));
    }
  }
  if (absl::Status s = ValidateSignatureBits(w.bits(), "dims (last entry, the bits)"); !s.ok()) {
    return s;
  }
  if (w.query_mlps.size() != static_cast<size_t>(w.num_layers) * w.num_q_heads ||
      w.key_mlps.size() != static_cast<size_t>(w.num_layers) * w.num_key_mlps) {
    return absl::InvalidArgumentError("query_mlps / key_mlps: wrong number of MLPs");
  }
  const size_t n_lin = w.dims.size() - 1;
  for (const auto* list : {&w.query_mlps, &w.key_mlps}) {
    for (const HashMlp& m : *list) {
      if (m.dims != w.dims || m.weights.size() != n_lin || m.biases.size() != n_lin) {
        return absl::InvalidArgumentError("an MLP's dims differ from the file's dims");
      }
      for (size_t i = 0; i < n_lin; ++i) {
        if (m.weights[i].size() != static_cast<size_t>(w.dims[i]) * w.dims[i + 1] ||
            m.biases[i].size() != static_cast<size_t>(w.dims[i + 1])) {
          return absl::InvalidArgumentError(absl::StrCat("MLP linear ", i, ": wrong size"));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SerializeLearnedHashWeights(const LearnedHashWeights& w) {
  if (absl::Status s = ValidateLearnedHashWeights(w); !s.ok()) return s;
  std::string out(kMagic, 8);
  PutU32(&out, kVersion);
  PutU32(&out, static_cast<uint32_t>(w.num_layers));
  PutU32(&out, static_cast<uint32_t>(w.num_q_heads));
  PutU32(&out, static_cast<uint32_t>(w.num_key_mlps));
  PutU32(&out, static_cast<uint32_t>(w.dims.size() - 1));
  for (int32_t d : w.dims) PutU32(&out, static_cast<uint32_t>(d));
  for (int32_t l = 0; l < w.num_layers; ++l) {
    for (int32_t h = 0; h < w.num_q_heads + w.num_key_mlps; ++h) {
      const HashMlp& m = h < w.num_q_heads ? w.query(l, h) : w.key(l, h - w.num_q_heads);
      for (size_t i = 0; i < m.weights.size(); ++i) {
        for (float f : m.weights[i]) PutF32(&out, f);
        for (float f : m.biases[i]) PutF32(&out, f);
      }
    }
  }
  return out;
}

absl::StatusOr<LearnedHashWeights> ParseLearnedHashWeights(std::string_view bytes) {
  ByteReader r(bytes);
  char magic[8];
  if (!r.Bytes(magic, 8) || std::memcmp(magic, kMagic, 8) != 0) {
    return absl::InvalidArgumentError("learned hash weights: bad magic (want \"KVSPHASH\")");
  }
  uint32_t version, layers, heads, key_mlps, n_lin;
  if (!r.U32(&version) || !r.U32(&layers) || !r.U32(&heads) || !r.U32(&key_mlps) ||
      !r.U32(&n_lin)) {
    return absl::InvalidArgumentError("learned hash weights: truncated header");
  }
  if (version != kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("learned hash weights: unsupported version ", version));
  }
  if (n_lin < 1 || n_lin > 64 || layers < 1 || layers > 4096 || heads < 1 || heads > 4096 ||
      key_mlps < 1 || key_mlps > 4096) {
    return absl::InvalidArgumentError("learned hash weights: header counts out of range");
  }
  LearnedHashWeights w;
  w.num_layers = static_cast<int32_t>(layers);
  w.num_q_heads = static_cast<int32_t>(heads);
  w.num_key_mlps = static_cast<int32_t>(key_mlps);
  w.dims.resize(n_lin + 1);
  for (uint32_t i = 0; i <= n_lin; ++i) {
    uint32_t d;
    if (!r.U32(&d)) return absl::InvalidArgumentError("learned hash weights: truncated dims");
    if (d < 1 || d > static_cast<uint32_t>(kMaxDim)) {
      return absl::InvalidArgumentError(absl::StrCat("learned hash weights: dims[", i, "] = ", d));
    }
    w.dims[i] = static_cast<int32_t>(d);
  }
  if (absl::Status s = ValidateSignatureBits(w.bits(), "learned hash weights: bits"); !s.ok()) {
    return s;
  }
  uint64_t per_mlp = 0;
  for (uint32_t i = 0; i < n_lin; ++i) {
    per_mlp += static_cast<uint64_t>(w.dims[i] + 1) * w.dims[i + 1];
  }
  const uint64_t expected = per_mlp * 4 * layers * (heads + key_mlps);
  if (r.remaining() != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        "learned hash weights: payload is ", r.remaining(), " bytes, header implies ", expected));
  }
  w.query_mlps.resize(static_cast<size_t>(layers) * heads);
  w.key_mlps.resize(static_cast<size_t>(layers) * key_mlps);
  for (uint32_t l = 0; l < layers; ++l) {
    for (uint32_t h = 0; h < heads + key_mlps; ++h) {
      HashMlp& m = h < heads ? w.query_mlps[l * heads + h] : w.key_mlps[l * key_mlps + h - heads];
      m.dims = w.dims;
      m.weights.resize(n_lin);
      m.biases.resize(n_lin);
      for (uint32_t i = 0; i < n_lin; ++i) {
        m.weights[i].resize(static_cast<size_t>(w.dims[i]) * w.dims[i + 1]);
        m.biases[i].resize(w.dims[i + 1]);
        r.F32s(m.weights[i].data(), m.weights[i].size());
        r.F32s(m.biases[i].data(), m.biases[i].size());
      }
    }
  }
  return w;
}

absl::Status WriteLearnedHashWeights(const LearnedHashWeights& w, const std::string& path) {
  absl::StatusOr<std::string> bytes = SerializeLearnedHashWeights(w);
  if (!bytes.ok()) return bytes.status();
  return WriteWholeFile(path, *bytes);
}

absl::StatusOr<LearnedHashWeights> ReadLearnedHashWeights(const std::string& path) {
  absl::StatusOr<std::string> bytes = ReadWholeFile(path);
  if (!bytes.ok()) return bytes.status();
  return ParseLearnedHashWeights(*bytes);
}

}  // namespace kvsparse::kernels
