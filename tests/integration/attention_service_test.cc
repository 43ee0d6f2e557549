// The decode worker end to end: the real kvsparse server (embedded store + worker, and the split
// store / worker deployment), the real clients, synthetic attention problems with known answers.
#include <grpcpp/grpcpp.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "absl/functional/function_ref.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/attention_client.h"
#include "client/kvstore_client.h"
#include "gtest/gtest.h"
#include "kernels/cpu_util.h"
#include "kernels/dense.h"
#include "kernels/philox.h"
#include "kernels/santa.h"
#include "kernels/synthetic.h"
#include "kvsparse/v1/kvstore.grpc.pb.h"
#include "kvstore/shared_arena.h"
#include "kvstore/ucx_plane.h"
#include "rpc/method_text.h"
#include "rpc/remote_row_source.h"
#include "server/server.h"
#include "tests/integration/http_get.h"

namespace kvsparse {
namespace {

using absl::StatusCode;
using kernels::DType;

constexpr uint32_t kLayers = 2;
constexpr uint32_t kLayer = 1;

// metrics: serve /metrics (prometheus-cpp's HTTP server takes ~2 s to stop, so only where read).
// tweak: changes to the options before the server starts.
std::unique_ptr<server::Server> StartServer(
    server::ServerRole role, int store_port = 0, bool metrics = false,
    absl::FunctionRef<void(server::ServerOptions&)> tweak = [](server::ServerOptions&) {}) {
  server::ServerOptions o;
  o.role = role;
  o.listen = "127.0.0.1:0";
  o.metrics_listen = metrics ? "127.0.0.1:0" : "";
  o.store_target = absl::StrCat("127.0.0.1:", store_port);
  o.store.capacity_bytes = 256 << 20;
  tweak(o);
  auto s = server::Server::Start(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? std::move(*s) : nullptr;
}

client::ClientOptions At(int port) {
  client::ClientOptions o;
  o.target = absl::StrCat("127.0.0.1:", port);
  o.timeout = absl::Seconds(20);
  return o;
}

// The value of the first line of a Prometheus text exposition that starts with `prefix` (a
// metric's name and the start of its labels); -1 when there is none.
double MetricValue(const std::string& text, const std::string& prefix) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::StartsWith(line, prefix)) continue;
    double v = 0;
    return absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &v) ? v : -1;
  }
  return -1;
}

v1::DType ProtoDType(DType d) {
  return d == DType::kBf16 ? v1::DTYPE_BF16 : d == DType::kFp16 ? v1::DTYPE_FP16 : v1::DTYPE_FP32;
}

// Loads a synthetic problem's sequences ("s0", "s1", ...) into a store through the KvStore API;
// store(id): the client of the store (shard) that holds sequence id.
void Load(absl::FunctionRef<client::KvStoreClient&(const std::string&)> store,
          const kernels::SyntheticProblem& prob, const v1::Placement& placement) {
  const kernels::DecodeProblem& p = prob.problem;
  for (int32_t b = 0; b < p.batch; ++b) {
    const std::string id = absl::StrCat("s", b);
    client::KvStoreClient& kv = store(id);
    v1::ModelShape shape;
    shape.set_num_layers(kLayers);
    shape.set_num_q_heads(p.num_q_heads);
    shape.set_num_kv_heads(p.num_kv_heads);
    shape.set_head_dim(p.head_dim);
    shape.set_dtype(ProtoDType(p.dtype));
    const auto created = kv.CreateSequence(id, shape, placement);
    ASSERT_TRUE(created.ok()) << id << ": " << created.status();
    const size_t n = prob.seq_lens[b];
    v1::AppendRequest r;
    r.set_sequence_id(id);
    r.set_num_layers(kLayers);
    for (auto [t, src] : {std::pair{r.mutable_k(), &prob.k}, {r.mutable_v(), &prob.v}}) {
      t->set_dtype(ProtoDType(p.dtype));
      for (int64_t d : {int64_t{kLayers}, static_cast<int64_t>(n), int64_t{p.num_kv_heads},
                        int64_t{p.head_dim}}) {
        t->add_shape(d);
      }
      const std::vector<uint8_t> rows = prob.LayerRows(*src, b, kLayers);
      t->set_data(rows.data(), rows.size());
    }
    auto a = kv.Append(r);
    ASSERT_TRUE(a.ok()) << a.status();
  }
}

void Load(client::KvStoreClient& kv, const kernels::SyntheticProblem& prob,
          const v1::Placement& placement) {
  Load([&](const std::string&) -> client::KvStoreClient& { return kv; }, prob, placement);
}

kernels::SyntheticProblem Problem(int32_t batch = 2, std::vector<int32_t> lens = {1200, 2000}) {
  kernels::SyntheticOptions o;
  o.family = kernels::ScoreFamily::kPeaked;
  o.batch = batch;
  o.num_q_heads = 8;
  o.num_kv_heads = 2;
  o.head_dim = 64;
  o.seq_lens = std::move(lens);
  o.seed = 11;
  return kernels::SyntheticProblem::Make(o);
}

v1::DecodeRequest Request(const kernels::SyntheticProblem& prob, const v1::Method& method,
                          uint64_t seed = 5) {
  const kernels::DecodeProblem& p = prob.problem;
  v1::DecodeRequest r;
  r.set_layer(kLayer);
  for (int32_t b = 0; b < p.batch; ++b) r.add_sequence_ids(absl::StrCat("s", b));
  r.mutable_q()->set_dtype(ProtoDType(p.dtype));
  for (int64_t d : {int64_t{p.batch}, int64_t{p.num_q_heads}, int64_t{p.head_dim}}) {
    r.mutable_q()->add_shape(d);
  }
  r.mutable_q()->set_data(prob.q.data(), prob.q.size());
  *r.mutable_method() = method;
  r.set_seed(seed);
  r.set_return_indices(true);
  return r;
}

double RelL2(const std::string& got, const std::vector<double>& ref, size_t offset, size_t n,
             DType t) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double g = kernels::LoadAsFloat(got.data(), offset + i, t);
    num += (g - ref[offset + i]) * (g - ref[offset + i]);
    den += ref[offset + i] * ref[offset + i];
  }
  return std::sqrt(num / den);
}

struct MethodCase {
  const char* name;
  v1::Method method;
  v1::Placement placement;
  double tolerance;  // relative L2 against dense (statistical; bf16 output)
};

