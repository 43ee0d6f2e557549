// The decode engine's GPU backend against the CPU engine, on the same store contents: for every
// placement and method the backend computes, the output agrees within rounding (sampled rows are
// the same: the same Philox draws, SequenceSeed per sequence), the rows it reports as fetched and
// the bytes per tier match, the row cache hits on a repeated step, appended tokens are synced,
// and a small GPU tier evicts idle sequences. Skips without a GPU.
#include <cuda_runtime_api.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "engine/cuda/gpu_backend.h"
#include "engine/decode_engine.h"
#include "gtest/gtest.h"
#include "kernels/dense.h"
#include "kernels/hash_signatures.h"
#include "kernels/philox.h"
#include "kernels/synthetic.h"
#include "kvstore/cuda_host_memory.h"
#include "kvstore/store.h"
#include "kvstore/synthetic_store.h"

namespace kvsparse::engine {
namespace {

using kernels::DType;
using kvstore::Tier;

bool HaveGpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

constexpr uint32_t kLayers = 2;
constexpr uint32_t kLayer = 1;
constexpr uint64_t kSigSeed = 4321;

// The store's rows as a store in another process shows them (the server's RemoteRowSource):
// tier remote, no page view, pages not device-visible, page size unknown; rows only through
// Gather.
class ApartSource final : public RowSource {
 public:
  explicit ApartSource(RowSource* inner) : inner_(inner) {}
  kvstore::Tier tier() const override { return kvstore::Tier::kRemote; }
  absl::StatusOr<SequenceDesc> Describe(absl::string_view id, absl::Time deadline) override {
    absl::StatusOr<SequenceDesc> d = inner_->Describe(id, deadline);
    if (d.ok()) d->page_tokens = 0;
    return d;
  }
  absl::Status Append(absl::string_view id, const kvstore::ModelShape& shape, uint32_t layer,
                      uint64_t expected_length, uint64_t num_tokens, absl::Span<const uint8_t> k,
                      absl::Span<const uint8_t> v, absl::Time deadline) override {
    return inner_->Append(id, shape, layer, expected_length, num_tokens, k, v, deadline);
  }
  absl::StatusOr<uint64_t> Gather(absl::string_view id, uint32_t layer, kvstore::RowKind kind,
                                  absl::Span<const RowRequest> heads, uint8_t* k_out,
                                  uint8_t* v_out, absl::Time deadline) override {
    ++gathers;
    return inner_->Gather(id, layer, kind, heads, k_out, v_out, deadline);
  }
  std::atomic<int> gathers{0};  // the GPU engine fetches a batch's sequences side by side

 private:
  RowSource* const inner_;
};

// One store (pinned, mapped pages) with a CPU engine and a GPU engine over it; apart: both read
// it through an ApartSource, as a worker reads a store in another process.
struct Rig {
  std::unique_ptr<kvstore::MemoryResource> memory;
  std::unique_ptr<kvstore::Store> store;
  std::unique_ptr<RowSource> source, local;
  std::unique_ptr<DecodeEngine> cpu, gpu;

  static std::unique_ptr<Rig> Make(
      size_t gpu_capacity = 1ull << 30, double row_cache = 1.0, bool apart = false,
      size_t max_fetch_bytes = 32 << 20,
      std::shared_ptr<const kernels::LearnedHashWeights> learned = nullptr,
      std::shared_ptr<const kernels::SaapWeights> saap = nullptr,
      std::shared_ptr<const kernels::KeyWidths> key_widths = nullptr) {
    auto r = std::make_unique<Rig>();
    auto mem = kvstore::NewPinnedHostMemoryResource();
    EXPECT_TRUE(mem.ok()) << mem.status();
    if (!mem.ok()) return nullptr;
    r->memory = std::move(*mem);
    kvstore::StoreOptions so;
    so.capacity_bytes = 1ull << 30;
    so.memory = r->memory.get();
    auto store = kvstore::Store::Create(so);
    EXPECT_TRUE(store.ok());
    r->store = std::move(*store);
    r->source = NewLocalRowSource(r->store.get(), /*pages_device_visible=*/true);
    if (apart) {
      r->local = std::move(r->source);
      r->source = std::make_unique<ApartSource>(r->local.get());
    }
    EngineOptions eo;
    eo.signatures.simhash_seed = kSigSeed;
    eo.signatures.learned = std::move(learned);
    eo.signatures.saap = std::move(saap);
    eo.key_widths = key_widths;
    // Both engines read the store in chunks of this size (the SimHash M of a sequence is taken
    // over its first chunk).
    eo.max_fetch_bytes = max_fetch_bytes;
    r->cpu = std::make_unique<DecodeEngine>(eo, r->source.get());
    EngineOptions go = eo;  // the GPU backend's: the same but for its capacity and row cache
    go.gpu.capacity_bytes = gpu_capacity;
    go.gpu.row_cache = row_cache;
    auto backend = NewGpuBackend(go, r->source.get());
    EXPECT_TRUE(backend.ok()) << backend.status();
    r->gpu = std::make_unique<DecodeEngine>(eo, r->source.get(), std::move(*backend));
    return r;
  }

