// The real kvsparse server on a loopback port, driven by the real client, with /metrics read
// over HTTP.
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/kvstore_client.h"
#include "client/synthetic.h"
#include "gtest/gtest.h"
#include "server/server.h"
#include "tests/integration/http_get.h"
#include "tests/integration/reflection_list.h"

namespace kvsparse {
namespace {

using absl::StatusCode;
using client::KvStoreClient;
using testing::HttpGet;
using testing::MetricValue;

constexpr uint32_t kLayers = 4, kHeads = 8, kKvHeads = 2, kDim = 64;
constexpr uint64_t kSeed = 42;

v1::ModelShape Shape(v1::DType dtype = v1::DTYPE_BF16) {
  v1::ModelShape s;
  s.set_num_layers(kLayers);
  s.set_num_q_heads(kHeads);
  s.set_num_kv_heads(kKvHeads);
  s.set_head_dim(kDim);
  s.set_dtype(dtype);
  return s;
}

v1::AppendRequest AppendReq(const std::string& id, uint64_t first_token, uint64_t n,
                            v1::DType dtype = v1::DTYPE_BF16) {
  v1::AppendRequest r;
  r.set_sequence_id(id);
  r.set_num_layers(kLayers);
  const kernels::DType dt = dtype == v1::DTYPE_BF16   ? kernels::DType::kBf16
                            : dtype == v1::DTYPE_FP16 ? kernels::DType::kFp16
                                                      : kernels::DType::kFp32;
  for (v1::Tensor* t : {r.mutable_k(), r.mutable_v()}) {
    t->set_dtype(dtype);
    for (int64_t d : {int64_t{kLayers}, static_cast<int64_t>(n), int64_t{kKvHeads}, int64_t{kDim}})
      t->add_shape(d);
  }
  client::SyntheticAppend(kSeed, 0, kLayers, first_token, n, kKvHeads, kDim, dt,
                          r.mutable_k()->mutable_data(), r.mutable_v()->mutable_data());
  return r;
}

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override { StartServer(8 << 20, kvstore::CapacityPolicy::kReject); }

  void StartServer(size_t capacity, kvstore::CapacityPolicy policy,
                   absl::Duration default_deadline = absl::Seconds(30),
                   size_t append_budget = size_t{1} << 30) {
    server::ServerOptions o;
    o.listen = "127.0.0.1:0";
    o.metrics_listen = "127.0.0.1:0";
    o.max_message_bytes = 4 << 20;
    o.max_append_bytes_in_flight = append_budget;
    o.default_deadline = default_deadline;
    o.shutdown_grace = absl::Seconds(2);
    o.store.capacity_bytes = capacity;
    o.store.policy = policy;
    o.store.page_bytes = 16 << 10;
    auto s = server::Server::Start(o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    client::ClientOptions co;
    co.target = absl::StrCat("127.0.0.1:", server_->port());
    co.timeout = absl::Seconds(10);
    auto c = KvStoreClient::Connect(co);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
    ASSERT_TRUE(client_->WaitForReady(absl::Seconds(5)).ok());
  }

  std::string Metrics() {
    auto body = HttpGet(server_->metrics_port(), "/metrics");
    EXPECT_TRUE(body.ok()) << body.status();
    return body.ok() ? *body : "";
  }

  // Checks that the server is still healthy and serving valid calls.
  void ExpectHealthy() {
    EXPECT_TRUE(client_->CheckHealth().ok());
    EXPECT_TRUE(client_->GetStats().ok());
  }

  std::unique_ptr<server::Server> server_;
  std::unique_ptr<KvStoreClient> client_;
};

// --auth_tokens_reload: a rewritten token file applies without a restart (the new token gets in,
// the removed one is UNAUTHENTICATED), and a malformed rewrite leaves the tokens as they were.
TEST(TokenReloadTest, RewrittenTokenFileAppliesWithoutRestart) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/reload_tokens.txt");
  auto write = [&](const std::string& text) {
    const std::string tmp = path + ".tmp";  // whole file at once, as an operator's tool would
    std::ofstream(tmp, std::ios::trunc) << text;
    ASSERT_EQ(std::rename(tmp.c_str(), path.c_str()), 0);
  };
  write("old-0123456789abcdef read\n");
  server::ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_listen = "";
  o.store.capacity_bytes = 8 << 20;
  o.auth_tokens_file = path;
  o.auth_tokens_reload = absl::Milliseconds(50);
  auto server = server::Server::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  auto stats = [&](const std::string& token) {
    client::ClientOptions co;
    co.target = absl::StrCat("127.0.0.1:", (*server)->port());
    co.timeout = absl::Seconds(10);
    co.token = token;
    auto c = KvStoreClient::Connect(co);
    return c.ok() ? (*c)->GetStats().status() : c.status();
  };
  // Polls until the token's code is `code` (the reloader runs every 50 ms).
  auto eventually = [&](const std::string& token, StatusCode code) {
    const absl::Time until = absl::Now() + absl::Seconds(10);
    absl::Status s = stats(token);
    while (s.code() != code && absl::Now() < until) {
      absl::SleepFor(absl::Milliseconds(20));
      s = stats(token);
    }
    return s;
  };
  EXPECT_TRUE(stats("old-0123456789abcdef").ok());
  EXPECT_EQ(stats("new-0123456789abcdef").code(), StatusCode::kUnauthenticated);

