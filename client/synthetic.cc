#include "client/synthetic.h"

namespace kvsparse::client {
namespace {

uint64_t Mix(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

void SyntheticRow(uint64_t seed, uint32_t layer, uint32_t kv_head, uint64_t token, int which,
                  uint32_t head_dim, kernels::DType dtype, uint8_t* dst) {
  const uint64_t base =
      Mix(seed ^ Mix(layer * 0x100000001b3ull ^ Mix(kv_head ^ Mix(token * 2 + which))));
  for (uint32_t i = 0; i < head_dim; ++i) {
    const uint64_t r = Mix(base + i);
    const float x = static_cast<float>(r >> 40) * (1.0f / (1u << 23)) - 1.0f;  // [-1, 1)
    kernels::StoreFromFloat(dst, i, dtype, x);
  }
}

void SyntheticAppend(uint64_t seed, uint32_t first_layer, uint32_t num_layers, uint64_t first_token,
                     uint64_t num_tokens, uint32_t num_kv_heads, uint32_t head_dim,
                     kernels::DType dtype, std::string* k, std::string* v) {
  const size_t row = static_cast<size_t>(head_dim) * kernels::DTypeSize(dtype);
  k->resize(num_layers * num_tokens * num_kv_heads * row);
  v->resize(k->size());
  size_t off = 0;
  for (uint32_t l = 0; l < num_layers; ++l) {
    for (uint64_t t = 0; t < num_tokens; ++t) {
      for (uint32_t h = 0; h < num_kv_heads; ++h, off += row) {
        SyntheticRow(seed, first_layer + l, h, first_token + t, 0, head_dim, dtype,
                     reinterpret_cast<uint8_t*>(k->data()) + off);
        SyntheticRow(seed, first_layer + l, h, first_token + t, 1, head_dim, dtype,
                     reinterpret_cast<uint8_t*>(v->data()) + off);
      }
    }
  }
}

}  // namespace kvsparse::client