  void Load(const kernels::SyntheticProblem& prob, const kvstore::Placement& placement,
            const std::string& prefix = "s") {
    absl::Status s = kvstore::LoadSynthetic(*store, prob, placement, kLayers, prefix);
    ASSERT_TRUE(s.ok()) << s;
  }
};

kernels::SyntheticProblem Problem(std::vector<int32_t> lens, DType dtype = DType::kBf16,
                                  int32_t d = 128, int32_t hkv = 2, int32_t g = 4) {
  kernels::SyntheticOptions o;
  o.family = kernels::ScoreFamily::kPeaked;
  o.batch = static_cast<int32_t>(lens.size());
  o.num_q_heads = hkv * g;
  o.num_kv_heads = hkv;
  o.head_dim = d;
  o.seq_lens = std::move(lens);
  o.dtype = dtype;
  o.seed = 17;
  return kernels::SyntheticProblem::Make(o);
}

DecodeCall Call(const kernels::SyntheticProblem& prob, const Method& m,
                const std::string& prefix = "s") {
  DecodeCall c;
  c.layer = kLayer;
  for (int32_t b = 0; b < prob.problem.batch; ++b)
    c.sequence_ids.push_back(prefix + std::to_string(b));
  c.q_dtype = prob.problem.dtype;
  c.q = prob.q;
  c.method = m;
  c.seed = 77;
  return c;
}

double RelL2(const std::string& a, const std::string& ref, DType t) {
  double num = 0, den = 0;
  const size_t n = ref.size() / kernels::DTypeSize(t);
  for (size_t i = 0; i < n; ++i) {
    const double x = kernels::LoadAsFloat(a.data(), i, t),
                 y = kernels::LoadAsFloat(ref.data(), i, t);
    num += (x - y) * (x - y);
    den += y * y;
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

struct Expect {
  double out_tol;
  bool same_rows;     // rows_fetched and bytes per tier equal the CPU engine's
  double rows_slack;  // else: |gpu - cpu| rows_fetched <= slack * cpu
};

// HashAttention top-k with the sequences' signature bits.
Method HashMethod(float top_k_fraction, int32_t top_k = 0, int32_t sink = 128,
                  int32_t local = 128) {
  Method m;
  m.kind = MethodKind::kHashTopK;
  m.hash.fixed.sink_tokens = sink;
  m.hash.fixed.local_tokens = local;
  m.hash.fixed.top_k_fraction = top_k_fraction;
  m.hash.fixed.top_k = top_k;
  m.hash.bits = 0;  // the sequence's
  return m;
}

// vAttention with the hash predictor at the sequence's signature bits, sink and window 32, top-k
// 2% of the tokens, base rate 0.05.
Method VAttentionMethod() {
  Method m;
  m.kind = MethodKind::kVAttention;
  m.vattention.fixed.sink_tokens = 32;
  m.vattention.fixed.local_tokens = 32;
  m.vattention.fixed.top_k_fraction = 0.02f;
  m.vattention.base_rate = 0.05f;
  m.vattention.bits = 0;  // the sequence's
  return m;
}

// Top-k by scores: sink and window as given, top-k a fraction (or a count) of the tokens.
Method TopKMethod(float top_k_fraction, int32_t top_k = 0, int32_t sink = 16, int32_t local = 32,
                  kernels::ScoreSource source = kernels::ScoreSource::kCompressedKeys) {
  Method m;
  m.kind = MethodKind::kTopK;
  m.top_k.fixed.sink_tokens = sink;
  m.top_k.fixed.local_tokens = local;
  m.top_k.fixed.top_k_fraction = top_k_fraction;
  m.top_k.fixed.top_k = top_k;
  m.top_k.source = source;
  return m;
}

// SANTA variant 0: iid; 1: S2ANTA-prop; 2: S2ANTA-flash; S samples per query head.
Method SantaMethod(int variant, int32_t samples) {
  Method m;
  m.kind = MethodKind::kSanta;
  m.santa.samples = samples;
  m.santa.sampler = variant == 0 ? kernels::SantaSampler::kIid : kernels::SantaSampler::kSystematic;
  m.santa.allocation = variant == 0   ? kernels::SantaAllocation::kGlobal
                       : variant == 1 ? kernels::SantaAllocation::kProp
                                      : kernels::SantaAllocation::kFlash;
  return m;
}

void Compare(Rig& rig, const kernels::SyntheticProblem& prob, const Method& m, const Expect& e,
             const std::string& what) {
  auto c = rig.cpu->Decode(Call(prob, m));
  ASSERT_TRUE(c.ok()) << what << ": " << c.status();
  auto g = rig.gpu->Decode(Call(prob, m));
  ASSERT_TRUE(g.ok()) << what << ": " << g.status();
  ASSERT_EQ(g->output.size(), c->output.size());
  EXPECT_LT(RelL2(g->output, c->output, prob.problem.dtype), e.out_tol) << what;
  ASSERT_EQ(g->heads.size(), c->heads.size()) << what;
  for (size_t i = 0; i < c->heads.size(); ++i) {
    const HeadStats& hc = c->heads[i];
    const HeadStats& hg = g->heads[i];
    EXPECT_EQ(hg.sequence_index, hc.sequence_index);
    EXPECT_EQ(hg.kv_head, hc.kv_head);
    EXPECT_EQ(hg.dense_equivalent_bytes, hc.dense_equivalent_bytes) << what;
    if (e.same_rows) {
      EXPECT_EQ(hg.rows_fetched, hc.rows_fetched) << what << " head " << i;
      EXPECT_EQ(hg.rows_selected, hc.rows_selected) << what << " head " << i;
      EXPECT_EQ(hg.budgets, hc.budgets) << what << " head " << i;
      for (int t = 0; t < kvstore::kNumTiers; ++t) {
        EXPECT_EQ(hg.bytes[t], hc.bytes[t]) << what << " head " << i << " tier " << t;
      }
    } else {
      EXPECT_LE(std::fabs(static_cast<double>(hg.rows_fetched) - hc.rows_fetched),
                e.rows_slack * hc.rows_fetched + 1)
          << what << " head " << i;
    }
  }
}

class GpuEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(GpuEngineTest, DenseEveryPlacement) {
  for (int pl = 0; pl < 3; ++pl) {
    auto rig = Rig::Make();
    ASSERT_NE(rig, nullptr);
    kvstore::Placement p;
    p.k_tier = pl >= 1 ? Tier::kDevice : Tier::kHost;
    p.v_tier = pl == 2 ? Tier::kDevice : Tier::kHost;
    auto prob = Problem({3000, 1, 700});
    rig->Load(prob, p);
    Compare(*rig, prob, Method{}, {6e-3, true, 0}, "dense placement " + std::to_string(pl));
    EXPECT_STREQ(rig->gpu->backend(), "cuda");
  }
}

TEST_F(GpuEngineTest, SantaKOnDeviceVInHostOrDevice) {
  for (bool v_dev : {false, true}) {
    auto rig = Rig::Make();
    ASSERT_NE(rig, nullptr);
    kvstore::Placement p;
    p.k_tier = Tier::kDevice;
    p.v_tier = v_dev ? Tier::kDevice : Tier::kHost;
    auto prob = Problem({5000, 300, 2600});
    rig->Load(prob, p);
    for (int variant = 0; variant < 3; ++variant) {
      Method m = SantaMethod(variant, 128);
      m.santa.tile_size = 256;
      // Same draws; a sample may move where float rounding of a cumulative sum differs.
      Compare(
          *rig, prob, m, {0.05, false, 0.02},
          std::string("santa variant ") + std::to_string(variant) + (v_dev ? " V dev" : " V host"));
    }
  }
}

// Bernoulli qK^T (the S2ANTA paper, Section 5): S2ANTA-sys over the mean group query's
// stratified feature samples (and per-head, iid), against the CPU engine for the same seed: the
// same K features read, the rows and the output within the rounding of exact-score S2ANTA.
TEST_F(GpuEngineTest, SantaOverBernoulliScores) {
  auto rig = Rig::Make();
  ASSERT_NE(rig, nullptr);
  kvstore::Placement p;
  p.k_tier = Tier::kDevice;
  p.v_tier = Tier::kHost;
  auto prob = Problem({5000, 300, 2600});
  rig->Load(prob, p);
  for (int variant = 1; variant < 3; ++variant) {
    for (bool per_head : {false, true}) {
      Method m = SantaMethod(variant, 128);
      m.santa.tile_size = 256;
      m.santa.bernoulli_qk_samples = per_head ? 2 : 4;
      m.santa.bernoulli_mode =
          per_head ? kernels::BernoulliQkMode::kPerHead : kernels::BernoulliQkMode::kMeanGroupQuery;
      m.santa.bernoulli_sampler =
          per_head ? kernels::BernoulliSampler::kIid : kernels::BernoulliSampler::kStratified;
      const std::string what =
          "bernoulli variant " + std::to_string(variant) + (per_head ? " per head" : " mean group");
      Compare(*rig, prob, m, {0.05, false, 0.02}, what);
      auto c = rig->cpu->Decode(Call(prob, m));
      auto g = rig->gpu->Decode(Call(prob, m));
      ASSERT_TRUE(c.ok() && g.ok()) << what;
      EXPECT_TRUE(g->not_on_backend.empty()) << what << ": " << g->not_on_backend;
      uint64_t read = 0;
      for (size_t i = 0; i < c->heads.size(); ++i) {
        EXPECT_EQ(g->heads[i].key_features_head, c->heads[i].key_features_head) << what << i;
        EXPECT_EQ(g->heads[i].key_features_group, c->heads[i].key_features_group) << what << i;
        EXPECT_LE(c->heads[i].key_features_group, static_cast<uint64_t>(prob.problem.head_dim));
        read += c->heads[i].key_features_head;
      }
      EXPECT_GT(read, 0u) << what;  // features were sampled, and fewer than all of them
      EXPECT_LT(read, c->heads.size() * prob.problem.group_size() * prob.problem.head_dim) << what;
    }
  }
}

TEST_F(GpuEngineTest, HashTopKAndTheRowCache) {
  for (int pl = 0; pl < 2; ++pl) {
    auto rig = Rig::Make();
    ASSERT_NE(rig, nullptr);
    kvstore::Placement p;
    p.signature_bits = pl == 0 ? 32 : 64;
    if (pl == 1) p.k_tier = p.v_tier = Tier::kDevice;
    auto prob =
        Problem({4000, 50, 1800}, pl == 0 ? DType::kBf16 : DType::kFp16, pl == 0 ? 128 : 64);
    rig->Load(prob, p);
    const Method m = HashMethod(0.05f, 0, 16, 32);
    Compare(*rig, prob, m, {8e-3, true, 0}, "hash placement " + std::to_string(pl));
    // The same step again: every row comes from the row cache.
    auto g = rig->gpu->Decode(Call(prob, m));
    ASSERT_TRUE(g.ok()) << g.status();
    for (const HeadStats& hs : g->heads) {
      EXPECT_EQ(hs.rows_cached, hs.rows_fetched);
      EXPECT_EQ(hs.bytes[static_cast<int>(Tier::kHost)], 0u);
    }
    // A smaller selection than the cache was sized for (a call with a smaller top-k): every
    // row fits the cache, none overflows. (Rows read from the cache count as device bytes, so
    // only rows and output are compared.)
    Compare(*rig, prob, HashMethod(0.f, 10, 16, 32), {8e-3, false, 0},
            "hash, smaller selection, placement " + std::to_string(pl));
  }
}

// The compressed-key tests' placements: 0: 2-bit keys, K and V in host memory (bf16, d = 128);
// 1: 1-bit keys, fp16, d = 64, the store read in chunks of 400 tokens (100 KB of K rows of 2 kv
// heads: groups of 128 straddle the chunks, part of a closing group is read back from the
// device); 2: 4-bit keys with K and V on the device.
struct CompressedCase {
  kvstore::Placement placement;
  DType dtype = DType::kBf16;
  int32_t head_dim = 128;
  uint64_t read_chunk_bytes = 32 << 20;
};
CompressedCase CompressedCaseOf(int pl) {
  CompressedCase c;
  c.placement.compressed_key_bits = pl == 0 ? 2 : pl == 1 ? 1 : 4;
  if (pl == 2) c.placement.k_tier = c.placement.v_tier = Tier::kDevice;
  if (pl == 1) {
    c.dtype = DType::kFp16;
    c.head_dim = 64;
    c.read_chunk_bytes = 100 << 10;
  }
  return c;
}

// Top-k by compressed-key scores with K and V in host memory (the offloaded case) and on the
// device: the GPU's scores equal the CPU reference's up to rounding (no near-ties here), so both
// engines select the same rows, fetch them and count the same bytes (the compressed keys' blocks
// and open rows read on the device); lengths below one group, on a group boundary and ragged; a
// repeated step reads every row from the row cache. Exact scores (the oracle reads every key) stay
// on the CPU engine.
TEST_F(GpuEngineTest, TopKByCompressedKeys) {
  for (int pl = 0; pl < 3; ++pl) {
    const CompressedCase cc = CompressedCaseOf(pl);
    auto rig = Rig::Make(1ull << 30, 1.0, false, cc.read_chunk_bytes);
    ASSERT_NE(rig, nullptr);
    auto prob = Problem({4000, 50, 1792, 128}, cc.dtype, cc.head_dim);
    rig->Load(prob, cc.placement);
    const std::string what = "top-k, compressed keys, placement " + std::to_string(pl);
    const Method m = TopKMethod(0.05f);
    Compare(*rig, prob, m, {8e-3, true, 0}, what);
    auto g = rig->gpu->Decode(Call(prob, m));
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_GT(g->timing.launch_seconds, 0.0) << what << ": on the GPU";
    for (const HeadStats& hs : g->heads) {
      EXPECT_EQ(hs.rows_cached, hs.rows_fetched) << what;
      EXPECT_EQ(hs.bytes[static_cast<int>(Tier::kHost)], 0u) << what;
    }
    Compare(*rig, prob, TopKMethod(0.f, 10), {8e-3, false, 0}, what + ", smaller selection");
    const Method oracle = TopKMethod(0.05f, 0, 16, 32, kernels::ScoreSource::kExact);
    Compare(*rig, prob, oracle, {8e-3, true, 0}, what + ", exact scores");
    auto o = rig->gpu->Decode(Call(prob, oracle));
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(o->timing.launch_seconds, 0.0) << what << ": exact scores on the CPU engine";
  }
}

// Short sequences and selections that would be empty (issue 48, defects 1 and 2) on the GPU:
// a top_k above a sequence's length reads what it has, and where sink, window and top-k select
// nothing the one best-scoring token is taken (kernels/sink_local_topk.h), the rule the GPU's
// selections share with the CPU references: the same rows and outputs as the CPU engine, never
// an empty selection. S2ANTA's group mixture proposal reads at most S + 1 rows a kv head.
TEST_F(GpuEngineTest, ShortSequencesAndEmptySelections) {
  auto rig = Rig::Make(1ull << 30, 0.0);  // no row cache: each call's rows cross as the CPU's
  ASSERT_NE(rig, nullptr);
  kvstore::Placement p;
  p.signature_bits = 32;
  p.compressed_key_bits = 2;
  auto prob = Problem({50, 300});
  rig->Load(prob, p);
  const std::vector<std::pair<std::string, Method>> methods = {
      {"hash top-64, no sink or window", HashMethod(0.f, 64, 0, 0)},
      {"hash top-k of 0.1%", HashMethod(0.001f, 0, 0, 0)},
      {"top-64 over compressed keys", TopKMethod(0.f, 64, 0, 0)},
      {"top-k of 0.1% over compressed keys", TopKMethod(0.001f, 0, 0, 0)},
  };
  for (const auto& [what, m] : methods) {
    Compare(*rig, prob, m, {8e-3, true, 0}, what);
    auto g = rig->gpu->Decode(Call(prob, m));
    ASSERT_TRUE(g.ok()) << what << ": " << g.status();
    EXPECT_TRUE(g->not_on_backend.empty()) << what << ": " << g->not_on_backend;
    for (const HeadStats& hs : g->heads) EXPECT_GE(hs.rows_fetched, 1u) << what;
  }
  Method group = SantaMethod(1, 64);
  group.santa.scores = kernels::ScoreSource::kCompressedKeys;
  group.santa.proposal = kernels::SantaProposal::kGroupMixture;
  Compare(*rig, prob, group, {0.05, false, 0.02}, "S2ANTA's group mixture");
  auto g = rig->gpu->Decode(Call(prob, group));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_TRUE(g->not_on_backend.empty()) << g->not_on_backend;
  for (const HeadStats& hs : g->heads) {
    EXPECT_GE(hs.rows_fetched, 1u);
    EXPECT_LE(hs.rows_fetched, 65u) << "the group mixture: at most S + 1 rows a kv head";
  }
}

// A uniform floor of 0.2 under each method's proposal (S2ANTA over compressed keys, per head or
// the group mixture): on the GPU, the CPU engine's outputs, budgets and rows (per head each
// head's read in place and counted per head; the group mixture's the CPU's union).
void CheckUniformFloor(Rig& rig, const kernels::SyntheticProblem& prob,
                       std::initializer_list<Method> methods, const std::string& what) {
  for (Method floored : methods) {
    floored.santa.uniform_floor = 0.2f;
    const bool per_head = floored.santa.proposal == kernels::SantaProposal::kPerHead;
    const std::string fw = what + ", floor 0.2" + (per_head ? "" : ", group mixture");
    auto fc = rig.cpu->Decode(Call(prob, floored));
    auto fg = rig.gpu->Decode(Call(prob, floored));
    ASSERT_TRUE(fc.ok() && fg.ok()) << fw << ": " << fc.status() << " " << fg.status();
    EXPECT_GT(fg->timing.launch_seconds, 0.0) << fw << ": on the GPU";
    EXPECT_TRUE(fg->not_on_backend.empty()) << fw << ": " << fg->not_on_backend;
    EXPECT_LT(RelL2(fg->output, fc->output, prob.problem.dtype), 0.05) << fw;
    for (size_t i = 0; i < fc->heads.size(); ++i) {
      const HeadStats &hc = fc->heads[i], &hg = fg->heads[i];
      EXPECT_EQ(hg.budgets, hc.budgets) << fw << " head " << i;
      if (per_head) {
        EXPECT_GE(hg.rows_fetched, hc.rows_fetched * 98 / 100) << fw << " head " << i;
      } else {
        EXPECT_LE(std::fabs(static_cast<double>(hg.rows_fetched) - hc.rows_fetched),
                  0.02 * hc.rows_fetched + 1)
            << fw << " head " << i;
      }
    }
  }
}

// S2ANTA over compressed keys (the ratio correction, prop) with K and V in host memory and on the
// device: the GPU samples from the compressed keys' scores (the CPU's up to rounding) with the CPU
// reference's arithmetic, so nearly every head reads the rows the CPU engine reads (a sample can
// move where a score's or expf's last bits differ) and the outputs agree; the sampled K and V rows
// cross (each head's read in place from the mapped pages; from a store in another process, the
// group's union staged and fetched). The uncorrected estimate stays on the CPU engine.
TEST_F(GpuEngineTest, SantaOverCompressedKeys) {
  for (int pl = 0; pl < 3; ++pl) {
    CompressedCase cc = CompressedCaseOf(pl);
    // S2ANTA refuses 1-bit keys (below): the chunked fp16 case at 2 bits.
    if (pl == 1) cc.placement.compressed_key_bits = 2;
    auto rig = Rig::Make(1ull << 30, 1.0, false, cc.read_chunk_bytes);
    ASSERT_NE(rig, nullptr);
    auto prob = Problem({4000, 50, 1792, 128}, cc.dtype, cc.head_dim);
    rig->Load(prob, cc.placement);
    const std::string what = "S2ANTA over compressed keys, placement " + std::to_string(pl);
    Method m = SantaMethod(1, 128);
    m.santa.scores = kernels::ScoreSource::kCompressedKeys;
    auto c = rig->cpu->Decode(Call(prob, m));
    ASSERT_TRUE(c.ok()) << what << ": " << c.status();
    auto g = rig->gpu->Decode(Call(prob, m));
    ASSERT_TRUE(g.ok()) << what << ": " << g.status();
    EXPECT_GT(g->timing.launch_seconds, 0.0) << what << ": on the GPU";
    ASSERT_EQ(g->heads.size(), c->heads.size());
    const size_t row = prob.problem.head_dim * kernels::DTypeSize(prob.problem.dtype);
    for (size_t i = 0; i < c->heads.size(); ++i) {
      const HeadStats& hc = c->heads[i];
      const HeadStats& hg = g->heads[i];
      // The store's pages are mapped: each query head's rows are read in place, once per head
      // (the GPU's rows_selected: each head's distinct rows), where the CPU engine reads their
      // union once (the same rows: the staged case below).
      EXPECT_EQ(hg.rows_fetched, hg.rows_selected) << what << " head " << i;
      EXPECT_GE(hg.rows_fetched, hc.rows_fetched * 98 / 100) << what << " head " << i;
      EXPECT_EQ(hg.budgets, hc.budgets) << what << " head " << i;
      // The first step: every sampled row crosses (K and V), from where the placement keeps it.
      const uint64_t crossed = hg.bytes[static_cast<int>(Tier::kHost)] +
                               (pl == 2 ? hg.bytes[static_cast<int>(Tier::kDevice)] : 0);
      EXPECT_GE(crossed, 2 * hg.rows_fetched * row) << what << " head " << i;
    }
    EXPECT_LT(RelL2(g->output, c->output, prob.problem.dtype), 0.05) << what;
    // Each query head states its standard error, read in place as the CPU engine states it from
    // its draws: the same value where the two drew the same sample (nearly every head).
    int se_heads = 0, se_close = 0;
    for (size_t i = 0; i < c->heads.size(); ++i) {
      const std::vector<float>&sg = g->heads[i].standard_error, &sc = c->heads[i].standard_error;
      ASSERT_EQ(sg.size(), sc.size()) << what << " head " << i << ": one a query head";
      for (size_t x = 0; x < sc.size(); ++x) {
        ++se_heads;
        if (std::isinf(sc[x]) || sc[x] == 0.f) {
          se_close += sg[x] == sc[x];
        } else {
          se_close += std::fabs(sg[x] - sc[x]) <= 0.01f * sc[x];
        }
      }
    }
    EXPECT_GT(se_heads, 0) << what;
    EXPECT_GE(se_close, se_heads * 9 / 10) << what << ": standard errors the CPU's";
    // The same step again (the same sample): S2ANTA's rows keep no row cache (its samples do not
    // repeat from step to step), so every row crosses again, none is counted cached.
    auto again = rig->gpu->Decode(Call(prob, m));
    ASSERT_TRUE(again.ok()) << what << ": " << again.status();
    for (size_t i = 0; i < again->heads.size(); ++i) {
      const HeadStats& hs = again->heads[i];
      EXPECT_EQ(hs.rows_cached, 0u) << what << " head " << i;
      EXPECT_EQ(hs.rows_fetched, g->heads[i].rows_fetched) << what << " head " << i;
      const uint64_t crossed = hs.bytes[static_cast<int>(Tier::kHost)] +
                               (pl == 2 ? hs.bytes[static_cast<int>(Tier::kDevice)] : 0);
      EXPECT_GE(crossed, 2 * hs.rows_fetched * row) << what << " head " << i;
    }
    // The group mixture: one sample of S rows per kv head for its four query heads.
    Method gm = m;
    gm.santa.proposal = kernels::SantaProposal::kGroupMixture;
    Compare(*rig, prob, gm, {0.05, false, 0.02}, what + ", group mixture");
    auto gg = rig->gpu->Decode(Call(prob, gm));
    ASSERT_TRUE(gg.ok()) << gg.status();
    EXPECT_GT(gg->timing.launch_seconds, 0.0) << what << ", group mixture: on the GPU";
    for (const HeadStats& hs : gg->heads) {
      EXPECT_LE(hs.rows_fetched, 129u) << what << ", group mixture: at most S + 1 rows";
      // Its rows are read once for the group: the kernel states no standard error there.
      EXPECT_TRUE(hs.standard_error.empty()) << what << ", group mixture";
    }
    Method none = m;
    none.santa.correction = kernels::SantaCorrection::kNone;
    auto n = rig->gpu->Decode(Call(prob, none));
    ASSERT_TRUE(n.ok()) << n.status();
    EXPECT_EQ(n->timing.launch_seconds, 0.0) << what << ": uncorrected on the CPU engine";
    CheckUniformFloor(*rig, prob, {m, gm}, what);
    if (pl != 0) continue;
    // From a store in another process (its pages not mapped): the group's union is staged and
    // fetched, each row once; the same rows and outputs as the CPU engine.
    auto apart = Rig::Make(1ull << 30, 1.0, true, cc.read_chunk_bytes);
    ASSERT_NE(apart, nullptr);
    apart->Load(prob, cc.placement);
    auto ca = apart->cpu->Decode(Call(prob, m));
    auto ga = apart->gpu->Decode(Call(prob, m));
    ASSERT_TRUE(ca.ok() && ga.ok()) << ca.status() << " " << ga.status();
    EXPECT_GT(ga->timing.launch_seconds, 0.0) << what << ", apart: on the GPU";
    size_t same_union = 0;
    for (size_t i = 0; i < ca->heads.size(); ++i) {
      same_union += ga->heads[i].rows_fetched == ca->heads[i].rows_fetched;
      EXPECT_LE(ga->heads[i].rows_fetched, ga->heads[i].rows_selected) << what << ", apart";
      // The union staged and fetched, not read in place: no standard error stated.
      EXPECT_TRUE(ga->heads[i].standard_error.empty()) << what << ", apart";
    }
    EXPECT_GE(same_union, ca->heads.size() * 9 / 10) << what << ", apart: the CPU's union";
    EXPECT_LT(RelL2(ga->output, ca->output, prob.problem.dtype), 0.05) << what << ", apart";
  }
  // 1-bit keys: refused by both engines, naming the keys' bits.
  const CompressedCase one = CompressedCaseOf(1);
  auto rig = Rig::Make(1ull << 30, 1.0, false, one.read_chunk_bytes);
  ASSERT_NE(rig, nullptr);
  auto prob = Problem({600}, one.dtype, one.head_dim);
  rig->Load(prob, one.placement);
  Method m = SantaMethod(1, 128);
  m.santa.scores = kernels::ScoreSource::kCompressedKeys;
  for (auto* engine : {rig->cpu.get(), rig->gpu.get()}) {
    const absl::Status s = engine->Decode(Call(prob, m)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "1-bit keys")) << s;
  }
}

// vAttention with the compressed predictor and the importance sampler, K and V in host memory
// and on the device: the GPU scores every token from the compressed keys (the CPU's scores up to
// rounding), takes the CPU reference's fixed set and draws from the same proposal, so the heads
// whose budgets agree read the CPU engine's rows and count its bytes (a draw can land elsewhere
// where the scores or the two float64 cumulative sums round apart); the outputs agree. The uniform
// sampler with this predictor (its residual bound) stays on the CPU engine.
TEST_F(GpuEngineTest, VAttentionOverCompressedKeys) {
  for (int pl = 0; pl < 3; ++pl) {
    const CompressedCase cc = CompressedCaseOf(pl);
    auto rig = Rig::Make(1ull << 30, 1.0, false, cc.read_chunk_bytes);
    ASSERT_NE(rig, nullptr);
    auto prob = Problem({4000, 50, 1792, 128}, cc.dtype, cc.head_dim);
    rig->Load(prob, cc.placement);
    const std::string what = "vAttention over compressed keys, placement " + std::to_string(pl);
    Method m = VAttentionMethod();
    m.vattention.predictor = kernels::TopKPredictor::kCompressed;
    m.vattention.sampler = kernels::ResidualSampler::kImportance;
    m.vattention.bound = kernels::BudgetBound::kCltRatio;
    m.vattention.epsilon = m.vattention.delta = 0.1f;
    if (cc.placement.compressed_key_bits == 1) {
      // Refused over 1-bit keys by both engines (engine/methods/vattention.cc): the promise
      // does not hold per head there.
      EXPECT_EQ(rig->cpu->Decode(Call(prob, m)).status().code(),
                absl::StatusCode::kFailedPrecondition)
          << what;
      EXPECT_EQ(rig->gpu->Decode(Call(prob, m)).status().code(),
                absl::StatusCode::kFailedPrecondition)
          << what;
      continue;
    }
    auto c = rig->cpu->Decode(Call(prob, m));
    ASSERT_TRUE(c.ok()) << what << ": " << c.status();
    auto g = rig->gpu->Decode(Call(prob, m));
    ASSERT_TRUE(g.ok()) << what << ": " << g.status();
    EXPECT_GT(g->timing.launch_seconds, 0.0) << what << ": on the GPU";
    ASSERT_EQ(g->heads.size(), c->heads.size());
    size_t agree = 0, same = 0;
    for (size_t i = 0; i < c->heads.size(); ++i) {
      const HeadStats& hc = c->heads[i];
      const HeadStats& hg = g->heads[i];
      ASSERT_EQ(hg.budgets.size(), hc.budgets.size()) << what << " head " << i;
      for (size_t k = 0; k < hc.budgets.size(); ++k) {
        EXPECT_NEAR(static_cast<double>(hg.budgets[k]), static_cast<double>(hc.budgets[k]), 1.0)
            << what << " head " << i;
      }
      if (hg.budgets != hc.budgets) continue;
      ++agree;
      // The epsilon each head's budget promises, as the CPU engine states it (the same float64
      // statistics summed in another order).
      ASSERT_EQ(hg.epsilon.size(), hc.epsilon.size()) << what << " head " << i;
      for (size_t k = 0; k < hc.epsilon.size(); ++k) {
        EXPECT_NEAR(hg.epsilon[k], hc.epsilon[k], 1e-4 + 1e-3 * hc.epsilon[k])
            << what << " head " << i << " query head " << k;
        EXPECT_LE(hg.epsilon[k], m.vattention.epsilon * (1 + 1e-6)) << what << " head " << i;
      }
      const bool rows = hg.rows_fetched == hc.rows_fetched && hg.rows_selected == hc.rows_selected;
      bool bytes = true;
      for (int t = 0; t < kvstore::kNumTiers; ++t) bytes &= hg.bytes[t] == hc.bytes[t];
      same += rows && bytes;
      EXPECT_LE(hg.rows_fetched, static_cast<uint64_t>(prob.seq_lens[hg.sequence_index]))
          << what << " head " << i;
    }
    EXPECT_GE(agree, c->heads.size() * 9 / 10) << what << ": heads whose budgets agree";
    EXPECT_GE(same, agree * 9 / 10) << what << ": of those, heads reading the CPU's rows and bytes";
    EXPECT_LT(RelL2(g->output, c->output, prob.problem.dtype), 0.05) << what;
    Method uniform = m;
    uniform.vattention.sampler = kernels::ResidualSampler::kUniform;
    auto u = rig->gpu->Decode(Call(prob, uniform));
    ASSERT_TRUE(u.ok()) << u.status();
    EXPECT_EQ(u->timing.launch_seconds, 0.0) << what << ": the uniform sampler on the CPU engine";
  }
}

// Learned hash weights (random MLPs of HashAttention's shape): hash top-k and vAttention's hash
// predictor sign keys and queries with them on the GPU (LearnedSign), selecting row for row
// what the CPU engine selects; weights with one key MLP per query head stay on the CPU engine.
std::shared_ptr<const kernels::LearnedHashWeights> RandomLearned(int32_t hk, int32_t bits,
                                                                 uint32_t seed) {
  auto w = std::make_shared<kernels::LearnedHashWeights>();
  w->num_layers = kLayers;
  w->num_q_heads = 8;
  w->num_key_mlps = hk;
  w->dims = {128, 64, 64, bits};
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  auto make = [&] {
    kernels::HashMlp m;
    m.dims = w->dims;
    for (size_t i = 0; i + 1 < m.dims.size(); ++i) {
      std::vector<float> wt(static_cast<size_t>(m.dims[i]) * m.dims[i + 1]), b(m.dims[i + 1]);
      for (float& x : wt) x = normal(rng) / std::sqrt(static_cast<float>(m.dims[i]));
      for (float& x : b) x = 0.1f * normal(rng);
      m.weights.push_back(std::move(wt));
      m.biases.push_back(std::move(b));
    }
    return m;
  };
  for (uint32_t l = 0; l < kLayers; ++l) {
    for (int32_t h = 0; h < w->num_q_heads; ++h) w->query_mlps.push_back(make());
  }
  for (uint32_t l = 0; l < kLayers; ++l) {
    for (int32_t j = 0; j < hk; ++j) w->key_mlps.push_back(make());
  }
  EXPECT_TRUE(kernels::ValidateLearnedHashWeights(*w).ok());
  return w;
}

TEST_F(GpuEngineTest, LearnedSignatures) {
  for (int32_t hk : {2, 8}) {
    auto rig = Rig::Make(1ull << 30, 1.0, false, 32 << 20, RandomLearned(hk, 64, 3 + hk));
    ASSERT_NE(rig, nullptr);
    kvstore::Placement p;
    p.signature_bits = 64;
    auto prob = Problem({3000, 700});
    rig->Load(prob, p);
    Method m = HashMethod(0.05f, 0, 16, 32);
    m.learned_signatures = true;
    Compare(*rig, prob, m, {8e-3, true, 0}, "learned hash, key MLPs " + std::to_string(hk));
    auto g = rig->gpu->Decode(Call(prob, m));
    ASSERT_TRUE(g.ok()) << g.status();
    if (hk == 2) {
      EXPECT_GT(g->timing.launch_seconds, 0.0) << "one key MLP per kv head: on the GPU";
    } else {
      EXPECT_EQ(g->timing.launch_seconds, 0.0) << "a key MLP per query head: the CPU engine";
    }
    Method v = VAttentionMethod();
    v.learned_signatures = true;
    auto c = rig->cpu->Decode(Call(prob, v));
    auto gv = rig->gpu->Decode(Call(prob, v));
    ASSERT_TRUE(c.ok() && gv.ok()) << c.status() << gv.status();
    EXPECT_LT(RelL2(gv->output, c->output, DType::kBf16), 0.02);
    EXPECT_EQ(gv->timing.launch_seconds > 0.0, hk == 2);
    // SimHash asked of a learned deployment: the CPU engine's FAILED_PRECONDITION, from both.
    const Method simhash = HashMethod(0.05f, 0, 16, 32);
    auto bad = rig->gpu->Decode(Call(prob, simhash));
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition) << bad.status();
  }
}

// SAAP (random partitions and classifiers): the GPU assigns the key buckets (SaapAssignKeys)
// and selects (SaapSelect) row for row what the CPU engine selects, in process and from a store
// in another process (staged rows); a repeated step is served from the row cache; the hash
// methods stay refused on a SAAP deployment.
TEST_F(GpuEngineTest, Saap) {
  auto w = std::make_shared<const kernels::SaapWeights>(
      kernels::RandomSaapWeights(kLayers, 8, 2, 128, 32, 64, 9));
  for (bool apart : {false, true}) {
    const std::string what = apart ? "saap, store apart" : "saap";
    auto rig = Rig::Make(1ull << 30, 1.0, apart, 32 << 20, nullptr, w);
    ASSERT_NE(rig, nullptr);
    kvstore::Placement p;
    p.signature_bits = 32;
    auto prob = Problem({3000, 700});
    rig->Load(prob, p);
    Method m;
    m.kind = MethodKind::kSaap;
    m.saap.probes = 4;
    m.saap.sink_tokens = 16;
    m.saap.local_tokens = 32;
    Compare(*rig, prob, m, {8e-3, true, 0}, what);
    auto g = rig->gpu->Decode(Call(prob, m));
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_GT(g->timing.launch_seconds, 0.0) << what << ": on the GPU";
    for (const HeadStats& hs : g->heads) {
      EXPECT_EQ(hs.rows_cached, hs.rows_fetched) << what;
      EXPECT_LT(hs.rows_fetched, static_cast<uint64_t>(prob.seq_lens[hs.sequence_index])) << what;
    }
    auto bad = rig->gpu->Decode(Call(prob, HashMethod(0.05f, 0, 16, 32)));
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition) << bad.status();
  }
}

TEST_F(GpuEngineTest, VAttention) {
  auto rig = Rig::Make();
  ASSERT_NE(rig, nullptr);
  kvstore::Placement p;
  p.signature_bits = 32;
  auto prob = Problem({6000, 2500});
  rig->Load(prob, p);
  const Method m = VAttentionMethod();
  auto c = rig->cpu->Decode(Call(prob, m));
  ASSERT_TRUE(c.ok()) << c.status();
  auto g = rig->gpu->Decode(Call(prob, m));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_LT(RelL2(g->output, c->output, DType::kBf16), 0.02);
  for (size_t i = 0; i < c->heads.size(); ++i) {
    ASSERT_EQ(g->heads[i].budgets.size(), c->heads[i].budgets.size());
    for (size_t k = 0; k < c->heads[i].budgets.size(); ++k) {
      EXPECT_NEAR(static_cast<double>(g->heads[i].budgets[k]),
                  static_cast<double>(c->heads[i].budgets[k]), 1.0);
    }
    // Each row read once for the GQA group, as the CPU engine reads them (the same rows where
    // the budgets agree; a budget one off samples other rows), and the epsilon each budget
    // promises as the CPU engine states it.
    if (g->heads[i].budgets == c->heads[i].budgets) {
      ASSERT_EQ(g->heads[i].epsilon.size(), c->heads[i].epsilon.size()) << "head " << i;
      for (size_t k = 0; k < c->heads[i].epsilon.size(); ++k) {
        EXPECT_NEAR(g->heads[i].epsilon[k], c->heads[i].epsilon[k],
                    1e-4 + 1e-3 * c->heads[i].epsilon[k])
            << "head " << i << " query head " << k;
      }
      EXPECT_EQ(g->heads[i].rows_fetched, c->heads[i].rows_fetched) << "head " << i;
      EXPECT_EQ(g->heads[i].rows_selected, c->heads[i].rows_selected) << "head " << i;
      for (int t = 0; t < kvstore::kNumTiers; ++t) {
        EXPECT_EQ(g->heads[i].bytes[t], c->heads[i].bytes[t]) << "head " << i << " tier " << t;
      }
    }
    // A union never holds more rows than the sequence (each head reading its own could).
    EXPECT_LE(g->heads[i].rows_fetched,
              static_cast<uint64_t>(prob.seq_lens[g->heads[i].sequence_index]));
  }
}

// A worker whose store is in another process: dense and hash top-k run on the GPU with their
// host rows gathered into staging (hash: only the row cache's misses), matching the CPU engine
// row for row and byte for byte (bytes from the remote tier), vAttention with its two parts
// staged, and SANTA / S2ANTA (K on the GPU) with their sampled V rows staged.
TEST_F(GpuEngineTest, StoreInAnotherProcess) {
  for (int pl = 0; pl < 4; ++pl) {
    // pl 3: placement 0 again with Gathers of at most 64 KB (128 rows of K and V): a sequence's
    // heads and a long list span several.
    auto rig = Rig::Make(1ull << 30, 1.0, /*apart=*/true, pl == 3 ? 64 << 10 : 32 << 20);
    ASSERT_NE(rig, nullptr);
    kvstore::Placement p;
    p.k_tier = pl == 1 || pl == 2 ? Tier::kDevice : Tier::kHost;
    p.v_tier = pl == 2 ? Tier::kDevice : Tier::kHost;
    p.signature_bits = pl == 0 || pl == 3 ? 32 : 0;
    p.compressed_key_bits = pl == 0 || pl == 3 ? 2 : 0;
    auto prob = Problem({3000, 1, 700});
    rig->Load(prob, p);
    Compare(*rig, prob, Method{}, {6e-3, true, 0}, "apart dense placement " + std::to_string(pl));
    auto g = rig->gpu->Decode(Call(prob, Method{}));
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_GT(g->timing.launch_seconds, 0.0) << "dense ran on the GPU, placement " << pl;
    if (pl == 2) continue;
    EXPECT_GT(g->heads[0].bytes[static_cast<int>(Tier::kRemote)], 0u);
    if (pl == 0 || pl == 3) {
      const Method m = HashMethod(0.05f, 0, 16, 32);
      Compare(*rig, prob, m, {8e-3, true, 0}, "apart hash, placement " + std::to_string(pl));
      auto* src = static_cast<ApartSource*>(rig->source.get());
      const int before = src->gathers.load();
      auto h = rig->gpu->Decode(Call(prob, m));  // the same step: every row from the row cache
      ASSERT_TRUE(h.ok()) << h.status();
      EXPECT_GT(h->timing.launch_seconds, 0.0);
      EXPECT_EQ(src->gathers.load(), before) << "no row crossed";
      for (const HeadStats& hs : h->heads) {
        EXPECT_EQ(hs.rows_cached, hs.rows_fetched);
        EXPECT_EQ(hs.bytes[static_cast<int>(Tier::kRemote)], 0u);
      }
      // Top-k by compressed keys: the selected rows staged from the store. The row cache still
      // holds hash top-k's rows of the same layer, so some rows hit: the rows fetched equal the
      // CPU engine's, and so do the bytes in all (device hits + remote misses).
      const Method tk = TopKMethod(0.05f);
      Compare(*rig, prob, tk, {8e-3, false, 0}, "apart top-k, placement " + std::to_string(pl));
      auto tc = rig->cpu->Decode(Call(prob, tk));
      auto tg = rig->gpu->Decode(Call(prob, tk));
      ASSERT_TRUE(tc.ok() && tg.ok()) << tc.status() << tg.status();
      for (size_t i = 0; i < tc->heads.size(); ++i) {
        const HeadStats &hc = tc->heads[i], &hg = tg->heads[i];
        EXPECT_EQ(hg.rows_fetched, hc.rows_fetched) << "apart top-k head " << i;
        EXPECT_EQ(
            hg.bytes[static_cast<int>(Tier::kDevice)] + hg.bytes[static_cast<int>(Tier::kRemote)],
            hc.bytes[static_cast<int>(Tier::kDevice)] + hc.bytes[static_cast<int>(Tier::kRemote)])
            << "apart top-k head " << i;
      }
      auto t = rig->gpu->Decode(Call(prob, tk));
      ASSERT_TRUE(t.ok()) << t.status();
      EXPECT_GT(t->timing.launch_seconds, 0.0) << "top-k over a remote store on the GPU";
      // vAttention: both parts of the union staged from the store, on the GPU.
      const Method v = VAttentionMethod();
      Compare(*rig, prob, v, {0.02, false, 0.02},
              "apart vAttention, placement " + std::to_string(pl));
      auto va = rig->gpu->Decode(Call(prob, v));
      ASSERT_TRUE(va.ok()) << va.status();
      EXPECT_GT(va->timing.launch_seconds, 0.0) << "vAttention over a remote store on the GPU";
      EXPECT_GT(va->heads[0].bytes[static_cast<int>(Tier::kRemote)], 0u);
    } else {
      // SANTA / S2ANTA with V in the store: a first run lists the sampled rows, they are staged,
      // the second reads them by token; the output equals the in-process GPU engine's (same
      // samples; fp32 atomics sum in another order) and the CPU engine's within sampling slack.
      auto local = Rig::Make();
      ASSERT_NE(local, nullptr);
      local->Load(prob, p);
      for (int variant = 0; variant < 3; ++variant) {
        const Method m = SantaMethod(variant, 64);
        const std::string what = "apart santa variant " + std::to_string(variant);
        Compare(*rig, prob, m, {0.05, false, 0.02}, what);
        auto s2 = rig->gpu->Decode(Call(prob, m));
        auto in = local->gpu->Decode(Call(prob, m));
        ASSERT_TRUE(s2.ok() && in.ok()) << s2.status() << in.status();
        EXPECT_GT(s2->timing.launch_seconds, 0.0) << what << ": on the GPU";
        EXPECT_LT(RelL2(s2->output, in->output, DType::kBf16), 2e-3) << what;
        for (size_t i = 0; i < s2->heads.size(); ++i) {
          EXPECT_EQ(s2->heads[i].rows_fetched, in->heads[i].rows_fetched) << what << " head " << i;
          EXPECT_EQ(s2->heads[i].bytes[static_cast<int>(Tier::kRemote)],
                    in->heads[i].bytes[static_cast<int>(Tier::kHost)])
              << what << " head " << i;
        }
      }
    }
  }
}

TEST_F(GpuEngineTest, AppendedTokensAreSynced) {
  // Two rigs with the same contents: one decodes on the CPU engine, the other on the GPU, each
  // appending the same new tokens step after step.
  auto a = Rig::Make(), b = Rig::Make();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  kvstore::Placement p;
  p.k_tier = Tier::kDevice;
  p.signature_bits = 32;
  p.compressed_key_bits = 2;
  // Page and capacity boundaries are crossed, and a compressed-key group closes (token 255).
  auto prob = Problem({255, 1024});
  a->Load(prob, p);
  b->Load(prob, p);
  const kernels::DecodeProblem& dp = prob.problem;
  const size_t tok = static_cast<size_t>(dp.batch) * dp.num_kv_heads * dp.head_dim * 2;
  std::vector<uint8_t> nk(tok), nv(tok);
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < tok / 2; ++i) {
      const float x = std::sin(0.37f * i + step), y = std::cos(0.11f * i - step);
      kernels::StoreFromFloat(nk.data(), i, DType::kBf16, x);
      kernels::StoreFromFloat(nv.data(), i, DType::kBf16, y);
    }
    for (int method = 0; method < 4; ++method) {
      Method m;
      if (method == 1) {
        m.kind = MethodKind::kSanta;
        m.santa.samples = 64;
      } else if (method == 2) {
        m = HashMethod(0.f, 20, 4, 8);
      } else if (method == 3) {
        m = TopKMethod(0.f, 20, 4, 8);
      }
      DecodeCall ca = Call(prob, m), cb = Call(prob, m);
      if (method == 0) {  // one appending call per step
        ca.new_k = cb.new_k = nk;
        ca.new_v = cb.new_v = nv;
      }
      auto rc = a->cpu->Decode(ca);
      auto rg = b->gpu->Decode(cb);
      ASSERT_TRUE(rc.ok()) << rc.status();
      ASSERT_TRUE(rg.ok()) << rg.status();
      EXPECT_LT(RelL2(rg->output, rc->output, DType::kBf16), method == 1 ? 0.05 : 8e-3)
          << "step " << step << " method " << method;
    }
  }
}