  write("new-0123456789abcdef read\n");
  EXPECT_TRUE(eventually("new-0123456789abcdef", StatusCode::kOk).ok());
  EXPECT_EQ(stats("old-0123456789abcdef").code(), StatusCode::kUnauthenticated);

  write("new-0123456789abcdef reader\nother-0123456789abcdef read\n");  // a bad role
  absl::SleepFor(absl::Milliseconds(300));                              // several reload periods
  EXPECT_TRUE(stats("new-0123456789abcdef").ok());
  EXPECT_EQ(stats("other-0123456789abcdef").code(), StatusCode::kUnauthenticated);
  std::remove(path.c_str());
}

TEST_F(ServiceTest, HealthAndReflectionServicesAnswer) {
  EXPECT_TRUE(client_->CheckHealth().ok());
  EXPECT_TRUE(client_->CheckHealth("kvsparse.v1.KvStore").ok());
  EXPECT_EQ(client_->CheckHealth("no.such.Service").code(), StatusCode::kNotFound);
  auto services = testing::ListServicesByReflection(client_->channel());
  ASSERT_TRUE(services.ok()) << services.status();
  EXPECT_NE(std::find(services->begin(), services->end(), "kvsparse.v1.KvStore"), services->end());
  EXPECT_NE(std::find(services->begin(), services->end(), "grpc.health.v1.Health"),
            services->end());
}

TEST_F(ServiceTest, AppendGatherRoundTripAndMetricsMove) {
  ASSERT_TRUE(client_->CreateSequence("s1", Shape()).ok());
  const std::string before = Metrics();
  for (uint64_t t = 0; t < 300; t += 100) {
    v1::AppendRequest r = AppendReq("s1", t, 100);
    r.set_expected_length(t);
    auto resp = client_->Append(r);
    ASSERT_TRUE(resp.ok()) << resp.status();
    EXPECT_EQ(resp->first_token(), t);
  }
  auto info = client_->GetSequenceInfo("s1");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layer_lengths(kLayers - 1), 300u);

