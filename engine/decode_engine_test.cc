#include "engine/decode_engine.h"

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>

#include "absl/strings/match.h"
#include "engine/engine_settings.h"
#include "engine/gpu_mode.h"
#include "engine/gpu_shape.h"
#include "engine/resident_cache.h"
#include "engine/signatures.h"
#include "gtest/gtest.h"
#include "kernels/dense.h"
#include "kernels/philox.h"
#include "kernels/saap.h"
#include "kernels/score_topk.h"
#include "kernels/synthetic.h"
#include "kvstore/store.h"
#include "kvstore/synthetic_store.h"

namespace kvsparse::engine {
namespace {

using kernels::DType;

constexpr uint32_t kLayers = 2;
constexpr uint32_t kLayer = 1;  // the layer the tests decode

// A store holding one synthetic problem's sequences (same K/V in every layer), and an engine
// over it.
class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    kvstore::StoreOptions so;
    so.capacity_bytes = 512ull << 20;
    auto store = kvstore::Store::Create(so);
    ASSERT_TRUE(store.ok());
    store_ = std::move(*store);
    source_ = NewLocalRowSource(store_.get());
    EngineOptions eo;
    eo.signatures.simhash_seed = kSigSeed;
    engine_ = std::make_unique<DecodeEngine>(eo, source_.get());
  }

  // Makes the synthetic problem and loads its sequences as "s0", "s1", ... with `placement`.
  void Load(kernels::SyntheticOptions o, const kvstore::Placement& placement) {
    prob_ = kernels::SyntheticProblem::Make(o);
    shape_ = kvstore::ShapeOf(prob_, kLayers);
    ASSERT_TRUE(kvstore::LoadSynthetic(*store_, prob_, placement, kLayers).ok());
  }

  DecodeCall Call(const Method& m, uint64_t seed = 99) {
    const kernels::DecodeProblem& p = prob_.problem;
    DecodeCall c;
    c.layer = kLayer;
    for (int32_t b = 0; b < p.batch; ++b) c.sequence_ids.push_back("s" + std::to_string(b));
    c.q_dtype = p.dtype;
    c.q = prob_.q;
    c.method = m;
    c.seed = seed;
    c.return_indices = true;
    return c;
  }

  // Batch-1 view of sequence b of the synthetic problem.
  kernels::DecodeProblem One(int32_t b, std::vector<uint8_t>* out) {
    kernels::DecodeProblem p = prob_.problem;
    const size_t es = kernels::DTypeSize(p.dtype);
    p.batch = 1;
    p.q = prob_.q.data() + static_cast<size_t>(b) * p.num_q_heads * p.head_dim * es;
    p.k = prob_.k.data() + b * p.kv_layout.batch_stride * es;
    p.v = prob_.v.data() + b * p.kv_layout.batch_stride * es;
    p.seq_lens = &prob_.seq_lens[b];
    out->assign(static_cast<size_t>(p.num_q_heads) * p.head_dim * es, 0);
    p.out = out->data();
    return p;
  }

  // The engine's result for every sequence equals SANTA's CPU reference with `params` (the
  // call's seed 99).
  void ExpectSantaReference(const DecodeResult& got, const kernels::SantaParams& params) {
    for (int32_t b = 0; b < prob_.problem.batch; ++b) {
      std::vector<uint8_t> out;
      kernels::DecodeProblem p = One(b, &out);
      kernels::RowSelection sel;
      ASSERT_TRUE(kernels::SantaDecodeCpu(p, params, kernels::SequenceSeed(99, b), &sel).ok());
      ExpectSame(got, b, sel, out);
    }
  }

  // The engine's result for sequence b equals the reference's: rows and output bytes.
  void ExpectSame(const DecodeResult& got, int32_t b, const kernels::RowSelection& want_sel,
                  const std::vector<uint8_t>& want_out) {
    const kernels::DecodeProblem& p = prob_.problem;
    const size_t es = kernels::DTypeSize(p.dtype);
    const size_t bytes = static_cast<size_t>(p.num_q_heads) * p.head_dim * es;
    for (int32_t j = 0; j < p.num_kv_heads; ++j) {
      const HeadStats& hs = got.heads[b * p.num_kv_heads + j];
      const auto& ws = want_sel.at(0, j);
      ASSERT_EQ(hs.fetched_tokens.size(), ws.tokens.size()) << "kv head " << j;
      for (size_t i = 0; i < ws.tokens.size(); ++i) {
        ASSERT_EQ(hs.fetched_tokens[i], static_cast<uint32_t>(ws.tokens[i]));
      }
      EXPECT_EQ(hs.rows_selected, static_cast<uint64_t>(ws.rows_selected()));
      ASSERT_EQ(hs.budgets.size(), ws.budgets.size());
      for (size_t g = 0; g < ws.budgets.size(); ++g) {
        EXPECT_EQ(hs.budgets[g], static_cast<uint64_t>(ws.budgets[g]));
      }
    }
    EXPECT_EQ(std::memcmp(got.output.data() + b * bytes, want_out.data(), bytes), 0)
        << "output of sequence " << b << " differs from the reference";
  }

  // The signatures the engine's resident cache must hold: SimHash of the layer, M = the max key
  // norm (every key is present at the first sync).
  static absl::Status SimHash(const kernels::DecodeProblem& p, int32_t bits,
                              kernels::Signatures* out) {
    kernels::SimHashConfig cfg;
    cfg.seed = kSigSeed;
    cfg.layer = kLayer;
    cfg.bits = bits;
    return kernels::ComputeSimHashSignatures(p, cfg, out);
  }

  static constexpr uint64_t kSigSeed = 1234;
  std::unique_ptr<kvstore::Store> store_;
  std::unique_ptr<RowSource> source_;
  std::unique_ptr<DecodeEngine> engine_;
  kernels::SyntheticProblem prob_;
  kvstore::ModelShape shape_;
};

kernels::SyntheticOptions Options(int32_t batch = 2, std::vector<int32_t> lens = {700, 1500}) {
  kernels::SyntheticOptions o;
  o.family = kernels::ScoreFamily::kPeaked;
  o.batch = batch;
  o.num_q_heads = 8;
  o.num_kv_heads = 2;
  o.head_dim = 64;
  o.seq_lens = std::move(lens);
  o.seed = 5;
  return o;
}

