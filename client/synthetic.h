// Deterministic synthetic K/V rows for workloads, demos and end-to-end checks: element i of the
// K or V row of (layer, kv head, token) is a pseudo-random value in [-1, 1) that anyone can
// recompute, so a gathered row can be verified byte for byte.
#ifndef KVSPARSE_CLIENT_SYNTHETIC_H_
#define KVSPARSE_CLIENT_SYNTHETIC_H_

#include <cstdint>
#include <string>

#include "kernels/dtype.h"

namespace kvsparse::client {

// Writes the row of (seed, layer, kv_head, token, which: 0 = K, 1 = V), head_dim elements of
// dtype, at dst.
void SyntheticRow(uint64_t seed, uint32_t layer, uint32_t kv_head, uint64_t token, int which,
                  uint32_t head_dim, kernels::DType dtype, uint8_t* dst);

// K and V tensors for an AppendRequest: [num_layers, num_tokens, num_kv_heads, head_dim].
void SyntheticAppend(uint64_t seed, uint32_t first_layer, uint32_t num_layers, uint64_t first_token,
                     uint64_t num_tokens, uint32_t num_kv_heads, uint32_t head_dim,
                     kernels::DType dtype, std::string* k, std::string* v);

}  // namespace kvsparse::client

#endif  // KVSPARSE_CLIENT_SYNTHETIC_H_