  v1::GatherRequest g;
  g.set_sequence_id("s1");
  g.set_layer(2);
  g.set_kind(v1::ROW_KIND_KV);
  for (uint32_t h : {1u, 0u, 1u}) {
    v1::HeadSelection* sel = g.add_heads();
    sel->set_kv_head(h);
    for (uint32_t t : {299u, 0u, 150u, 150u, 17u}) sel->add_token_indices(t);
  }
  auto resp = client_->Gather(g);
  ASSERT_TRUE(resp.ok()) << resp.status();
  ASSERT_EQ(resp->heads_size(), 3);
  EXPECT_EQ(resp->k().shape(0), 15);
  EXPECT_EQ(resp->k().shape(1), kDim);
  EXPECT_EQ(resp->k().dtype(), v1::DTYPE_BF16);
  const size_t row = kDim * 2;
  std::string want(row, '\0');
  for (int hi = 0; hi < 3; ++hi) {
    const v1::HeadRows& hr = resp->heads(hi);
    for (uint64_t i = 0; i < hr.row_count(); ++i) {
      const uint32_t tok = g.heads(hi).token_indices(i);
      client::SyntheticRow(kSeed, 2, hr.kv_head(), tok, 0, kDim, kernels::DType::kBf16,
                           reinterpret_cast<uint8_t*>(want.data()));
      EXPECT_EQ(resp->k().data().substr((hr.row_offset() + i) * row, row), want);
      client::SyntheticRow(kSeed, 2, hr.kv_head(), tok, 1, kDim, kernels::DType::kBf16,
                           reinterpret_cast<uint8_t*>(want.data()));
      EXPECT_EQ(resp->v().data().substr((hr.row_offset() + i) * row, row), want);
    }
  }
  // Unique, V only.
  g.set_unique(true);
  g.set_kind(v1::ROW_KIND_V);
  resp = client_->Gather(g);
  ASSERT_TRUE(resp.ok());
  EXPECT_TRUE(resp->k().data().empty());
  ASSERT_EQ(resp->heads(0).token_indices_size(), 4);
  EXPECT_EQ(resp->heads(0).token_indices(1), 17u);
  EXPECT_EQ(resp->heads(0).counts(2), 2u);  // token 150 twice

  const std::string after = Metrics();
  EXPECT_EQ(MetricValue(after, "kvsparse_rpc_requests_total", "code=\"OK\",method=\"Append\""), 3);
  EXPECT_EQ(MetricValue(after, "kvsparse_rpc_requests_total", "code=\"OK\",method=\"Gather\""), 2);
  EXPECT_EQ(MetricValue(after, "kvsparse_rpc_duration_seconds_count", "method=\"Gather\""), 2);
  EXPECT_EQ(MetricValue(after, "kvsparse_store_appended_bytes_total"),
            3.0 * 2 * kLayers * 100 * kKvHeads * row);
  EXPECT_EQ(MetricValue(after, "kvsparse_store_gathered_bytes_total", "tier=\"host\""),
            (15.0 * 2 + 12.0) * row);
  EXPECT_EQ(MetricValue(after, "kvsparse_store_sequences"), 1);
  EXPECT_GT(MetricValue(after, "kvsparse_store_used_bytes"),
            MetricValue(before, "kvsparse_store_used_bytes"));
  EXPECT_EQ(MetricValue(after, "kvsparse_store_capacity_bytes"), 8 << 20);
}