TEST_F(GpuEngineTest, SmallGpuTierEvictsIdleSequences) {
  auto rig = Rig::Make(/*gpu_capacity=*/3 << 20);
  ASSERT_NE(rig, nullptr);
  kvstore::Placement p;
  p.k_tier = p.v_tier = Tier::kDevice;
  auto prob = Problem({2000});  // 2 kv heads x 2000 x 256 B x 2 = 2 MB per layer
  rig->Load(prob, p, "a");
  rig->Load(prob, p, "b");
  for (int i = 0; i < 4; ++i) {
    const std::string prefix = i % 2 == 0 ? "a" : "b";
    auto c = rig->cpu->Decode(Call(prob, Method{}, prefix));
    auto g = rig->gpu->Decode(Call(prob, Method{}, prefix));
    ASSERT_TRUE(c.ok() && g.ok()) << c.status() << g.status();
    EXPECT_LT(RelL2(g->output, c->output, DType::kBf16), 6e-3);
    EXPECT_LE(rig->gpu->device_backend()->resident_bytes(), 3u << 20);
  }
  // A single sequence larger than the tier is refused with RESOURCE_EXHAUSTED.
  auto big = Problem({8000});
  rig->Load(big, p, "big");
  auto r = rig->gpu->Decode(Call(big, Method{}, "big"));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  // ...and the backend keeps serving.
  auto again = rig->gpu->Decode(Call(prob, Method{}, "a"));
  EXPECT_TRUE(again.ok()) << again.status();
}