std::vector<MethodCase> Cases() {
  std::vector<MethodCase> cases;
  {
    MethodCase c{"dense", {}, {}, 8e-3};
    c.method.mutable_dense();
    cases.push_back(c);
  }
  {
    MethodCase c{"santa_prop", {}, {}, 0.15};
    auto* s = c.method.mutable_santa();
    s->set_allocation(v1::SANTA_ALLOCATION_PROP);
    s->set_samples(512);
    s->set_tile_size(128);
    c.placement.set_k_tier(v1::TIER_DEVICE);
    cases.push_back(c);
  }
  {
    MethodCase c{"santa_flash", {}, {}, 0.15};
    auto* s = c.method.mutable_santa();
    s->set_allocation(v1::SANTA_ALLOCATION_FLASH);
    s->set_samples(1024);
    s->set_tile_size(128);
    c.placement.set_k_tier(v1::TIER_DEVICE);
    cases.push_back(c);
  }
  {
    MethodCase c{"hash_top_k", {}, {}, 0.25};
    auto* h = c.method.mutable_hash_top_k();
    h->set_sink_tokens(32);
    h->set_local_tokens(64);
    h->set_top_k_fraction(0.2f);
    c.placement.set_signature_bits(64);
    cases.push_back(c);
  }
  {
    MethodCase c{"vattention", {}, {}, 0.15};
    auto* v = c.method.mutable_vattention();
    v->set_epsilon(0.05f);
    v->set_delta(0.05f);
    v->set_sink_tokens(32);
    v->set_local_tokens(64);
    v->set_top_k_fraction(0.05f);
    v->set_base_rate(0.05f);
    v->set_predictor(v1::TOP_K_PREDICTOR_EXACT);
    c.placement.set_k_tier(v1::TIER_DEVICE);
    cases.push_back(c);
  }
  {
    MethodCase c{"top_k_compressed_keys", {}, {}, 0.25};
    auto* t = c.method.mutable_top_k();
    t->set_sink_tokens(32);
    t->set_local_tokens(64);
    t->set_top_k_fraction(0.2f);
    t->set_scores(v1::SCORE_SOURCE_COMPRESSED_KEYS);
    c.placement.set_compressed_key_bits(2);
    cases.push_back(c);
  }
  {
    MethodCase c{"top_k_exact", {}, {}, 0.25};
    auto* t = c.method.mutable_top_k();
    t->set_sink_tokens(32);
    t->set_local_tokens(64);
    t->set_top_k_fraction(0.2f);
    t->set_scores(v1::SCORE_SOURCE_EXACT);
    c.placement.set_k_tier(v1::TIER_DEVICE);
    cases.push_back(c);
  }
  return cases;
}

// Every method through the embedded server: output within its tolerance of dense attention,
// the rows it reports are the rows the store served (the store's own counters), and repeated
// calls with one seed give the same rows.
TEST(AttentionServiceTest, EveryMethodEndToEnd) {
  const kernels::SyntheticProblem prob = Problem();
  std::vector<double> dense;
  ASSERT_TRUE(kernels::DenseDecodeFloat64(prob.problem, &dense).ok());
  const size_t hd = static_cast<size_t>(prob.problem.num_q_heads) * prob.problem.head_dim;
  for (const MethodCase& c : Cases()) {
    SCOPED_TRACE(c.name);
    auto server = StartServer(server::ServerRole::kAll);
    ASSERT_NE(server, nullptr);
    auto kv = client::KvStoreClient::Connect(At(server->port()));
    ASSERT_TRUE(kv.ok());
    Load(**kv, prob, c.placement);
    auto attn = client::AttentionClient::Connect(At(server->port()));
    ASSERT_TRUE(attn.ok());
    const uint64_t gathered_before = server->store()->Stats().rows_gathered[0];
    auto r = (*attn)->Decode(Request(prob, c.method));
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->output().data().size(), 2 * hd * 2);
    for (int b = 0; b < 2; ++b) {
      EXPECT_LT(RelL2(r->output().data(), dense, b * hd, hd, DType::kBf16), c.tolerance)
          << "sequence " << b;
    }
    // What the worker says it read from the host tier is what the store served.
    const size_t row = prob.problem.head_dim * 2;
    uint64_t host_rows = 0;
    for (const v1::HeadStats& h : r->heads()) {
      EXPECT_EQ(h.bytes_host() % row, 0u);
      host_rows += h.bytes_host() / row;
      EXPECT_EQ(h.fetched_tokens_size() > 0, true);
      EXPECT_LE(h.rows_fetched(), h.dense_equivalent_bytes() / (2 * row) * 2);
    }
    const uint64_t served = server->store()->Stats().rows_gathered[0] - gathered_before;
    // The store also served the resident state's first sync (K rows of every token, and
    // signatures are computed from K): that is the placement's one-off cost, not the step's.
    uint64_t sync_rows = 0;
    if (c.placement.k_tier() == v1::TIER_DEVICE || c.placement.signature_bits() > 0 ||
        c.placement.compressed_key_bits() > 0) {
      sync_rows = (1200 + 2000) * 2;  // K rows of every token of both kv heads
    }
    EXPECT_EQ(served, host_rows + sync_rows);
    // Same seed, same rows and output.
    auto again = (*attn)->Decode(Request(prob, c.method));
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->output().data(), r->output().data());
    for (int i = 0; i < r->heads_size(); ++i) {
      EXPECT_EQ(again->heads(i).fetched_tokens_size(), r->heads(i).fetched_tokens_size());
    }
  }
}

// The placement the proto says a method reads (rpc::PlacementFor, what kvsparse.placement_for
// derives in Python) is one the engine serves it over, and where it names something (signatures,
// compressed keys) a sequence without it is refused: the proto's statement and the engine's
// CheckFits agree.
TEST(AttentionServiceTest, PlacementForServesEveryMethod) {
  const kernels::SyntheticProblem prob = Problem();
  for (const MethodCase& c : Cases()) {
    SCOPED_TRACE(c.name);
    const v1::Placement placement = rpc::PlacementFor(c.method);
    for (const bool with : {true, false}) {
      auto server = StartServer(server::ServerRole::kAll);
      ASSERT_NE(server, nullptr);
      auto kv = client::KvStoreClient::Connect(At(server->port()));
      ASSERT_TRUE(kv.ok());
      Load(**kv, prob, with ? placement : v1::Placement{});
      auto attn = client::AttentionClient::Connect(At(server->port()));
      ASSERT_TRUE(attn.ok());
      auto r = (*attn)->Decode(Request(prob, c.method));
      if (with) {
        EXPECT_TRUE(r.ok()) << r.status();
      } else if (placement.signature_bits() > 0 || placement.compressed_key_bits() > 0) {
        EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
      }
    }
  }
}