double RelL2(const std::string& got, const std::vector<double>& ref, DType t) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = kernels::LoadAsFloat(got.data(), i, t);
    num += (g - ref[i]) * (g - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

// A layer's rows grow with headroom for the steps that follow: 1/16 of a short sequence (appends
// stay amortised: a sequence appended token by token to 200k tokens regrows at most 150 times,
// each time by at most 1/8), but at most kMostHeadroomTokens past what a long one needs (a
// 128k-token prefix held 8,192 tokens, 6%, more than it needed), in compressed keys too, whose
// unit is a group of 128 tokens.
TEST(GrowRowsTest, BoundsTheHeadroomOfALongSequence) {
  EXPECT_EQ(GrowRows(131072, 0, 1024), 131072u + kMostHeadroomTokens);
  EXPECT_EQ(GrowRows(1024, 0, 8, kMostHeadroomTokens / 128), 1024u + kMostHeadroomTokens / 128);
  EXPECT_EQ(GrowRows(1600, 0, 256), 1700u);
  EXPECT_EQ(GrowRows(100, 0, 256), 256u);
  EXPECT_EQ(GrowRows(1000, 960, 256), 1120u);  // 1/8 of what it held
  uint64_t cap = 0, regrows = 0;
  for (uint64_t n = 1; n <= 200000; ++n) {
    if (n <= cap) continue;
    cap = GrowRows(n, cap, 256);
    EXPECT_GE(cap, n);
    EXPECT_LE(cap, n + std::max<uint64_t>(n / 8, 256));
    ++regrows;
  }
  EXPECT_LE(regrows, 150u);
}

TEST_F(EngineTest, DenseEqualsDenseAttention) {
  Load(Options(), {});
  auto r = engine_->Decode(Call(Method{}));
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<double> ref;
  ASSERT_TRUE(kernels::DenseDecodeFloat64(prob_.problem, &ref).ok());
  EXPECT_LT(RelL2(r->output, ref, DType::kBf16), 8e-3);
  // Dense over the host tier fetches every K and V row, and says so.
  const size_t row = shape_.row_bytes();
  for (const HeadStats& hs : r->heads) {
    const uint64_t n = prob_.seq_lens[hs.sequence_index];
    EXPECT_EQ(hs.rows_fetched, n);
    EXPECT_EQ(hs.bytes[static_cast<int>(kvstore::Tier::kHost)], 2 * n * row);
    EXPECT_EQ(hs.dense_equivalent_bytes, 2 * n * row);
  }
}

TEST_F(EngineTest, SantaSelectsWhatTheReferenceSelectsAndFetchesOnlyV) {
  kvstore::Placement kdev;
  kdev.k_tier = kvstore::Tier::kDevice;  // S2ANTA placement: K resident, V in host memory
  Load(Options(), kdev);
  for (auto alloc : {kernels::SantaAllocation::kProp, kernels::SantaAllocation::kFlash}) {
    Method m;
    m.kind = MethodKind::kSanta;
    m.santa.allocation = alloc;
    m.santa.samples = 64;
    m.santa.tile_size = 128;
    auto r = engine_->Decode(Call(m));
    ASSERT_TRUE(r.ok()) << r.status();
    ExpectSantaReference(*r, m.santa);
    const size_t row = shape_.row_bytes();
    for (const HeadStats& hs : r->heads) {
      // Only the sampled V rows cross from the host; K is read where it lives (device).
      EXPECT_EQ(hs.bytes[static_cast<int>(kvstore::Tier::kHost)], hs.rows_fetched * row);
      EXPECT_EQ(hs.rows_fetched, hs.fetched_tokens.size());
      EXPECT_GT(hs.bytes[static_cast<int>(kvstore::Tier::kDevice)], 0u);
    }
  }
}

// A backend that takes no call and records the method each call showed it.
class RecordingBackend final : public DecodeBackend {
 public:
  explicit RecordingBackend(std::vector<Method>* seen) : seen_(seen) {}
  const char* name() const override { return "recording"; }
  absl::Status Supports(const DecodeCall& call, absl::Span<const SequenceDesc>) const override {
    seen_->push_back(call.method);
    return absl::FailedPreconditionError("the recording backend takes no call");
  }
  absl::Status Decode(const DecodeCall&, absl::Span<const SequenceDesc>, DecodeResult*) override {
    return absl::InternalError("never taken");
  }
  void Forget(const std::string&) override {}
  size_t resident_bytes() const override { return 0; }
  size_t resident_capacity() const override { return 0; }

 private:
  std::vector<Method>* seen_;
};

// A request's tile size 0 is the engine's default, resolved once before either backend sees the
// call: the backend is shown the default, and the CPU engine's rows are the reference's at it.
TEST_F(EngineTest, SantaTileSizeZeroIsTheEnginesDefaultOnBothBackends) {
  kvstore::Placement kdev;
  kdev.k_tier = kvstore::Tier::kDevice;
  Load(Options(), kdev);
  std::vector<Method> seen;
  EngineOptions eo;
  eo.default_tile_size = 128;  // not the kernels' or the struct's default (256)
  DecodeEngine engine(eo, source_.get(), std::make_unique<RecordingBackend>(&seen));
  Method m;
  m.kind = MethodKind::kSanta;
  m.santa.samples = 64;
  m.santa.tile_size = 0;
  auto r = engine.Decode(Call(m));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].santa.tile_size, 128);
  Method want = m;
  want.santa.tile_size = 128;
  ExpectSantaReference(*r, want.santa);
  // A tile size the request gives is left as it is.
  m.santa.tile_size = 64;
  ASSERT_TRUE(engine.Decode(Call(m)).ok());
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[1].santa.tile_size, 64);
}

// A backend's refusal says why: the result of a call computed on the CPU carries it, and a call
// whose q is on the device is refused with it, before anything is appended.
TEST_F(EngineTest, ABackendsRefusalIsTheReasonGiven) {
  Load(Options(), {});
  std::vector<Method> seen;
  DecodeEngine engine(EngineOptions(), source_.get(), std::make_unique<RecordingBackend>(&seen));
  Method m;
  m.kind = MethodKind::kDense;
  auto r = engine.Decode(Call(m));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->not_on_backend, "the recording backend takes no call");
  // Without a backend there is nothing to explain.
  auto plain = engine_->Decode(Call(m));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->not_on_backend, "");
  DecodeCall on_device = Call(m);
  const uint64_t before = store_->GetSequenceInfo("s0")->layer_lengths[kLayer];
  std::vector<uint8_t> row(prob_.problem.batch * shape_.num_kv_heads * shape_.row_bytes());
  on_device.new_k = row;
  on_device.new_v = row;
  on_device.new_kv_dtype = shape_.dtype;
  int device_q = 0, device_out = 0;  // never touched: the call is refused first
  on_device.q = {};
  on_device.q_device = &device_q;
  on_device.out_device = &device_out;
  on_device.q_heads = shape_.num_q_heads;
  on_device.q_dim = shape_.head_dim;
  // q on the device: the engine cannot see its size, so the call states its batch, which must be
  // the sequences' count (the op sent none: a q of another batch was read and written past).
  for (uint32_t batch : {0u, static_cast<uint32_t>(prob_.problem.batch) + 1}) {
    on_device.q_batch = batch;
    const absl::Status bad = engine.Decode(on_device).status();
    EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << batch << ": " << bad;
    EXPECT_TRUE(absl::StrContains(bad.message(), "q_batch") ||
                absl::StrContains(bad.message(), "batch of"))
        << bad;
  }
  on_device.q_batch = static_cast<uint32_t>(prob_.problem.batch);
  auto refused = engine.Decode(on_device);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "the recording backend takes no call"))
      << refused.status();
  EXPECT_EQ(store_->GetSequenceInfo("s0")->layer_lengths[kLayer], before);  // nothing appended
}

TEST_F(EngineTest, SantaWithKInHostFetchesAllKForTheScores) {
  Load(Options(1, {900}), {});
  Method m;
  m.kind = MethodKind::kSanta;
  m.santa.samples = 32;
  auto r = engine_->Decode(Call(m));
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<uint8_t> out;
  kernels::DecodeProblem p = One(0, &out);
  kernels::RowSelection sel;
  ASSERT_TRUE(kernels::SantaDecodeCpu(p, m.santa, kernels::SequenceSeed(99, 0), &sel).ok());
  ExpectSame(*r, 0, sel, out);
  const size_t row = shape_.row_bytes();
  for (const HeadStats& hs : r->heads) {
    EXPECT_EQ(hs.rows_fetched, 900u);  // every token read (its K), each counted once
    EXPECT_EQ(hs.bytes[static_cast<int>(kvstore::Tier::kHost)],
              (900 + hs.fetched_tokens.size()) * row);  // every K row, the sampled V rows
  }
}

// Bernoulli qK^T scores: the reference's rows, and the K features its estimates read reported
// per kv head (the reference's counts; exact scores report none).
TEST_F(EngineTest, SantaOverBernoulliScoresReportsTheKeyFeaturesRead) {
  Load(Options(1, {900}), {});
  Method m;
  m.kind = MethodKind::kSanta;
  m.santa.samples = 32;
  m.santa.bernoulli_qk_samples = 2;
  auto r = engine_->Decode(Call(m));
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<uint8_t> out;
  kernels::DecodeProblem p = One(0, &out);
  kernels::RowSelection sel;
  kernels::SantaStats stats;
  ASSERT_TRUE(kernels::SantaSelectCpu(p, m.santa, kernels::SequenceSeed(99, 0), &sel, &stats).ok());
  ASSERT_TRUE(kernels::SantaDecodeCpu(p, m.santa, kernels::SequenceSeed(99, 0), &sel).ok());
  ExpectSame(*r, 0, sel, out);
  const int32_t gd = p.group_size() * p.head_dim;
  for (const HeadStats& hs : r->heads) {
    EXPECT_EQ(hs.key_features_head, static_cast<uint64_t>(stats.key_features_head[hs.kv_head]));
    EXPECT_EQ(hs.key_features_group, static_cast<uint64_t>(stats.key_features_group[hs.kv_head]));
    EXPECT_GT(hs.key_features_head, 0u);
    EXPECT_LT(hs.key_features_head, static_cast<uint64_t>(gd));  // B = 2 leaves features unread
  }
  m.santa.bernoulli_qk_samples = 0;
  auto exact = engine_->Decode(Call(m));
  ASSERT_TRUE(exact.ok()) << exact.status();
  for (const HeadStats& hs : exact->heads) EXPECT_EQ(hs.key_features_head, 0u);
}