// A row cache smaller than the selection: the rows beyond it cross every step (overflow rows),
// the output stays the CPU engine's, and the GPU holds only the cache's slots beside the
// signatures.
TEST_F(GpuEngineTest, SmallRowCacheOverflows) {
  auto rig = Rig::Make(1ull << 30, /*row_cache=*/0.02);
  ASSERT_NE(rig, nullptr);
  kvstore::Placement p;
  p.signature_bits = 32;
  auto prob = Problem({4000, 1800});
  rig->Load(prob, p);
  const Method m = HashMethod(0.05f, 0, 16, 32);
  Compare(*rig, prob, m, {8e-3, true, 0}, "hash, small row cache");
  // Slots per kv head: 2% of the tokens rounded up to 64: 128 (4000 tokens) and 64 (1800).
  const uint64_t slots[2] = {128, 64};
  for (int step = 0; step < 2; ++step) {  // the same step again: the cache's rows hit
    auto g = rig->gpu->Decode(Call(prob, m));
    ASSERT_TRUE(g.ok()) << g.status();
    for (const HeadStats& hs : g->heads) {
      ASSERT_GT(hs.rows_fetched, slots[hs.sequence_index]);
      EXPECT_EQ(hs.rows_cached, slots[hs.sequence_index]);
      EXPECT_EQ(hs.bytes[static_cast<int>(Tier::kHost)],
                2 * (hs.rows_fetched - hs.rows_cached) * 128 * 2);
    }
  }
  // Signatures ([Hkv][capacity] words, capacity rounded up) and the caches' slots
  // (tokens, slots, K and V rows).
  const size_t held = rig->gpu->device_backend()->resident_bytes();
  const size_t caches = 2 * (128 + 64) * (2 * 128 * 2 + 8);
  EXPECT_GT(held, caches);
  EXPECT_LE(held, caches + 2u * 2 * 4000 * 4 + 8192);
}