// Split deployment (store in one server, worker in another, rows through the Gather RPC) gives
// bit-identical results to the embedded one, and reports its bytes on the remote tier.
TEST(AttentionServiceTest, SplitModeEqualsEmbeddedMode) {
  const kernels::SyntheticProblem prob = Problem();
  auto embedded = StartServer(server::ServerRole::kAll);
  auto store = StartServer(server::ServerRole::kStore);
  ASSERT_NE(embedded, nullptr);
  ASSERT_NE(store, nullptr);
  auto worker = StartServer(server::ServerRole::kWorker, store->port());
  ASSERT_NE(worker, nullptr);
  EXPECT_EQ(store->engine(), nullptr);
  EXPECT_EQ(worker->store(), nullptr);
  for (const MethodCase& c : Cases()) {
    SCOPED_TRACE(c.name);
    for (server::Server* s : {embedded.get(), store.get()}) {
      auto kv = client::KvStoreClient::Connect(At(s->port()));
      ASSERT_TRUE(kv.ok());
      for (int b = 0; b < 2; ++b) (void)(*kv)->DropSequence(absl::StrCat("s", b));
      Load(**kv, prob, c.placement);
    }
    auto a = client::AttentionClient::Connect(At(embedded->port()));
    auto w = client::AttentionClient::Connect(At(worker->port()));
    auto ra = (*a)->Decode(Request(prob, c.method, 17));
    auto rw = (*w)->Decode(Request(prob, c.method, 17));
    ASSERT_TRUE(ra.ok()) << ra.status();
    ASSERT_TRUE(rw.ok()) << rw.status();
    EXPECT_EQ(ra->output().data(), rw->output().data());
    ASSERT_EQ(ra->heads_size(), rw->heads_size());
    for (int i = 0; i < ra->heads_size(); ++i) {
      const auto& x = ra->heads(i);
      const auto& y = rw->heads(i);
      ASSERT_EQ(x.fetched_tokens_size(), y.fetched_tokens_size());
      for (int t = 0; t < x.fetched_tokens_size(); ++t) {
        ASSERT_EQ(x.fetched_tokens(t), y.fetched_tokens(t));
      }
      EXPECT_EQ(x.bytes_host(), y.bytes_remote());
      EXPECT_EQ(y.bytes_host(), 0u);
      EXPECT_EQ(x.bytes_device(), y.bytes_device());
    }
  }
  // The store alone does not serve Attention; the worker alone does not serve KvStore.
  auto direct = client::AttentionClient::Connect(At(store->port()));
  EXPECT_EQ((*direct)->Decode(Request(prob, Cases()[0].method)).status().code(),
            StatusCode::kUnimplemented);
  auto wkv = client::KvStoreClient::Connect(At(worker->port()));
  EXPECT_EQ((*wkv)->GetStats().status().code(), StatusCode::kUnimplemented);
}

// How a worker reads the store's pages without Gather: a mapping of the arena file (the
// shared-arena pod) or one-sided UCX gets over TCP (any host).
struct DirectCase {
  const char* name;
  bool ucx;
};

class DirectReadTest : public ::testing::TestWithParam<DirectCase> {
 protected:
  void SetUp() override {
    if (GetParam().ucx && !kvstore::UcxAvailable()) GTEST_SKIP() << "built without UCX";
  }
  // The store's options: its pages in the arena file (and exported over UCX).
  void StoreOptions(server::ServerOptions& o, kvstore::MemoryResource* arena) const {
    o.store.memory = arena;
    if (GetParam().ucx) {
      o.data_plane = "ucx";
      o.data_plane_transports = "tcp";
    }
  }
  // A worker reading directly; `broken`: one that cannot (the file missing, UCX not starting).
  void WorkerOptions(server::ServerOptions& o, const std::string& path, bool broken) const {
    if (GetParam().ucx) {
      o.store_data_plane = "ucx";
      o.data_plane_transports = broken ? "no_such_transport" : "tcp";
    } else {
      o.store_arena_file = broken ? ::testing::TempDir() + "/no-such-arena" : path;
    }
  }
  rpc::RemoteRowSourceOptions SourceOptions(const std::string& path) const {
    if (GetParam().ucx) return {"", "", "ucx", "tcp"};
    return {"", path, "", ""};
  }
};

INSTANTIATE_TEST_SUITE_P(Readers, DirectReadTest,
                         ::testing::Values(DirectCase{"file", false}, DirectCase{"ucx_tcp", true}),
                         [](const ::testing::TestParamInfo<DirectCase>& i) {
                           return std::string(i.param.name);
                         });

