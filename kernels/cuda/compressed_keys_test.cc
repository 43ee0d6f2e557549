#include "kernels/cuda/compressed_keys.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/compressed_keys.h"
#include "kernels/cuda/cuda_test_util.h"
#include "kernels/key_quantization.h"
#include "kernels/key_widths.h"

namespace kvsparse::kernels::cuda {
namespace {

// Channel maps per kv head for the key-widths tests (kernels/key_widths.h): kv head j widens
// channels j, j + 8, ... and leaves out channels j + 4, j + 12, ...; the maps, and their channel
// and part tables side by side ([Hkv, d] each, the kernels' layout).
struct WidthsMaps {
  std::vector<KeyChannelMap> maps;
  std::vector<uint8_t> channel, part;
};
WidthsMaps MakeWidthsMaps(int32_t hkv, int32_t d) {
  WidthsMaps out;
  for (int32_t j = 0; j < hkv; ++j) {
    std::vector<ChannelWidth> w(d, ChannelWidth::kWhole);
    for (int32_t c = j; c + 4 < d; c += 8) {
      w[c] = ChannelWidth::kWide;
      w[c + 4] = ChannelWidth::kOut;
    }
    absl::StatusOr<KeyChannelMap> m = ChannelMapOf(w);
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return out;
    out.maps.push_back(*m);
    out.channel.insert(out.channel.end(), m->channel.begin(), m->channel.end());
    for (StoredPart x : m->part) out.part.push_back(static_cast<uint8_t>(x));
  }
  return out;
}

// How far the tensor cores' score of a token of closed group g may be from the reference's
// (compressed_keys.h): scale * (code_max d 2^-20 max_c |w_c| + 2^-14 sum_c (|q_c lo_c| +
// code_max |w_c|)), w_c = q_c step_c: the digits' remainder and the fp32 sums' rounding. A
// channel read for another, or a code off by one, moves a score by far more (checked below).
float TensorCoreBound(const CompressedKeysView& v, int64_t g, const float* q, float scale) {
  double base = 0, sum = 0, mx = 0;
  for (int32_t c = 0; c < v.head_dim; ++c) {
    const double w = std::fabs(static_cast<double>(q[c]) * keyq::Half(v.step(g)[c]));
    base += std::fabs(static_cast<double>(q[c]) * keyq::Half(v.lo(g)[c]));
    sum += w;
    mx = std::max(mx, w);
  }
  const double code_max = (1 << v.bits) - 1;
  return static_cast<float>(scale * (code_max * v.head_dim * std::ldexp(mx, -20) +
                                     std::ldexp(base + code_max * sum, -14)));
}

// The GPU's approximate scores of B = 3 sequences (ragged lengths: one shorter than a group, one
// ending on a group boundary, one whose closed groups span blocks after its open group) equal the
// CPU reference's bit for bit for 4- and 8-bit keys and the open group's rows, and within
// TensorCoreBound of them for the closed groups of 1- and 2-bit keys; a perturbed code's score
// is outside that bound (the bound can fail). With `widths`, each kv head's keys are quantized
// with its own channel map (WidthsMaps) and scored through it on both sides.
void ExpectScoresOfTheCpu(int32_t H, int32_t hkv, int32_t d, DType dt, int32_t bits,
                          bool widths = false) {
  SCOPED_TRACE(testing::Message() << DTypeName(dt) << " bits " << bits << " d " << d << " H " << H
                                  << " Hkv " << hkv << (widths ? " key widths" : ""));
  const int32_t B = 3, G = H / hkv;
  const std::vector<int32_t> lens = {1000, 77, 512};
  const size_t es = DTypeSize(dt), row = static_cast<size_t>(d) * es;
  std::mt19937 rng(bits * 131 + d);
  std::normal_distribution<float> z;
  std::vector<uint8_t> q(static_cast<size_t>(B) * H * row);
  for (size_t i = 0; i < q.size() / es; ++i) StoreFromFloat(q.data(), i, dt, z(rng));
  WidthsMaps maps;
  if (widths) {
    ASSERT_NO_FATAL_FAILURE(maps = MakeWidthsMaps(hkv, d));
  }
  // Host compressed keys per (b, j) and their blocks on the device.
  std::vector<CompressedKeys> keys;
  int32_t max_groups = 0;
  for (int32_t b = 0; b < B; ++b) {
    for (int32_t j = 0; j < hkv; ++j) {
      keys.emplace_back(KeyCompression{bits, kKeyGroupTokens, widths ? &maps.maps[j] : nullptr}, d,
                        dt);
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
  DeviceBuffer dch, dpart;
  if (widths) {
    dch = ToDevice(maps.channel);
    dpart = ToDevice(maps.part);
    p.map_channel = dch.as<uint8_t>();
    p.map_part = dpart.as<uint8_t>();
  }
  KVSPARSE_ASSERT_CUDA(CompressedScores(p, nullptr));
  KVSPARSE_ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> got = ToHost<float>(dscores, static_cast<size_t>(B) * H * stride);
  std::vector<float> qf(d), qm(d), want(1024);
  double worst = 0;  // the tensor cores' largest error, in units of its bound
  int64_t moves_seen = 0;
  for (int32_t b = 0; b < B; ++b) {
    for (int32_t h = 0; h < H; ++h) {
      for (int32_t c = 0; c < d; ++c) qf[c] = LoadAsFloat(q.data() + (b * H + h) * row, c, dt);
      const CompressedKeysView v = keys[b * hkv + h / G].view();
      ApproximateScores(v, qf.data(), 0.125f, want.data());
      // What the closed groups' stored channels are scored against: q through the map.
      for (int32_t c = 0; c < d; ++c) qm[c] = widths ? qf[maps.maps[h / G].channel[c]] : qf[c];
      for (int32_t t = 0; t < lens[b]; ++t) {
        const float g = got[(static_cast<int64_t>(b) * H + h) * stride + t];
        if (bits > 2 || t >= v.closed) {
          ASSERT_EQ(std::memcmp(&g, &want[t], 4), 0)
              << "b " << b << " h " << h << " t " << t << ": " << g << " vs " << want[t];
          continue;
        }
        const float bound = TensorCoreBound(v, t / v.group, qm.data(), 0.125f);
        ASSERT_LE(std::fabs(g - want[t]), bound)
            << "b " << b << " h " << h << " t " << t << ": " << g << " vs " << want[t];
        worst = std::max(worst, static_cast<double>(std::fabs(g - want[t]) / bound));
        // The bound is tight enough to see one code off by one in channel 0.
        const float moved = 0.125f * std::fabs(qm[0] * keyq::Half(v.step(t / v.group)[0]));
        if (moved > 4 * bound) ++moves_seen;
      }
    }
  }
  if (bits <= 2) {
    EXPECT_GT(moves_seen, 0) << "no token whose one-code change the bound would see";
    testing::Test::RecordProperty("worst_error_over_bound", std::to_string(worst));
  }
}

// Over bits, dtypes, head dims and GQA groups 1, 4 and 8 (at d = 512 with G = 8 the kernel takes
// fewer groups a block: its shared memory).
TEST(CompressedScoresCudaTest, EqualsTheCpuReference) {
  KVSPARSE_REQUIRE_GPU();
  for (DType dt : {DType::kBf16, DType::kFp16, DType::kFp32}) {
    for (int32_t bits : {1, 2, 4, 8}) {
      for (int32_t d : {64, 128}) ExpectScoresOfTheCpu(8, 2, d, dt, bits);
      ExpectScoresOfTheCpu(4, 4, 128, dt, bits);
      for (int32_t d : {128, 512}) ExpectScoresOfTheCpu(8, 1, d, dt, bits);
    }
  }
}

// Keys at per-channel widths: the closed groups scored with q through each kv head's map, the
// open group's rows over the channels it keeps (ApproximateScores with the map), for the widths'
// bits (1, 2 and 4) and GQA groups 1 and 4.
TEST(CompressedScoresCudaTest, ChannelWidthsEqualTheCpuReference) {
  KVSPARSE_REQUIRE_GPU();
  for (DType dt : {DType::kBf16, DType::kFp32}) {
    for (int32_t bits : {1, 2, 4}) {
      ExpectScoresOfTheCpu(8, 2, 128, dt, bits, true);
      ExpectScoresOfTheCpu(2, 2, 64, dt, bits, true);
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
  alignas(4) const uint8_t map[128] = {};
  p.map_channel = map;  // a channel map without its parts
  EXPECT_EQ(CompressedScores(p, nullptr), cudaErrorInvalidValue);
  alignas(4) const uint8_t part[132] = {};
  p.map_part = part + 1;  // not 4-byte aligned: the open group reads the map a word at a time
  EXPECT_EQ(CompressedScores(p, nullptr), cudaErrorInvalidValue);
  p.map_part = map;
  p.bits = 8;  // a map for 8-bit keys
  p.block_bytes = static_cast<int64_t>(KeyGroupBytes({8, p.group}, 128));
  EXPECT_EQ(CompressedScores(p, nullptr), cudaErrorInvalidValue);
  p.map_channel = p.map_part = nullptr;
  p.num_seqs = 0;  // a valid shape with nothing to score: accepted, nothing launched
  EXPECT_EQ(CompressedScores(p, nullptr), cudaSuccess);
}

// A captured step's append on the device closes each group with the bits the CPU reference's
// CompressedKeys gives (kernels/key_quantization.h on both), byte for byte, and keeps the open
// group's rows exact: over bits, dtypes and head dims, keys with an outlier channel, a constant
// channel (step 0) and a channel of signed zeros (min and max compare as std::min / std::max do),
// two groups closed and one left open; a sequence whose step is refused (length 0) writes
// nothing (its buffers keep their poison where the reference holds nothing).
// Keys of d channels (elements of dtype dt) for the quantization tests: every seventh channel
// of a larger range, some channels signed zeros, some constant (a step of 0).
void FillKeys(std::vector<uint8_t>* k, int32_t d, DType dt, std::mt19937* rng) {
  std::normal_distribution<float> z;
  for (size_t x = 0; x < k->size() / DTypeSize(dt); ++x) {
    const int32_t c = static_cast<int32_t>(x % d);
    float v = (c % 7 == 0 ? 4.f : 1.f) * z(*rng);
    if (c % 11 == 3) v = ((*rng)() & 1) ? 0.f : -0.f;
    if (c % 13 == 5) v = 0.75f;
    StoreFromFloat(k->data(), x, dt, v);
  }
}

// One (dtype, bits, head dim) of the test below: B = 2 sequences of hkv = 3 kv heads through
// 2 groups and 37 tokens of steps, with `widths` each kv head closing its groups with its channel
// map (WidthsMaps), as CompressedKeys with KeyCompression::map does.
void ExpectStepsCloseGroupsAsTheCpu(DType dt, int32_t bits, int32_t d, bool widths) {
  SCOPED_TRACE(testing::Message() << DTypeName(dt) << " bits " << bits << " d " << d
                                  << (widths ? " key widths" : ""));
  const int32_t B = 2, hkv = 3, G = kKeyGroupTokens, steps = 2 * G + 37;
  const size_t es = DTypeSize(dt), row = static_cast<size_t>(d) * es;
  const size_t block = KeyGroupBytes({bits, G}, d);
  std::mt19937 rng(bits * 17 + d + static_cast<int>(dt));
  WidthsMaps maps;
  if (widths) {
    ASSERT_NO_FATAL_FAILURE(maps = MakeWidthsMaps(hkv, d));
  }
  std::vector<CompressedKeys> want;
  std::vector<DeviceBuffer> bufs;
  std::vector<uint8_t*> heads;
  std::vector<void*> tails;
  for (int32_t i = 0; i < B * hkv; ++i) {
    want.emplace_back(KeyCompression{bits, G, widths ? &maps.maps[i % hkv] : nullptr}, d, dt);
    bufs.emplace_back(2 * block);  // room for the two groups the steps close
    ASSERT_EQ(bufs.back().Poison(), cudaSuccess);
    heads.push_back(bufs.back().as<uint8_t>());
    bufs.emplace_back(G * row);
    ASSERT_EQ(bufs.back().Poison(), cudaSuccess);
    tails.push_back(bufs.back().get());
  }
  DeviceBuffer dheads = ToDevice(heads), dtails = ToDevice(tails);
  DeviceBuffer dk(static_cast<size_t>(B) * hkv * row), dlens(sizeof(int32_t) * B);
  DeviceBuffer dch, dpart;
  if (widths) {
    dch = ToDevice(maps.channel);
    dpart = ToDevice(maps.part);
  }
  std::vector<uint8_t> k(static_cast<size_t>(B) * hkv * row);
  std::vector<int32_t> lens(B, 0);
  for (int32_t st = 0; st < steps; ++st) {
    FillKeys(&k, d, dt, &rng);
    // Sequence 1 takes a token every other step; its refused steps write nothing.
    std::vector<int32_t> after(B);
    for (int32_t b = 0; b < B; ++b) {
      const bool takes = b == 0 || st % 2 == 0;
      if (takes) ++lens[b];
      after[b] = takes ? lens[b] : 0;
      for (int32_t j = 0; j < hkv && takes; ++j) {
        want[b * hkv + j].Append(k.data() + (b * hkv + j) * row);
      }
    }
    ASSERT_EQ(dk.Upload(k.data(), k.size()), cudaSuccess);
    ASSERT_EQ(dlens.Upload(after.data(), sizeof(int32_t) * B), cudaSuccess);
    CompressedKeyStepParams p;
    p.batch = B;
    p.num_kv_heads = hkv;
    p.head_dim = d;
    p.bits = bits;
    p.group = G;
    p.dtype = dt;
    p.new_k = dk.get();
    p.seq_lens = dlens.as<int32_t>();
    p.tails = dtails.as<void*>();
    p.group_heads = dheads.as<uint8_t*>();
    p.block_bytes = static_cast<int64_t>(block);
    p.map_channel = dch.as<uint8_t>();
    p.map_part = dpart.as<uint8_t>();
    KVSPARSE_ASSERT_CUDA(AppendCompressedKeyStep(p, nullptr));
  }
  KVSPARSE_ASSERT_CUDA(cudaDeviceSynchronize());
  for (int32_t i = 0; i < B * hkv; ++i) {
    const CompressedKeysView v = want[i].view();
    const std::vector<uint8_t> got = ToHost<uint8_t>(bufs[2 * i], 2 * block);
    for (int64_t g = 0; g < v.closed / G; ++g) {
      for (size_t x = 0; x < block; ++x) {
        ASSERT_EQ(got[g * block + x], v.groups[g][x])
            << "(b, j) " << i << " group " << g << " byte " << x;
      }
    }
    for (size_t x = (v.closed / G) * block; x < 2 * block; ++x) {
      ASSERT_EQ(got[x], 0xFF) << "(b, j) " << i << ": a group not closed was written";
    }
    const size_t open = static_cast<size_t>(v.length - v.closed);
    const std::vector<uint8_t> tail = ToHost<uint8_t>(bufs[2 * i + 1], G * row);
    ASSERT_EQ(std::memcmp(tail.data(), v.tail, open * row), 0) << "(b, j) " << i;
  }
}

// With key widths (1-, 2- and 4-bit keys) as well as without.
TEST(CompressedKeyStepCudaTest, ClosesGroupsWithTheCpuBits) {
  KVSPARSE_REQUIRE_GPU();
  for (const bool widths : {false, true}) {
    for (DType dt : {DType::kBf16, DType::kFp16, DType::kFp32}) {
      for (int32_t bits : {1, 2, 4, 8}) {
        for (int32_t d : {64, 128}) {
          if (widths && (bits == 8 || dt == DType::kFp16)) continue;
          ASSERT_NO_FATAL_FAILURE(ExpectStepsCloseGroupsAsTheCpu(dt, bits, d, widths));
        }
      }
    }
  }
}

TEST(CompressedKeyStepCudaTest, RefusesBadShapes) {
  int32_t lens = 1;
  void* tail = &lens;
  uint8_t* head = reinterpret_cast<uint8_t*>(&lens);
  CompressedKeyStepParams p;
  p.batch = 1;
  p.num_kv_heads = 1;
  p.head_dim = 128;
  p.new_k = &lens;  // pointers only checked for null: nothing is launched below
  p.seq_lens = &lens;
  p.tails = &tail;
  p.group_heads = &head;
  p.block_bytes = static_cast<int64_t>(KeyGroupBytes({2, p.group}, 128));
  p.bits = 3;
  EXPECT_EQ(AppendCompressedKeyStep(p, nullptr), cudaErrorInvalidValue);
  p.bits = 1;
  p.head_dim = 48;  // 48 bits: not whole words
  EXPECT_EQ(AppendCompressedKeyStep(p, nullptr), cudaErrorInvalidValue);
  p.head_dim = 128;
  p.block_bytes = static_cast<int64_t>(KeyGroupBytes({1, p.group}, 128)) - 4;  // too small
  EXPECT_EQ(AppendCompressedKeyStep(p, nullptr), cudaErrorInvalidValue);
  p.block_bytes += 4;
  p.tails = nullptr;
  EXPECT_EQ(AppendCompressedKeyStep(p, nullptr), cudaErrorInvalidValue);
}

// CompressKeyGroups' parameters over `groups` groups of kKeyGroupTokens rows of each of hkv kv
// heads laid out one after another at rows (the blocks are the caller's).
CompressKeyGroupsParams GroupsParams(int32_t hkv, int32_t groups, int32_t d, int32_t bits, DType dt,
                                     const void* rows) {
  CompressKeyGroupsParams p;
  p.num_kv_heads = hkv;
  p.groups = groups;
  p.head_dim = d;
  p.bits = bits;
  p.group = kKeyGroupTokens;
  p.dtype = dt;
  p.rows = rows;
  p.head_stride = static_cast<int64_t>(groups) * kKeyGroupTokens * d * DTypeSize(dt);
  return p;
}

// A prompt's groups quantized on the device, kv heads and groups side by side, hold the CPU
// reference's bits (CompressKeyGroup) in every byte; the blocks around them (another kv head's
// stride gap, the groups after the chunk) are not written. The same keys as the step test's,
// with a constant channel (step 0) and signed zeros.
TEST(CompressKeyGroupsCudaTest, EqualsTheCpuBits) {
  KVSPARSE_REQUIRE_GPU();
  const int32_t hkv = 3, G = kKeyGroupTokens, groups = 5, spare = 2;
  for (DType dt : {DType::kBf16, DType::kFp16, DType::kFp32}) {
    for (int32_t bits : {1, 2, 4, 8}) {
      for (int32_t d : {64, 128}) {
        SCOPED_TRACE(testing::Message() << DTypeName(dt) << " bits " << bits << " d " << d);
        const size_t row = static_cast<size_t>(d) * DTypeSize(dt);
        const size_t block = KeyGroupBytes({bits, G}, d);
        std::mt19937 rng(bits * 31 + d + static_cast<int>(dt));
        std::vector<uint8_t> rows(static_cast<size_t>(hkv) * groups * G * row);
        FillKeys(&rows, d, dt, &rng);
        const size_t head_blocks = groups + spare;  // a kv head's room: more than the chunk
        DeviceBuffer drows = ToDevice(rows), dblocks(hkv * head_blocks * block);
        ASSERT_EQ(dblocks.Poison(), cudaSuccess);
        CompressKeyGroupsParams p = GroupsParams(hkv, groups, d, bits, dt, drows.get());
        p.blocks = dblocks.as<uint8_t>();
        p.block_head_stride = static_cast<int64_t>(head_blocks * block);
        p.block_bytes = static_cast<int64_t>(block);
        KVSPARSE_ASSERT_CUDA(CompressKeyGroups(p, nullptr));
        KVSPARSE_ASSERT_CUDA(cudaDeviceSynchronize());
        const std::vector<uint8_t> got = ToHost<uint8_t>(dblocks, hkv * head_blocks * block);
        std::vector<uint8_t> want(block);
        for (int32_t j = 0; j < hkv; ++j) {
          for (int32_t g = 0; g < groups; ++g) {
            CompressKeyGroup({bits, G}, d, dt, rows.data() + (j * groups + g) * G * row,
                             want.data());
            const size_t at = (j * head_blocks + g) * block;
            ASSERT_EQ(std::memcmp(got.data() + at, want.data(), block), 0)
                << "head " << j << " group " << g;
          }
          for (size_t x = (j * head_blocks + groups) * block; x < (j + 1) * head_blocks * block;
               ++x) {
            ASSERT_EQ(got[x], 0xFF) << "head " << j << ": a block past the chunk was written";
          }
        }
      }
    }
  }
}

// With a channel map per kv head (kernels/key_widths.h: widened, whole and left-out channels),
// the blocks are the CPU reference's (CompressKeyGroup with KeyCompression::map) in every byte.
TEST(CompressKeyGroupsCudaTest, ChannelWidthsEqualTheCpuBits) {
  KVSPARSE_REQUIRE_GPU();
  const int32_t hkv = 3, G = kKeyGroupTokens, groups = 3;
  for (DType dt : {DType::kBf16, DType::kFp16, DType::kFp32}) {
    for (int32_t bits : {1, 2, 4}) {
      for (int32_t d : {64, 128}) {
        SCOPED_TRACE(testing::Message() << DTypeName(dt) << " bits " << bits << " d " << d);
        WidthsMaps maps;
        ASSERT_NO_FATAL_FAILURE(maps = MakeWidthsMaps(hkv, d));
        const size_t row = static_cast<size_t>(d) * DTypeSize(dt);
        const size_t block = KeyGroupBytes({bits, G}, d);
        std::mt19937 rng(bits * 17 + d + static_cast<int>(dt));
        std::vector<uint8_t> rows(static_cast<size_t>(hkv) * groups * G * row);
        FillKeys(&rows, d, dt, &rng);
        DeviceBuffer drows = ToDevice(rows), dblocks(hkv * groups * block),
                     dch = ToDevice(maps.channel), dpart = ToDevice(maps.part);
        ASSERT_EQ(dblocks.Poison(), cudaSuccess);
        CompressKeyGroupsParams p = GroupsParams(hkv, groups, d, bits, dt, drows.get());
        p.blocks = dblocks.as<uint8_t>();
        p.block_head_stride = static_cast<int64_t>(groups * block);
        p.block_bytes = static_cast<int64_t>(block);
        p.map_channel = dch.as<uint8_t>();
        p.map_part = dpart.as<uint8_t>();
        KVSPARSE_ASSERT_CUDA(CompressKeyGroups(p, nullptr));
        KVSPARSE_ASSERT_CUDA(cudaDeviceSynchronize());
        const std::vector<uint8_t> got = ToHost<uint8_t>(dblocks, hkv * groups * block);
        std::vector<uint8_t> want(block);
        for (int32_t j = 0; j < hkv; ++j) {
          for (int32_t g = 0; g < groups; ++g) {
            CompressKeyGroup({bits, G, &maps.maps[j]}, d, dt,
                             rows.data() + (j * groups + g) * G * row, want.data());
            const size_t at = (j * groups + g) * block;
            ASSERT_EQ(std::memcmp(got.data() + at, want.data(), block), 0)
                << "head " << j << " group " << g;
          }
        }
      }
    }
  }
}

TEST(CompressKeyGroupsCudaTest, RefusesBadShapes) {
  uint8_t buf[4];
  CompressKeyGroupsParams p;
  p.num_kv_heads = 1;
  p.groups = 1;
  p.head_dim = 128;
  p.rows = buf;  // pointers only checked for null: nothing is launched below
  p.blocks = buf;
  p.block_bytes = static_cast<int64_t>(KeyGroupBytes({2, p.group}, 128));
  p.bits = 3;
  EXPECT_EQ(CompressKeyGroups(p, nullptr), cudaErrorInvalidValue);
  p.bits = 2;
  p.block_bytes -= 4;
  EXPECT_EQ(CompressKeyGroups(p, nullptr), cudaErrorInvalidValue);
  p.block_bytes += 4;
  p.rows = nullptr;
  EXPECT_EQ(CompressKeyGroups(p, nullptr), cudaErrorInvalidValue);
  p.rows = buf;
  p.groups = 0;  // nothing to do
  EXPECT_EQ(CompressKeyGroups(p, nullptr), cudaSuccess);
}

}  // namespace
}  // namespace kvsparse::kernels::cuda