TEST_F(GpuEngineTest, WithoutTheRowCacheOnlySignaturesStay) {
  auto rig = Rig::Make(1ull << 30, /*row_cache=*/0.0);
  ASSERT_NE(rig, nullptr);
  kvstore::Placement p;
  p.signature_bits = 32;
  auto prob = Problem({3000, 700});
  rig->Load(prob, p);
  const Method m = HashMethod(0.f, 50);
  Compare(*rig, prob, m, {8e-3, true, 0}, "hash without row cache");
  auto g = rig->gpu->Decode(Call(prob, m));
  ASSERT_TRUE(g.ok()) << g.status();
  for (const HeadStats& hs : g->heads) EXPECT_EQ(hs.rows_cached, 0u);
  // Signatures of the decoded layer (capacity rounded up) and their norms: no row sets.
  const size_t held = rig->gpu->device_backend()->resident_bytes();
  EXPECT_GT(held, 0u);
  EXPECT_LE(held, 2u * 2 * 3000 * 4 + 4096);
}

// No row cache with the rows in another process: the union's rows are gathered into staging in
// union order (its counts from the statistics) and every row crosses, every step.
TEST_F(GpuEngineTest, StoreInAnotherProcessWithoutTheRowCache) {
  auto rig = Rig::Make(1ull << 30, /*row_cache=*/0.0, /*apart=*/true);
  ASSERT_NE(rig, nullptr);
  kvstore::Placement p;
  p.signature_bits = 32;
  p.compressed_key_bits = 2;
  auto prob = Problem({3000, 1, 700});
  rig->Load(prob, p);
  Method top_k = TopKMethod(0.05f, 0, 16, 32);
  for (const Method& m : {HashMethod(0.05f, 0, 16, 32), top_k}) {
    Compare(*rig, prob, m, {8e-3, true, 0}, "apart, no row cache");
    auto g = rig->gpu->Decode(Call(prob, m));
    ASSERT_TRUE(g.ok()) << g.status();
    for (const HeadStats& hs : g->heads) {
      EXPECT_EQ(hs.rows_cached, 0u);
      EXPECT_EQ(hs.bytes[static_cast<int>(Tier::kRemote)], 2 * hs.rows_fetched * 128 * 2);
    }
  }
}

// A device buffer for the captured-step tests.
struct Dev {
  void* p = nullptr;
  explicit Dev(size_t bytes) { EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess); }
  ~Dev() { cudaFree(p); }
  template <typename X>
  X* as() const {
    return static_cast<X*>(p);
  }
};

// One step of every layer recorded as a CUDA graph on `stream` (the plan's Enqueue per layer:
// the step's inputs, layer l's output at out + l * q_bytes), destroyed with it.
struct RecordedStep {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ~RecordedStep() {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (graph != nullptr) cudaGraphDestroy(graph);
  }
};

void RecordStep(StaticStep& plan, const Dev& q, const Dev& nk, const Dev& nv, const Dev& pos,
                const Dev& out, size_t q_bytes, cudaStream_t stream, RecordedStep* r,
                const std::string& what) {
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  for (uint32_t l = 0; l < kLayers; ++l) {
    absl::Status s =
        plan.Enqueue(l, q.p, nk.p, nv.p, pos.as<int64_t>(), out.as<char>() + l * q_bytes, stream);
    EXPECT_TRUE(s.ok()) << what << ": " << s;
  }
  ASSERT_EQ(cudaStreamEndCapture(stream, &r->graph), cudaSuccess) << what;
  ASSERT_EQ(cudaGraphInstantiate(&r->exec, r->graph, 0), cudaSuccess) << what;
}

// A step's inputs for the captured-step tests, in device buffers that stay the same from step to
// step (q, nk, nv, pos) and on the host (hq, hk, hv, hp): the step's token K/V (a function of the
// step), the problem's query drifting from step to step, positions lens + step.
struct StepInputs {
  StepInputs(const kernels::SyntheticProblem& prob, std::vector<int32_t> lens)
      : prob(prob),
        lens(std::move(lens)),
        q_bytes(static_cast<size_t>(prob.problem.batch) * prob.problem.num_q_heads *
                prob.problem.head_dim * 2),
        kv_bytes(static_cast<size_t>(prob.problem.batch) * prob.problem.num_kv_heads *
                 prob.problem.head_dim * 2),
        q(q_bytes),
        nk(kv_bytes),
        nv(kv_bytes),
        pos(sizeof(int64_t) * prob.problem.batch),
        hk(kv_bytes),
        hv(kv_bytes),
        hq(prob.q),
        hp(prob.problem.batch) {}

