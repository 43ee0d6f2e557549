// Row gathers from device memory and, zero-copy, from pinned mapped host memory.
#include "kernels/cuda/gather.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_test_util.h"

namespace kvsparse::kernels::cuda {
namespace {

void CheckGather(bool host_src, int row_bytes, int64_t stride, int rows_total, int picks) {
  std::mt19937_64 rng(row_bytes * 7 + picks);
  std::vector<uint8_t> src(static_cast<size_t>(rows_total) * stride);
  for (auto& x : src) x = static_cast<uint8_t>(rng());
  std::vector<int64_t> rows(picks);
  std::uniform_int_distribution<int64_t> pick(-1, rows_total - 1);
  for (auto& r : rows) r = pick(rng);
  DeviceBuffer dsrc;
  void* host = nullptr;
  const void* src_dev = nullptr;
  if (host_src) {
    ASSERT_EQ(cudaHostAlloc(&host, src.size(), cudaHostAllocMapped), cudaSuccess);
    std::memcpy(host, src.data(), src.size());
    ASSERT_EQ(MappedDevicePointer(host, &src_dev), cudaSuccess);
  } else {
    dsrc = ToDevice(src);
    src_dev = dsrc.get();
  }
  DeviceBuffer drows = ToDevice(rows);
  const int64_t dst_stride = row_bytes + 16;
  DeviceBuffer dst(static_cast<size_t>(picks) * dst_stride);
  ASSERT_EQ(dst.Poison(0xAB), cudaSuccess);
  GatherRowsParams p;
  p.src = src_dev;
  p.src_row_stride = stride;
  p.rows = drows.as<int64_t>();
  p.num_rows = picks;
  p.row_bytes = row_bytes;
  p.dst = dst.get();
  p.dst_row_stride = dst_stride;
  ASSERT_EQ(GatherRows(p, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got = ToHost<uint8_t>(dst, dst.size());
  for (int i = 0; i < picks; ++i) {
    for (int c = 0; c < row_bytes; ++c) {
      const uint8_t want = rows[i] < 0 ? 0 : src[rows[i] * stride + c];
      ASSERT_EQ(got[i * dst_stride + c], want) << "row " << i << " byte " << c;
    }
    for (int c = row_bytes; c < dst_stride; ++c) ASSERT_EQ(got[i * dst_stride + c], 0xAB);
  }
  if (host != nullptr) cudaFreeHost(host);
}

TEST(GatherCudaTest, DeviceRows) {
  KVSPARSE_REQUIRE_GPU();
  CheckGather(false, 256, 512, 10000, 3000);  // K and V interleaved per token: stride 2 rows
  CheckGather(false, 128, 128, 500, 1);
  CheckGather(false, 20, 36, 100, 77);  // 4-byte path
}

TEST(GatherCudaTest, ZeroCopyPinnedHostRows) {
  KVSPARSE_REQUIRE_GPU();
  CheckGather(true, 256, 256, 20000, 4096);
  CheckGather(true, 512, 1024, 1000, 999);
}

TEST(GatherCudaTest, EmptyAndInvalid) {
  GatherRowsParams p;
  EXPECT_EQ(GatherRows(p, nullptr), cudaSuccess);
  p.num_rows = 3;
  p.row_bytes = 6;
  EXPECT_EQ(GatherRows(p, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace kvsparse::kernels::cuda