// Each bad request gets the status that says why, never UNKNOWN or INTERNAL, and the server
// keeps serving with the acknowledged data intact.
TEST_F(ServiceTest, BadRequestsGetClearCodesAndLoseNothing) {
  ASSERT_TRUE(client_->CreateSequence("s", Shape()).ok());
  ASSERT_TRUE(client_->Append(AppendReq("s", 0, 10)).ok());
  auto expect = [&](absl::Status s, StatusCode code, const char* what) {
    EXPECT_EQ(s.code(), code) << what << ": " << s;
    ExpectHealthy();
  };
  // Create.
  expect(client_->CreateSequence("s", Shape()).status(), StatusCode::kAlreadyExists, "dup");
  expect(client_->CreateSequence("bad id!", Shape()).status(), StatusCode::kInvalidArgument, "id");
  v1::ModelShape bad = Shape();
  bad.set_num_q_heads(3);
  expect(client_->CreateSequence("x", bad).status(), StatusCode::kInvalidArgument, "GQA");
  bad = Shape(v1::DTYPE_UNSPECIFIED);
  expect(client_->CreateSequence("x", bad).status(), StatusCode::kInvalidArgument, "dtype");
  v1::Placement dev;
  dev.set_k_tier(v1::TIER_DEVICE);
  dev.set_k_tier(v1::TIER_REMOTE);
  expect(client_->CreateSequence("x", Shape(), dev).status(), StatusCode::kInvalidArgument, "tier");
  // Append.
  expect(client_->Append(AppendReq("nope", 0, 1)).status(), StatusCode::kNotFound, "unknown seq");
  expect(client_->Append(AppendReq("s", 10, 1, v1::DTYPE_FP16)).status(),
         StatusCode::kInvalidArgument, "dtype mismatch");
  v1::AppendRequest malformed = AppendReq("s", 10, 1);
  malformed.mutable_v()->mutable_data()->pop_back();
  expect(client_->Append(malformed).status(), StatusCode::kInvalidArgument, "short tensor");
  v1::AppendRequest empty;
  empty.set_sequence_id("s");
  expect(client_->Append(empty).status(), StatusCode::kInvalidArgument, "empty append");
  v1::AppendRequest retry = AppendReq("s", 10, 1);
  retry.set_expected_length(3);
  expect(client_->Append(retry).status(), StatusCode::kFailedPrecondition, "stale retry");
  // 5 MB of K+V: over the server's 4 MiB message limit.
  expect(client_->Append(AppendReq("s", 10, 2500)).status(), StatusCode::kResourceExhausted,
         "oversized message");
  // Gather.
  v1::GatherRequest g;
  g.set_sequence_id("s");
  v1::HeadSelection* sel = g.add_heads();
  sel->set_kv_head(0);
  sel->add_token_indices(10);
  expect(client_->Gather(g).status(), StatusCode::kOutOfRange, "token past length");
  sel->set_token_indices(0, 9);
  sel->set_kv_head(kKvHeads);
  expect(client_->Gather(g).status(), StatusCode::kInvalidArgument, "kv head");
  sel->set_kv_head(0);
  g.set_layer(kLayers);
  expect(client_->Gather(g).status(), StatusCode::kInvalidArgument, "layer");
  g.set_layer(0);
  g.set_sequence_id("nope");
  expect(client_->Gather(g).status(), StatusCode::kNotFound, "unknown seq");
  g.set_sequence_id("s");
  g.set_kind(static_cast<v1::RowKind>(77));
  expect(client_->Gather(g).status(), StatusCode::kInvalidArgument, "row kind");
  g.set_kind(v1::ROW_KIND_KV);
  v1::GatherRequest none;
  none.set_sequence_id("s");
  expect(client_->Gather(none).status(), StatusCode::kInvalidArgument, "no heads");
  v1::GatherRequest huge = g;
  huge.mutable_heads(0)->mutable_token_indices()->Resize(20000, 1);  // 20000 x 256 B x 2 = 10 MB
  expect(client_->Gather(huge).status(), StatusCode::kResourceExhausted, "oversized response");
  expect(client_->DropSequence("nope").status(), StatusCode::kNotFound, "drop unknown");
  expect(client_->GetSequenceInfo("nope").status(), StatusCode::kNotFound, "info unknown");

  // Nothing acknowledged was lost: 10 tokens, rows intact, and a valid append still works.
  auto info = client_->GetSequenceInfo("s");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layer_lengths(0), 10u);
  auto ok = client_->Gather(g);
  ASSERT_TRUE(ok.ok());
  std::string want(kDim * 2, '\0');
  client::SyntheticRow(kSeed, 0, 0, 9, 1, kDim, kernels::DType::kBf16,
                       reinterpret_cast<uint8_t*>(want.data()));
  EXPECT_EQ(ok->v().data(), want);
  EXPECT_TRUE(client_->Append(AppendReq("s", 10, 1)).ok());

  const std::string m = Metrics();
  EXPECT_GE(
      MetricValue(m, "kvsparse_rpc_requests_total", "code=\"INVALID_ARGUMENT\",method=\"Append\""),
      3);
  EXPECT_EQ(MetricValue(m, "kvsparse_rpc_requests_total", "code=\"INTERNAL\""), -1);
  EXPECT_EQ(MetricValue(m, "kvsparse_rpc_requests_total", "code=\"UNKNOWN\""), -1);
}

