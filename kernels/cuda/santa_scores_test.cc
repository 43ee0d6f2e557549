#include "kernels/cuda/santa_scores.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_test_util.h"
#include "kernels/santa.h"

namespace kvsparse::kernels::cuda {
namespace {

// PropFromScores's outputs, read back: per query head its rows (max_selected a head), their
// number, the budget S and the log2 weights.
struct PropOutputs {
  std::vector<int32_t> idx, cnt, bud;
  std::vector<float> lw;
  int32_t max_selected = 0;
};

// What PropFromScores samples, as the CPU reference's parameters.
kernels::SantaParams PropParams(int32_t S) {
  kernels::SantaParams params;
  params.samples = S;
  params.tile_size = 256;
  return params;
}

// PropFromScores over `rows` device score rows a sequence ([B * rows, stride]), each serving
// heads_per_row query heads, S samples in tiles of 256 with per-sequence seeds; the counts and
// budgets poisoned first, so a head the kernel does not write shows.
void RunProp(const float* scores, int32_t B, int32_t rows, int32_t hkv, int32_t heads_per_row,
             int64_t stride, const int32_t* lens, const uint64_t* seeds, int32_t S,
             PropOutputs* out) {
  PropFromScoresParams p;
  p.batch = B;
  p.num_q_heads = rows;
  p.num_kv_heads = hkv;
  p.heads_per_row = heads_per_row;
  p.scores = scores;
  p.score_stride = stride;
  p.seq_lens = lens;
  p.max_seq_len = static_cast<int32_t>(stride);
  p.num_samples = S;
  p.tile_size = 256;
  p.seeds = seeds;
  p.max_selected = S + 1;
  const size_t cells = static_cast<size_t>(B) * rows * heads_per_row;
  DeviceBuffer di(cells * p.max_selected * 4), dc(cells * 4), db(cells * 4),
      dw(cells * p.max_selected * 4), ws(PropFromScoresWorkspaceBytes(p));
  ASSERT_EQ(dc.Poison(), cudaSuccess);
  ASSERT_EQ(db.Poison(), cudaSuccess);
  p.indices = di.as<int32_t>();
  p.counts = dc.as<int32_t>();
  p.budgets = db.as<int32_t>();
  p.log2_weights = dw.as<float>();
  KVSPARSE_ASSERT_CUDA(PropFromScores(p, ws.get(), ws.size(), nullptr));
  KVSPARSE_ASSERT_CUDA(cudaDeviceSynchronize());
  out->idx = ToHost<int32_t>(di, cells * p.max_selected);
  out->cnt = ToHost<int32_t>(dc, cells);
  out->bud = ToHost<int32_t>(db, cells);
  out->lw = ToHost<float>(dw, cells * p.max_selected);
  out->max_selected = p.max_selected;
}

// PropFromScores samples what the CPU reference (PlanSantaHead + SampleSantaHead, prop) samples
// from the same scores: per (sequence, head) the same rows ascending, counts read back from the
// log2 weights (log2(c) - s log2 e), the budget S. Ragged lengths (0, 1, under a tile, many
// tiles, more tiles than a block's threads: the budgets' scans in chunks), peaked and flat heads, a
// masked (-inf) tile, GQA group 4, per-sequence seeds. A head may differ where rounding (the
// GPU's sums run in another order, expf's last bit) moves a threshold across a cumulative sum:
// a draw moves to a neighbouring token or tile, so a differing head keeps all but a few of its
// rows; at most 1 head in 10 differs.
TEST(SantaScoresCudaTest, SamplesWhatTheCpuSamples) {
  KVSPARSE_REQUIRE_GPU();
  const std::vector<int32_t> lens = {0, 1, 200, 3000, 20000, 70000};
  const int32_t B = static_cast<int32_t>(lens.size()), H = 8, Hkv = 2, S = 128;
  const int32_t n_max = *std::max_element(lens.begin(), lens.end());
  std::mt19937 rng(5);
  std::normal_distribution<float> z;
  std::vector<float> scores(static_cast<size_t>(B) * H * n_max, 0.f);
  for (int32_t b = 0; b < B; ++b) {
    for (int32_t h = 0; h < H; ++h) {
      float* s = &scores[(static_cast<size_t>(b) * H + h) * n_max];
      for (int32_t t = 0; t < lens[b]; ++t) s[t] = (h % 2 == 0 ? 1.f : 0.2f) * z(rng);
      if (lens[b] > 10) s[3] = 9.f;  // a sink
      if (lens[b] >= 3000) {
        for (int32_t t = 512; t < 768; ++t) s[t] = -INFINITY;  // a masked tile
      }
    }
  }
  std::vector<uint64_t> seeds(B);
  for (int32_t b = 0; b < B; ++b) seeds[b] = 1000 + 17 * b;
  DeviceBuffer ds = ToDevice(scores), dl = ToDevice(lens), dseed = ToDevice(seeds);
  PropOutputs o;
  ASSERT_NO_FATAL_FAILURE(
      RunProp(ds.as<float>(), B, H, Hkv, 1, n_max, dl.as<int32_t>(), dseed.as<uint64_t>(), S, &o));
  const kernels::SantaParams params = PropParams(S);
  SantaHeadPlan plan;
  HeadRows rows;
  int differing = 0;
  for (int32_t b = 0; b < B; ++b) {
    for (int32_t h = 0; h < H; ++h) {
      const size_t bh = static_cast<size_t>(b) * H + h;
      SCOPED_TRACE(testing::Message() << "b " << b << " h " << h);
      const int32_t n = lens[b];
      if (n == 0) {
        EXPECT_EQ(o.cnt[bh], 0);
        EXPECT_EQ(o.bud[bh], 0);
        continue;
      }
      const std::vector<float> s(scores.begin() + bh * n_max, scores.begin() + bh * n_max + n);
      ASSERT_TRUE(PlanSantaHead(s, params, &plan).ok());
      SampleSantaHead(plan, params, seeds[b], 0, h, h / (H / Hkv), &rows);
      EXPECT_EQ(o.bud[bh], S);
      std::vector<int32_t> got(o.idx.begin() + bh * o.max_selected,
                               o.idx.begin() + bh * o.max_selected + o.cnt[bh]);
      if (got != rows.tokens) {
        ++differing;
        std::vector<int32_t> moved;
        std::set_symmetric_difference(got.begin(), got.end(), rows.tokens.begin(),
                                      rows.tokens.end(), std::back_inserter(moved));
        EXPECT_LE(moved.size(), 4u) << "rows in one of the GPU's and the CPU's samples only";
        continue;
      }
      for (size_t r = 0; r < got.size(); ++r) {
        const float c = std::exp2(o.lw[bh * o.max_selected + r] + s[got[r]] * 1.4426950408889634f);
        EXPECT_NEAR(c, rows.counts[r], 1e-3f * rows.counts[r]) << "row " << got[r];
      }
    }
  }
  EXPECT_LE(differing, 4) << "heads whose rows differ from the CPU's (of 40)";
}

// The group mixture on the GPU: GroupMixtureFromScores gives the CPU reference's mixture scores
// (kernels::GroupMixtureScores, float64) to float rounding, -inf where no head has mass (a tile
// every head masks); PropFromScores over the mixture rows with heads_per_row = G samples what the
// CPU samples from those rows (the streams of the kv head's first query head) and writes the
// sample to each of the group's G heads. Heads that attend apart (one peaked, one flat, a sink
// in one head only), ragged lengths, G = 4.
TEST(SantaScoresCudaTest, GroupMixtureSamplesOncePerKvHead) {
  KVSPARSE_REQUIRE_GPU();
  const std::vector<int32_t> lens = {0, 1, 300, 9000, 40000};
  const int32_t B = static_cast<int32_t>(lens.size()), H = 8, Hkv = 2, G = H / Hkv, S = 128;
  const int32_t n_max = *std::max_element(lens.begin(), lens.end());
  std::mt19937 rng(11);
  std::normal_distribution<float> z;
  std::vector<float> scores(static_cast<size_t>(B) * H * n_max, 0.f);
  for (int32_t b = 0; b < B; ++b) {
    for (int32_t h = 0; h < H; ++h) {
      float* s = &scores[(static_cast<size_t>(b) * H + h) * n_max];
      for (int32_t t = 0; t < lens[b]; ++t) s[t] = (h % 2 == 0 ? 2.f : 0.3f) * z(rng) + h;
      if (lens[b] > 10 && h % G == 1) s[7] = 30.f;  // a sink of one head of each group
      if (lens[b] >= 9000) {
        for (int32_t t = 1024; t < 1280; ++t) s[t] = -INFINITY;  // masked in every head
      }
    }
  }
  std::vector<uint64_t> seeds(B);
  for (int32_t b = 0; b < B; ++b) seeds[b] = 77 + 5 * b;
  DeviceBuffer ds = ToDevice(scores), dl = ToDevice(lens), dseed = ToDevice(seeds);
  const size_t rows = static_cast<size_t>(B) * Hkv;
  DeviceBuffer dmix(rows * n_max * sizeof(float));
  ASSERT_EQ(dmix.Poison(), cudaSuccess);
  GroupMixtureParams gm;
  gm.batch = B;
  gm.num_q_heads = H;
  gm.num_kv_heads = Hkv;
  gm.scores = ds.as<float>();
  gm.score_stride = n_max;
  gm.seq_lens = dl.as<int32_t>();
  gm.max_seq_len = n_max;
  gm.mixture = dmix.as<float>();
  gm.mixture_stride = n_max;
  DeviceBuffer gws(std::max<size_t>(1, GroupMixtureWorkspaceBytes(gm)));
  KVSPARSE_ASSERT_CUDA(GroupMixtureFromScores(gm, gws.get(), gws.size(), nullptr));
  PropOutputs o;
  ASSERT_NO_FATAL_FAILURE(RunProp(dmix.as<float>(), B, Hkv, Hkv, G, n_max, dl.as<int32_t>(),
                                  dseed.as<uint64_t>(), S, &o));
  const auto mix = ToHost<float>(dmix, rows * n_max);
  const kernels::SantaParams params = PropParams(S);
  SantaHeadPlan plan;
  HeadRows want;
  int64_t masked = 0;
  for (int32_t b = 0; b < B; ++b) {
    const int32_t n = lens[b];
    for (int32_t j = 0; j < Hkv; ++j) {
      SCOPED_TRACE(testing::Message() << "b " << b << " kv head " << j);
      std::vector<const float*> heads(G);
      for (int32_t g = 0; g < G; ++g) {
        heads[g] = &scores[(static_cast<size_t>(b) * H + j * G + g) * n_max];
      }
      std::vector<float> ref;
      GroupMixtureScores(heads, n, &ref);
      const float* got = &mix[(static_cast<size_t>(b) * Hkv + j) * n_max];
      for (int32_t t = 0; t < n; ++t) {
        if (std::isinf(ref[t])) {
          ASSERT_EQ(got[t], ref[t]) << "t " << t;
          ++masked;
          continue;
        }
        ASSERT_NEAR(got[t], ref[t], 2e-5f * std::max(1.f, std::fabs(ref[t]))) << "t " << t;
      }
      if (n == 0) {
        for (int32_t g = 0; g < G; ++g) EXPECT_EQ(o.cnt[b * H + j * G + g], 0);
        continue;
      }
      // The sampler over the GPU's own mixture rows: the CPU's rows exactly.
      const std::vector<float> row(got, got + n);
      ASSERT_TRUE(PlanSantaHead(row, params, &plan).ok());
      SampleSantaHead(plan, params, seeds[b], 0, j * G, j, &want);
      for (int32_t g = 0; g < G; ++g) {
        const size_t bh = static_cast<size_t>(b) * H + j * G + g;
        EXPECT_EQ(o.bud[bh], S) << "head " << g;
        const std::vector<int32_t> rows_g(o.idx.begin() + bh * o.max_selected,
                                          o.idx.begin() + bh * o.max_selected + o.cnt[bh]);
        ASSERT_EQ(rows_g, want.tokens) << "head " << g;
        for (size_t r = 0; r < rows_g.size(); ++r) {
          const float c =
              std::exp2(o.lw[bh * o.max_selected + r] + row[rows_g[r]] * 1.4426950408889634f);
          EXPECT_NEAR(c, want.counts[r], 1e-3f * want.counts[r]) << "row " << rows_g[r];
        }
      }
    }
  }
  EXPECT_GT(masked, 0) << "the masked tile's tokens are -inf in the mixture";
}

// The uniform floor on the GPU (ProposalFloorOnScores) gives the CPU reference's scores
// (kernels::ProposalFloor, float64) to float rounding on every row of each sequence's length:
// ragged lengths (0, 1, under a chunk, several chunks of 4096), a row with -inf tokens (which
// get the floor's a / n), a row with no mass at all (every token a / n); tokens past a
// sequence's length keep what they held. Two floors, rows_per_seq 3 (as a mixture's rows).
TEST(SantaScoresCudaTest, ProposalFloorGivesTheCpusScores) {
  KVSPARSE_REQUIRE_GPU();
  const std::vector<int32_t> lens = {0, 1, 700, 9000};
  const int32_t B = static_cast<int32_t>(lens.size()), R = 3;
  const int32_t n_max = *std::max_element(lens.begin(), lens.end());
  constexpr float kPast = 123.f;  // what every token past its sequence's length holds
  std::mt19937 rng(29);
  std::normal_distribution<float> z;
  std::vector<float> scores(static_cast<size_t>(B) * R * n_max, kPast);
  for (int32_t b = 0; b < B; ++b) {
    for (int32_t r = 0; r < R; ++r) {
      float* s = &scores[(static_cast<size_t>(b) * R + r) * n_max];
      for (int32_t t = 0; t < lens[b]; ++t) {
        s[t] = r == 2 ? -INFINITY : 3.f * z(rng) + (r == 0 && t == 5 ? 25.f : 0.f);
      }
      if (r == 1 && lens[b] > 600) {
        for (int32_t t = 100; t < 600; ++t) s[t] = -INFINITY;
      }
    }
  }
  DeviceBuffer dl = ToDevice(lens);
  for (const float a : {0.05f, 0.5f}) {
    SCOPED_TRACE(testing::Message() << "floor " << a);
    DeviceBuffer ds = ToDevice(scores);
    ProposalFloorParams fp;
    fp.batch = B;
    fp.rows_per_seq = R;
    fp.scores = ds.as<float>();
    fp.score_stride = n_max;
    fp.seq_lens = dl.as<int32_t>();
    fp.max_seq_len = n_max;
    fp.floor = a;
    DeviceBuffer ws(std::max<size_t>(1, ProposalFloorWorkspaceBytes(fp)));
    KVSPARSE_ASSERT_CUDA(ProposalFloorOnScores(fp, ws.get(), ws.size(), nullptr));
    KVSPARSE_ASSERT_CUDA(cudaDeviceSynchronize());
    const auto got = ToHost<float>(ds, scores.size());
    for (int32_t b = 0; b < B; ++b) {
      for (int32_t r = 0; r < R; ++r) {
        SCOPED_TRACE(testing::Message() << "b " << b << " row " << r);
        const size_t at = (static_cast<size_t>(b) * R + r) * n_max;
        std::vector<float> want(scores.begin() + at, scores.begin() + at + lens[b]);
        ProposalFloor(a, &want);
        for (int32_t t = 0; t < n_max; ++t) {
          if (t >= lens[b]) {
            ASSERT_EQ(got[at + t], kPast) << "token " << t << " past the length";
            continue;
          }
          ASSERT_TRUE(std::isfinite(got[at + t])) << "token " << t;
          ASSERT_NEAR(got[at + t], want[t], 2e-5f * std::max(1.f, std::fabs(want[t])))
              << "token " << t;
        }
      }
    }
  }
  ProposalFloorParams bad;
  bad.batch = 1;
  bad.rows_per_seq = 1;
  bad.scores = nullptr;
  EXPECT_EQ(ProposalFloorOnScores(bad, nullptr, 0, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace kvsparse::kernels::cuda
