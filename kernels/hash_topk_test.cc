#include "kernels/hash_topk.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/dense.h"
#include "kernels/hash_signatures.h"
#include "kernels/philox.h"
#include "kernels/synthetic.h"

namespace kvsparse::kernels {
namespace {

// SimHashRecallOfTrueTopK floors: measured recall minus about 0.1.
constexpr double kRecallFloor32 = 0.33;   // measured 0.430
constexpr double kRecallFloor64 = 0.53;   // measured 0.633
constexpr double kRecallFloor128 = 0.80;  // measured 0.898

TEST(HashSignaturesTest, BitsMustBeMultipleOf32UpTo256) {
  for (int32_t bits : {0, 16, 31, 48, 288, -32}) {
    const absl::Status s = ValidateSignatureBits(bits);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bits;
    EXPECT_NE(std::string(s.message()).find("bits"), std::string::npos);
  }
  for (int32_t bits : {32, 64, 128, 256}) EXPECT_TRUE(ValidateSignatureBits(bits).ok()) << bits;
  SimHashPlanes planes;
  EXPECT_EQ(MakeSimHashPlanes(1, 0, 0, 40, 16, &planes).code(), absl::StatusCode::kInvalidArgument);
}

// Planes are exactly the documented Philox/Box-Muller values.
TEST(HashSignaturesTest, SimHashPlanesFollowTheStreamMapping) {
  SimHashPlanes a, b, c;
  ASSERT_TRUE(MakeSimHashPlanes(42, 3, 5, 64, 127, &a).ok());
  ASSERT_TRUE(MakeSimHashPlanes(42, 3, 5, 64, 127, &b).ok());
  ASSERT_TRUE(MakeSimHashPlanes(42, 3, 6, 64, 127, &c).ok());
  EXPECT_EQ(a.w, b.w);
  EXPECT_NE(a.w, c.w);
  ASSERT_EQ(a.w.size(), 64u * 128u);
  for (int j : {0, 17, 63}) {
    const PhiloxStream s = PhiloxStream::Make(42, RngTag::kSimHashPlane, 3, 5, j);
    for (int cidx : {0, 1, 64, 127}) {
      float z0, z1;
      GaussianPair(s, cidx / 2, &z0, &z1);
      EXPECT_EQ(a.w[j * 128 + cidx], cidx % 2 == 0 ? z0 : z1);
    }
  }
}

// The augmentation makes every key's augmented norm M, so the expected similarity of a query
// and a key is bits * (1 - 2 theta / pi) with cos theta = q.k / (|q| M), whatever |k| is.
TEST(HashSignaturesTest, SimHashAugmentationTurnsInnerProductIntoCosine) {
  const int d = 64, bits = 256, kSeedsPlanes = 200;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> q(d), dir(d);
  for (float& x : q) x = normal(rng);
  for (int i = 0; i < d; ++i) dir[i] = q[i] + normal(rng);  // positive cosine with q
  double qn = 0, dn = 0;
  for (int i = 0; i < d; ++i) {
    qn += q[i] * q[i];
    dn += dir[i] * dir[i];
  }
  qn = std::sqrt(qn);
  dn = std::sqrt(dn);
  const float M = 10.f;
  // Keys along one direction with different norms: q.k grows with |k|, so must similarity.
  std::vector<double> mean_sim;
  for (float norm : {2.f, 5.f, 9.f}) {
    std::vector<float> k(d);
    double dot = 0;
    for (int i = 0; i < d; ++i) {
      k[i] = static_cast<float>(dir[i] / dn * norm);
      dot += q[i] * k[i];
    }
    const double theta = std::acos(dot / (qn * M));
    const double expected = bits * (1 - 2 * theta / M_PI);
    double sum = 0, sum2 = 0;
    std::vector<uint32_t> qs(8), ks(8), ks2(8);
    for (int s = 0; s < kSeedsPlanes; ++s) {
      SimHashPlanes planes;
      ASSERT_TRUE(MakeSimHashPlanes(s, 0, 0, bits, d, &planes).ok());
      SimHashQuery(planes, q.data(), qs.data());
      SimHashKey(planes, k.data(), M, ks.data());
      SimHashSign(planes, k.data(), std::sqrt(M * M - norm * norm), ks2.data());
      EXPECT_EQ(ks, ks2);
      const double sim = HammingSimilarity(qs.data(), ks.data(), 8);
      sum += sim;
      sum2 += sim * sim;
    }
    const double mean = sum / kSeedsPlanes;
    const double se = std::sqrt((sum2 / kSeedsPlanes - mean * mean) / kSeedsPlanes);
    EXPECT_NEAR(mean, expected, 4 * se + 0.5) << "norm " << norm;
    mean_sim.push_back(mean);
  }
  EXPECT_LT(mean_sim[0], mean_sim[1]);
  EXPECT_LT(mean_sim[1], mean_sim[2]);
}

// Ties: higher score first, then the lower token index; sink and window always included.
TEST(HashTopKTest, SelectionRuleAndTieBreaking) {
  std::vector<int32_t> scores(20, 5);
  scores[10] = 9;
  scores[15] = 9;
  scores[12] = 7;
  std::vector<int32_t> out, scratch;
  EXPECT_EQ(SelectSinkLocalTopK(scores.data(), 20, 2, 3, 5, &out, &scratch), 5);
  // sink {0,1}, window {17,18,19}, top-5 of [2,17): 10, 15 (9), 12 (7), then ties at 5: 2, 3.
  EXPECT_EQ(out, (std::vector<int32_t>{0, 1, 2, 3, 10, 12, 15, 17, 18, 19}));
  // k larger than the rest: everything.
  EXPECT_EQ(SelectSinkLocalTopK(scores.data(), 20, 2, 3, 20, &out, &scratch), 15);
  EXPECT_EQ(out.size(), 20u);
  // Window and sink overlapping a short sequence.
  EXPECT_EQ(SelectSinkLocalTopK(scores.data(), 4, 3, 3, 2, &out, &scratch), 0);
  EXPECT_EQ(out, (std::vector<int32_t>{0, 1, 2, 3}));
  std::vector<float> f = {1.f, 3.f, 3.f, 2.f};
  EXPECT_EQ(SelectSinkLocalTopK(f.data(), 4, 0, 0, 1, &out, &scratch), 1);
  EXPECT_EQ(out, (std::vector<int32_t>{1}));
}

SyntheticProblem Problem(DType dtype, std::vector<int32_t> lens, int32_t h = 8, int32_t hkv = 2) {
  SyntheticOptions o;
  o.family = ScoreFamily::kPeaked;
  o.batch = static_cast<int32_t>(lens.size());
  o.num_q_heads = h;
  o.num_kv_heads = hkv;
  o.head_dim = 64;
  o.seq_lens = std::move(lens);
  o.dtype = dtype;
  return SyntheticProblem::Make(o);
}

// A selection is never empty where the sequence has a token (issue 48: every output is an
// estimate of attention, not zeros): sink, window and top-k all 0, or a fraction that rounds to
// no token, take the one highest-scoring token; a top_k above a short sequence's length reads
// what it has (it was INVALID_ARGUMENT before, for every decode of a prompt shorter than top_k).
TEST(HashTopKTest, ShortSequencesReadWhatTheyHaveAndNoSelectionIsEmpty) {
  std::vector<float> f = {1.f, 3.f, 5.f, 2.f, 4.f};
  std::vector<int32_t> out, scratch;
  EXPECT_EQ(SelectSinkLocalTopK(f.data(), 5, 0, 0, 0, &out, &scratch), 1);
  EXPECT_EQ(out, (std::vector<int32_t>{2}));
  absl::StatusOr<int32_t> k = ResolveTopK(FixedSet{0, 0, 0, 0.01f}, 50);  // 0.5 rounds to 0 rows
  ASSERT_TRUE(k.ok());
  EXPECT_EQ(SelectSinkLocalTopK(f.data(), 5, 0, 0, *k, &out, &scratch), 1);
  EXPECT_EQ(out, (std::vector<int32_t>{2}));
  // With a sink or a window the rule needs no extra row.
  EXPECT_EQ(SelectSinkLocalTopK(f.data(), 5, 1, 0, 0, &out, &scratch), 0);
  EXPECT_EQ(out, (std::vector<int32_t>{0}));
  EXPECT_EQ(SelectSinkLocalTopK(f.data(), 0, 0, 0, 0, &out, &scratch), 0);  // no token: none
  EXPECT_TRUE(out.empty());
  // top_k beyond the sequence: its length.
  k = ResolveTopK(FixedSet{0, 0, 64, 0.f}, 50);
  ASSERT_TRUE(k.ok());
  EXPECT_EQ(*k, 50);
  // End to end: HashTopKParams{} (every field 0, as a request's defaults on the wire can be)
  // and a top-k longer than the sequence with sink and window covering it.
  SyntheticProblem sp = Problem(DType::kBf16, {50}, 4, 2);
  Signatures sigs;
  ASSERT_TRUE(ComputeSimHashSignatures(sp.problem, SimHashConfig{1, 0, 32, {}}, &sigs).ok());
  HashTopKParams zero;
  zero.fixed.sink_tokens = 0;
  zero.fixed.local_tokens = 0;
  zero.fixed.top_k = 0;
  zero.fixed.top_k_fraction = 0.f;
  RowSelection sel;
  ASSERT_TRUE(HashTopKDecodeCpu(sp.problem, zero, sigs.view, &sel).ok());
  double mass = 0;
  for (int32_t j = 0; j < 2; ++j) EXPECT_GE(sel.at(0, j).num_rows(), 1) << "kv head " << j;
  for (double x : OutputAsDouble(sp.problem)) mass += std::fabs(x);
  EXPECT_GT(mass, 0.0) << "an output of zeros";
  HashTopKParams over;
  over.fixed.sink_tokens = 128;
  over.fixed.local_tokens = 128;
  over.fixed.top_k = 64;
  ASSERT_TRUE(HashTopKDecodeCpu(sp.problem, over, sigs.view, &sel).ok());
  std::vector<double> dense;
  ASSERT_TRUE(DenseDecodeFloat64(sp.problem, &dense).ok());
  EXPECT_LT(RelativeL2(dense, OutputAsDouble(sp.problem)), 8e-3);
}

// k = n selects every row: the output is dense attention.
TEST(HashTopKTest, KEqualsNIsDense) {
  for (DType dt : {DType::kFp32, DType::kBf16}) {
    SyntheticProblem sp = Problem(dt, {500, 3, 0});
    std::vector<double> dense;
    ASSERT_TRUE(DenseDecodeFloat64(sp.problem, &dense).ok());
    Signatures sigs;
    ASSERT_TRUE(ComputeSimHashSignatures(sp.problem, SimHashConfig{1, 0, 64, {}}, &sigs).ok());
    HashTopKParams params;
    params.fixed.sink_tokens = 4;
    params.fixed.local_tokens = 16;
    params.fixed.top_k_fraction = 1.f;
    params.bits = 64;
    RowSelection sel;
    ASSERT_TRUE(HashTopKDecodeCpu(sp.problem, params, sigs.view, &sel).ok());
    EXPECT_EQ(sel.kind, EstimateKind::kSoftmax);
    EXPECT_EQ(sel.at(0, 1).num_rows(), 500);
    EXPECT_EQ(sel.at(2, 0).num_rows(), 0);
    const double err = RelativeL2(dense, OutputAsDouble(sp.problem));
    EXPECT_LT(err, dt == DType::kFp32 ? 2e-6 : 8e-3) << DTypeName(dt);
  }
}

// SelectAllRows + EstimateInPlace is dense attention (the reference as a RowSelection).
TEST(RowSelectionTest, SelectAllRowsIsDense) {
  SyntheticProblem sp = Problem(DType::kFp32, {300, 0, 7});
  std::vector<double> dense;
  ASSERT_TRUE(DenseDecodeFloat64(sp.problem, &dense).ok());
  RowSelection sel;
  ASSERT_TRUE(SelectAllRows(sp.problem, &sel).ok());
  EXPECT_EQ(sel.at(0, 1).rows_selected(), 4 * 300);
  EXPECT_EQ(sel.at(2, 0).budgets, (std::vector<int64_t>{7, 7, 7, 7}));
  ASSERT_TRUE(EstimateInPlace(sp.problem, sel).ok());
  EXPECT_LT(RelativeL2(dense, OutputAsDouble(sp.problem)), 2e-6);
}

// Per query head exactly sink + window + k rows; the union is what a kv head fetches; the
// budgets are the k chosen.
TEST(HashTopKTest, SelectionShape) {
  SyntheticProblem sp = Problem(DType::kBf16, {1000});
  Signatures sigs;
  ASSERT_TRUE(ComputeSimHashSignatures(sp.problem, SimHashConfig{9, 0, 32, {}}, &sigs).ok());
  HashTopKParams params;
  params.fixed.sink_tokens = 8;
  params.fixed.local_tokens = 32;
  params.fixed.top_k = 50;
  RowSelection sel;
  ASSERT_TRUE(HashTopKSelectCpu(sp.problem, params, sigs.view, &sel).ok());
  for (int32_t kvh = 0; kvh < 2; ++kvh) {
    const KvHeadSelection& h = sel.at(0, kvh);
    EXPECT_EQ(h.budgets, (std::vector<int64_t>{50, 50, 50, 50}));
    for (int g = 0; g < 4; ++g) {
      int32_t used = 0;
      for (int32_t r = 0; r < h.num_rows(); ++r) used += h.head_counts[g * h.num_rows() + r];
      EXPECT_EQ(used, 8 + 32 + 50);
    }
    EXPECT_GE(h.num_rows(), 90);
    EXPECT_LE(h.num_rows(), 8 + 32 + 4 * 50);
    EXPECT_EQ(h.rows_selected(), 4 * 90);
  }
}

// Recall of the true top-16 (by exact q.k) within the hash top-128 of n = 4096 keys: keys
// with log-normal norms (sigma 0.2) and random directions, plus 16 planted high-similarity
// tokens (cosine with q uniform in [0.5, 0.9]); mean over 16 independent (query, keys, planes)
// trials. Plane j does not depend on the number of bits, so the 32- and 64-bit signatures are
// the first words of the 128-bit ones. Floors: the recalls measured when this test was written
// (printed below) minus a margin of about 0.1.
TEST(HashTopKTest, SimHashRecallOfTrueTopK) {
  const int d = 128, n = 4096, planted = 16, true_k = 16, hash_k = 128, trials = 16;
  const int max_bits = 128, max_words = max_bits / 32;
  const std::vector<std::pair<int32_t, double>> floors = {
      {32, kRecallFloor32}, {64, kRecallFloor64}, {128, kRecallFloor128}};
  std::vector<double> recall(floors.size(), 0.0);
  std::vector<float> k(static_cast<size_t>(n) * d), q(d), g(d);
  std::vector<uint32_t> qs(max_words), ks(static_cast<size_t>(n) * max_words);
  std::vector<int32_t> sim(n), hash_top, scratch, order(n);
  std::vector<double> exact(n);
  for (int trial = 0; trial < trials; ++trial) {
    std::mt19937_64 rng(1000 + trial);
    std::normal_distribution<float> normal(0.f, 1.f);
    std::lognormal_distribution<float> lognorm(0.f, 0.2f);
    std::uniform_real_distribution<float> cosine(0.5f, 0.9f);
    double qn = 0;
    for (float& x : q) {
      x = normal(rng);
      qn += double{x} * x;
    }
    qn = std::sqrt(qn);
    std::vector<int32_t> pos(n);
    std::iota(pos.begin(), pos.end(), 0);
    std::shuffle(pos.begin(), pos.end(), rng);
    std::vector<bool> is_plant(n, false);
    for (int i = 0; i < planted; ++i) is_plant[pos[i]] = true;
    float max_norm = 0;
    for (int t = 0; t < n; ++t) {
      // g = a q^ + o with o orthogonal to q; key = r (c q^ + sqrt(1 - c^2) o / |o|), where c is
      // g's own cosine with q (random keys) or drawn from [0.5, 0.9] (planted keys).
      double a = 0;
      for (int i = 0; i < d; ++i) {
        g[i] = normal(rng);
        a += g[i] * q[i] / qn;
      }
      double o2 = 0;
      for (int i = 0; i < d; ++i) {
        g[i] -= static_cast<float>(a * q[i] / qn);
        o2 += double{g[i]} * g[i];
      }
      const double c = is_plant[t] ? cosine(rng) : a / std::sqrt(o2 + a * a);
      const double r = lognorm(rng) * std::sqrt(static_cast<double>(d));
      double s = 0, nn = 0;
      float* kt = &k[static_cast<size_t>(t) * d];
      for (int i = 0; i < d; ++i) {
        kt[i] =
            static_cast<float>(r * (c * q[i] / qn + std::sqrt(1 - c * c) * g[i] / std::sqrt(o2)));
        s += double{q[i]} * kt[i];
        nn += double{kt[i]} * kt[i];
      }
      exact[t] = s;
      max_norm = std::max(max_norm, static_cast<float>(std::sqrt(nn)));
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + true_k, order.end(),
                      [&](int32_t x, int32_t y) { return exact[x] > exact[y]; });
    SimHashPlanes planes;
    ASSERT_TRUE(MakeSimHashPlanes(77 + trial, 0, 0, max_bits, d, &planes).ok());
    SimHashQuery(planes, q.data(), qs.data());
    for (int t = 0; t < n; ++t) {
      SimHashKey(planes, &k[static_cast<size_t>(t) * d], max_norm, &ks[t * max_words]);
    }
    for (size_t f = 0; f < floors.size(); ++f) {
      const int32_t words = floors[f].first / 32;
      for (int t = 0; t < n; ++t) sim[t] = HammingSimilarity(qs.data(), &ks[t * max_words], words);
      SelectSinkLocalTopK(sim.data(), n, 0, 0, hash_k, &hash_top, &scratch);
      int hit = 0;
      for (int i = 0; i < true_k; ++i) {
        hit += std::binary_search(hash_top.begin(), hash_top.end(), order[i]) ? 1 : 0;
      }
      recall[f] += static_cast<double>(hit) / true_k / trials;
    }
  }
  for (size_t f = 0; f < floors.size(); ++f) {
    std::printf(
        "[hash recall] SimHash %3d bits: recall of true top-%d in hash top-%d of n=%d = "
        "%.3f (floor %.2f)\n",
        floors[f].first, true_k, hash_k, n, recall[f], floors[f].second);
    RecordProperty(absl::StrCat("recall_", floors[f].first, "_bits"), absl::StrCat(recall[f]));
    EXPECT_GE(recall[f], floors[f].second) << floors[f].first << " bits";
  }
}

// ---- learned MLP signatures ---------------------------------------------------------------------

LearnedHashWeights RandomWeights(int32_t layers, int32_t heads, int32_t key_mlps,
                                 std::vector<int32_t> dims, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  LearnedHashWeights w;
  w.num_layers = layers;
  w.num_q_heads = heads;
  w.num_key_mlps = key_mlps;
  w.dims = dims;
  auto make = [&]() {
    HashMlp m;
    m.dims = dims;
    for (size_t i = 0; i + 1 < dims.size(); ++i) {
      m.weights.emplace_back(static_cast<size_t>(dims[i]) * dims[i + 1]);
      m.biases.emplace_back(dims[i + 1]);
      const float sc = 1.f / std::sqrt(static_cast<float>(dims[i]));
      for (float& x : m.weights.back()) x = sc * normal(rng);
      for (float& x : m.biases.back()) x = 0.1f * normal(rng);
    }
    return m;
  };
  for (int32_t i = 0; i < layers * heads; ++i) w.query_mlps.push_back(make());
  for (int32_t i = 0; i < layers * key_mlps; ++i) w.key_mlps.push_back(make());
  return w;
}

TEST(LearnedHashTest, RoundTripsThroughTheFileFormat) {
  const LearnedHashWeights w = RandomWeights(2, 8, 2, {64, 48, 40, 64}, 3);
  const std::string path = testing::TempDir() + "/kvsparse_hash_weights.bin";
  ASSERT_TRUE(WriteLearnedHashWeights(w, path).ok());
  absl::StatusOr<LearnedHashWeights> r = ReadLearnedHashWeights(path);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->num_layers, 2);
  EXPECT_EQ(r->num_q_heads, 8);
  EXPECT_EQ(r->num_key_mlps, 2);
  EXPECT_EQ(r->dims, w.dims);
  for (size_t i = 0; i < w.query_mlps.size(); ++i) {
    EXPECT_EQ(r->query_mlps[i].weights, w.query_mlps[i].weights);
    EXPECT_EQ(r->query_mlps[i].biases, w.query_mlps[i].biases);
  }
  for (size_t i = 0; i < w.key_mlps.size(); ++i) {
    EXPECT_EQ(r->key_mlps[i].weights, w.key_mlps[i].weights);
    EXPECT_EQ(r->key_mlps[i].biases, w.key_mlps[i].biases);
  }
  // Header bytes as specified.
  absl::StatusOr<std::string> bytes = SerializeLearnedHashWeights(w);
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(bytes->substr(0, 8), "KVSPHASH");
  EXPECT_EQ(static_cast<uint8_t>((*bytes)[8]), 1);  // version, little-endian
  const size_t per_mlp = (64 + 1) * 48 + (48 + 1) * 40 + (40 + 1) * 64;
  EXPECT_EQ(bytes->size(), 8 + 4 * 5 + 4 * 4 + 4 * per_mlp * 2 * (8 + 2));
  // Same signatures from the re-read weights.
  SyntheticProblem sp = Problem(DType::kBf16, {300});
  Signatures a, b;
  ASSERT_TRUE(ComputeLearnedSignatures(sp.problem, w, 1, &a).ok());
  ASSERT_TRUE(ComputeLearnedSignatures(sp.problem, *r, 1, &b).ok());
  EXPECT_EQ(a.q, b.q);
  EXPECT_EQ(a.k, b.k);
  // Malformed files.
  auto bad = [&](std::string s, const char* why) {
    EXPECT_EQ(ParseLearnedHashWeights(s).status().code(), absl::StatusCode::kInvalidArgument)
        << why;
  };
  std::string s = *bytes;
  s[0] = 'X';
  bad(s, "magic");
  s = *bytes;
  s[8] = 2;
  bad(s, "version");
  bad(bytes->substr(0, bytes->size() - 1), "truncated");
  bad(*bytes + "x", "trailing byte");
  s = *bytes;
  s[28 + 12] = 48;  // dims[3] (bits) = 48
  bad(s, "bits not a multiple of 32");
  EXPECT_EQ(ReadLearnedHashWeights(path + ".missing").status().code(), absl::StatusCode::kNotFound);
}

// One linear layer with the SimHash planes' first d coordinates and zero bias gives exactly
// SimHash query signatures (checks the MLP arithmetic and the bit packing agree).
TEST(LearnedHashTest, SingleLinearLayerEqualsSimHashQuery) {
  const int d = 64, bits = 96;
  SimHashPlanes planes;
  ASSERT_TRUE(MakeSimHashPlanes(5, 0, 0, bits, d, &planes).ok());
  HashMlp m;
  m.dims = {d, bits};
  m.weights.emplace_back(static_cast<size_t>(bits) * d);
  m.biases.emplace_back(bits, 0.f);
  for (int j = 0; j < bits; ++j) {
    for (int c = 0; c < d; ++c) m.weights[0][j * d + c] = planes.w[j * (d + 1) + c];
  }
  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(d), scratch;
  for (int trial = 0; trial < 50; ++trial) {
    for (float& v : x) v = normal(rng);
    uint32_t a[3], b[3];
    SimHashQuery(planes, x.data(), a);
    m.Sign(x.data(), b, &scratch);
    EXPECT_EQ(std::vector<uint32_t>(a, a + 3), std::vector<uint32_t>(b, b + 3));
  }
}

// Learned signatures with one key MLP per query head (key_heads = H) drive the selection; with
// k = n the output is dense.
TEST(LearnedHashTest, PerQueryHeadKeyMlpsEndToEnd) {
  SyntheticProblem sp = Problem(DType::kFp32, {400, 50});
  const LearnedHashWeights w = RandomWeights(1, 8, 8, {64, 32, 32, 32}, 8);
  Signatures sigs;
  ASSERT_TRUE(ComputeLearnedSignatures(sp.problem, w, 0, &sigs).ok());
  EXPECT_EQ(sigs.view.key_heads, 8);
  HashTopKParams params;
  params.fixed.sink_tokens = 0;
  params.fixed.local_tokens = 0;
  params.fixed.top_k = 40;
  RowSelection sel;
  ASSERT_TRUE(HashTopKDecodeCpu(sp.problem, params, sigs.view, &sel).ok());
  EXPECT_GE(sel.at(0, 0).num_rows(), 40);
  params.fixed.top_k = 0;
  params.fixed.top_k_fraction = 1.f;
  std::vector<double> dense;
  ASSERT_TRUE(DenseDecodeFloat64(sp.problem, &dense).ok());
  ASSERT_TRUE(HashTopKDecodeCpu(sp.problem, params, sigs.view, &sel).ok());
  EXPECT_LT(RelativeL2(dense, OutputAsDouble(sp.problem)), 2e-6);
  // Mismatched weights are rejected.
  const LearnedHashWeights w3 = RandomWeights(1, 8, 3, {64, 32}, 8);
  EXPECT_EQ(ComputeLearnedSignatures(sp.problem, w3, 0, &sigs).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputeLearnedSignatures(sp.problem, w, 1, &sigs).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(HashTopKTest, RejectsBadParameters) {
  SyntheticProblem sp = Problem(DType::kBf16, {100});
  Signatures sigs;
  ASSERT_TRUE(ComputeSimHashSignatures(sp.problem, SimHashConfig{1, 0, 32, {}}, &sigs).ok());
  auto expect_invalid = [&](HashTopKParams params, const char* field) {
    const absl::Status s = HashTopKDecodeCpu(sp.problem, params, sigs.view);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(std::string(s.message()).find(field), std::string::npos) << s.message();
  };
  HashTopKParams p;
  p.fixed.top_k = -1;
  expect_invalid(p, "top_k");
  p = HashTopKParams{};
  p.fixed.top_k_fraction = 1.5f;
  expect_invalid(p, "top_k_fraction");
  p = HashTopKParams{};
  p.bits = 48;
  expect_invalid(p, "bits");
  p = HashTopKParams{};
  p.bits = 64;  // signatures have 32
  expect_invalid(p, "bits");
  p = HashTopKParams{};
  p.fixed.sink_tokens = -1;
  expect_invalid(p, "sink_tokens");
  EXPECT_EQ(ComputeSimHashSignatures(sp.problem, SimHashConfig{1, 0, 300, {}}, &sigs).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvsparse::kernels