// --max_append_bytes_in_flight: an append takes the size its client declares (the C++ client
// declares every append) before gRPC reads its body; appends that do not fit together wait for
// each other instead of all being read at once; a size over --max_message_size is refused before
// the body is read; a declaration that understates the message, or that is not a number, is
// refused and appends nothing; an append that declares nothing is charged the largest message.
TEST_F(ServiceTest, AppendsTakeTheirDeclaredShareOfTheRequestBudget) {
  constexpr size_t kBudget = 4 << 20;  // the smallest the server takes: --max_message_size
  StartServer(64 << 20, kvstore::CapacityPolicy::kReject, absl::Seconds(30), kBudget);
  // 700 tokens: 700 x 4 layers x 2 kv heads x 64 x 2 bytes x (K and V) = 1.4 MB a message, so
  // two fit at once and eight concurrent appends wait for room in turn.
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(8);
  for (int t = 0; t < 8; ++t) {
    const std::string id = absl::StrCat("b", t);
    ASSERT_TRUE(client_->CreateSequence(id, Shape()).ok());
    threads.emplace_back([&, t, id] {
      for (uint64_t first = 0; first < 2100 && results[t].ok(); first += 700) {
        results[t] = client_->Append(AppendReq(id, first, 700)).status();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int t = 0; t < 8; ++t) {
    EXPECT_TRUE(results[t].ok()) << t << ": " << results[t];
    auto info = client_->GetSequenceInfo(absl::StrCat("b", t));
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->layer_lengths(0), 2100u);
  }
  const std::string metrics = Metrics();
  EXPECT_EQ(MetricValue(metrics, "kvsparse_rpc_in_flight_request_bytes"), 0.0) << metrics;
  EXPECT_EQ(MetricValue(metrics,
                        "kvsparse_rpc_admission_refusals_total{limit=\"max_append_bytes_"
                        "in_flight\",method=\"Append\"}"),
            0.0);

  // Raw calls with a declaration of their own.
  auto channel = client_->channel();
  auto stub = v1::KvStore::NewStub(channel);
  auto raw_append = [&](const v1::AppendRequest& r, const char* declared) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (declared != nullptr) ctx.AddMetadata("kvsparse-request-bytes", declared);
    v1::AppendResponse resp;
    return stub->Append(&ctx, r, &resp);
  };
  const v1::AppendRequest next = AppendReq("b0", 2100, 100);
  grpc::Status s = raw_append(next, "1000");  // understated
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "declared 1000 bytes")) << s.error_message();
  s = raw_append(next, "many");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  s = raw_append(next, "5000000");  // over --max_message_size: refused before the body is read
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_TRUE(absl::StrContains(s.error_message(), "--max_message_size")) << s.error_message();
  auto info = client_->GetSequenceInfo("b0");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->layer_lengths(0), 2100u);  // none of them appended
  s = raw_append(next, nullptr);  // undeclared: charged 4 MiB, the whole budget, and served
  EXPECT_TRUE(s.ok()) << s.error_message();
  s = raw_append(AppendReq("b0", 2200, 100), std::to_string(next.ByteSizeLong()).c_str());
  EXPECT_TRUE(s.ok()) << s.error_message();
  info = client_->GetSequenceInfo("b0");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->layer_lengths(0), 2300u);
  ExpectHealthy();
}

TEST(ServerOptionsTest, AnAppendBudgetBelowTheLargestMessageIsRefused) {
  server::ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_listen = "";
  o.store.capacity_bytes = 8 << 20;
  o.max_message_bytes = 4 << 20;
  o.max_append_bytes_in_flight = 2 << 20;
  auto s = server::Server::Start(o);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(absl::StrContains(s.status().message(), "max_append_bytes_in_flight")) << s.status();
}

TEST_F(ServiceTest, CapacityRejectShowsInMetrics) {
  // 8 MiB capacity; each 100-token append of this shape takes 4 layers x 2 heads x 1 page.
  ASSERT_TRUE(client_->CreateSequence("s", Shape()).ok());
  absl::Status last;
  int appended = 0;
  for (int i = 0; i < 100 && last.ok(); ++i) {
    last = client_->Append(AppendReq("s", i * 100, 100)).status();
    if (last.ok()) ++appended;
  }
  EXPECT_EQ(last.code(), StatusCode::kResourceExhausted) << last;
  ExpectHealthy();
  auto info = client_->GetSequenceInfo("s");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layer_lengths(0), appended * 100u);
  const std::string m = Metrics();
  EXPECT_EQ(MetricValue(m, "kvsparse_store_rejections_total"), 1);
  EXPECT_EQ(MetricValue(m, "kvsparse_rpc_requests_total",
                        "code=\"RESOURCE_EXHAUSTED\",method=\"Append\""),
            1);
}