// The worker reads the store's pages directly. Results are bit-identical to the embedded
// deployment's, the store serves no Gather, a sequence dropped and made again with other rows is
// read anew, a worker that cannot read directly reads through Gather instead, and a store
// restarted on the same port (a new arena) is found again.
TEST_P(DirectReadTest, WorkerReadsRowsWithoutGather) {
  const std::string path = ::testing::TempDir() + "/kvsparse-shared-arena-test-" + GetParam().name;
  auto arena = kvstore::NewFileMemoryResource(path, 256 << 20);
  ASSERT_TRUE(arena.ok()) << arena.status();
  auto embedded = StartServer(server::ServerRole::kAll);
  auto store = StartServer(server::ServerRole::kStore, 0, false,
                           [&](server::ServerOptions& o) { StoreOptions(o, arena->get()); });
  ASSERT_NE(embedded, nullptr);
  ASSERT_NE(store, nullptr);
  auto worker = StartServer(server::ServerRole::kWorker, store->port(), /*metrics=*/true,
                            [&](server::ServerOptions& o) { WorkerOptions(o, path, false); });
  auto missing = StartServer(server::ServerRole::kWorker, store->port(), false,
                             [&](server::ServerOptions& o) { WorkerOptions(o, path, true); });
  ASSERT_NE(worker, nullptr);
  ASSERT_NE(missing, nullptr);
  auto skv = client::KvStoreClient::Connect(At(store->port()));
  ASSERT_TRUE(skv.ok());
  auto gathered = [&] {
    auto st = (*skv)->GetStats();
    EXPECT_TRUE(st.ok());
    return st->bytes_gathered();
  };
  for (uint64_t seed : {11u, 12u}) {  // the second pass drops and re-creates every sequence
    kernels::SyntheticOptions po;
    po.family = kernels::ScoreFamily::kPeaked;
    po.batch = 2;
    po.num_q_heads = 8;
    po.num_kv_heads = 2;
    po.head_dim = 64;
    po.seq_lens = {1200, 2000};
    po.seed = seed;
    const kernels::SyntheticProblem prob = kernels::SyntheticProblem::Make(po);
    for (const MethodCase& c : Cases()) {
      SCOPED_TRACE(absl::StrCat(c.name, " seed ", seed));
      for (server::Server* s : {embedded.get(), store.get()}) {
        auto kv = client::KvStoreClient::Connect(At(s->port()));
        ASSERT_TRUE(kv.ok());
        for (int b = 0; b < 2; ++b) (void)(*kv)->DropSequence(absl::StrCat("s", b));
        Load(**kv, prob, c.placement);
      }
      auto ra = (*client::AttentionClient::Connect(At(embedded->port())))
                    ->Decode(Request(prob, c.method, 17));
      ASSERT_TRUE(ra.ok()) << ra.status();
      const uint64_t before = gathered();
      auto rw = (*client::AttentionClient::Connect(At(worker->port())))
                    ->Decode(Request(prob, c.method, 17));
      ASSERT_TRUE(rw.ok()) << rw.status();
      EXPECT_EQ(gathered(), before) << "the worker called Gather";
      EXPECT_EQ(ra->output().data(), rw->output().data());
      ASSERT_EQ(ra->heads_size(), rw->heads_size());
      for (int i = 0; i < ra->heads_size(); ++i) {
        EXPECT_EQ(ra->heads(i).bytes_host(), rw->heads(i).bytes_remote());
      }
      auto rm = (*client::AttentionClient::Connect(At(missing->port())))
                    ->Decode(Request(prob, c.method, 17));
      ASSERT_TRUE(rm.ok()) << rm.status();
      EXPECT_EQ(ra->output().data(), rm->output().data());
      EXPECT_GT(gathered(), before);
    }
  }
  auto m = testing::HttpGet(worker->metrics_port(), "/metrics");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_GT(MetricValue(*m, "kvsparse_worker_in_place_rows_total{shard=\"0\""), 0);
  EXPECT_EQ(MetricValue(*m, "kvsparse_worker_in_place_fallbacks_total{shard=\"0\""), 0);
  missing.reset();

  // The store restarts on the same port with a new arena file at the path; the worker, still
  // mapping the old file, maps the new one and reads the new store's rows in place.
  const int port = store->port();
  store.reset();
  arena->reset();
  arena = kvstore::NewFileMemoryResource(path, 256 << 20);
  ASSERT_TRUE(arena.ok()) << arena.status();
  store = StartServer(server::ServerRole::kStore, 0, false, [&](server::ServerOptions& o) {
    StoreOptions(o, arena->get());
    o.listen = absl::StrCat("127.0.0.1:", port);
  });
  ASSERT_NE(store, nullptr);
  const kernels::SyntheticProblem prob = Problem();
  const MethodCase c = Cases()[0];  // a copy: Cases() is a temporary
  for (server::Server* s : {embedded.get(), store.get()}) {
    auto kv = client::KvStoreClient::Connect(At(s->port()));
    ASSERT_TRUE(kv.ok());
    for (int b = 0; b < 2; ++b) (void)(*kv)->DropSequence(absl::StrCat("s", b));
    Load(**kv, prob, c.placement);
  }
  skv = client::KvStoreClient::Connect(At(store->port()));
  ASSERT_TRUE(skv.ok());
  auto ra = (*client::AttentionClient::Connect(At(embedded->port())))
                ->Decode(Request(prob, c.method, 17));
  auto rw =
      (*client::AttentionClient::Connect(At(worker->port())))->Decode(Request(prob, c.method, 17));
  ASSERT_TRUE(ra.ok()) << ra.status();
  ASSERT_TRUE(rw.ok()) << rw.status();
  EXPECT_EQ(ra->output().data(), rw->output().data());
  EXPECT_EQ(gathered(), 0u) << "the worker called Gather on the restarted store";
  worker.reset();
  store.reset();
  std::remove(path.c_str());
}

// Each of the two shards holds its own one of "s0" (shard 0) and "s1" (shard 1)
// (kvstore/placement_test.cc), read over UCX when `ucx` (no Gather served); a list in the other
// order is caught, and a store refuses another shard's sequence.
void ExpectShardsPlaceAsTheClient(client::StoreShards& shards, client::ClientOptions co, int port0,
                                  int port1, bool ucx) {
  // "s0" lives on shard 0 and "s1" on shard 1 (kvstore/placement_test.cc), one each.
  for (int i = 0; i < 2; ++i) {
    auto st = shards.shard(i).GetStats();
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(st->num_sequences(), 1u);
    EXPECT_EQ(st->shard_index(), static_cast<uint32_t>(i));
    EXPECT_TRUE(shards.shard(i).GetSequenceInfo(absl::StrCat("s", i)).ok());
    if (ucx) {
      EXPECT_EQ(st->bytes_gathered(), 0u) << "shard " << i << " served Gather";
    }
  }
  // A list in the other order is caught, and a store refuses another shard's sequence.
  co.target = absl::StrCat("127.0.0.1:", port1, ",127.0.0.1:", port0);
  auto reversed = client::StoreShards::Connect(co);
  ASSERT_TRUE(reversed.ok());
  EXPECT_EQ((*reversed)->CheckPlacement().code(), StatusCode::kFailedPrecondition);
  v1::ModelShape shape;
  shape.set_num_layers(1);
  shape.set_num_q_heads(8);
  shape.set_num_kv_heads(2);
  shape.set_head_dim(64);
  shape.set_dtype(v1::DTYPE_BF16);
  EXPECT_EQ(shards.shard(1).CreateSequence("s0", shape).status().code(),
            StatusCode::kFailedPrecondition);
}

