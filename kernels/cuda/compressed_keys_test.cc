#include "kernels/cuda/compressed_keys.h"

#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/compressed_keys.h"
#include "kernels/cuda/cuda_test_util.h"

namespace kvsparse::kernels::cuda {
namespace {

// The GPU's approximate scores equal the CPU reference's bit for bit, over bits, dtypes, ragged
// lengths (a sequence shorter than one group, one ending on a group boundary), GQA groups.
TEST(CompressedScoresCudaTest, EqualsTheCpuReference) {
  KVSPARSE_REQUIRE_GPU();
  const int32_t B = 3, H = 8, hkv = 2, G = H / hkv;
  const std::vector<int32_t> lens = {1000, 77, 512};
  for (DType dt : {DType::kBf16, DType::kFp16, DType::kFp32}) {
    for (int32_t bits : {1, 2, 4, 8}) {
      for (int32_t d : {64, 128}) {
        SCOPED_TRACE(testing::Message() << DTypeName(dt) << " bits " << bits << " d " << d);
        const size_t es = DTypeSize(dt), row = static_cast<size_t>(d) * es;
        std::mt19937 rng(bits * 131 + d);
        std::normal_distribution<float> z;
        std::vector<uint8_t> q(static_cast<size_t>(B) * H * row);
        for (size_t i = 0; i < q.size() / es; ++i) StoreFromFloat(q.data(), i, dt, z(rng));
        // Host compressed keys per (b, j) and their blocks on the device.
        std::vector<CompressedKeys> keys;
        int32_t max_groups = 0;
        for (int32_t b = 0; b < B; ++b) {
          for (int32_t j = 0; j < hkv; ++j) {
            keys.emplace_back(KeyCompression{bits, kKeyGroupTokens}, d, dt);
            std::vector<uint8_t> r(row);
            for (int32_t t = 0; t < lens[b]; ++t) {
              for (int32_t c = 0; c < d; ++c) {
                StoreFromFloat(r.data(), c, dt, (c % 7 == 0 ? 4.f : 1.f) * z(rng) + 0.5f * j);
              }
              keys.back().Append(r.data());
            }
          }
          max_groups = std::max(max_groups, lens[b] / kKeyGroupTokens);
        }
        // Each (b, j)'s blocks contiguous, max_groups of them (the device state's layout).
        const size_t block = KeyGroupBytes({bits, kKeyGroupTokens}, d);
        std::vector<DeviceBuffer> bufs;
        std::vector<const uint8_t*> head_ptrs(keys.size(), nullptr);
        std::vector<const void*> tail_ptrs(keys.size(), nullptr);
        for (size_t s = 0; s < keys.size(); ++s) {
          const CompressedKeysView v = keys[s].view();
          std::vector<uint8_t> blocks(std::max<size_t>(1, max_groups) * block, 0);
          for (int64_t g = 0; g < v.closed / v.group; ++g) {
            std::memcpy(blocks.data() + g * block, v.groups[g], block);
          }
          bufs.push_back(ToDevice(blocks));
          head_ptrs[s] = bufs.back().as<uint8_t>();
          const size_t open = static_cast<size_t>(v.length - v.closed);
          bufs.emplace_back(std::max<size_t>(open * row, 16));
          if (open > 0) {
            ASSERT_EQ(bufs.back().Upload(v.tail, open * row), cudaSuccess);
          }
          tail_ptrs[s] = bufs.back().get();
        }
        DeviceBuffer dq = ToDevice(q), dheads = ToDevice(head_ptrs), dtails = ToDevice(tail_ptrs);
        DeviceBuffer dlens = ToDevice(lens);
        const int64_t stride = 1024;
        DeviceBuffer dscores(static_cast<size_t>(B) * H * stride * sizeof(float));
        ASSERT_EQ(dscores.Poison(), cudaSuccess);
        CompressedScoreParams p;
        p.num_seqs = B;
        p.num_q_heads = H;
        p.num_kv_heads = hkv;
        p.head_dim = d;
        p.bits = bits;
        p.group = kKeyGroupTokens;
        p.max_groups = max_groups;
        p.dtype = dt;
        p.scale = 0.125f;
        p.q = dq.get();
        p.group_heads = dheads.as<const uint8_t*>();
        p.block_bytes = static_cast<int64_t>(block);
        p.tails = dtails.as<const void*>();
        p.seq_lens = dlens.as<int32_t>();
        p.scores = dscores.as<float>();
        p.score_stride = stride;
        KVSPARSE_ASSERT_CUDA(CompressedScores(p, nullptr));
        KVSPARSE_ASSERT_CUDA(cudaDeviceSynchronize());
        const std::vector<float> got = ToHost<float>(dscores, static_cast<size_t>(B) * H * stride);
        std::vector<float> qf(d), want(1024);
        for (int32_t b = 0; b < B; ++b) {
          for (int32_t h = 0; h < H; ++h) {
            for (int32_t c = 0; c < d; ++c)
              qf[c] = LoadAsFloat(q.data() + (b * H + h) * row, c, dt);
            ApproximateScores(keys[b * hkv + h / G].view(), qf.data(), 0.125f, want.data());
            for (int32_t t = 0; t < lens[b]; ++t) {
              const float g = got[(static_cast<int64_t>(b) * H + h) * stride + t];
              ASSERT_EQ(std::memcmp(&g, &want[t], 4), 0)
                  << "b " << b << " h " << h << " t " << t << ": " << g << " vs " << want[t];
            }
          }
        }
      }
    }
  }
}

TEST(CompressedScoresCudaTest, RefusesBadShapes) {
  CompressedScoreParams p;
  p.num_seqs = 1;
  p.num_q_heads = 8;
  p.num_kv_heads = 3;
  p.head_dim = 128;
  p.block_bytes = 1 << 20;  // only the parameter under test is wrong below
  EXPECT_EQ(CompressedScores(p, nullptr), cudaErrorInvalidValue);
  p.num_kv_heads = 2;
  p.bits = 3;
  EXPECT_EQ(CompressedScores(p, nullptr), cudaErrorInvalidValue);
  p.bits = 1;
  p.head_dim = 48;  // 48 bits: not whole words
  EXPECT_EQ(CompressedScores(p, nullptr), cudaErrorInvalidValue);
  p.head_dim = 128;
  p.block_bytes = static_cast<int64_t>(KeyGroupBytes({1, p.group}, 128)) - 4;  // blocks overlap
  EXPECT_EQ(CompressedScores(p, nullptr), cudaErrorInvalidValue);
  p.block_bytes += 6;  // large enough, not a multiple of 4: the codes' words misaligned
  EXPECT_EQ(CompressedScores(p, nullptr), cudaErrorInvalidValue);
  p.block_bytes -= 2;
  p.num_seqs = 0;  // a valid shape with nothing to score: accepted, nothing launched
  EXPECT_EQ(CompressedScores(p, nullptr), cudaSuccess);
}

}  // namespace
}  // namespace kvsparse::kernels::cuda