TEST_F(ServiceTest, EvictLruServesNewSequencesAndReportsEvictions) {
  server_.reset();
  // 64 pages of 16 KiB, and 8 KiB for the sequences' bookkeeping (a few hundred bytes each,
  // charged to the capacity from creation).
  StartServer((1 << 20) + (8 << 10), kvstore::CapacityPolicy::kEvictLru);
  // A 16 KiB page holds 64 tokens of 2 x 128 B, so 100 tokens take 2 pages in each of
  // 4 layers x 2 kv heads: 16 pages a sequence, 4 sequences fit.
  for (int i = 0; i < 12; ++i) {
    const std::string id = absl::StrCat("s", i);
    ASSERT_TRUE(client_->CreateSequence(id, Shape()).ok());
    ASSERT_TRUE(client_->Append(AppendReq(id, 0, 100)).ok()) << i;
  }
  for (int i = 0; i < 12; ++i) {
    EXPECT_EQ(client_->GetSequenceInfo(absl::StrCat("s", i)).ok(), i >= 8) << i;
  }
  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->evictions(), 8u);
  EXPECT_EQ(MetricValue(Metrics(), "kvsparse_store_evictions_total"), 8);
}

TEST_F(ServiceTest, DefaultDeadlineAppliesToCallsWithoutOne) {
  server_.reset();
  StartServer(8 << 20, kvstore::CapacityPolicy::kReject, absl::Microseconds(200));
  ASSERT_TRUE(client_->CreateSequence("s", Shape()).ok());
  ASSERT_TRUE(client_->Append(AppendReq("s", 0, 100)).ok());
  // A gather of 30000 rows takes longer than the 200 us default deadline: the store checks the
  // deadline as it copies and gives up with DEADLINE_EXCEEDED rather than run on.
  v1::GatherRequest g;
  g.set_sequence_id("s");
  g.set_kind(v1::ROW_KIND_K);
  v1::HeadSelection* sel = g.add_heads();
  for (int i = 0; i < 30000; ++i) sel->add_token_indices((i * 37) % 100);
  absl::Status slow = absl::OkStatus();
  for (int attempt = 0; attempt < 5 && slow.ok(); ++attempt) slow = client_->Gather(g).status();
  EXPECT_EQ(slow.code(), StatusCode::kDeadlineExceeded) << slow;
  ExpectHealthy();
}

TEST_F(ServiceTest, ShutdownStopsServingAndFinishesInFlightCalls) {
  ASSERT_TRUE(client_->CreateSequence("s", Shape()).ok());
  ASSERT_TRUE(client_->Append(AppendReq("s", 0, 100)).ok());
  v1::GatherRequest g;
  g.set_sequence_id("s");
  v1::HeadSelection* sel = g.add_heads();
  sel->set_kv_head(1);
  for (int i = 0; i < 5000; ++i) sel->add_token_indices(i % 100);
  // Calls racing with shutdown either finish OK or are refused as UNAVAILABLE/CANCELLED;
  // none is cut off with a wrong answer.
  std::atomic<int> ok{0}, refused{0}, other{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 50; ++i) {
        auto r = client_->Gather(g);
        if (r.ok()) {
          if (r->v().data().size() == 5000u * kDim * 2) ++ok;
        } else if (r.status().code() == StatusCode::kUnavailable ||
                   r.status().code() == StatusCode::kCancelled) {
          ++refused;
        } else {
          ++other;
        }
      }
    });
  }
  absl::SleepFor(absl::Milliseconds(20));
  server_->Shutdown();
  for (auto& t : threads) t.join();
  EXPECT_GT(ok.load(), 0);
  EXPECT_EQ(other.load(), 0);
  EXPECT_EQ(ok + refused, 200);
  EXPECT_FALSE(client_->CheckHealth().ok());
}

}  // namespace
}  // namespace kvsparse