// Two store shards (--shard_index/--shard_count) and a worker with both (--store=A,B): each
// sequence on the shard placement gives it (the client's StoreShards and the worker agree), every
// method bit-identical to the embedded deployment, rows read over UCX where this build has it. A
// shard that goes away fails its own sequences' decodes with UNAVAILABLE (the other shard's keep
// decoding), and once back (empty), NOT_FOUND until the model server re-creates them.
TEST(AttentionServiceTest, ShardedStoresEqualEmbedded) {
  const bool ucx = kvstore::UcxAvailable();
  std::vector<std::string> paths;
  std::vector<std::unique_ptr<kvstore::MemoryResource>> arenas;
  std::vector<std::unique_ptr<server::Server>> stores;
  auto start_store = [&](uint32_t i, int port) {
    if (arenas.size() <= i) {
      paths.push_back(absl::StrCat(::testing::TempDir(), "/kvsparse-shard-test-", i));
      arenas.emplace_back();
      stores.emplace_back();
    }
    auto arena = kvstore::NewFileMemoryResource(paths[i], 64 << 20);
    ASSERT_TRUE(arena.ok()) << arena.status();
    arenas[i] = std::move(*arena);
    stores[i] = StartServer(server::ServerRole::kStore, 0, false, [&](server::ServerOptions& o) {
      o.store.capacity_bytes = 64 << 20;
      o.store.memory = arenas[i].get();
      o.store.shard = {i, 2};
      if (ucx) o.data_plane = "ucx", o.data_plane_transports = "tcp";
      if (port != 0) o.listen = absl::StrCat("127.0.0.1:", port);
    });
    ASSERT_NE(stores[i], nullptr);
  };
  start_store(0, 0);
  start_store(1, 0);
  const std::string list =
      absl::StrCat("127.0.0.1:", stores[0]->port(), ",127.0.0.1:", stores[1]->port());
  auto embedded = StartServer(server::ServerRole::kAll);
  auto worker =
      StartServer(server::ServerRole::kWorker, 0, /*metrics=*/true, [&](server::ServerOptions& o) {
        o.store_target = list;
        if (ucx) o.store_data_plane = "ucx", o.data_plane_transports = "tcp";
      });
  ASSERT_NE(embedded, nullptr);
  ASSERT_NE(worker, nullptr);
  client::ClientOptions co = At(0);
  co.target = list;
  auto shards = client::StoreShards::Connect(co);
  ASSERT_TRUE(shards.ok()) << shards.status();
  ASSERT_EQ((*shards)->size(), 2u);
  EXPECT_TRUE((*shards)->CheckPlacement().ok()) << (*shards)->CheckPlacement();
  auto ekv = client::KvStoreClient::Connect(At(embedded->port()));
  ASSERT_TRUE(ekv.ok());
  auto on_shard = [&](const std::string& id) -> client::KvStoreClient& {
    return (*shards)->For(id);
  };
  auto decode = [&](int port, const kernels::SyntheticProblem& prob, const MethodCase& c) {
    return (*client::AttentionClient::Connect(At(port)))->Decode(Request(prob, c.method, 17));
  };
  const kernels::SyntheticProblem prob = Problem();
  // The problem's sequences afresh in the embedded store and on their shards.
  auto reload = [&](const MethodCase& c) {
    for (int b = 0; b < 2; ++b) {
      const std::string id = absl::StrCat("s", b);
      (void)(*ekv)->DropSequence(id);
      (void)(*shards)->For(id).DropSequence(id);
    }
    Load(**ekv, prob, c.placement);
    Load(on_shard, prob, c.placement);
  };
  for (const MethodCase& c : Cases()) {
    SCOPED_TRACE(c.name);
    reload(c);
    auto ra = decode(embedded->port(), prob, c);
    auto rw = decode(worker->port(), prob, c);
    ASSERT_TRUE(ra.ok()) << ra.status();
    ASSERT_TRUE(rw.ok()) << rw.status();
    EXPECT_EQ(ra->output().data(), rw->output().data());
  }
  ExpectShardsPlaceAsTheClient(**shards, co, stores[0]->port(), stores[1]->port(), ucx);

  // Shard 1 goes away: s1's decodes fail with UNAVAILABLE, s0's go on, bit-identical.
  const MethodCase c = Cases()[0];  // a copy: Cases() is a temporary
  reload(c);
  const int port1 = stores[1]->port();
  stores[1].reset();
  auto both = decode(worker->port(), prob, c);
  EXPECT_EQ(both.status().code(), StatusCode::kUnavailable) << both.status();
  kernels::SyntheticProblem first = Problem(1, {1200});
  auto ra = decode(embedded->port(), first, c);
  auto rw = decode(worker->port(), first, c);
  ASSERT_TRUE(ra.ok()) << ra.status();
  ASSERT_TRUE(rw.ok()) << rw.status();
  EXPECT_EQ(ra->output().data(), rw->output().data());
  auto m = testing::HttpGet(worker->metrics_port(), "/metrics");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(MetricValue(*m, "kvsparse_worker_store_shard_up{shard=\"0\""), 1);
  EXPECT_EQ(MetricValue(*m, "kvsparse_worker_store_shard_up{shard=\"1\""), 0);

  // Back on its port, empty: NOT_FOUND, then the model server re-creates s1 and all is as before.
  // (The worker reconnects after gRPC's reconnect backoff; until then UNAVAILABLE, which a model
  // server retries.)
  start_store(1, port1);
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  do {
    both = decode(worker->port(), prob, c);
  } while (both.status().code() == StatusCode::kUnavailable && absl::Now() < give_up &&
           (absl::SleepFor(absl::Milliseconds(100)), true));
  EXPECT_EQ(both.status().code(), StatusCode::kNotFound) << both.status();
  ASSERT_TRUE((*shards)->For("s0").DropSequence("s0").ok());
  Load(on_shard, prob, c.placement);
  ra = decode(embedded->port(), prob, c);
  rw = decode(worker->port(), prob, c);
  ASSERT_TRUE(ra.ok()) << ra.status();
  ASSERT_TRUE(rw.ok()) << rw.status();
  EXPECT_EQ(ra->output().data(), rw->output().data());
  worker.reset();
  stores.clear();
  for (const std::string& p : paths) std::remove(p.c_str());
}

// The direct row source alone against a store with an arena file: the store's answers where a
// read is wrong (OUT_OF_RANGE, NOT_FOUND), never rows of another sequence or unwritten slots.
TEST_P(DirectReadTest, RowSourceKeepsTheStoresAnswers) {
  const std::string path = ::testing::TempDir() + "/kvsparse-row-source-test-" + GetParam().name;
  auto arena = kvstore::NewFileMemoryResource(path, 64 << 20);
  ASSERT_TRUE(arena.ok()) << arena.status();
  auto store = StartServer(server::ServerRole::kStore, 0, false,
                           [&](server::ServerOptions& o) { StoreOptions(o, arena->get()); });
  ASSERT_NE(store, nullptr);
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", store->port()),
                                     grpc::InsecureChannelCredentials());
  auto source = rpc::NewRemoteRowSource(channel, SourceOptions(path));
  auto kv = client::KvStoreClient::Connect(At(store->port()));
  ASSERT_TRUE(kv.ok());
  const kernels::SyntheticProblem prob = Problem(2, {1200, 300});
  Load(**kv, prob, {});
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  auto desc = source->Describe("s0", deadline);
  ASSERT_TRUE(desc.ok()) << desc.status();
  const size_t row = 64 * 2;  // head_dim 64, bf16
  std::vector<uint32_t> tokens = {0, 1199, 640};
  std::vector<uint8_t> k(tokens.size() * row), v(k.size());
  std::vector<engine::RowRequest> heads = {{1, tokens}};
  auto n = source->Gather("s0", kLayer, kvstore::RowKind::kKV, heads, k.data(), v.data(), deadline);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 1200u);
  EXPECT_EQ(source->in_place_stats().rows, 6u);
  // Past the length: OUT_OF_RANGE, as the store says it.
  std::vector<uint32_t> past = {1200};
  std::vector<engine::RowRequest> past_heads = {{0, past}};
  EXPECT_EQ(
      source->Gather("s0", kLayer, kvstore::RowKind::kK, past_heads, k.data(), nullptr, deadline)
          .status()
          .code(),
      StatusCode::kOutOfRange);
  // "s0" dropped and made again shorter (300 tokens, after this worker's Describe saw 1200):
  // token 640 is past the new length, whatever this worker knew of the old sequence.
  ASSERT_TRUE((*kv)->DropSequence("s0").ok());
  ASSERT_TRUE((*kv)->DropSequence("s1").ok());
  Load(**kv, Problem(2, {300, 300}), {});
  std::vector<uint32_t> mid = {640};
  std::vector<engine::RowRequest> mid_heads = {{1, mid}};
  EXPECT_EQ(
      source->Gather("s0", kLayer, kvstore::RowKind::kKV, mid_heads, k.data(), v.data(), deadline)
          .status()
          .code(),
      StatusCode::kOutOfRange);
  // Dropped: NOT_FOUND.
  ASSERT_TRUE((*kv)->DropSequence("s0").ok());
  EXPECT_EQ(source->Gather("s0", kLayer, kvstore::RowKind::kKV, heads, k.data(), v.data(), deadline)
                .status()
                .code(),
            StatusCode::kNotFound);
  source.reset();
  store.reset();
  std::remove(path.c_str());
}