TEST_F(EngineTest, HashTopKSelectsWhatTheReferenceSelects) {
  kvstore::Placement sig;
  sig.signature_bits = 64;
  Load(Options(), sig);
  Method m;
  m.kind = MethodKind::kHashTopK;
  m.hash.fixed.sink_tokens = 16;
  m.hash.fixed.local_tokens = 32;
  m.hash.fixed.top_k = 40;
  m.hash.bits = 0;  // the sequence's
  auto r = engine_->Decode(Call(m));
  ASSERT_TRUE(r.ok()) << r.status();
  for (int32_t b = 0; b < 2; ++b) {
    std::vector<uint8_t> out;
    kernels::DecodeProblem p = One(b, &out);
    kernels::Signatures sigs;
    ASSERT_TRUE(SimHash(p, 64, &sigs).ok());
    kernels::HashTopKParams hp = m.hash;
    hp.bits = 64;
    kernels::RowSelection sel;
    ASSERT_TRUE(kernels::HashTopKDecodeCpu(p, hp, sigs.view, &sel).ok());
    ExpectSame(*r, b, sel, out);
  }
  // Only the selected K and V rows cross; the device holds 64 bits per key instead of K and V.
  const size_t row = shape_.row_bytes();
  for (const HeadStats& hs : r->heads) {
    EXPECT_EQ(hs.bytes[static_cast<int>(kvstore::Tier::kHost)], 2 * hs.rows_fetched * row);
    EXPECT_LE(hs.rows_fetched, 16u + 32u + 4u * 40u);
  }
  const uint64_t resident = engine_->resident().bytes();
  EXPECT_LT(resident, (700 + 1500) * 2 * 2 * row / 20);  // < 5% of the K+V layout
}

// Issue 48, defects 1 and 2, through the engine: hash top-k and top-k with every selection
// field 0 (a request's wire defaults) answer an estimate of attention (at least one row per
// query head, not zeros), and a top_k above a short sequence's length reads its rows (it was
// INVALID_ARGUMENT: a model server's decodes failed until the prompt reached top_k).
TEST_F(EngineTest, ShortSequencesAndEmptySelectionsAnswerAttention) {
  kvstore::Placement place;
  place.signature_bits = 32;
  place.compressed_key_bits = 2;
  Load(Options(2, {50, 50}), place);
  Method hash;
  hash.kind = MethodKind::kHashTopK;
  hash.hash.fixed.sink_tokens = hash.hash.fixed.local_tokens = hash.hash.fixed.top_k = 0;
  hash.hash.fixed.top_k_fraction = 0.01f;  // 0.5 rows of 50: none before the rule
  hash.hash.bits = 0;
  Method topk;
  topk.kind = MethodKind::kTopK;
  topk.top_k.fixed.sink_tokens = topk.top_k.fixed.local_tokens = topk.top_k.fixed.top_k = 0;
  topk.top_k.fixed.top_k_fraction = 0.f;
  for (const Method& m : {hash, topk}) {
    auto r = engine_->Decode(Call(m));
    ASSERT_TRUE(r.ok()) << r.status();
    for (const HeadStats& hs : r->heads) EXPECT_GE(hs.rows_fetched, 1u);
    double mass = 0;
    for (size_t i = 0; i < r->output.size() / kernels::DTypeSize(prob_.problem.dtype); ++i) {
      mass += std::fabs(kernels::LoadAsFloat(r->output.data(), i, prob_.problem.dtype));
    }
    EXPECT_GT(mass, 0.0) << "an output of zeros";
  }
  // top_k 64 over 50 tokens (sink and window cover them too): every row, dense attention.
  hash.hash.fixed.sink_tokens = hash.hash.fixed.local_tokens = 128;
  hash.hash.fixed.top_k = 64;
  topk.top_k.fixed.top_k = 64;
  for (const Method& m : {hash, topk}) {
    auto r = engine_->Decode(Call(m));
    ASSERT_TRUE(r.ok()) << r.status();
    for (const HeadStats& hs : r->heads) EXPECT_EQ(hs.rows_fetched, 50u);
    for (int32_t b = 0; b < 2; ++b) {
      std::vector<uint8_t> out;
      kernels::DecodeProblem p = One(b, &out);
      std::vector<double> dense;
      ASSERT_TRUE(kernels::DenseDecodeFloat64(p, &dense).ok());
      const size_t bytes = out.size();
      EXPECT_LT(RelL2(r->output.substr(b * bytes, bytes), dense, p.dtype), 1e-2);
    }
  }
}

// The compressed keys of every kv head of a one-sequence problem, as the worker builds them.
std::vector<kernels::CompressedKeysView> CompressedViewsOf(
    const kernels::DecodeProblem& p, int32_t bits, std::vector<kernels::CompressedKeys>* keys) {
  const size_t es = kernels::DTypeSize(p.dtype);
  keys->clear();
  for (int32_t j = 0; j < p.num_kv_heads; ++j) {
    keys->emplace_back(kernels::KeyCompression{bits, kernels::kKeyGroupTokens}, p.head_dim,
                       p.dtype);
    for (int32_t t = 0; t < p.seq_lens[0]; ++t) {
      keys->back().Append(static_cast<const uint8_t*>(p.k) +
                          (j * p.kv_layout.head_stride + t * p.kv_layout.token_stride) * es);
    }
  }
  std::vector<kernels::CompressedKeysView> views;
  for (const kernels::CompressedKeys& k : *keys) views.push_back(k.view());
  return views;
}

// S2ANTA over compressed keys (K and V in host memory, 2-bit keys on the worker): the same
// rows and output as the reference for both corrections; the ratio correction fetches the
// sampled K rows with their V rows, "none" only V rows; no K row is read to select. A sequence
// without compressed keys is refused before anything is appended.
TEST_F(EngineTest, SantaOverCompressedKeysSelectsWhatTheReferenceSelects) {
  using kernels::SantaCorrection;
  using kernels::SantaProposal;
  for (auto [correction, proposal] :
       {std::pair{SantaCorrection::kRatio, SantaProposal::kPerHead},
        std::pair{SantaCorrection::kNone, SantaProposal::kPerHead},
        std::pair{SantaCorrection::kRatio, SantaProposal::kGroupMixture}}) {
    SetUp();
    kernels::SyntheticOptions o = Options();
    o.head_dim = 128;
    kvstore::Placement place;
    place.compressed_key_bits = 2;
    Load(o, place);
    Method m;
    m.kind = MethodKind::kSanta;
    m.santa.samples = 64;
    m.santa.tile_size = 128;
    m.santa.scores = kernels::ScoreSource::kCompressedKeys;
    m.santa.correction = correction;
    m.santa.proposal = proposal;
    auto r = engine_->Decode(Call(m));
    ASSERT_TRUE(r.ok()) << r.status();
    for (int32_t b = 0; b < 2; ++b) {
      std::vector<uint8_t> out;
      kernels::DecodeProblem p = One(b, &out);
      std::vector<kernels::CompressedKeys> keys;
      const std::vector<kernels::CompressedKeysView> views = CompressedViewsOf(p, 2, &keys);
      kernels::RowSelection sel;
      ASSERT_TRUE(
          kernels::SantaDecodeCpu(p, m.santa, kernels::SequenceSeed(99, b), &sel, nullptr, views)
              .ok());
      EXPECT_EQ(sel.kind, correction == kernels::SantaCorrection::kRatio
                              ? kernels::EstimateKind::kSoftmax
                              : kernels::EstimateKind::kLinear);
      ExpectSame(*r, b, sel, out);
    }
    const size_t row = shape_.row_bytes();
    const uint64_t per_row = correction == kernels::SantaCorrection::kRatio ? 2 * row : row;
    for (const HeadStats& hs : r->heads) {
      EXPECT_EQ(hs.rows_fetched, hs.fetched_tokens.size());
      // The group mixture: one sample of S (+1 from the systematic rounding) per kv head.
      EXPECT_LE(hs.rows_fetched, proposal == SantaProposal::kGroupMixture ? 65u : 4u * 64u);
      EXPECT_EQ(hs.bytes[static_cast<int>(kvstore::Tier::kHost)], hs.rows_fetched * per_row);
      EXPECT_GT(hs.bytes[static_cast<int>(kvstore::Tier::kDevice)], 0u);  // the compressed keys
    }
  }
  SetUp();
  Load(Options(), {});  // no compressed keys
  Method m;
  m.kind = MethodKind::kSanta;
  m.santa.scores = kernels::ScoreSource::kCompressedKeys;
  EXPECT_EQ(engine_->Decode(Call(m)).status().code(), absl::StatusCode::kFailedPrecondition);
  // 1-bit keys: refused, naming the keys' bits and what to use instead (the estimate's bias
  // there is far beyond its standard error); 2 bits and more are served.
  SetUp();
  kvstore::Placement one_bit;
  one_bit.compressed_key_bits = 1;
  kernels::SyntheticOptions o = Options();
  o.head_dim = 128;
  Load(o, one_bit);
  const absl::Status refused = engine_->Decode(Call(m)).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(refused.message(), "1-bit keys")) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "compressed_key_bits >= 2")) << refused;
  // vAttention's compressed predictor over the same keys: refused the same way (its (epsilon,
  // delta) promise does not hold per head over 1-bit keys).
  Method v;
  v.kind = MethodKind::kVAttention;
  v.vattention.epsilon = 0.1f;
  v.vattention.delta = 0.1f;
  v.vattention.fixed.top_k_fraction = 0.02f;
  v.vattention.base_rate = 0.05f;
  v.vattention.predictor = kernels::TopKPredictor::kCompressed;
  const absl::Status vatt = engine_->Decode(Call(v)).status();
  EXPECT_EQ(vatt.code(), absl::StatusCode::kFailedPrecondition) << vatt;
  EXPECT_TRUE(absl::StrContains(vatt.message(), "vattention")) << vatt;
  EXPECT_TRUE(absl::StrContains(vatt.message(), "1-bit keys")) << vatt;
  m.kind = MethodKind::kTopK;  // top-k over the same keys is served
  m.top_k.source = kernels::ScoreSource::kCompressedKeys;
  m.top_k.fixed.top_k_fraction = 0.1f;
  EXPECT_TRUE(engine_->Decode(Call(m)).ok());
}

