// Zero-copy reads of the store's pinned host tier by a GPU kernel, against a bulk host-to-device
// copy measured in the same run: how fast do the rows a sparse method selects cross PCIe/C2C?
//
//   host_tier_bench [--tokens=32768] [--layers=8] [--densities=0.01,0.05,0.1] [--reps=20]
//
// The store (pinned, mapped pages; Llama-3.1-8B kv shapes: 8 kv heads, d = 128, bf16) holds
// `layers` layers of `tokens` tokens. A call reads, for every kv head of one layer (rotating),
// the rows of a uniformly random `density` of the tokens: the token's K and V together (512 B,
// adjacent in the page: HashAttention / vAttention placement) or its V alone (256 B: S2ANTA).
// Timed with CUDA events around the gather kernel alone (median); the host's work to list the
// rows' addresses from a PageView is timed separately and reported.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kernels/cuda/gather.h"
#include "kvstore/cuda_host_memory.h"
#include "kvstore/store.h"
#include "tests/gpu/bench_util.h"

ABSL_FLAG(int, tokens, 32768, "Tokens per layer");
ABSL_FLAG(int, layers, 8, "Layers held (rotated through)");
ABSL_FLAG(std::string, densities, "0.01,0.05,0.1", "Fractions of tokens read per kv head");
ABSL_FLAG(int, reps, 20, "Timed calls per configuration (median)");

namespace {

#define CK(x) KVSPARSE_BENCH_CK(x)

using kvsparse::bench::Median;

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  namespace kv = kvsparse::kvstore;
  const int tokens = absl::GetFlag(FLAGS_tokens), layers = absl::GetFlag(FLAGS_layers);
  const int reps = absl::GetFlag(FLAGS_reps);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  auto memory = kv::NewPinnedHostMemoryResource();
  if (!memory.ok()) {
    std::fprintf(stderr, "%s\n", memory.status().ToString().c_str());
    return 1;
  }
  const kv::ModelShape shape{static_cast<uint32_t>(layers), 32, 8, 128,
                             kvsparse::kernels::DType::kBf16};
  const size_t row = shape.row_bytes();
  const uint64_t bytes = 2ull * layers * tokens * 8 * row;
  kv::StoreOptions so;
  so.capacity_bytes = bytes + (64 << 20);
  so.max_append_bytes = 1ull << 31;
  so.memory = memory->get();
  auto store = kv::Store::Create(so);
  if (!store.ok() || !(*store)->CreateSequence("s", shape, {}).ok()) return 1;
  std::fprintf(stderr, "%s: filling %.2f GB of pinned store pages...\n", prop.name, bytes / 1e9);
  {
    const uint64_t chunk = 1024;
    std::vector<uint8_t> block(layers * chunk * 8 * row);
    std::mt19937_64 rng(1);
    // Random values the store accepts.
    for (size_t i = 0; i < block.size(); ++i) {
      block[i] = kvsparse::kernels::AcceptedByte(static_cast<uint8_t>(rng()), i);
    }
    for (uint64_t t = 0; t < static_cast<uint64_t>(tokens); t += chunk) {
      kv::AppendRequest r;
      r.sequence_id = "s";
      r.num_layers = layers;
      r.num_tokens = std::min<uint64_t>(chunk, tokens - t);
      r.dtype = shape.dtype;
      r.num_kv_heads = 8;
      r.head_dim = 128;
      r.k = absl::MakeConstSpan(block.data(), layers * r.num_tokens * 8 * row);
      r.v = r.k;
      if (!(*store)->Append(r).ok()) return 1;
    }
  }
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  // Baseline: one bulk copy of 256 MiB from pinned host memory.
  const double h2d_gbs = kvsparse::bench::BulkHostToDeviceGBs();
  std::printf("device %s; bulk host-to-device copy (pinned, 256 MiB): %.1f GB/s\n", prop.name,
              h2d_gbs);
  std::printf("%-8s %-4s %9s %9s %11s %11s %9s %9s\n", "density", "kind", "rows", "MB", "list us",
              "kernel us", "GB/s", "% of H2D");
  auto view = (*store)->View("s");
  if (!view.ok()) return 1;
  const size_t max_rows = static_cast<size_t>(tokens) * 8;
  const void** d_ptrs = nullptr;
  void* d_out = nullptr;
  CK(cudaMalloc(reinterpret_cast<void**>(&d_ptrs), max_rows * sizeof(void*)));
  CK(cudaMalloc(&d_out, max_rows * 2 * row));
  std::mt19937_64 rng(7);
  std::vector<const void*> ptrs;
  for (absl::string_view ds : absl::StrSplit(absl::GetFlag(FLAGS_densities), ',')) {
    double density = 0;
    if (!absl::SimpleAtod(ds, &density) || density <= 0 || density > 1) return 2;
    for (const bool kv_rows : {true, false}) {
      std::vector<float> kernel_ms;
      double list_us = 0;
      size_t rows = 0;
      for (int rep = -2; rep < reps; ++rep) {
        const uint32_t layer = static_cast<uint32_t>((rep + 2) % layers);
        const auto t0 = std::chrono::steady_clock::now();
        ptrs.clear();
        std::bernoulli_distribution pick(density);
        for (uint32_t j = 0; j < 8; ++j) {
          for (int t = 0; t < tokens; ++t) {
            if (!pick(rng)) continue;
            const uint8_t* slot = (*view)->KRow(layer, j, t);
            ptrs.push_back(kv_rows ? slot : slot + row);
          }
        }
        const auto t1 = std::chrono::steady_clock::now();
        CK(cudaMemcpy(d_ptrs, ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice));
        kvsparse::kernels::cuda::GatherRowPtrsParams p;
        p.rows = d_ptrs;
        p.num_rows = static_cast<int32_t>(ptrs.size());
        p.row_bytes = static_cast<int32_t>(kv_rows ? 2 * row : row);
        p.dst = d_out;
        p.dst_row_stride = p.row_bytes;
        CK(cudaEventRecord(e0));
        CK(kvsparse::kernels::cuda::GatherRowPtrs(p, nullptr));
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (rep >= 0) {
          kernel_ms.push_back(ms);
          list_us += std::chrono::duration<double, std::micro>(t1 - t0).count();
          rows = ptrs.size();
        }
      }
      const float ms = Median(kernel_ms);
      const double mb = rows * (kv_rows ? 2.0 : 1.0) * row / 1e6;
      std::printf("%-8.3f %-4s %9zu %9.2f %11.0f %11.1f %9.1f %8.0f%%\n", density,
                  kv_rows ? "kv" : "v", rows, mb, list_us / reps, ms * 1e3, mb / ms,
                  100.0 * (mb / ms) / h2d_gbs);
    }
  }
  return 0;
}