// GetDataPlane hands out the arena's UCX address only to a token without a tenant (the arena
// holds every tenant's rows), and says FAILED_PRECONDITION where the store exports none.
TEST(AttentionServiceTest, DataPlaneNeedsAnUntenantedToken) {
  if (!kvstore::UcxAvailable()) GTEST_SKIP() << "built without UCX";
  const std::string path = ::testing::TempDir() + "/kvsparse-data-plane-auth";
  const std::string tokens = ::testing::TempDir() + "/kvsparse-data-plane-tokens";
  std::ofstream(tokens) << "worker-token-0123456789 read\ntenant-token-0123456789 read t1\n";
  auto arena = kvstore::NewFileMemoryResource(path, 16 << 20);
  ASSERT_TRUE(arena.ok());
  auto store = StartServer(server::ServerRole::kStore, 0, false, [&](server::ServerOptions& o) {
    o.store.memory = arena->get();
    o.data_plane = "ucx";
    o.data_plane_transports = "tcp";
    o.auth_tokens_file = tokens;
  });
  auto plain = StartServer(server::ServerRole::kStore);
  ASSERT_NE(store, nullptr);
  ASSERT_NE(plain, nullptr);
  auto ask = [](int port, const std::string& token) {
    auto stub = v1::KvStore::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
    v1::DataPlane dp;
    grpc::Status s = stub->GetDataPlane(&ctx, v1::GetDataPlaneRequest(), &dp);
    EXPECT_TRUE(!s.ok() || (dp.transport() == "ucx" && !dp.worker_address().empty() &&
                            !dp.rkey().empty() && dp.secret() != 0));
    return s.error_code();
  };
  EXPECT_EQ(ask(store->port(), "worker-token-0123456789"), grpc::StatusCode::OK);
  EXPECT_EQ(ask(store->port(), "tenant-token-0123456789"), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(ask(store->port(), ""), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(ask(plain->port(), ""), grpc::StatusCode::FAILED_PRECONDITION);
  store.reset();
  std::remove(path.c_str());
  std::remove(tokens.c_str());
}

// A model server's step loop over DecodeStream: append the new token and decode, every step;
// the store and the resident state grow by one token per step.
TEST(AttentionServiceTest, StreamStepsAppendAndDecode) {
  const kernels::SyntheticProblem prob = Problem(1, {500});
  auto server = StartServer(server::ServerRole::kAll);
  auto kv = client::KvStoreClient::Connect(At(server->port()));
  v1::Placement place;
  place.set_k_tier(v1::TIER_DEVICE);
  place.set_signature_bits(32);
  Load(**kv, prob, place);
  auto attn = client::AttentionClient::Connect(At(server->port()));
  auto session = (*attn)->OpenSession(absl::Seconds(60));
  ASSERT_TRUE(session.ok());
  v1::Method santa;
  santa.mutable_santa()->set_samples(64);
  const kernels::DecodeProblem& p = prob.problem;
  const size_t token = static_cast<size_t>(p.num_kv_heads) * p.head_dim * 2;
  for (int step = 0; step < 5; ++step) {
    v1::DecodeRequest r = Request(prob, santa, step);
    r.set_request_id(100 + step);
    for (v1::Tensor* t : {r.mutable_new_k(), r.mutable_new_v()}) {
      t->set_dtype(v1::DTYPE_BF16);
      for (int64_t d : {int64_t{1}, int64_t{p.num_kv_heads}, int64_t{p.head_dim}}) t->add_shape(d);
      // The next token's K and V: rows of token `step` (any valid data will do).
      t->set_data(reinterpret_cast<const char*>(prob.k.data()) + step * token, token);
    }
    auto resp = (*session)->Step(r);
    ASSERT_TRUE(resp.ok()) << resp.status();
    EXPECT_EQ(resp->request_id(), 100u + step);
    EXPECT_EQ(resp->heads(0).dense_equivalent_bytes(), 2ull * (501 + step) * p.head_dim * 2);
  }
  EXPECT_TRUE((*session)->Close().ok());
  EXPECT_EQ((*kv)->GetSequenceInfo("s0")->layer_lengths(kLayer), 505u);
  EXPECT_EQ((*kv)->GetSequenceInfo("s0")->layer_lengths(0), 500u);
}

// A failed message ends a DecodeStream, and says which it was (issue 48, defect 4): good,
// unknown sequence, good: the first is answered, the second fails NOT_FOUND naming message 1
// and its request_id, the stream is then closed (the third gets the session's refusal, never a
// silent nothing).
TEST(AttentionServiceTest, AFailedStreamMessageEndsTheStreamNamingIt) {
  const kernels::SyntheticProblem prob = Problem(1, {300});
  auto server = StartServer(server::ServerRole::kAll);
  auto kv = client::KvStoreClient::Connect(At(server->port()));
  Load(**kv, prob, {});
  auto attn = client::AttentionClient::Connect(At(server->port()));
  auto session = (*attn)->OpenSession(absl::Seconds(60));
  ASSERT_TRUE(session.ok());
  v1::Method dense;
  dense.mutable_dense();
  v1::DecodeRequest good = Request(prob, dense);
  good.set_request_id(7);
  v1::DecodeRequest unknown = good;
  unknown.set_sequence_ids(0, "nope");
  unknown.set_request_id(8);
  auto first = (*session)->Step(good);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->request_id(), 7u);
  const absl::Status failed = (*session)->Step(unknown).status();
  EXPECT_EQ(failed.code(), absl::StatusCode::kNotFound) << failed;
  EXPECT_TRUE(absl::StrContains(failed.message(), "DecodeStream message 1 (request_id 8)"))
      << failed;
  EXPECT_TRUE(absl::StrContains(failed.message(), "nope")) << failed;
  EXPECT_EQ((*session)->Step(good).status().code(), absl::StatusCode::kFailedPrecondition);
}

// --max_calls_per_token: one token's open streams take all its slots, its next stream and its
// unary calls are refused with RESOURCE_EXHAUSTED naming the flag, while another token of the same
// tenant still decodes; a closed stream gives its slot back.
TEST(AttentionServiceTest, PerTokenLimitRefusesOneTokenNotAnother) {
  constexpr int kMax = 3;
  const std::string tokens = absl::StrCat(::testing::TempDir(), "/per_token_limit_tokens.txt");
  {
    std::ofstream f(tokens);
    f << "alice-0123456789abcdef write team\nbob-0123456789abcdef write team\n";
  }
  server::ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_listen = "";
  o.store.capacity_bytes = 64 << 20;
  o.auth_tokens_file = tokens;
  o.max_calls_per_token = kMax;
  auto server = server::Server::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  client::ClientOptions alice = At((*server)->port()), bob = At((*server)->port());
  alice.token = "alice-0123456789abcdef";
  bob.token = "bob-0123456789abcdef";
  const kernels::SyntheticProblem prob = Problem(1, {300});
  auto kv = client::KvStoreClient::Connect(bob);
  ASSERT_TRUE(kv.ok());
  Load(**kv, prob, {});
  auto attn_a = client::AttentionClient::Connect(alice);
  auto attn_b = client::AttentionClient::Connect(bob);
  ASSERT_TRUE(attn_a.ok() && attn_b.ok());
  v1::Method dense;
  dense.mutable_dense();
  const v1::DecodeRequest r = Request(prob, dense);

  std::vector<std::unique_ptr<client::DecodeSession>> held;
  for (int i = 0; i < kMax; ++i) {
    auto s = (*attn_a)->OpenSession(absl::Seconds(60));
    ASSERT_TRUE(s.ok());
    auto step = (*s)->Step(r);  // answered: the stream is open on the server
    ASSERT_TRUE(step.ok()) << i << ": " << step.status();
    held.push_back(std::move(*s));
  }
  auto extra = (*attn_a)->OpenSession(absl::Seconds(60));
  ASSERT_TRUE(extra.ok());
  const absl::Status refused = (*extra)->Step(r).status();
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "--max_calls_per_token")) << refused;
  const absl::Status unary = (*attn_a)->Decode(r).status();
  EXPECT_EQ(unary.code(), StatusCode::kResourceExhausted) << unary;

  // Another token of the same tenant has slots of its own.
  EXPECT_TRUE((*attn_b)->Decode(r).ok());
  auto other = (*attn_b)->OpenSession(absl::Seconds(60));
  ASSERT_TRUE(other.ok());
  EXPECT_TRUE((*other)->Step(r).ok());
  EXPECT_TRUE((*other)->Close().ok());

  // Steps of the held streams still run (they hold their slots), and a closed one frees its own.
  EXPECT_TRUE(held[0]->Step(r).ok());
  EXPECT_TRUE(held.back()->Close().ok());
  held.pop_back();
  auto again = (*attn_a)->Decode(r);
  EXPECT_TRUE(again.ok()) << again.status();
  for (auto& s : held) EXPECT_TRUE(s->Close().ok());
}