TEST_F(EngineTest, VAttentionSelectsWhatTheReferenceSelects) {
  using Sampler = kernels::ResidualSampler;
  struct Case {
    kernels::TopKPredictor predictor;
    Sampler sampler;
    bool k_in_host = false;  // the exact predictor reading every K row from the store
  };
  const Case cases[] = {{kernels::TopKPredictor::kHash, Sampler::kUniform},
                        {kernels::TopKPredictor::kExact, Sampler::kUniform},
                        {kernels::TopKPredictor::kExact, Sampler::kUniform, true},
                        {kernels::TopKPredictor::kCompressed, Sampler::kUniform},
                        {kernels::TopKPredictor::kExact, Sampler::kImportance},
                        {kernels::TopKPredictor::kCompressed, Sampler::kImportance}};
  for (const auto& [predictor, sampler, k_in_host] : cases) {
    SCOPED_TRACE(static_cast<int>(predictor) * 10 + static_cast<int>(sampler) + 100 * k_in_host);
    SetUp();
    kvstore::Placement place;
    place.signature_bits = 32;
    if (predictor == kernels::TopKPredictor::kExact && !k_in_host) {
      place.k_tier = kvstore::Tier::kDevice;
    }
    if (predictor == kernels::TopKPredictor::kCompressed) place.compressed_key_bits = 2;
    Load(Options(), place);
    Method m;
    m.kind = MethodKind::kVAttention;
    m.vattention.epsilon = 0.1f;
    m.vattention.delta = 0.1f;
    m.vattention.fixed.sink_tokens = 8;
    m.vattention.fixed.local_tokens = 16;
    m.vattention.fixed.top_k = 0;
    m.vattention.fixed.top_k_fraction = 0.02f;
    m.vattention.base_rate = 0.05f;
    m.vattention.predictor = predictor;
    m.vattention.sampler = sampler;
    m.vattention.bits = 0;
    auto r = engine_->Decode(Call(m, 7));
    ASSERT_TRUE(r.ok()) << r.status();
    for (int32_t b = 0; b < 2; ++b) {
      std::vector<uint8_t> out;
      kernels::DecodeProblem p = One(b, &out);
      kernels::Signatures sigs;
      ASSERT_TRUE(SimHash(p, 32, &sigs).ok());
      kernels::VAttentionParams vp = m.vattention;
      vp.bits = 32;
      std::vector<kernels::CompressedKeys> keys;
      const std::vector<kernels::CompressedKeysView> views =
          predictor == kernels::TopKPredictor::kCompressed
              ? CompressedViewsOf(p, 2, &keys)
              : std::vector<kernels::CompressedKeysView>();
      kernels::RowSelection sel;
      ASSERT_TRUE(kernels::VAttentionDecodeCpu(p, vp, kernels::SequenceSeed(7, b), &sigs.view, &sel,
                                               nullptr, views)
                      .ok());
      ExpectSame(*r, b, sel, out);
    }
    if (!k_in_host) continue;
    // The exact predictor with K in host memory (issue 48): every K row is read once to score,
    // the selected rows' K reused from there and only their V fetched; rows_fetched counts each
    // token once (it said 2n for n tokens, and the bytes were 1.5x dense's).
    const size_t row = shape_.row_bytes();
    for (const HeadStats& hs : r->heads) {
      const uint64_t n = hs.dense_equivalent_bytes / (2 * row);
      EXPECT_EQ(hs.rows_fetched, n);
      // Every K row, then the V rows of the selection (at most all of them): never over dense.
      EXPECT_GT(hs.bytes[static_cast<int>(kvstore::Tier::kHost)], n * row);
      EXPECT_LE(hs.bytes[static_cast<int>(kvstore::Tier::kHost)], hs.dense_equivalent_bytes);
    }
  }
}

// Top-k by scores through the engine: from the sequence's compressed keys (resident, built as
// the rows reach it) the engine selects and estimates exactly what the CPU reference does on
// the same problem; only the selected K and V rows cross, and the compressed keys stay under 8%
// of the K and V bytes. Exact scores (the oracle) with K resident or in host memory likewise.
TEST_F(EngineTest, TopKSelectsWhatTheReferenceSelects) {
  struct Case {
    kernels::ScoreSource source;
    kvstore::Placement placement;
  };
  kvstore::Placement compressed, k_device, host;
  compressed.compressed_key_bits = 2;
  k_device.k_tier = kvstore::Tier::kDevice;
  for (const Case& c :
       {Case{kernels::ScoreSource::kCompressedKeys, compressed},
        Case{kernels::ScoreSource::kExact, k_device}, Case{kernels::ScoreSource::kExact, host}}) {
    SetUp();
    kernels::SyntheticOptions o = Options();
    o.head_dim = 128;
    Load(o, c.placement);
    Method m;
    m.kind = MethodKind::kTopK;
    m.top_k.fixed.sink_tokens = 16;
    m.top_k.fixed.local_tokens = 32;
    m.top_k.fixed.top_k = 40;
    m.top_k.source = c.source;
    auto r = engine_->Decode(Call(m));
    ASSERT_TRUE(r.ok()) << r.status();
    for (int32_t b = 0; b < 2; ++b) {
      std::vector<uint8_t> out;
      kernels::DecodeProblem p = One(b, &out);
      std::vector<kernels::CompressedKeys> keys;
      std::vector<kernels::CompressedKeysView> views;
      if (c.source == kernels::ScoreSource::kCompressedKeys) views = CompressedViewsOf(p, 2, &keys);
      kernels::RowSelection sel;
      ASSERT_TRUE(kernels::ScoreTopKDecodeCpu(p, m.top_k, views, &sel).ok());
      ExpectSame(*r, b, sel, out);
    }
    const size_t row = shape_.row_bytes();
    for (const HeadStats& hs : r->heads) {
      const bool every_key_read =
          c.source == kernels::ScoreSource::kExact && c.placement.k_tier == kvstore::Tier::kHost;
      if (!every_key_read) {
        EXPECT_LE(hs.rows_fetched, 16u + 32u + 4u * 40u);
      }
      if (c.placement.k_tier == kvstore::Tier::kHost) {
        // Every K row is read for exact scores from host memory; the selected V rows after.
        const uint64_t host_bytes = hs.bytes[static_cast<int>(kvstore::Tier::kHost)];
        if (c.source == kernels::ScoreSource::kCompressedKeys) {
          EXPECT_EQ(host_bytes, 2 * hs.rows_fetched * row);
          EXPECT_GT(hs.bytes[static_cast<int>(kvstore::Tier::kDevice)], 0u);
        } else {
          EXPECT_GT(host_bytes, 2 * (16u + 32u + 4u * 40u) * row);
        }
      }
    }
    if (c.source == kernels::ScoreSource::kCompressedKeys) {
      const uint64_t resident = engine_->resident().bytes();
      EXPECT_GT(resident, 0u);
      // Exactly the compressed keys' bytes: 38 a token at 2 bits and d = 128 (7.4% of K+V),
      // and the still-filling groups' exact rows (60 and 92 tokens, in steps of 16 rows).
      const kernels::KeyCompression kc{2, kernels::kKeyGroupTokens};
      const uint64_t want = 2 * (kernels::CompressedKeyBytes(kc, 128, row, 700) +
                                 kernels::CompressedKeyBytes(kc, 128, row, 1500));
      EXPECT_EQ(resident, want);
      EXPECT_LT(resident, (700 + 1500) * 2 * 2 * row * 8 / 100 + 2 * (64 + 96) * row);
    }
  }
}

