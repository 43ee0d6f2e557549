// Shared set-up of the gather benchmarks: a store sequence filled with random rows, in process.
#ifndef KVSPARSE_TESTS_BENCH_BENCH_FILL_H_
#define KVSPARSE_TESTS_BENCH_BENCH_FILL_H_

#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "kvstore/store.h"

namespace kvsparse::bench {

// Creates sequence `id` of `shape` and appends `tokens` tokens of random K/V bytes to every
// layer (chunks of 512 tokens; the same random block each time: contents do not matter here).
inline absl::Status FillSequence(kvstore::Store* store, const char* id,
                                 const kvstore::ModelShape& shape, uint64_t tokens) {
  if (absl::Status s = store->CreateSequence(id, shape, {}).status(); !s.ok()) return s;
  const size_t row = shape.row_bytes();
  std::fprintf(stderr, "filling %.2f GB (%lu tokens x %u layers x %u kv heads)...\n",
               2.0 * tokens * shape.num_layers * shape.num_kv_heads * row / 1e9,
               static_cast<unsigned long>(tokens), shape.num_layers, shape.num_kv_heads);
  constexpr uint64_t kChunk = 512;
  std::vector<uint8_t> block(shape.num_layers * kChunk * shape.num_kv_heads * row);
  std::mt19937_64 rng(1);
  // Random values the store accepts.
  for (size_t i = 0; i < block.size(); ++i) {
    block[i] = kernels::AcceptedByte(static_cast<uint8_t>(rng()), i);
  }
  for (uint64_t t = 0; t < tokens; t += kChunk) {
    kvstore::AppendRequest r;
    r.sequence_id = id;
    r.num_layers = shape.num_layers;
    r.num_tokens = std::min(kChunk, tokens - t);
    r.dtype = shape.dtype;
    r.num_kv_heads = shape.num_kv_heads;
    r.head_dim = shape.head_dim;
    const size_t bytes = r.num_layers * r.num_tokens * shape.num_kv_heads * row;
    r.k = absl::MakeConstSpan(block.data(), bytes);
    r.v = r.k;
    if (absl::Status s = store->Append(r).status(); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace kvsparse::bench

#endif  // KVSPARSE_TESTS_BENCH_BENCH_FILL_H_