// Responses state their error (issue 50 item 4): S2ANTA each query head's standard error, finite
// and of the size of the head's error against dense over a few seeds, with one observation per
// query head on /metrics; vAttention the epsilon its budget promises, at most the one asked for;
// dense neither.
TEST(AttentionServiceTest, EstimatesStateTheirError) {
  const kernels::SyntheticProblem prob = Problem();
  const kernels::DecodeProblem& p = prob.problem;
  auto server = StartServer(server::ServerRole::kAll, 0, /*metrics=*/true);
  auto kv = client::KvStoreClient::Connect(At(server->port()));
  Load(**kv, prob, {});
  auto attn = client::AttentionClient::Connect(At(server->port()));
  std::vector<double> dense;
  ASSERT_TRUE(kernels::DenseDecodeFloat64(p, &dense).ok());
  v1::Method santa;
  santa.mutable_santa()->set_samples(256);
  const int G = p.group_size(), d = p.head_dim;
  constexpr int kSeeds = 8;
  double err2 = 0, se2 = 0;
  for (int seed = 0; seed < kSeeds; ++seed) {
    auto r = (*attn)->Decode(Request(prob, santa, 100 + seed));
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->heads_size(), p.batch * p.num_kv_heads);
    for (const v1::HeadStats& h : r->heads()) {
      ASSERT_EQ(h.standard_error_size(), G);
      for (int g = 0; g < G; ++g) {
        const float se = h.standard_error(g);
        EXPECT_TRUE(std::isfinite(se) && se > 0.f) << se;
        const size_t at =
            (static_cast<size_t>(h.sequence_index()) * p.num_q_heads + h.kv_head() * G + g) * d;
        const double rel = RelL2(r->output().data(), dense, at, d, p.dtype);
        err2 += rel * rel;
        se2 += double{se} * se;
      }
    }
  }
  // Mean squared relative error against the mean stated variance: of one size (the stated one
  // overstates for prop's systematic draws; bf16 output adds its rounding to the error).
  std::printf("[santa standard error] server, S = 256: error^2 / stated^2 %.3f\n", err2 / se2);
  EXPECT_LT(err2 / se2, 2.0);
  EXPECT_GT(err2 / se2, 0.05);
  v1::Method dense_method;
  dense_method.mutable_dense();
  auto r = (*attn)->Decode(Request(prob, dense_method));
  ASSERT_TRUE(r.ok()) << r.status();
  for (const v1::HeadStats& h : r->heads()) {
    EXPECT_EQ(h.standard_error_size(), 0);
    EXPECT_EQ(h.epsilon_size(), 0);
  }
  // vAttention (exact predictor) states the error its budget promises: at most the epsilon asked
  // for, and no standard error.
  v1::Method vatt;
  v1::VAttentionParams* v = vatt.mutable_vattention();
  v->set_predictor(v1::TOP_K_PREDICTOR_EXACT);
  v->set_epsilon(0.1f);
  v->set_delta(0.1f);
  v->set_sink_tokens(32);
  v->set_local_tokens(64);
  v->set_top_k_fraction(0.05f);
  v->set_base_rate(0.05f);
  r = (*attn)->Decode(Request(prob, vatt));
  ASSERT_TRUE(r.ok()) << r.status().message();
  for (const v1::HeadStats& h : r->heads()) {
    ASSERT_EQ(h.epsilon_size(), G);
    for (float e : h.epsilon()) EXPECT_TRUE(e >= 0.f && e <= 0.1f) << e;
    EXPECT_EQ(h.standard_error_size(), 0);
  }
  auto metrics = testing::HttpGet(server->metrics_port(), "/metrics");
  ASSERT_TRUE(metrics.ok());
  EXPECT_EQ(
      testing::MetricValue(*metrics, "kvsparse_decode_standard_error_count", "method=\"santa\""),
      kSeeds * p.batch * p.num_q_heads);
  EXPECT_EQ(
      testing::MetricValue(*metrics, "kvsparse_decode_standard_error_count", "method=\"dense\""),
      0);
}

