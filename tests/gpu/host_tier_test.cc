// The zero-copy host tier on a GPU: a store whose pages are pinned, CUDA-mapped host memory,
// read in place by a GPU kernel through a PageView, gives exactly the rows the store's own
// (CPU) gather gives. Skips without a GPU.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/gather.h"
#include "kvstore/cuda_host_memory.h"
#include "kvstore/store.h"

namespace kvsparse {
namespace {

bool HaveGpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << cudaGetErrorString(x)

TEST(HostTierGpuTest, ZeroCopyGatherFromPinnedPagesMatchesTheStoresGather) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  auto memory = kvstore::NewPinnedHostMemoryResource();
  ASSERT_TRUE(memory.ok()) << memory.status();
  kvstore::StoreOptions so;
  so.capacity_bytes = 256ull << 20;
  so.memory = memory->get();
  auto store = kvstore::Store::Create(so);
  ASSERT_TRUE(store.ok());
  const kvstore::ModelShape shape{2, 32, 8, 128, kernels::DType::kBf16};
  const size_t row = shape.row_bytes();
  const uint32_t n = 4096;
  ASSERT_TRUE((*store)->CreateSequence("s", shape, {}).ok());
  std::vector<uint8_t> k(2ull * n * 8 * row), v(k.size());
  std::mt19937_64 rng(3);
  // Random values the store accepts.
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = kernels::AcceptedByte(static_cast<uint8_t>(rng()), i);
    v[i] = kernels::AcceptedByte(static_cast<uint8_t>(rng()), i);
  }
  kvstore::AppendRequest ar;
  ar.sequence_id = "s";
  ar.num_layers = 2;
  ar.num_tokens = n;
  ar.dtype = shape.dtype;
  ar.num_kv_heads = 8;
  ar.head_dim = 128;
  ar.k = k;
  ar.v = v;
  ASSERT_TRUE((*store)->Append(ar).ok());

  // 5% of the tokens of every kv head of layer 1, ascending (as the decode worker asks).
  std::vector<std::vector<uint32_t>> tokens(8);
  std::vector<kvstore::HeadSelection> heads;
  for (uint32_t j = 0; j < 8; ++j) {
    for (uint32_t t = 0; t < n; ++t) {
      if (rng() % 20 == 0) tokens[j].push_back(t);
    }
    heads.push_back({j, tokens[j]});
  }
  // The store's gather (CPU copy): K rows and V rows.
  std::vector<uint8_t> want_k, want_v;
  kvstore::GatherRequest gr;
  gr.sequence_id = "s";
  gr.layer = 1;
  gr.heads = heads;
  auto res =
      (*store)->Gather(gr, [&](uint64_t rows, size_t rb) -> absl::StatusOr<kvstore::GatherBuffers> {
        want_k.resize(rows * rb);
        want_v.resize(rows * rb);
        return kvstore::GatherBuffers{want_k.data(), want_v.data()};
      });
  ASSERT_TRUE(res.ok());
  const size_t rows = res->rows;

  // The GPU reads each token's K|V slot (adjacent in the page: one 512-byte row) in place.
  auto view = (*store)->View("s");
  ASSERT_TRUE(view.ok());
  std::vector<const void*> ptrs;
  for (uint32_t j = 0; j < 8; ++j) {
    for (uint32_t t : tokens[j]) ptrs.push_back((*view)->KRow(1, j, t));
  }
  ptrs.push_back(nullptr);  // a null row comes back zeroed
  const void** d_ptrs = nullptr;
  uint8_t* d_out = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d_ptrs), ptrs.size() * sizeof(void*)));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d_out), ptrs.size() * 2 * row));
  CUDA_OK(cudaMemset(d_out, 0xAB, ptrs.size() * 2 * row));  // poison
  CUDA_OK(cudaMemcpy(d_ptrs, ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice));
  kernels::cuda::GatherRowPtrsParams p;
  p.rows = d_ptrs;
  p.num_rows = static_cast<int32_t>(ptrs.size());
  p.row_bytes = static_cast<int32_t>(2 * row);
  p.dst = d_out;
  p.dst_row_stride = static_cast<int64_t>(2 * row);
  CUDA_OK(kernels::cuda::GatherRowPtrs(p, nullptr));
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint8_t> got(ptrs.size() * 2 * row);
  CUDA_OK(cudaMemcpy(got.data(), d_out, got.size(), cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < rows; ++i) {
    ASSERT_EQ(std::memcmp(got.data() + i * 2 * row, want_k.data() + i * row, row), 0) << i;
    ASSERT_EQ(std::memcmp(got.data() + i * 2 * row + row, want_v.data() + i * row, row), 0) << i;
  }
  for (size_t b = rows * 2 * row; b < got.size(); ++b) ASSERT_EQ(got[b], 0) << "null row";
  // Bad arguments are refused, not run.
  p.row_bytes = 100;
  EXPECT_EQ(kernels::cuda::GatherRowPtrs(p, nullptr), cudaErrorInvalidValue);
  cudaFree(const_cast<void**>(d_ptrs));
  cudaFree(d_out);
}

}  // namespace
}  // namespace kvsparse