// New tokens reach the compressed keys as they are appended (the still-filling group exact,
// quantized when it closes): decoding step by step across a group boundary selects what the
// reference selects over the grown sequence. Bad placements and a sequence without compressed
// keys get clear codes.
TEST_F(EngineTest, TopKFollowsAppendedTokensAndRefusesWhatItCannotServe) {
  kvstore::Placement compressed;
  compressed.compressed_key_bits = 4;
  kernels::SyntheticOptions o = Options(1, {250});
  o.head_dim = 64;
  Load(o, compressed);
  Method m;
  m.kind = MethodKind::kTopK;
  m.top_k.fixed.sink_tokens = 4;
  m.top_k.fixed.local_tokens = 4;
  m.top_k.fixed.top_k = 10;
  const kernels::DecodeProblem& p0 = prob_.problem;
  const size_t es = kernels::DTypeSize(p0.dtype);
  const size_t token = static_cast<size_t>(p0.num_kv_heads) * p0.head_dim * es;
  // Keys of the reference: the problem's rows, then the appended ones.
  std::vector<uint8_t> k(prob_.k.begin(), prob_.k.begin() + 250 * token);
  std::vector<uint8_t> v(prob_.v.begin(), prob_.v.begin() + 250 * token);
  for (int step = 0; step < 12; ++step) {  // 250 -> 262 tokens: group 1 closes at 256
    std::vector<uint8_t> nk(token), nv(token);
    for (size_t i = 0; i < token; i += es) {  // a copy of an earlier token, scaled
      kernels::StoreFromFloat(
          nk.data(), i / es, p0.dtype,
          1.5f * kernels::LoadAsFloat(k.data() + step * 17 * token, i / es, p0.dtype));
      kernels::StoreFromFloat(nv.data(), i / es, p0.dtype,
                              kernels::LoadAsFloat(v.data() + step * 13 * token, i / es, p0.dtype));
    }
    DecodeCall c = Call(m);
    c.new_k = nk;
    c.new_v = nv;
    c.new_kv_dtype = p0.dtype;
    auto r = engine_->Decode(c);
    ASSERT_TRUE(r.ok()) << r.status();
    k.insert(k.end(), nk.begin(), nk.end());
    v.insert(v.end(), nv.begin(), nv.end());
    const int32_t n = static_cast<int32_t>(k.size() / token);
    kernels::DecodeProblem p = p0;
    std::vector<uint8_t> out(static_cast<size_t>(p.num_q_heads) * p.head_dim * es);
    p.k = k.data();
    p.v = v.data();
    p.seq_lens = &n;
    p.kv_layout.batch_stride = 0;
    p.out = out.data();
    std::vector<kernels::CompressedKeys> keys;
    std::vector<kernels::CompressedKeysView> views;
    for (int32_t j = 0; j < p.num_kv_heads; ++j) {
      keys.emplace_back(kernels::KeyCompression{4, kernels::kKeyGroupTokens}, p.head_dim, p.dtype);
      for (int32_t t = 0; t < n; ++t) {
        keys.back().Append(k.data() +
                           (j * p.kv_layout.head_stride + t * p.kv_layout.token_stride) * es);
      }
    }
    for (const kernels::CompressedKeys& x : keys) views.push_back(x.view());
    kernels::RowSelection sel;
    ASSERT_TRUE(kernels::ScoreTopKDecodeCpu(p, m.top_k, views, &sel).ok());
    for (int32_t j = 0; j < p.num_kv_heads; ++j) {
      const auto& want = sel.at(0, j).tokens;
      const auto& got = r->heads[j].fetched_tokens;
      ASSERT_EQ(got.size(), want.size()) << "step " << step;
      for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(got[i], static_cast<uint32_t>(want[i]));
    }
    EXPECT_EQ(std::memcmp(r->output.data(), out.data(), out.size()), 0) << "step " << step;
  }
  using absl::StatusCode;
  kvstore::Placement odd;
  odd.compressed_key_bits = 3;
  EXPECT_EQ(store_->CreateSequence("odd", shape_, odd).status().code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(store_->CreateSequence("plain", shape_, {}).ok());
  DecodeCall c = Call(m);
  c.sequence_ids = {"plain"};
  std::vector<uint8_t> nk(token, 0);
  c.new_k = nk;
  c.new_v = nk;
  c.new_kv_dtype = p0.dtype;
  auto r = engine_->Decode(c);
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "compressed_key_bits")) << r.status();
  EXPECT_EQ(store_->GetSequenceInfo("plain")->layer_lengths[kLayer], 0u) << "nothing appended";
}

// Many small reads instead of one large one give the same result (the catch-up of resident state
// and the full K fetch both read in chunks of max_fetch_bytes).
TEST_F(EngineTest, ChunkedFetchesGiveTheSameRows) {
  kvstore::Placement sig;
  sig.signature_bits = 32;  // signatures resident, K in the host tier
  Load(Options(1, {900}), sig);
  EngineOptions small;
  small.signatures.simhash_seed = kSigSeed;
  small.max_fetch_bytes = 3000;  // a few rows per read: hundreds of reads
  DecodeEngine chunked(small, source_.get());
  for (MethodKind kind : {MethodKind::kSanta, MethodKind::kHashTopK}) {
    Method m;
    m.kind = kind;
    m.santa.samples = 32;
    m.hash.fixed.top_k = 50;
    m.hash.fixed.sink_tokens = 4;
    m.hash.fixed.local_tokens = 4;
    m.hash.bits = 0;
    auto a = engine_->Decode(Call(m));
    auto b = chunked.Decode(Call(m));
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(a->output, b->output);
    for (size_t i = 0; i < a->heads.size(); ++i) {
      EXPECT_EQ(a->heads[i].fetched_tokens, b->heads[i].fetched_tokens);
    }
  }
}