// Top-k over compressed keys states, per query head, a certified bound on the share of its
// attention the rows it used leave out (issue 50 item 4; kernels/missed_mass_test.cc checks it
// against the truth per query head): here never below the share the whole GQA group's rows
// (fetched_tokens) leave out, which a head's own rows leave out at least, computed in float64
// from the problem's keys; at most 1; one observation per query head on /metrics; S2ANTA states
// none.
TEST(AttentionServiceTest, TopKStatesTheMassItLeavesOut) {
  const kernels::SyntheticProblem prob = Problem();
  const kernels::DecodeProblem& p = prob.problem;
  auto server = StartServer(server::ServerRole::kAll, 0, /*metrics=*/true);
  auto kv = client::KvStoreClient::Connect(At(server->port()));
  v1::Placement placement;
  placement.set_compressed_key_bits(2);
  Load(**kv, prob, placement);
  auto attn = client::AttentionClient::Connect(At(server->port()));
  v1::Method topk;
  v1::TopKParams* t = topk.mutable_top_k();
  t->set_scores(v1::SCORE_SOURCE_COMPRESSED_KEYS);
  t->set_sink_tokens(16);
  t->set_local_tokens(32);
  t->set_top_k_fraction(0.05f);
  auto r = (*attn)->Decode(Request(prob, topk));
  ASSERT_TRUE(r.ok()) << r.status().message();
  const int G = p.group_size(), d = p.head_dim;
  std::vector<float> q(d), k(d);
  for (const v1::HeadStats& h : r->heads()) {
    ASSERT_EQ(h.missed_mass_bound_size(), G);
    EXPECT_EQ(h.standard_error_size(), 0);
    const int32_t b = static_cast<int32_t>(h.sequence_index()),
                  j = static_cast<int32_t>(h.kv_head());
    const int32_t n = prob.seq_lens[b];
    std::vector<bool> used(n, false);
    for (uint32_t tok : h.fetched_tokens()) used[tok] = true;
    for (int g = 0; g < G; ++g) {
      kernels::LoadQuery(p, b, j * G + g, q.data());
      std::vector<double> s(n);
      double m = -INFINITY;
      for (int32_t tok = 0; tok < n; ++tok) {
        kernels::LoadRowAsFloat(p.k, kernels::KvRowOffset(p, b, j, tok), d, p.dtype, k.data());
        double dot = 0;
        for (int c = 0; c < d; ++c) dot += double{q[c]} * k[c];
        s[tok] = dot * p.scale;
        m = std::max(m, s[tok]);
      }
      double all = 0, out = 0;
      for (int32_t tok = 0; tok < n; ++tok) {
        all += std::exp(s[tok] - m);
        if (!used[tok]) out += std::exp(s[tok] - m);
      }
      const float bound = h.missed_mass_bound(g);
      EXPECT_GE(double{bound}, out / all) << "sequence " << b << ", query head " << j * G + g;
      EXPECT_LE(bound, 1.f);
    }
  }
  v1::Method santa;
  santa.mutable_santa()->set_samples(64);
  auto sr = (*attn)->Decode(Request(prob, santa));
  ASSERT_TRUE(sr.ok()) << sr.status();
  for (const v1::HeadStats& h : sr->heads()) EXPECT_EQ(h.missed_mass_bound_size(), 0);
  auto metrics = testing::HttpGet(server->metrics_port(), "/metrics");
  ASSERT_TRUE(metrics.ok());
  EXPECT_EQ(
      testing::MetricValue(*metrics, "kvsparse_decode_missed_mass_bound_count", "method=\"top_k\""),
      p.batch * p.num_q_heads);
  EXPECT_EQ(
      testing::MetricValue(*metrics, "kvsparse_decode_missed_mass_bound_count", "method=\"santa\""),
      0);
}

// Bad requests get clear codes and the server stays healthy; nothing is appended by them.
TEST(AttentionServiceTest, BadRequestsGetClearCodes) {
  const kernels::SyntheticProblem prob = Problem();
  auto server = StartServer(server::ServerRole::kAll, 0, /*metrics=*/true);
  auto kv = client::KvStoreClient::Connect(At(server->port()));
  Load(**kv, prob, {});
  auto attn = client::AttentionClient::Connect(At(server->port()));
  v1::Method dense;
  dense.mutable_dense();
  auto expect = [&](const v1::DecodeRequest& r, StatusCode code, const char* what) {
    EXPECT_EQ((*attn)->Decode(r).status().code(), code) << what;
    EXPECT_TRUE((*kv)->CheckHealth().ok());
  };
  v1::DecodeRequest r = Request(prob, dense);
  r.mutable_q()->set_shape(1, 6);  // wrong head count for the data
  expect(r, StatusCode::kInvalidArgument, "tensor size");
  r = Request(prob, dense);
  r.mutable_q()->set_shape(1, 4);
  r.mutable_q()->set_shape(2, 128);  // consistent tensor, wrong head count for the model
  expect(r, StatusCode::kInvalidArgument, "head count");
  r = Request(prob, dense);
  r.set_sequence_ids(1, "nope");
  expect(r, StatusCode::kNotFound, "unknown sequence");
  r = Request(prob, dense);
  r.mutable_q()->set_dtype(v1::DTYPE_FP32);  // 4-byte elements: the data is half the size
  expect(r, StatusCode::kInvalidArgument, "q dtype");
  v1::Method m;
  m.mutable_santa()->set_samples(0);
  expect(Request(prob, m), StatusCode::kInvalidArgument, "S = 0");
  m.mutable_vattention()->set_epsilon(2.f);
  expect(Request(prob, m), StatusCode::kInvalidArgument, "epsilon");
  m.mutable_hash_top_k()->set_top_k(10);
  expect(Request(prob, m), StatusCode::kFailedPrecondition, "no signatures");
  r = Request(prob, dense);
  r.set_layer(kLayers);
  expect(r, StatusCode::kInvalidArgument, "layer");
  r = Request(prob, dense);
  r.mutable_new_k()->set_dtype(v1::DTYPE_BF16);
  expect(r, StatusCode::kInvalidArgument, "new_k without new_v");
  EXPECT_EQ((*kv)->GetSequenceInfo("s0")->layer_lengths(kLayer), 1200u);
  EXPECT_TRUE((*attn)->Decode(Request(prob, dense)).ok());
  auto metrics = testing::HttpGet(server->metrics_port(), "/metrics");
  ASSERT_TRUE(metrics.ok());
  EXPECT_GT(testing::MetricValue(*metrics, "kvsparse_decode_fetched_bytes_total",
                                 "method=\"dense\",tier=\"host\""),
            0);
  EXPECT_GT(testing::MetricValue(*metrics, "kvsparse_decode_dense_equivalent_bytes_total",
                                 "method=\"dense\""),
            0);
  EXPECT_EQ(testing::MetricValue(*metrics, "kvsparse_rpc_requests_total",
                                 "code=\"NOT_FOUND\",method=\"Decode\""),
            1);
}

}  // namespace
}  // namespace kvsparse