  void Upload(int st) {
    for (size_t i = 0; i < kv_bytes / 2; ++i) {
      kernels::StoreFromFloat(hk.data(), i, DType::kBf16, std::sin(0.37f * i + st));
      kernels::StoreFromFloat(hv.data(), i, DType::kBf16, std::cos(0.11f * i - st));
    }
    for (size_t i = 0; i < q_bytes / 2; ++i) {  // the query drifts from step to step
      const float x = kernels::LoadAsFloat(prob.q.data(), i, DType::kBf16);
      kernels::StoreFromFloat(hq.data(), i, DType::kBf16, x + 0.05f * std::sin(0.7f * i + st));
    }
    for (size_t i = 0; i < hp.size(); ++i) hp[i] = lens[i] + st;
    UploadPositions();
    ASSERT_EQ(cudaMemcpy(q.p, hq.data(), q_bytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(nk.p, hk.data(), kv_bytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(nv.p, hv.data(), kv_bytes, cudaMemcpyHostToDevice), cudaSuccess);
  }
  void UploadPositions() {
    ASSERT_EQ(cudaMemcpy(pos.p, hp.data(), sizeof(int64_t) * hp.size(), cudaMemcpyHostToDevice),
              cudaSuccess);
  }

  const kernels::SyntheticProblem& prob;
  const std::vector<int32_t> lens;
  const size_t q_bytes, kv_bytes;
  Dev q, nk, nv, pos;
  std::vector<uint8_t> hk, hv, hq;
  std::vector<int64_t> hp;
};

// The rows of both rigs' sequences "s<i>" from two tokens before their first length to the
// last of `steps` appended ones, in every layer: equal byte for byte.
void ExpectSameRows(Rig& a, Rig& b, const std::vector<int32_t>& lens, int steps, int32_t kv_heads,
                    size_t row, const std::string& what) {
  for (uint32_t l = 0; l < kLayers; ++l) {
    for (size_t i = 0; i < lens.size(); ++i) {
      std::vector<uint32_t> toks;
      for (int st = -2; st < steps; ++st) toks.push_back(static_cast<uint32_t>(lens[i] + st));
      std::vector<RowRequest> heads;
      for (uint32_t j = 0; j < static_cast<uint32_t>(kv_heads); ++j) {
        heads.push_back({j, toks});
      }
      const size_t n = toks.size() * kv_heads * row;
      std::vector<uint8_t> ka(n), va(n), kb(n), vb(n);
      const std::string id = "s" + std::to_string(i);
      ASSERT_TRUE(a.source
                      ->Gather(id, l, kvstore::RowKind::kKV, heads, ka.data(), va.data(),
                               absl::InfiniteFuture())
                      .ok());
      ASSERT_TRUE(b.source
                      ->Gather(id, l, kvstore::RowKind::kKV, heads, kb.data(), vb.data(),
                               absl::InfiniteFuture())
                      .ok());
      EXPECT_EQ(ka, kb) << what << " layer " << l << " sequence " << i;
      EXPECT_EQ(va, vb) << what << " layer " << l << " sequence " << i;
    }
  }
}

// Captured steps (engine/static_step.h) against eager calls: one rig decodes every layer of each
// step eagerly, appending the step's token (seed + position, as a step draws), the other plans
// the batch once, captures all layers of a step in one CUDA graph and replays it step after
// step. Outputs agree, the committed rows are the eager ones, the plan's sequences are held,
// and after the plan the eager path goes on from the committed rows.
void CapturedStepsEqualEagerCalls(const Method& m, const kvstore::Placement& p,
                                  std::vector<int32_t> lens, double tol, const std::string& what,
                                  std::shared_ptr<const kernels::KeyWidths> key_widths = nullptr) {
  auto a = Rig::Make(1ull << 30, 1.0, false, 32 << 20, nullptr, nullptr, key_widths);
  auto b = Rig::Make(1ull << 30, 1.0, false, 32 << 20, nullptr, nullptr, key_widths);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  auto prob = Problem(lens);
  a->Load(prob, p);
  b->Load(prob, p);
  const kernels::DecodeProblem& dp = prob.problem;
  const int32_t B = dp.batch;
  const size_t row = static_cast<size_t>(dp.head_dim) * 2;
  const size_t q_bytes = static_cast<size_t>(B) * dp.num_q_heads * row;
  StaticStepRequest req;
  for (int32_t i = 0; i < B; ++i) req.sequence_ids.push_back("s" + std::to_string(i));
  req.method = m;
  req.max_tokens = 2048;
  req.seed = 77;
  auto plan = b->gpu->PlanStatic(req);
  ASSERT_TRUE(plan.ok()) << what << ": " << plan.status();
  StaticStep& step = **plan;
  // Held: eager calls, a second plan and evictions leave the sequences alone.
  EXPECT_EQ(b->gpu->Decode(Call(prob, m)).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(b->gpu->PlanStatic(req).status().code(), absl::StatusCode::kFailedPrecondition);

  StepInputs in(prob, lens);
  Dev out(kLayers * q_bytes);
  std::vector<uint8_t>&hq = in.hq, &hk = in.hk, &hv = in.hv;
  std::vector<int64_t>& hp = in.hp;
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  RecordedStep rec;
  RecordStep(step, in.q, in.nk, in.nv, in.pos, out, q_bytes, stream, &rec, what);
  cudaGraphExec_t exec = rec.exec;

  constexpr int kSteps = 10;
  for (int st = 0; st < kSteps; ++st) {
    in.Upload(st);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::string got(kLayers * q_bytes, '\0');
    ASSERT_EQ(cudaMemcpy(got.data(), out.p, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    for (uint32_t l = 0; l < kLayers; ++l) {
      DecodeCall c = Call(prob, m);
      c.layer = l;
      c.q = hq;
      c.new_k = hk;
      c.new_v = hv;
      // Equal positions where it matters (the sampling methods' batches).
      c.seed = 77 + (static_cast<uint64_t>(l) << 32) + static_cast<uint64_t>(hp[0]);
      auto e = a->gpu->Decode(c);
      ASSERT_TRUE(e.ok()) << what << ": " << e.status();
      EXPECT_LT(RelL2(got.substr(l * q_bytes, q_bytes), e->output, DType::kBf16), tol)
          << what << " step " << st << " layer " << l;
    }
  }
  // The statistics stay on the device until asked for.
  Dev stats(sizeof(int32_t) * kLayers * StaticStep::kStatBlocks * B * dp.num_q_heads);
  ASSERT_TRUE(step.CopyStats(stats.as<int32_t>(), stream).ok());
  auto lengths = step.Commit(stream);
  ASSERT_TRUE(lengths.ok()) << what << ": " << lengths.status();
  for (int32_t i = 0; i < B; ++i) {
    EXPECT_EQ((*lengths)[i], static_cast<uint64_t>(lens[i] + kSteps)) << what;
    auto info = b->store->GetSequenceInfo("s" + std::to_string(i));
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->layer_lengths,
              std::vector<uint64_t>(kLayers, static_cast<uint64_t>(lens[i] + kSteps)));
  }
  ExpectSameRows(*a, *b, lens, kSteps, dp.num_kv_heads, row, what);
  // A position outside the window: that sequence's output is zeros, Commit says OUT_OF_RANGE.
  hp[B - 1] = lens[B - 1] + kSteps;
  hp[0] = lens[0] + kSteps + 5;
  in.UploadPositions();
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  EXPECT_EQ(step.Commit(stream).status().code(), absl::StatusCode::kOutOfRange) << what;
  std::vector<uint16_t> first(dp.num_q_heads * dp.head_dim);
  ASSERT_EQ(cudaMemcpy(first.data(), out.p, first.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  for (uint16_t x : first) ASSERT_EQ(x, 0) << what;
  // Called inside the caller's capture: no layer graphs of the plan's own.
  EXPECT_EQ(step.layer_graph_counts().recorded, 0u) << what;
  cudaStreamDestroy(stream);
  plan->reset();
  // Released: the eager path goes on from the committed rows (the other sequence took one more).
  if (B == 1) {
    DecodeCall c = Call(prob, m);
    c.seed = 5;
    auto ra = a->gpu->Decode(c), rb = b->gpu->Decode(c);
    ASSERT_TRUE(ra.ok() && rb.ok()) << ra.status() << rb.status();
    EXPECT_LT(RelL2(rb->output, ra->output, DType::kBf16), tol) << what;
  }
}

TEST_F(GpuEngineTest, CapturedStepsDenseResident) {
  kvstore::Placement p;
  p.k_tier = p.v_tier = Tier::kDevice;
  CapturedStepsEqualEagerCalls(Method{}, p, {380, 1000}, 6e-3, "dense, uneven lengths");
  CapturedStepsEqualEagerCalls(Method{}, p, {1020}, 6e-3, "dense, one sequence");
}

TEST_F(GpuEngineTest, CapturedStepsS2antaVInHost) {
  kvstore::Placement p;
  p.k_tier = Tier::kDevice;
  p.signature_bits = 32;  // kept beside, re-synced after the plan
  CapturedStepsEqualEagerCalls(SantaMethod(1, 64), p, {1000, 1000}, 0.02, "S2ANTA-prop");
  CapturedStepsEqualEagerCalls(SantaMethod(2, 64), p, {1000}, 0.02, "S2ANTA-flash");
}

TEST_F(GpuEngineTest, CapturedStepsHashTopK) {
  kvstore::Placement p;
  p.signature_bits = 64;  // K and V in host memory; each step signs its key on the device
  // A short window: the steps' own tokens leave it and are chosen by their signatures.
  CapturedStepsEqualEagerCalls(HashMethod(0.05f, 0, 4, 4), p, {700, 1000}, 8e-3, "hash top-k");
  CapturedStepsEqualEagerCalls(HashMethod(0.f, 24, 4, 2), p, {900}, 8e-3, "hash top-24");
}

// Top-k, S2ANTA-prop (2 bits; 1 bit is refused; per head and the group mixture, with and without
// a uniform floor) and vAttention's importance sampler (2 bits) over compressed keys, K and V in
// host memory: each step appends its key to the compressed keys on the device, closing a group
// where the step fills one (250 -> 260 and 1020 -> 1030 cross 256 and 1024) with the bits the eager
// path's sync gives (CompressKeyGroups: the CPU engine's bits), so the captured scores select
// the eager rows; a short window and sink, so the steps' own tokens are chosen by their compressed
// scores.
TEST_F(GpuEngineTest, CapturedStepsOverCompressedKeys) {
  for (uint32_t bits : {2u, 1u}) {
    kvstore::Placement p;
    p.compressed_key_bits = bits;
    const std::string b = ", " + std::to_string(bits) + "-bit keys";
    CapturedStepsEqualEagerCalls(TopKMethod(0.05f, 0, 4, 4), p, {250, 1020}, 8e-3, "top-k" + b);
    CapturedStepsEqualEagerCalls(TopKMethod(0.f, 24, 4, 2), p, {1020}, 8e-3, "top-24" + b);
    if (bits == 1) continue;  // S2ANTA refuses 1-bit keys (engine/methods/santa.cc)
    Method santa = SantaMethod(1, 64);
    santa.santa.scores = kernels::ScoreSource::kCompressedKeys;
    // Equal lengths: the eager rig draws every sequence of a call with one position's seed.
    CapturedStepsEqualEagerCalls(santa, p, {250, 250}, 0.02, "S2ANTA-prop" + b);
    CapturedStepsEqualEagerCalls(santa, p, {1020}, 0.02, "S2ANTA-prop, one sequence" + b);
    santa.santa.proposal = kernels::SantaProposal::kGroupMixture;
    CapturedStepsEqualEagerCalls(santa, p, {1020}, 0.02, "S2ANTA-prop, group mixture" + b);
    santa.santa.uniform_floor = 0.1f;  // the mixture's scores floored in place inside the step
    CapturedStepsEqualEagerCalls(santa, p, {1020}, 0.02, "S2ANTA-prop, group mixture, floor" + b);
    // vAttention's importance sampler: the fixed set by compressed scores, the base and final
    // samples drawn from their softmax, the budget computed on the device.
    Method vatt = VAttentionMethod();
    vatt.vattention.predictor = kernels::TopKPredictor::kCompressed;
    vatt.vattention.sampler = kernels::ResidualSampler::kImportance;
    vatt.vattention.bound = kernels::BudgetBound::kCltRatio;
    vatt.vattention.epsilon = vatt.vattention.delta = 0.1f;
    CapturedStepsEqualEagerCalls(vatt, p, {250, 250}, 0.02, "vAttention, importance sampler" + b);
    CapturedStepsEqualEagerCalls(vatt, p, {1020}, 0.02, "vAttention, one sequence" + b);
  }
}

// Key widths for the test model at 2 bits: every kv head of every layer widens channels 0, 16,
// ... and leaves out channels 8, 24, ...
std::shared_ptr<const kernels::KeyWidths> TestKeyWidths(int32_t hkv, int32_t d) {
  std::vector<kernels::ChannelWidth> w(d, kernels::ChannelWidth::kWhole);
  for (int32_t c = 0; c + 8 < d; c += 16) {
    w[c] = kernels::ChannelWidth::kWide;
    w[c + 8] = kernels::ChannelWidth::kOut;
  }
  auto widths = kernels::MakeKeyWidths(
      kLayers, hkv, d, 2, std::vector<std::vector<kernels::ChannelWidth>>(kLayers * hkv, w));
  EXPECT_TRUE(widths.ok()) << widths.status();
  if (!widths.ok()) return nullptr;
  return std::make_shared<const kernels::KeyWidths>(*std::move(widths));
}

// Key widths (EngineOptions::key_widths) on the GPU: a sequence of their model and bits keeps
// its compressed keys at those widths on the device (quantized there with the maps, scored
// through them), so top-k selects the CPU engine's rows and S2ANTA (per head, the group
// mixture) gives its output, on the GPU; the same calls without the widths select other rows
// (the maps are read); vAttention's compressed predictor with the importance sampler budgets as
// the CPU engine does and gives its output. A sequence of other bits takes uniform widths on the
// GPU.
TEST_F(GpuEngineTest, KeyWidthsOnTheGpu) {
  auto prob = Problem({1300, 600});
  const kernels::DecodeProblem& p = prob.problem;
  auto rig = Rig::Make(1ull << 30, 1.0, false, 32 << 20, nullptr, nullptr,
                       TestKeyWidths(p.num_kv_heads, p.head_dim));
  auto plain = Rig::Make();
  ASSERT_NE(rig, nullptr);
  ASSERT_NE(plain, nullptr);
  kvstore::Placement pl;
  pl.compressed_key_bits = 2;
  rig->Load(prob, pl);
  plain->Load(prob, pl);
  const Method topk = TopKMethod(0.05f);
  Compare(*rig, prob, topk, {8e-3, true, 0}, "top-k, key widths");
  auto g = rig->gpu->Decode(Call(prob, topk));
  auto u = plain->gpu->Decode(Call(prob, topk));
  ASSERT_TRUE(g.ok() && u.ok()) << g.status() << " " << u.status();
  EXPECT_GT(g->timing.launch_seconds, 0.0) << "key widths: on the GPU";
  EXPECT_GT(RelL2(g->output, u->output, p.dtype), 1e-3) << "the widths change the selection";
  Method santa = SantaMethod(1, 128);
  santa.santa.scores = kernels::ScoreSource::kCompressedKeys;
  for (auto proposal : {kernels::SantaProposal::kPerHead, kernels::SantaProposal::kGroupMixture}) {
    santa.santa.proposal = proposal;
    auto c = rig->cpu->Decode(Call(prob, santa));
    auto s = rig->gpu->Decode(Call(prob, santa));
    ASSERT_TRUE(c.ok() && s.ok()) << c.status() << " " << s.status();
    EXPECT_GT(s->timing.launch_seconds, 0.0) << "S2ANTA over key widths: on the GPU";
    EXPECT_LT(RelL2(s->output, c->output, p.dtype), 0.05) << "S2ANTA, the CPU engine's output";
  }
  Method vatt = VAttentionMethod();
  vatt.vattention.predictor = kernels::TopKPredictor::kCompressed;
  vatt.vattention.sampler = kernels::ResidualSampler::kImportance;
  vatt.vattention.bound = kernels::BudgetBound::kCltRatio;
  auto vc = rig->cpu->Decode(Call(prob, vatt));
  auto v = rig->gpu->Decode(Call(prob, vatt));
  ASSERT_TRUE(vc.ok() && v.ok()) << vc.status() << " " << v.status();
  EXPECT_GT(v->timing.launch_seconds, 0.0) << "vAttention over key widths: on the GPU";
  ASSERT_EQ(v->heads.size(), vc->heads.size());
  size_t agree = 0;  // heads whose budgets are the CPU engine's (the same scores through the maps)
  for (size_t i = 0; i < vc->heads.size(); ++i)
    agree += v->heads[i].budgets == vc->heads[i].budgets;
  EXPECT_GE(agree, vc->heads.size() * 9 / 10) << "vAttention over key widths: budgets";
  EXPECT_LT(RelL2(v->output, vc->output, p.dtype), 0.05) << "vAttention, the CPU engine's output";
  pl.compressed_key_bits = 4;
  rig->Load(prob, pl, "b4");
  auto f = rig->gpu->Decode(Call(prob, topk, "b4"));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_GT(f->timing.launch_seconds, 0.0) << "other bits: on the GPU";
}

// Captured steps over key widths: each step's key joins the compressed keys on the device, a
// group that closes quantized with the maps (1020 -> 1030 crosses 1024), as the eager sync's.
TEST_F(GpuEngineTest, CapturedStepsOverKeyWidths) {
  auto prob = Problem({1020});
  auto widths = TestKeyWidths(prob.problem.num_kv_heads, prob.problem.head_dim);
  kvstore::Placement p;
  p.compressed_key_bits = 2;
  CapturedStepsEqualEagerCalls(TopKMethod(0.f, 24, 4, 2), p, {1020}, 8e-3, "top-24, key widths",
                               widths);
  Method santa = SantaMethod(1, 64);
  santa.santa.scores = kernels::ScoreSource::kCompressedKeys;
  santa.santa.proposal = kernels::SantaProposal::kGroupMixture;
  CapturedStepsEqualEagerCalls(santa, p, {1020}, 0.02, "S2ANTA-prop, group mixture, key widths",
                               widths);
}

// Layer graphs (StaticStepRequest::layer_graphs): the flagship's plan called layer by layer
// outside any capture, the same buffers each step, records each layer's kernels at its second
// call and replays them from then on; its outputs and committed rows are those of the same plan
// with the graphs off (two rigs, the same sequences and seed). Another out buffer is launched
// once, then recorded too.
TEST_F(GpuEngineTest, LayerGraphsReplayTheLaunchedKernels) {
  auto a = Rig::Make(), b = Rig::Make();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  kvstore::Placement p;
  p.compressed_key_bits = 2;
  const std::vector<int32_t> lens = {250, 1020};
  auto prob = Problem(lens);
  a->Load(prob, p);
  b->Load(prob, p);
  const kernels::DecodeProblem& dp = prob.problem;
  const int32_t B = dp.batch;
  const size_t row = static_cast<size_t>(dp.head_dim) * 2;
  const size_t q_bytes = static_cast<size_t>(B) * dp.num_q_heads * row;
  StaticStepRequest req;
  req.sequence_ids = {"s0", "s1"};
  req.method = SantaMethod(1, 64);
  req.method.santa.scores = kernels::ScoreSource::kCompressedKeys;
  req.max_tokens = 2048;
  req.seed = 77;
  req.layer_graphs = false;
  auto plan_a = a->gpu->PlanStatic(req);
  req.layer_graphs = true;
  auto plan_b = b->gpu->PlanStatic(req);
  ASSERT_TRUE(plan_a.ok() && plan_b.ok()) << plan_a.status() << plan_b.status();
  StaticStep &eager = **plan_a, &graphs = **plan_b;
  StepInputs in(prob, lens);
  Dev out_a(kLayers * q_bytes), out_b(2 * kLayers * q_bytes);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  constexpr int kSteps = 8, kMoved = 5;  // steps kMoved.. write the second half of out_b
  for (int st = 0; st < kSteps; ++st) {
    in.Upload(st);
    char* ob = out_b.as<char>() + (st >= kMoved ? kLayers * q_bytes : 0);
    for (uint32_t l = 0; l < kLayers; ++l) {
      ASSERT_TRUE(eager
                      .Enqueue(l, in.q.p, in.nk.p, in.nv.p, in.pos.as<int64_t>(),
                               out_a.as<char>() + l * q_bytes, stream)
                      .ok());
      ASSERT_TRUE(
          graphs
              .Enqueue(l, in.q.p, in.nk.p, in.nv.p, in.pos.as<int64_t>(), ob + l * q_bytes, stream)
              .ok());
    }
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::string ga(kLayers * q_bytes, '\0'), gb(kLayers * q_bytes, '\0');
    ASSERT_EQ(cudaMemcpy(ga.data(), out_a.p, ga.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(gb.data(), ob, gb.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    for (uint32_t l = 0; l < kLayers; ++l) {
      EXPECT_LT(
          RelL2(gb.substr(l * q_bytes, q_bytes), ga.substr(l * q_bytes, q_bytes), DType::kBf16),
          1e-5)
          << "step " << st << " layer " << l;
    }
    // Recorded at the second call with the same buffers: steps 1 and kMoved + 1.
    const uint64_t recorded = kLayers * ((st >= 1) + (st >= kMoved + 1));
    const uint64_t replayed = kLayers * (st - (st >= kMoved ? 1 : 0));
    EXPECT_EQ(graphs.layer_graph_counts().recorded, recorded) << "step " << st;
    EXPECT_EQ(graphs.layer_graph_counts().replayed, replayed) << "step " << st;
  }
  EXPECT_EQ(eager.layer_graph_counts().recorded, 0u);
  auto la = eager.Commit(stream), lb = graphs.Commit(stream);
  ASSERT_TRUE(la.ok() && lb.ok()) << la.status() << lb.status();
  EXPECT_EQ(*la, *lb);
  ExpectSameRows(*a, *b, lens, kSteps, dp.num_kv_heads, row, "layer graphs");
  cudaStreamDestroy(stream);
}

// The layers of a captured plan share one region for their scores (B x H x max_tokens floats
// each): doubling max_tokens grows the plan's device memory by about one layer's scores, not by
// one per layer.
TEST_F(GpuEngineTest, CapturedLayersShareTheirScores) {
  auto rig = Rig::Make();
  ASSERT_NE(rig, nullptr);
  kvstore::Placement p;
  p.compressed_key_bits = 2;
  auto prob = Problem({250, 250});
  rig->Load(prob, p);
  StaticStepRequest req;
  req.sequence_ids = {"s0", "s1"};
  req.method = SantaMethod(1, 64);
  req.method.santa.scores = kernels::ScoreSource::kCompressedKeys;
  uint64_t bytes[2];
  for (int i = 0; i < 2; ++i) {
    req.max_tokens = 2048u << i;
    auto plan = rig->gpu->PlanStatic(req);
    ASSERT_TRUE(plan.ok()) << plan.status();
    bytes[i] = (*plan)->device_bytes();
  }
  const uint64_t layer_scores = 2ull * prob.problem.num_q_heads * 2048 * sizeof(float);
  static_assert(kLayers >= 2);
  EXPECT_GE(bytes[1] - bytes[0], layer_scores);
  EXPECT_LT(bytes[1] - bytes[0], layer_scores * 3 / 2) << bytes[0] << " -> " << bytes[1];
}

// Captured steps need the store's pages mapped, so both proposals read their rows in place and
// their plans hold no rows: per-head sampling each head's own, the group mixture (a kv head's G
// query heads over the same rows) each row once for the group (SelectedRowsParams::shared_rows).
// The group mixture's plan is the per-head one's plus its mixture's scores: less than one head's
// S + 1 rows a layer more (until 2026-12-02 it held the union of one head's rows, fetched).
TEST_F(GpuEngineTest, CapturedGroupMixturePlansNoRows) {
  auto rig = Rig::Make();
  ASSERT_NE(rig, nullptr);
  kvstore::Placement p;
  p.compressed_key_bits = 2;
  auto prob = Problem({1500, 1500});
  const kernels::DecodeProblem& dp = prob.problem;
  const int64_t G = dp.num_q_heads / dp.num_kv_heads;
  ASSERT_GT(G, 1);
  rig->Load(prob, p);
  StaticStepRequest req;
  req.sequence_ids = {"s0", "s1"};
  req.max_tokens = 2048;
  req.method = SantaMethod(1, 64);
  req.method.santa.scores = kernels::ScoreSource::kCompressedKeys;
  uint64_t bytes[2];
  for (int i = 0; i < 2; ++i) {
    req.method.santa.proposal =
        i == 0 ? kernels::SantaProposal::kPerHead : kernels::SantaProposal::kGroupMixture;
    auto plan = rig->gpu->PlanStatic(req);
    ASSERT_TRUE(plan.ok()) << plan.status();
    bytes[i] = (*plan)->device_bytes();
  }
  const std::string what =
      "per head " + std::to_string(bytes[0]) + ", group mixture " + std::to_string(bytes[1]);
  // K and V rows of one head's S + 1 per (sequence, kv head) and layer.
  const uint64_t head_rows =
      uint64_t{kLayers} * 2 * dp.num_kv_heads * 65 * 2 * dp.head_dim * kernels::DTypeSize(dp.dtype);
  EXPECT_LT(bytes[1], bytes[0] + head_rows) << what;
}

// Two slots' step inputs in device buffers that stay the same (a recorded graph reads them):
// q [2, H, d], the step's K / V [2, Hkv, d] (functions of the step), positions [2].
struct SlotInputs {
  SlotInputs(int32_t h, int32_t hkv, int32_t d)
      : q_elems(2 * h * d),
        kv_elems(2 * hkv * d),
        q(q_elems * 2),
        nk(kv_elems * 2),
        nv(kv_elems * 2),
        pos(2 * sizeof(int64_t)) {}
  void Upload(int st, int64_t p0, int64_t p1) {
    std::vector<uint8_t> hq(q_elems * 2), hk(kv_elems * 2), hv(kv_elems * 2);
    for (size_t i = 0; i < q_elems; ++i) {
      kernels::StoreFromFloat(hq.data(), i, DType::kBf16, std::sin(0.013f * i + 0.5f * st));
    }
    for (size_t i = 0; i < kv_elems; ++i) {
      kernels::StoreFromFloat(hk.data(), i, DType::kBf16, std::sin(0.37f * i + st));
      kernels::StoreFromFloat(hv.data(), i, DType::kBf16, std::cos(0.11f * i - st));
    }
    const int64_t hp[2] = {p0, p1};
    ASSERT_EQ(cudaMemcpy(q.p, hq.data(), hq.size(), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(nk.p, hk.data(), hk.size(), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(nv.p, hv.data(), hv.size(), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(pos.p, hp, sizeof(hp), cudaMemcpyHostToDevice), cudaSuccess);
  }
  const size_t q_elems, kv_elems;
  Dev q, nk, nv, pos;
};

// Rebinds refused before the plan moves, which keeps its own sequences (s2 and s3 here): a
// sequence another plan holds, one that does not exist, one of another placement.
void ExpectRefusedRebindsKeepThePlan(Rig& rig, StaticStep& plan, StaticStepRequest req,
                                     const kvstore::Placement& p,
                                     const kernels::SyntheticProblem& prob, cudaStream_t stream,
                                     const std::string& what) {
  // Refused before the plan moves (it keeps its own): a sequence another plan holds, one that
  // does not exist.
  req.sequence_ids = {"s0"};
  req.bounds = {};
  auto other = rig.gpu->PlanStatic(req);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(plan.Rebind({"s0", "s1"}, {}, stream).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(rig.gpu->Held("s2") && rig.gpu->Held("s3")) << what;
  other->reset();
  EXPECT_EQ(plan.Rebind({"s1", "nope"}, {}, stream).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(rig.gpu->Held("s2") && rig.gpu->Held("s3") && !rig.gpu->Held("s1")) << what;
  // A sequence of another placement takes another plan.
  kvstore::Placement other_placement = p;
  other_placement.signature_bits = p.signature_bits == 64 ? 32 : 64;
  rig.Load(prob, other_placement, "x");
  EXPECT_EQ(plan.Rebind({"s1", "x0"}, {}, stream).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(rig.gpu->Held("s2") && rig.gpu->Held("s3") && !rig.gpu->Held("x0")) << what;
}

// Rebind (engine/static_step.h): one graph, recorded once over a placeholder sequence in an idle
// slot (bound at its length) and a real one, replays over the batches the plan is moved to,
// whichever slot a sequence takes; each batch's outputs and committed rows equal those of a
// plan made for that batch on a twin rig. An idle slot's output is zeros and writes nothing;
// refused rebinds leave the plan as it was.
void RebindReplaysTheRecordedGraph(const Method& m, const kvstore::Placement& p,
                                   const std::string& what) {
  auto a = Rig::Make(), b = Rig::Make();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  // s0..s2 real, s3 a one-token placeholder.
  const std::vector<int32_t> lens = {250, 1020, 600, 1};
  auto prob = Problem(lens);
  a->Load(prob, p);
  b->Load(prob, p);
  const kernels::DecodeProblem& dp = prob.problem;
  const size_t q_bytes = 2 * static_cast<size_t>(dp.num_q_heads) * dp.head_dim * 2;
  StaticStepRequest req;
  req.method = m;
  req.max_tokens = 2048;
  req.seed = 77;
  req.sequence_ids = {"s3", "s0"};
  req.bounds = {1, 0};
  auto moved = b->gpu->PlanStatic(req);
  ASSERT_TRUE(moved.ok()) << what << ": " << moved.status();
  StaticStep& plan = **moved;
  SlotInputs in(dp.num_q_heads, dp.num_kv_heads, dp.head_dim);
  Dev out(kLayers * q_bytes), ref_out(kLayers * q_bytes);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  RecordedStep rec;
  RecordStep(plan, in.q, in.nk, in.nv, in.pos, out, q_bytes, stream, &rec, what);
  cudaGraphExec_t exec = rec.exec;

  int st = 0;  // steps taken, each with its own inputs
  // Per batch: the graph's steps against a plan made for the batch on rig a, launched layer by
  // layer with the same inputs. -1: the slot idle.
  auto run = [&](const std::vector<std::string>& ids, const std::vector<uint64_t>& bounds,
                 std::vector<int64_t> start, int steps) {
    StaticStepRequest r = req;
    r.sequence_ids = ids;
    r.bounds = bounds;
    auto ref = a->gpu->PlanStatic(r);
    ASSERT_TRUE(ref.ok()) << what << ": " << ref.status();
    for (int k = 0; k < steps; ++k, ++st) {
      in.Upload(st, start[0] < 0 ? -1 : start[0] + k, start[1] < 0 ? -1 : start[1] + k);
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      for (uint32_t l = 0; l < kLayers; ++l) {
        ASSERT_TRUE((*ref)
                        ->Enqueue(l, in.q.p, in.nk.p, in.nv.p, in.pos.as<int64_t>(),
                                  ref_out.as<char>() + l * q_bytes, stream)
                        .ok());
      }
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      std::string got(kLayers * q_bytes, '\0'), want(kLayers * q_bytes, '\0');
      ASSERT_EQ(cudaMemcpy(got.data(), out.p, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(want.data(), ref_out.p, want.size(), cudaMemcpyDeviceToHost),
                cudaSuccess);
      for (uint32_t l = 0; l < kLayers; ++l) {
        EXPECT_LT(RelL2(got.substr(l * q_bytes, q_bytes), want.substr(l * q_bytes, q_bytes),
                        DType::kBf16),
                  1e-5)
            << what << " " << ids[0] << "," << ids[1] << " step " << k << " layer " << l;
        for (int slot = 0; slot < 2; ++slot) {
          if (start[slot] >= 0) continue;
          const std::string half = got.substr(l * q_bytes + slot * q_bytes / 2, q_bytes / 2);
          EXPECT_EQ(half, std::string(q_bytes / 2, '\0')) << what << " idle slot " << slot;
        }
      }
    }
    auto la = (*ref)->Commit(stream), lb = plan.Commit(stream);
    ASSERT_TRUE(la.ok() && lb.ok()) << what << ": " << la.status() << lb.status();
    EXPECT_EQ(*la, *lb) << what;
    for (int slot = 0; slot < 2; ++slot) {
      const uint64_t want = start[slot] < 0 ? (bounds.empty() || bounds[slot] == 0 ? 0 : 1)
                                            : static_cast<uint64_t>(start[slot] + steps);
      if (want != 0) {
        EXPECT_EQ((*lb)[slot], want) << what << " slot " << slot;
      }
    }
  };
  run({"s3", "s0"}, {1, 0}, {-1, 250}, 3);
  // s0 moves to another slot, s1 and s2 take the others in turn; the placeholder comes back.
  ASSERT_TRUE(plan.Rebind({"s1", "s2"}, {}, stream).ok()) << what;
  run({"s1", "s2"}, {}, {1020, 600}, 3);
  ASSERT_TRUE(plan.Rebind({"s0", "s1"}, {}, stream).ok()) << what;
  run({"s0", "s1"}, {}, {253, 1023}, 2);
  ASSERT_TRUE(plan.Rebind({"s2", "s3"}, {0, 1}, stream).ok()) << what;
  run({"s2", "s3"}, {0, 1}, {603, -1}, 2);
  // The committed rows of every sequence are the reference's, byte for byte.
  for (int i = 0; i < 3; ++i) {
    auto info = b->store->GetSequenceInfo("s" + std::to_string(i));
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->layer_lengths, std::vector<uint64_t>(kLayers, lens[i] + 5)) << what << i;
  }
  ExpectSameRows(*a, *b, {lens[0], lens[1], lens[2]}, 5, dp.num_kv_heads,
                 static_cast<size_t>(dp.head_dim) * 2, what);
  auto info = b->store->GetSequenceInfo("s3");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layer_lengths[0], 1u) << what << ": the idle placeholder took no row";
  ExpectRefusedRebindsKeepThePlan(*b, plan, req, p, prob, stream, what);
  cudaStreamDestroy(stream);
}

// A rebind that fails while moving (the GPU tier too small for the new sequences' rows: dense
// with K and V resident, each bound at 2048 rows, over 4 MiB, in a 7 MiB tier): the plan holds no
// sequence, a replay of its graph writes nothing and gives zeros, Commit says why, and the next
// rebind serves again.
TEST_F(GpuEngineTest, ARebindThatFailsMovingLeavesAPlanThatWritesNothing) {
  auto rig = Rig::Make(/*gpu_capacity=*/7 << 20);
  ASSERT_NE(rig, nullptr);
  kvstore::Placement p;
  p.k_tier = p.v_tier = Tier::kDevice;
  auto prob = Problem({250, 1020, 600, 1});
  rig->Load(prob, p);
  const kernels::DecodeProblem& dp = prob.problem;
  const size_t q_bytes = 2 * static_cast<size_t>(dp.num_q_heads) * dp.head_dim * 2;
  StaticStepRequest req;
  req.max_tokens = 2048;
  req.sequence_ids = {"s3", "s0"};
  req.bounds = {1, 0};
  auto made = rig->gpu->PlanStatic(req);
  ASSERT_TRUE(made.ok()) << made.status();
  StaticStep& plan = **made;
  SlotInputs in(dp.num_q_heads, dp.num_kv_heads, dp.head_dim);
  Dev out(kLayers * q_bytes);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  RecordedStep rec;
  RecordStep(plan, in.q, in.nk, in.nv, in.pos, out, q_bytes, stream, &rec, "a failed rebind");
  cudaGraphExec_t exec = rec.exec;
  const absl::Status moved = plan.Rebind({"s1", "s2"}, {}, stream);
  EXPECT_EQ(moved.code(), absl::StatusCode::kResourceExhausted) << moved;
  EXPECT_FALSE(rig->gpu->Held("s0") || rig->gpu->Held("s1") || rig->gpu->Held("s2"));
  in.Upload(0, 1020, 600);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::string got(kLayers * q_bytes, '\0');
  ASSERT_EQ(cudaMemcpy(got.data(), out.p, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got, std::string(got.size(), '\0')) << "a plan holding nothing";
  EXPECT_EQ(plan.Commit(stream).status().code(), absl::StatusCode::kFailedPrecondition);
  for (const char* id : {"s1", "s2"}) {
    EXPECT_EQ(rig->store->GetSequenceInfo(id)->layer_lengths[0], id[1] == '1' ? 1020u : 600u);
  }
  // Serves again: s0 takes a step from its length.
  ASSERT_TRUE(plan.Rebind({"s3", "s0"}, {1, 0}, stream).ok());
  in.Upload(1, -1, 250);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  auto lengths = plan.Commit(stream);
  ASSERT_TRUE(lengths.ok()) << lengths.status();
  EXPECT_EQ((*lengths)[1], 251u);
  cudaStreamDestroy(stream);
}

TEST_F(GpuEngineTest, RebindReplaysTheRecordedGraph) {
  kvstore::Placement ck;
  ck.compressed_key_bits = 2;
  Method santa = SantaMethod(1, 64);
  santa.santa.scores = kernels::ScoreSource::kCompressedKeys;
  RebindReplaysTheRecordedGraph(santa, ck, "S2ANTA-prop over 2-bit keys");
  RebindReplaysTheRecordedGraph(TopKMethod(0.05f, 0, 4, 4), ck, "top-k over 2-bit keys");
  kvstore::Placement sig;
  sig.signature_bits = 64;
  RebindReplaysTheRecordedGraph(HashMethod(0.05f, 0, 4, 4), sig, "hash top-k");
  kvstore::Placement resident;
  resident.k_tier = resident.v_tier = Tier::kDevice;
  RebindReplaysTheRecordedGraph(Method{}, resident, "dense, K and V resident");
}

TEST_F(GpuEngineTest, CapturedStepsRefuseWhatTheyCannotCapture) {
  auto rig = Rig::Make();
  ASSERT_NE(rig, nullptr);
  kvstore::Placement p;
  p.signature_bits = 32;
  auto prob = Problem({500});
  rig->Load(prob, p);
  StaticStepRequest req;
  req.sequence_ids = {"s0"};
  req.max_tokens = 1024;
  // vAttention with the hash predictor: its steps would need the appended key signed on the
  // device (the compressed predictor's are captured: CapturedStepsOverCompressedKeys).
  req.method = VAttentionMethod();
  EXPECT_EQ(rig->gpu->PlanStatic(req).status().code(), absl::StatusCode::kFailedPrecondition);
  req.method = Method{};  // dense with K and V in host memory stages every row
  EXPECT_EQ(rig->gpu->PlanStatic(req).status().code(), absl::StatusCode::kFailedPrecondition);
  req.method = SantaMethod(0, 64);  // iid counts its rows on the host
  EXPECT_EQ(rig->gpu->PlanStatic(req).status().code(), absl::StatusCode::kFailedPrecondition);
  req.method = SantaMethod(1, 64);  // K not on the device: the GPU path needs it there
  const absl::Status no_k = rig->gpu->PlanStatic(req).status();
  EXPECT_EQ(no_k.code(), absl::StatusCode::kFailedPrecondition);
  // The refusal names the runner's reason, and an eager call run on the CPU carries it.
  EXPECT_TRUE(absl::StrContains(no_k.message(), "needs K on the device")) << no_k;
  auto on_cpu = rig->gpu->Decode(Call(prob, SantaMethod(1, 64)));
  ASSERT_TRUE(on_cpu.ok()) << on_cpu.status();
  EXPECT_TRUE(absl::StrContains(on_cpu->not_on_backend, "needs K on the device"))
      << on_cpu->not_on_backend;
  // Every reason at once (kernels::Reasons): K not on the device, and tiles the kernels do not
  // take.
  Method odd_tiles = SantaMethod(1, 64);
  odd_tiles.santa.tile_size = 48;
  auto both = rig->gpu->Decode(Call(prob, odd_tiles));
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_TRUE(absl::StrContains(both->not_on_backend, "needs K on the device") &&
              absl::StrContains(both->not_on_backend, "takes tiles of"))
      << both->not_on_backend;
  req.max_tokens = 100;  // already longer
  EXPECT_EQ(rig->gpu->PlanStatic(req).status().code(), absl::StatusCode::kOutOfRange);
  req.sequence_ids = {"nope"};
  EXPECT_EQ(rig->gpu->PlanStatic(req).status().code(), absl::StatusCode::kNotFound);
  // Nothing stays held after a refused plan.
  EXPECT_FALSE(rig->gpu->Held("s0"));
  EXPECT_TRUE(rig->gpu->Decode(Call(prob, Method{})).ok());
  // The CPU engine has no captured steps.
  req.sequence_ids = {"s0"};
  req.max_tokens = 1024;
  EXPECT_EQ(rig->cpu->PlanStatic(req).status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace kvsparse::engine