TEST_F(EngineTest, NewTokenIsAppendedToStoreAndResidentState) {
  kvstore::Placement kdev;
  kdev.k_tier = kvstore::Tier::kDevice;
  kdev.signature_bits = 32;
  Load(Options(2, {300, 301}), kdev);
  // Warm the resident state, then decode with a new token: it must be part of the attention.
  Method dense;
  ASSERT_TRUE(engine_->Decode(Call(dense)).ok());
  DecodeCall c = Call(dense);
  const size_t token = static_cast<size_t>(2) * 64 * 2;  // Hkv x d x bf16
  std::vector<uint8_t> nk(2 * token), nv(2 * token);
  for (size_t i = 0; i < nk.size() / 2; ++i) {
    kernels::StoreFromFloat(nk.data(), i, DType::kBf16, 0.01f * (i % 17));
    kernels::StoreFromFloat(nv.data(), i, DType::kBf16, 1.0f + 0.1f * (i % 5));
  }
  c.new_k = nk;
  c.new_v = nv;
  c.new_kv_dtype = DType::kBf16;
  auto r = engine_->Decode(c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(store_->GetSequenceInfo("s0")->layer_lengths[kLayer], 301u);
  EXPECT_EQ(store_->GetSequenceInfo("s1")->layer_lengths[kLayer], 302u);
  EXPECT_EQ(store_->GetSequenceInfo("s1")->layer_lengths[0], 301u);  // other layer untouched
  for (const HeadStats& hs : r->heads) {
    EXPECT_EQ(hs.fetched_tokens.back(), hs.sequence_index == 0 ? 300u : 301u);
  }
  // SANTA reads K from the resident state, which must now hold the new token too.
  Method santa;
  santa.kind = MethodKind::kSanta;
  santa.santa.samples = 16;
  auto r2 = engine_->Decode(Call(santa));
  ASSERT_TRUE(r2.ok()) << r2.status();
  EXPECT_EQ(r2->sync_bytes, 0u);  // in sync: nothing read back
}

// A caller that goes away stops the work (issue 28, defect 2): the engine checks
// DecodeCall::cancelled with the deadline before each sequence and between a step's stages
// (sync, all keys, selection, gather, estimate), so a call whose caller leaves at any of those
// points computes nothing further and answers CANCELLED; one past its deadline,
// DEADLINE_EXCEEDED. Before the checks the engine asked nothing and ran every sequence.
TEST_F(EngineTest, CancelledCallsStopBetweenSequencesAndStages) {
  Load(Options(), {});
  Method vatt;
  vatt.kind = MethodKind::kVAttention;
  vatt.vattention.predictor = kernels::TopKPredictor::kExact;  // a step with every stage
  vatt.vattention.epsilon = 0.1f;
  vatt.vattention.delta = 0.1f;
  int checks = 0;
  DecodeCall c = Call(vatt);
  c.cancelled = [&] {
    ++checks;
    return false;
  };
  ASSERT_TRUE(engine_->Decode(c).ok());
  const int full = checks;
  EXPECT_GE(full, 1 + 2 * 5) << "the start, then each of 2 sequences before and between stages";
  for (int stop_at = 1; stop_at <= full; ++stop_at) {
    checks = 0;
    c.cancelled = [&] { return ++checks >= stop_at; };
    const absl::Status s = engine_->Decode(c).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << stop_at << ": " << s;
    EXPECT_EQ(checks, stop_at) << "the engine went on after the caller had gone";
  }
  c.cancelled = nullptr;
  c.deadline = absl::Now() - absl::Seconds(1);
  EXPECT_EQ(engine_->Decode(c).status().code(), absl::StatusCode::kDeadlineExceeded);
  c.deadline = absl::InfiniteFuture();
  EXPECT_TRUE(engine_->Decode(c).ok());
}

TEST_F(EngineTest, BadRequestsGetClearCodes) {
  Load(Options(), {});
  using absl::StatusCode;
  DecodeCall c = Call(Method{});
  c.sequence_ids = {"s0", "nope"};
  EXPECT_EQ(engine_->Decode(c).status().code(), StatusCode::kNotFound);
  c = Call(Method{});
  c.q = c.q.subspan(1);
  EXPECT_EQ(engine_->Decode(c).status().code(), StatusCode::kInvalidArgument);
  c = Call(Method{});
  c.layer = kLayers;
  EXPECT_EQ(engine_->Decode(c).status().code(), StatusCode::kInvalidArgument);
  c = Call(Method{});
  c.q_batch = static_cast<uint32_t>(c.sequence_ids.size()) + 1;  // q's batch: the sequences'
  EXPECT_EQ(engine_->Decode(c).status().code(), StatusCode::kInvalidArgument);
  Method hash;
  hash.kind = MethodKind::kHashTopK;
  hash.hash.fixed.top_k = 8;
  EXPECT_EQ(engine_->Decode(Call(hash)).status().code(), StatusCode::kFailedPrecondition);
  Method santa;
  santa.kind = MethodKind::kSanta;
  santa.santa.samples = 0;
  EXPECT_EQ(engine_->Decode(Call(santa)).status().code(), StatusCode::kInvalidArgument);
  Method vatt;
  vatt.kind = MethodKind::kVAttention;
  vatt.vattention.predictor = kernels::TopKPredictor::kExact;
  vatt.vattention.epsilon = 1.5f;
  EXPECT_EQ(engine_->Decode(Call(vatt)).status().code(), StatusCode::kInvalidArgument);
  vatt.vattention.epsilon = 0.1f;
  vatt.vattention.fixed.top_k = 5000;  // k > n: the sequence's 700 rows (kernels/hash_topk.h)
  EXPECT_TRUE(engine_->Decode(Call(vatt)).ok());
  c = Call(Method{});
  std::vector<uint8_t> nk(7);
  c.new_k = nk;
  c.new_v = nk;
  EXPECT_EQ(engine_->Decode(c).status().code(), StatusCode::kInvalidArgument);
  // The scale: one rule for the server and the op (issue 49: the op took an infinite scale).
  for (float bad :
       {std::numeric_limits<float>::infinity(), -1.f, std::numeric_limits<float>::quiet_NaN()}) {
    c = Call(Method{});
    c.scale = bad;
    const absl::Status s = engine_->Decode(c).status();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StrContains(s.message(), "scale")) << s;
  }
  // Nothing was appended by the refused calls.
  EXPECT_EQ(store_->GetSequenceInfo("s0")->layer_lengths[kLayer], 700u);
  EXPECT_TRUE(engine_->Decode(Call(Method{})).ok());
}

// One rule for every method (issue 15's defects): an empty layer is FAILED_PRECONDITION, a q
// with a NaN or an infinity INVALID_ARGUMENT, a sequence named twice or too many sequences in one
// call INVALID_ARGUMENT, a call covering more bytes than the bound RESOURCE_EXHAUSTED; nothing is
// appended by a refused call.
TEST_F(EngineTest, EveryMethodRefusesEmptyLayersNonFiniteQAndRepeats) {
  Load(Options(), {});
  kvstore::Placement with_k;
  with_k.k_tier = kvstore::Tier::kDevice;
  with_k.signature_bits = 32;
  ASSERT_TRUE(store_->CreateSequence("empty", shape_, with_k).ok());
  std::vector<Method> methods(4);
  methods[1].kind = MethodKind::kSanta;
  methods[1].santa.samples = 16;
  methods[2].kind = MethodKind::kHashTopK;
  methods[2].hash.fixed.top_k = 8;
  methods[2].hash.bits = 0;
  methods[3].kind = MethodKind::kVAttention;
  methods[3].vattention.predictor = kernels::TopKPredictor::kExact;
  methods[3].vattention.base_rate = 1e-6f;  // once INTERNAL here ("no buffer")
  using absl::StatusCode;
  for (const Method& m : methods) {
    const std::string what = "method " + std::to_string(static_cast<int>(m.kind));
    DecodeCall c = Call(m);
    c.sequence_ids = {"empty"};
    c.q = c.q.subspan(0, c.q.size() / 2);  // one sequence's q
    auto r = engine_->Decode(c);
    EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << what << ": " << r.status();
    EXPECT_TRUE(absl::StrContains(r.status().message(), "holds no tokens")) << r.status();
    for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity(), 3e38f, 4.3e9f}) {
      DecodeCall q = Call(m);
      std::vector<uint8_t> qb(q.q.begin(), q.q.end());
      kernels::StoreFromFloat(qb.data(), 77, q.q_dtype, bad);
      q.q = qb;
      auto rq = engine_->Decode(q);
      EXPECT_EQ(rq.status().code(), StatusCode::kInvalidArgument) << what << ": " << rq.status();
    }
  }
  // With the new token in the same call there is a layer to attend to; a new token whose K or V
  // holds a NaN, an infinity or a value of 2^32 or more is refused and not appended.
  DecodeCall c = Call(Method{});
  c.sequence_ids = {"empty"};
  c.q = c.q.subspan(0, c.q.size() / 2);
  const size_t token = static_cast<size_t>(shape_.num_kv_heads) * shape_.row_bytes();
  std::vector<uint8_t> nk(token, 0);
  c.new_kv_dtype = shape_.dtype;
  for (float bad : {std::nanf(""), -std::numeric_limits<float>::infinity(), 5e9f}) {
    std::vector<uint8_t> poisoned = nk;
    kernels::StoreFromFloat(poisoned.data(), 3, shape_.dtype, bad);
    for (bool in_v : {false, true}) {
      c.new_k = in_v ? absl::Span<const uint8_t>(nk) : absl::Span<const uint8_t>(poisoned);
      c.new_v = in_v ? absl::Span<const uint8_t>(poisoned) : absl::Span<const uint8_t>(nk);
      auto rn = engine_->Decode(c);
      EXPECT_EQ(rn.status().code(), StatusCode::kInvalidArgument) << rn.status();
      EXPECT_EQ(store_->GetSequenceInfo("empty")->layer_lengths[kLayer], 0u);
    }
  }
  c.new_k = nk;
  c.new_v = nk;
  EXPECT_TRUE(engine_->Decode(c).ok());
  DecodeCall twice = Call(Method{});
  twice.sequence_ids = {"s0", "s0"};
  auto r2 = engine_->Decode(twice);
  EXPECT_EQ(r2.status().code(), StatusCode::kInvalidArgument) << r2.status();
  EXPECT_TRUE(absl::StrContains(r2.status().message(), "more than once")) << r2.status();
  EngineOptions small;
  small.max_call_sequences = 1;
  DecodeEngine bounded(small, source_.get());
  auto r3 = bounded.Decode(Call(Method{}));  // two sequences
  EXPECT_EQ(r3.status().code(), StatusCode::kInvalidArgument) << r3.status();
  EngineOptions few_bytes;
  few_bytes.max_call_bytes = 2 * 700 * shape_.num_kv_heads * shape_.row_bytes();  // s0 alone
  DecodeEngine byte_bounded(few_bytes, source_.get());
  auto r4 = byte_bounded.Decode(Call(Method{}));  // s0 and s1
  EXPECT_EQ(r4.status().code(), StatusCode::kResourceExhausted) << r4.status();
  EXPECT_EQ(store_->GetSequenceInfo("s0")->layer_lengths[kLayer], 700u);
}

// SAAP through the engine: keys get their buckets as they reach the resident state, and a
// decode selects and estimates exactly what the CPU reference does on the same problem; the hash
// methods are refused on such a server, and so is SAAP on a server without partitions.
// Per-sequence seed offsets: sequence b draws from SequenceSeed(seed + seed_offsets[b], b), as
// a captured step at position seed_offsets[b] does; a wrong count is refused. Without a GPU
// backend there are no captured steps.
TEST_F(EngineTest, SeedOffsetsMoveEachSequencesDrawsAndCpuEnginePlansNoSteps) {
  kvstore::Placement kdev;
  kdev.k_tier = kvstore::Tier::kDevice;
  Load(Options(), kdev);
  Method m;
  m.kind = MethodKind::kSanta;
  m.santa.samples = 32;
  m.santa.tile_size = 128;
  DecodeCall c = Call(m, 99);
  c.seed_offsets = {5, 1000};
  auto r = engine_->Decode(c);
  ASSERT_TRUE(r.ok()) << r.status();
  for (int32_t b = 0; b < 2; ++b) {
    std::vector<uint8_t> out;
    kernels::DecodeProblem p = One(b, &out);
    kernels::RowSelection sel;
    const uint64_t base = 99 + c.seed_offsets[b];
    ASSERT_TRUE(kernels::SantaDecodeCpu(p, m.santa, kernels::SequenceSeed(base, b), &sel).ok());
    ExpectSame(*r, b, sel, out);
  }
  c.seed_offsets = {5};
  EXPECT_EQ(engine_->Decode(c).status().code(), absl::StatusCode::kInvalidArgument);

  StaticStepRequest req;
  req.sequence_ids = {"s0", "s1"};
  req.method = m;
  req.max_tokens = 4096;
  EXPECT_EQ(engine_->PlanStatic(req).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(engine_->Held("s0"));
}

TEST_F(EngineTest, SaapSelectsWhatTheReferenceSelects) {
  kvstore::Placement p;
  p.signature_bits = 32;
  Load(Options(), p);
  auto w = std::make_shared<kernels::SaapWeights>(kernels::RandomSaapWeights(
      kLayers, shape_.num_q_heads, shape_.num_kv_heads, shape_.head_dim, 16, 32, 8));
  ASSERT_TRUE(kernels::ValidateSaapWeights(*w).ok());
  EngineOptions eo;
  eo.signatures.saap = w;
  DecodeEngine saap_engine(eo, source_.get());
  Method m;
  m.kind = MethodKind::kSaap;
  m.saap.probes = 3;
  m.saap.sink_tokens = 16;
  m.saap.local_tokens = 32;
  auto r = saap_engine.Decode(Call(m));
  ASSERT_TRUE(r.ok()) << r.status();
  for (int32_t b = 0; b < prob_.problem.batch; ++b) {
    std::vector<uint8_t> out;
    kernels::DecodeProblem one = One(b, &out);
    std::vector<int32_t> buckets;
    kernels::SaapBuckets view;
    ASSERT_TRUE(kernels::ComputeSaapBuckets(one, *w, kLayer, &buckets, &view).ok());
    kernels::RowSelection sel;
    ASSERT_TRUE(kernels::SaapDecodeCpu(one, m.saap, *w, kLayer, view, &sel).ok());
    ExpectSame(*r, b, sel, out);
    for (int32_t j = 0; j < prob_.problem.num_kv_heads; ++j) {
      const HeadStats& hs = r->heads[b * prob_.problem.num_kv_heads + j];
      EXPECT_LT(hs.rows_fetched, static_cast<uint64_t>(prob_.seq_lens[b])) << "reads a subset";
    }
  }
  Method hash;
  hash.kind = MethodKind::kHashTopK;
  hash.hash.fixed.top_k = 8;
  hash.hash.bits = 0;
  EXPECT_EQ(saap_engine.Decode(Call(hash)).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(engine_->Decode(Call(m)).status().code(), absl::StatusCode::kFailedPrecondition);
  m.saap.probes = 17;  // more than the partition's buckets
  EXPECT_EQ(saap_engine.Decode(Call(m)).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(EngineTest, ResidentStateFollowsARecreatedSequence) {
  kvstore::Placement kdev;
  kdev.k_tier = kvstore::Tier::kDevice;
  Load(Options(1, {500}), kdev);
  Method santa;
  santa.kind = MethodKind::kSanta;
  santa.santa.samples = 16;
  auto first = engine_->Decode(Call(santa));
  ASSERT_TRUE(first.ok());
  EXPECT_GT(first->sync_bytes, 0u);
  // Drop it: a Decode gets NOT_FOUND and the worker frees its resident state.
  ASSERT_TRUE(store_->DropSequence("s0").ok());
  EXPECT_GT(engine_->resident().bytes(), 0u);
  EXPECT_EQ(engine_->Decode(Call(santa)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->resident().bytes(), 0u);
  // Re-create it with other data: the worker must not reuse the old K.
  kernels::SyntheticOptions o = Options(1, {500});
  o.seed = 77;
  Load(o, kdev);
  auto second = engine_->Decode(Call(santa));
  ASSERT_TRUE(second.ok());
  EXPECT_GT(second->sync_bytes, 0u);
  std::vector<uint8_t> out;
  kernels::DecodeProblem p = One(0, &out);
  kernels::RowSelection sel;
  ASSERT_TRUE(kernels::SantaDecodeCpu(p, santa.santa, kernels::SequenceSeed(99, 0), &sel).ok());
  ExpectSame(*second, 0, sel, out);
}

// Threads decoding the same sequences (both layers, several methods) while a small device tier
// forces evictions of each other's resident state: every result equals the single-threaded one
// (the same seed gives the same rows and output), and the cache stays within its capacity.
// Run under TSan and ASan in CI.
TEST(EngineConcurrencyTest, ConcurrentDecodesWithEvictions) {
  kvstore::StoreOptions so;
  so.capacity_bytes = 256ull << 20;
  auto store = kvstore::Store::Create(so);
  ASSERT_TRUE(store.ok());
  auto source = NewLocalRowSource(store->get());
  kernels::SyntheticOptions o = Options(3, {600, 800, 1000});
  auto prob = kernels::SyntheticProblem::Make(o);
  kvstore::Placement place;
  place.k_tier = kvstore::Tier::kDevice;
  place.signature_bits = 32;
  ASSERT_TRUE(kvstore::LoadSynthetic(**store, prob, place, kLayers).ok());
  std::vector<Method> methods(3);
  methods[0].kind = MethodKind::kSanta;
  methods[0].santa.samples = 64;
  methods[1].kind = MethodKind::kHashTopK;
  methods[1].hash.fixed.top_k = 30;
  methods[1].hash.fixed.sink_tokens = 8;
  methods[1].hash.fixed.local_tokens = 8;
  methods[1].hash.bits = 0;
  methods[2].kind = MethodKind::kVAttention;
  methods[2].vattention.epsilon = 0.2f;
  methods[2].vattention.delta = 0.2f;
  methods[2].vattention.bits = 0;
  auto call = [&](uint32_t layer, const std::string& id, int32_t b, const Method& m) {
    DecodeCall c;
    c.layer = layer;
    c.sequence_ids = {id};
    c.q = absl::MakeConstSpan(prob.q.data() + static_cast<size_t>(b) * 8 * 64 * 2, 8 * 64 * 2);
    c.method = m;
    c.seed = 3;
    return c;
  };
  // Expected results from an engine with room for everything, one thread.
  std::map<std::tuple<uint32_t, int32_t, int>, std::string> want;
  {
    EngineOptions eo;
    DecodeEngine ref(eo, source.get());
    for (uint32_t l = 0; l < kLayers; ++l)
      for (int32_t b = 0; b < 3; ++b)
        for (int m = 0; m < 3; ++m) {
          auto r = ref.Decode(call(l, "s" + std::to_string(b), b, methods[m]));
          ASSERT_TRUE(r.ok()) << r.status();
          want[{l, b, m}] = r->output;
        }
  }
  // Room for about two (sequence, layer) states at a time: K (n x 2 heads x 128 B) plus
  // signatures, so the threads keep evicting each other.
  EngineOptions eo;
  eo.resident_capacity_bytes = 700 * 1024;
  DecodeEngine engine(eo, source.get());
  std::atomic<int> mismatches{0}, errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 30; ++i) {
        const uint32_t l = (t + i) % kLayers;
        const int32_t b = (t * 7 + i) % 3;
        const int m = (t + 2 * i) % 3;
        auto r = engine.Decode(call(l, "s" + std::to_string(b), b, methods[m]));
        if (!r.ok()) {
          // A call may not fit while every other state is in use; nothing else may fail.
          if (r.status().code() != absl::StatusCode::kResourceExhausted) ++errors;
          continue;
        }
        if (r->output != want[{l, b, m}]) ++mismatches;
        EXPECT_LE(engine.resident().bytes(), engine.resident().capacity());
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_GT(engine.resident().evictions(), 0u);
}

// The signature weight files of a deployment, read by one function for the server's flags and
// the op's arguments: SimHash without files; a file that does not read, or both kinds at once,
// refused naming the setting as the caller spells it.
TEST(SignatureWeightsTest, LoadNamesTheSettingOfEachRefusal) {
  SignatureConfig config;
  ASSERT_TRUE(LoadSignatureWeights("", "", "--hash_weights", "--saap_weights", &config).ok());
  EXPECT_EQ(config.learned, nullptr);
  EXPECT_EQ(config.saap, nullptr);
  const std::string missing = ::testing::TempDir() + "/no-such-weights.bin";
  absl::Status s = LoadSignatureWeights(missing, "", "--hash_weights", "--saap_weights", &config);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(s.message(), "--hash_weights: ")) << s;
  s = LoadSignatureWeights("", missing, "hash_weights", "saap_weights", &config);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(s.message(), "saap_weights: ")) << s;
  s = LoadSignatureWeights(missing, missing, "hash_weights", "saap_weights", &config);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "hash_weights and saap_weights exclude each other");
  EXPECT_EQ(config.learned, nullptr);
  EXPECT_EQ(config.saap, nullptr);
}

// One reader of an engine's settings for kvsparse-server's flags and the op's arguments: the GPU
// backend's capacity is the resident capacity unless given (the op held 8 GiB where the server
// held --resident_capacity), and each error names the setting with the caller's prefix.
TEST(EngineSettingsTest, OneReadingForTheServerAndTheOp) {
  EngineSettings s;
  s.options.resident_capacity_bytes = 1ull << 30;
  for (const char* prefix : {"--", ""}) {
    absl::StatusOr<EngineOptions> o = EngineOptionsFrom(s, prefix);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(o->gpu.mode, GpuMode::kAuto);
    EXPECT_EQ(o->gpu.capacity_bytes, 1ull << 30) << "tied to the resident capacity";
    EXPECT_EQ(o->default_tile_size, EngineOptions{}.default_tile_size);
  }
  s.gpu_capacity = 3ull << 30;
  absl::StatusOr<EngineOptions> o = EngineOptionsFrom(s, "--");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->gpu.capacity_bytes, 3ull << 30);
  EXPECT_EQ(o->resident_capacity_bytes, 1ull << 30);
  auto expect_bad = [](const EngineSettings& bad, const char* prefix, const std::string& head) {
    const absl::Status st = EngineOptionsFrom(bad, prefix).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << head;
    EXPECT_TRUE(absl::StartsWith(st.message(), head)) << st;
  };
  EngineSettings bad = s;
  bad.gpu = "sometimes";
  expect_bad(bad, "--", "--gpu: ");
  expect_bad(bad, "", "gpu: ");
  bad = s;
  bad.options.resident_capacity_bytes = 0;
  expect_bad(bad, "--", "--resident_capacity: ");
  bad = s;
  bad.options.gpu.row_cache = 2.0;
  expect_bad(bad, "", "gpu_row_cache ");
  bad = s;
  bad.options.gpu.stage_timing_every = -1;
  expect_bad(bad, "--", "--gpu_stage_timing_every: ");
  bad = s;
  bad.key_widths = ::testing::TempDir() + "/no-such-widths";
  expect_bad(bad, "", "key_widths: ");
  bad = s;
  bad.hash_weights = ::testing::TempDir() + "/no-such-weights";
  expect_bad(bad, "--", "--hash_weights: ");
}

// The GPU options' ranges, one check for kvsparse-server's flags and the op's arguments, naming
// the setting as the caller spells it.
TEST(GpuOptionsTest, CheckNamesTheSettingOutsideItsRange) {
  GpuOptions g;
  EXPECT_TRUE(CheckGpuOptions(g, "--gpu_").ok());
  g.row_cache = 1.5;
  absl::Status s = CheckGpuOptions(g, "--gpu_");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "--gpu_row_cache must be a fraction in [0, 1], not 1.5");
  g.row_cache = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(CheckGpuOptions(g, "gpu_").code(), absl::StatusCode::kInvalidArgument);
  g.row_cache = 0.0;
  g.fetch_parallelism = 65;
  s = CheckGpuOptions(g, "gpu_");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(s.message(), "gpu_fetch_parallelism must be in [1, 64]")) << s;
  g.fetch_parallelism = 0;
  EXPECT_EQ(CheckGpuOptions(g, "gpu_").code(), absl::StatusCode::kInvalidArgument);
}

// The shapes the GPU kernels take, one rule for the backend and for callers choosing before they
// decode: every reason at once, so a model with two misfits hears of both.
TEST(GpuShapeTest, NamesEveryReasonTheKernelsRefuseAShape) {
  kvstore::ModelShape s{32, 32, 8, 128, kernels::DType::kBf16};  // Llama-3.1-8B: group 4
  EXPECT_TRUE(GpuTakesShape(s).ok());
  s.dtype = kernels::DType::kFp16;
  EXPECT_TRUE(GpuTakesShape(s).ok());
  const kvstore::ModelShape smollm2{30, 9, 3, 64, kernels::DType::kBf16};  // group 3
  absl::Status why = GpuTakesShape(smollm2);
  EXPECT_EQ(why.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(why.message(), "GQA group of 3 (the GPU's: 1, 2, 4, 8)");
  const kvstore::ModelShape odd{2, 12, 2, 96, kernels::DType::kFp32};  // fp32, d 96, group 6
  why = GpuTakesShape(odd);
  EXPECT_EQ(why.message(),
            "the GPU kernels take bf16 or fp16 rows; head dim 96 (the GPU's: 64, 128, 256); "
            "GQA group of 6 (the GPU's: 1, 2, 4, 8)");
  EXPECT_TRUE(absl::StrContains(GpuTakesShape({2, 8, 3, 64, kernels::DType::kBf16}).message(),
                                "8 query heads over 3 kv heads"));
}

}  // namespace
}  // namespace kvsparse::engine
