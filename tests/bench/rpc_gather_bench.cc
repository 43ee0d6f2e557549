// Gather RPC over loopback against a raw gRPC bytes echo of the same response size, measured
// in the same run; with --arena_file, also a direct read of the same rows by a RemoteRowSource:
// the shared-arena worker's in-place read (--reader=file, the file mapped) or one-sided UCX gets
// (--reader=ucx, the store exporting the arena).
//
//   rpc_gather_bench [--pool_mb=1024] [--rows=4096,131072] [--calls=100] [--arena_file=PATH]
//                    [--pattern=random|contiguous]
//   # across hosts or network namespaces: the store and the echo on one side, the clients on the
//   # other (the reader's arena file, with --reader=file, must be the same file)
//   rpc_gather_bench --serve=ADDR --echo_listen=ADDR [--arena_file=PATH --reader=ucx ...] &
//   rpc_gather_bench --connect=ADDR --echo=ADDR [--reader=ucx ...]
//
// One process runs the real kvsparse server (KvStore service) and a bare Echo service, each on
// its own loopback port with the same message limits, and drives both with gRPC clients over
// TCP. A Gather asks for `rows` V rows (256 B) at random tokens spread over 8 kv heads, rotating
// through the layers; the matching Echo sends a payload the size of the gather's index list
// and gets back rows x 256 bytes. Reported: median latency and payload throughput of each, and
// Gather's throughput as a fraction of Echo's.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/kvstore_client.h"
#include "echo.grpc.pb.h"
#include "kvstore/shared_arena.h"
#include "rpc/remote_row_source.h"
#include "server/server.h"
#include "tests/bench/bench_fill.h"

ABSL_FLAG(uint64_t, pool_mb, 1024, "MB of K+V held by the store");
ABSL_FLAG(std::string, rows, "4096,131072", "Rows per Gather call");
ABSL_FLAG(int, calls, 100, "Timed calls per configuration and RPC");
ABSL_FLAG(std::string, arena_file, "",
          "Keep the store's pages in this file (put it on tmpfs, e.g. /dev/shm/...) and also time "
          "the direct read of the same rows (see --reader)");
ABSL_FLAG(std::string, reader, "file",
          "With --arena_file, the direct reader: file (a mapping of the file, the shared-arena "
          "worker), ucx (UCX batched gathers) or ucx-rma (one-sided UCX gets per row); the store "
          "exports with --data_plane=ucx");
ABSL_FLAG(std::string, ucx_transports, "", "--reader=ucx: UCX transports (UCX_TLS syntax)");
ABSL_FLAG(std::string, pattern, "random",
          "Which tokens a read asks for: random (a sparse method's selection) or contiguous (the "
          "same number of consecutive tokens per kv head: the transport's best case for the "
          "same bytes)");
ABSL_FLAG(std::string, serve, "",
          "Only serve: the store (filled) at this address and the echo at --echo_listen, until "
          "killed; the clients run elsewhere with --connect");
ABSL_FLAG(std::string, echo_listen, "127.0.0.1:0", "--serve: the echo service's address");
ABSL_FLAG(std::string, connect, "",
          "Only measure, against a --serve process's store at this address (and --echo)");
ABSL_FLAG(std::string, echo, "", "--connect: the echo service's address");

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kMaxMessage = 256 << 20;

class EchoService final : public kvsparse::bench::Echo::Service {
 public:
  grpc::Status Echo(grpc::ServerContext*, const kvsparse::bench::EchoRequest* req,
                    kvsparse::bench::EchoResponse* resp) override {
    if (req->response_bytes() > kMaxMessage) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "too large");
    }
    // The bytes exist already (as the store's rows do); the echo copies them into the reply.
    if (buffer_.size() < req->response_bytes()) buffer_.assign(req->response_bytes(), 'x');
    resp->mutable_payload()->assign(buffer_.data(), req->response_bytes());
    return grpc::Status::OK;
  }

 private:
  std::string buffer_;  // grown once by the warm-up calls (single client)
};

struct Stat {
  double p50_us, p99_us;
  double mb_per_s;       // payload / median latency (robust to stalls from other processes)
  double mean_mb_per_s;  // payload / mean latency
};

template <typename Call>
Stat Measure(int calls, size_t payload, Call&& call) {
  std::vector<double> us;
  const auto start = Clock::now();
  for (int i = -3; i < calls; ++i) {
    const auto t0 = Clock::now();
    call(i + 3);
    if (i >= 0) us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  double total = 0;
  for (double u : us) total += u;
  (void)start;
  std::sort(us.begin(), us.end());
  const double p50 = us[us.size() / 2];
  return {p50, us[(us.size() * 99) / 100], payload / p50, payload * us.size() / total};
}

namespace kv = kvsparse::kvstore;

// The model shape the store holds (one sequence "bench").
const kv::ModelShape kShape{16, 32, 8, 128, kv::DType::kBf16};

// The processes' endpoints: the store and the echo started here (unless --connect), or those of
// a --serve process.
struct Endpoints {
  std::unique_ptr<kv::MemoryResource> arena;  // --arena_file: the store's pages
  std::unique_ptr<kvsparse::server::Server> server;
  std::unique_ptr<EchoService> echo_service;
  std::unique_ptr<grpc::Server> echo_server;
  std::string store_target, echo_target;
};

// Starts the store (filled with `tokens` tokens) and the echo service; with --serve, serves
// until killed. Errors are printed; false on failure.
bool StartServers(uint64_t tokens, uint64_t token_bytes, Endpoints* ep) {
  const std::string serve = absl::GetFlag(FLAGS_serve);
  kvsparse::server::ServerOptions so;
  so.listen = serve.empty() ? "127.0.0.1:0" : serve;
  so.insecure = true;  // a benchmark between namespaces or hosts of a trusted test network
  so.metrics_listen = "";
  so.max_message_bytes = kMaxMessage;
  so.store.capacity_bytes = tokens * token_bytes + (256ull << 20);
  const std::string arena_path = absl::GetFlag(FLAGS_arena_file);
  if (!arena_path.empty()) {
    auto file = kv::NewFileMemoryResource(arena_path, so.store.capacity_bytes, so.store.page_bytes);
    if (!file.ok()) {
      std::fprintf(stderr, "%s\n", file.status().ToString().c_str());
      return false;
    }
    ep->arena = std::move(*file);
    so.store.memory = ep->arena.get();
    if (absl::StartsWith(absl::GetFlag(FLAGS_reader), "ucx")) {
      so.data_plane = "ucx";
      so.data_plane_transports = absl::GetFlag(FLAGS_ucx_transports);
    }
  }
  auto server = kvsparse::server::Server::Start(so);
  if (!server.ok()) {
    std::fprintf(stderr, "%s\n", server.status().ToString().c_str());
    return false;
  }
  ep->server = std::move(*server);
  ep->echo_service = std::make_unique<EchoService>();
  grpc::ServerBuilder eb;
  int echo_port = 0;
  const std::string echo_listen = serve.empty() ? "127.0.0.1:0" : absl::GetFlag(FLAGS_echo_listen);
  eb.AddListeningPort(echo_listen, grpc::InsecureServerCredentials(), &echo_port);
  eb.SetMaxReceiveMessageSize(kMaxMessage);
  eb.SetMaxSendMessageSize(kMaxMessage);
  eb.RegisterService(ep->echo_service.get());
  ep->echo_server = eb.BuildAndStart();
  if (!ep->echo_server) return false;
  // Fill the store in-process (setup, not measured).
  if (absl::Status s = kvsparse::bench::FillSequence(ep->server->store(), "bench", kShape, tokens);
      !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return false;
  }
  if (!serve.empty()) {
    std::printf("serving: store %s, echo %s, %lu tokens\n", serve.c_str(), echo_listen.c_str(),
                static_cast<unsigned long>(tokens));
    std::fflush(stdout);
    for (;;) pause();  // until killed
  }
  ep->store_target = absl::StrCat("127.0.0.1:", ep->server->port());
  ep->echo_target = absl::StrCat("127.0.0.1:", echo_port);
  return true;
}

// 8 Gather requests of `per_head` V rows per kv head (--pattern) over `layer_tokens` tokens.
std::vector<kvsparse::v1::GatherRequest> MakeRequests(uint64_t per_head, uint64_t layer_tokens,
                                                      std::mt19937_64& rng) {
  std::vector<kvsparse::v1::GatherRequest> reqs(8);
  std::uniform_int_distribution<uint32_t> tok(0, static_cast<uint32_t>(layer_tokens - 1));
  const bool contiguous = absl::GetFlag(FLAGS_pattern) == "contiguous";
  std::uniform_int_distribution<uint32_t> first(
      0, static_cast<uint32_t>(layer_tokens - std::min(per_head, layer_tokens)));
  for (size_t i = 0; i < reqs.size(); ++i) {
    reqs[i].set_sequence_id("bench");
    reqs[i].set_kind(kvsparse::v1::ROW_KIND_V);
    for (uint32_t h = 0; h < kShape.num_kv_heads; ++h) {
      auto* sel = reqs[i].add_heads();
      sel->set_kv_head(h);
      const uint32_t t0 = contiguous ? first(rng) : 0;
      for (uint64_t j = 0; j < per_head; ++j) {
        sel->add_token_indices(contiguous ? t0 + static_cast<uint32_t>(j) : tok(rng));
      }
    }
  }
  return reqs;
}

// The same requests through the direct reader: the page tables are fetched by the warm-up calls
// (one per layer), then every read is a copy. Checks that no read fell back to Gather and that
// the rows equal the Gather RPC's; *failed on any error.
Stat MeasureDirect(kvsparse::rpc::RemoteRowSource& in_place,
                   kvsparse::client::KvStoreClient& client,
                   std::vector<kvsparse::v1::GatherRequest>& reqs, int calls, size_t payload,
                   bool* failed) {
  std::vector<std::vector<std::vector<uint32_t>>> tokens_of(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    for (const auto& sel : reqs[i].heads()) {
      tokens_of[i].emplace_back(sel.token_indices().begin(), sel.token_indices().end());
    }
  }
  std::vector<uint8_t> out(payload);
  const uint64_t fallbacks = in_place.in_place_stats().fallbacks;
  const Stat p = Measure(calls, payload, [&](int i) {
    const auto& toks = tokens_of[i % reqs.size()];
    std::vector<kvsparse::engine::RowRequest> heads;
    for (uint32_t h = 0; h < toks.size(); ++h) heads.push_back({h, toks[h]});
    auto r = in_place.Gather("bench", i % kShape.num_layers, kv::RowKind::kV, heads, nullptr,
                             out.data(), absl::Now() + absl::Seconds(30));
    if (!r.ok()) {
      std::fprintf(stderr, "in-place read failed: %s\n", r.status().ToString().c_str());
      *failed = true;
    }
  });
  if (in_place.in_place_stats().fallbacks != fallbacks) {
    std::fprintf(stderr, "in-place reads fell back to Gather\n");
    *failed = true;
  }
  // The rows equal the Gather RPC's (the first request, at layer 3).
  kvsparse::v1::GatherRequest& req = reqs[0];
  req.set_layer(3);
  kvsparse::v1::GatherResponse gresp;
  std::vector<kvsparse::engine::RowRequest> heads;
  for (uint32_t h = 0; h < tokens_of[0].size(); ++h) heads.push_back({h, tokens_of[0][h]});
  if (!client.Gather(req, &gresp).ok() ||
      !in_place
           .Gather("bench", 3, kv::RowKind::kV, heads, nullptr, out.data(),
                   absl::Now() + absl::Seconds(30))
           .ok() ||
      gresp.v().data() != std::string(out.begin(), out.end())) {
    std::fprintf(stderr, "in-place rows differ from the Gather RPC's\n");
    *failed = true;
  }
  return p;
}

// One row of the table: Gather and Echo (and the direct reader) for `rows` rows. false on error.
bool MeasureRows(uint64_t rows, uint64_t layer_tokens, kvsparse::client::KvStoreClient& client,
                 kvsparse::bench::Echo::Stub& echo, kvsparse::rpc::RemoteRowSource* in_place,
                 std::mt19937_64& rng) {
  const size_t row = kShape.row_bytes();
  const int calls = absl::GetFlag(FLAGS_calls);
  const uint64_t per_head = rows / kShape.num_kv_heads;
  rows = per_head * kShape.num_kv_heads;
  const size_t payload = rows * row;
  std::vector<kvsparse::v1::GatherRequest> reqs = MakeRequests(per_head, layer_tokens, rng);
  kvsparse::v1::GatherResponse gresp;
  bool failed = false;
  const Stat g = Measure(calls, payload, [&](int i) {
    auto& req = reqs[i % reqs.size()];
    req.set_layer(i % kShape.num_layers);
    gresp.Clear();
    absl::Status s = client.Gather(req, &gresp);
    if (!s.ok() || gresp.v().data().size() != payload) {
      std::fprintf(stderr, "gather failed: %s\n", s.ToString().c_str());
      failed = true;
    }
  });
  kvsparse::bench::EchoRequest ereq;
  ereq.set_response_bytes(payload);
  ereq.set_payload(std::string(rows * 4, 'i'));  // the size of the gather's index list
  kvsparse::bench::EchoResponse eresp;
  const Stat e = Measure(calls, payload, [&](int) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    eresp.Clear();
    grpc::Status s = echo.Echo(&ctx, ereq, &eresp);
    if (!s.ok() || eresp.payload().size() != payload) {
      std::fprintf(stderr, "echo failed: %s\n", s.error_message().c_str());
      failed = true;
    }
  });
  Stat p{};
  if (in_place != nullptr) p = MeasureDirect(*in_place, client, reqs, calls * 4, payload, &failed);
  if (failed) return false;
  std::printf("%-8lu %-8.2f %11.0f %11.0f %8.0f %9.0f %11.0f %11.0f %8.0f %9.0f %6.0f%% %6.0f%%",
              static_cast<unsigned long>(rows), payload / 1e6, g.p50_us, g.p99_us, g.mb_per_s,
              g.mean_mb_per_s, e.p50_us, e.p99_us, e.mb_per_s, e.mean_mb_per_s,
              100.0 * g.mb_per_s / e.mb_per_s, 100.0 * g.mean_mb_per_s / e.mean_mb_per_s);
  if (in_place != nullptr) {
    std::printf(" %11.0f %11.0f %8.0f %9.1fx", p.p50_us, p.p99_us, p.mb_per_s,
                p.mb_per_s / g.mb_per_s);
  }
  std::printf("\n");
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const size_t row = kShape.row_bytes();
  const uint64_t token_bytes = 2ull * kShape.num_layers * kShape.num_kv_heads * row;
  const uint64_t tokens =
      std::max<uint64_t>(1024, (absl::GetFlag(FLAGS_pool_mb) << 20) / token_bytes);
  const std::string connect = absl::GetFlag(FLAGS_connect);
  const std::string arena_path = absl::GetFlag(FLAGS_arena_file);
  const bool ucx_reader = absl::StartsWith(absl::GetFlag(FLAGS_reader), "ucx");
  Endpoints ep;
  ep.store_target = connect;
  ep.echo_target = absl::GetFlag(FLAGS_echo);
  if (connect.empty() && !StartServers(tokens, token_bytes, &ep)) return 1;

  kvsparse::client::ClientOptions co;
  co.target = ep.store_target;
  co.max_message_bytes = kMaxMessage;
  auto client = kvsparse::client::KvStoreClient::Connect(co);
  if (!client.ok()) return 1;
  uint64_t layer_tokens = tokens;
  if (!connect.empty()) {
    auto info = (*client)->GetSequenceInfo("bench");
    if (!info.ok()) {
      std::fprintf(stderr, "%s: %s\n", connect.c_str(), info.status().ToString().c_str());
      return 1;
    }
    layer_tokens = info->layer_lengths(0);
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessage);
  args.SetMaxSendMessageSize(kMaxMessage);
  auto echo = kvsparse::bench::Echo::NewStub(
      grpc::CreateCustomChannel(ep.echo_target, grpc::InsecureChannelCredentials(), args));

  std::unique_ptr<kvsparse::rpc::RemoteRowSource> in_place;
  if (!arena_path.empty() || (!connect.empty() && ucx_reader)) {
    in_place = kvsparse::rpc::NewRemoteRowSource(
        grpc::CreateCustomChannel(co.target, grpc::InsecureChannelCredentials(), args),
        ucx_reader ? kvsparse::rpc::RemoteRowSourceOptions{"", "", absl::GetFlag(FLAGS_reader),
                                                           absl::GetFlag(FLAGS_ucx_transports)}
                   : kvsparse::rpc::RemoteRowSourceOptions{"", arena_path, "", ""});
  }
  std::printf("%-8s %-8s %11s %11s %8s %9s %11s %11s %8s %9s %7s %7s", "rows", "MB/resp",
              "gather p50", "gather p99", "MB/s", "mean MB/s", "echo p50", "echo p99", "MB/s",
              "mean MB/s", "ratio", "(mean)");
  if (in_place != nullptr) {
    std::printf(" %11s %11s %8s %10s", "direct p50", "direct p99", "MB/s", "x gather");
  }
  std::printf("\n");
  std::mt19937_64 rng(7);
  for (absl::string_view rs : absl::StrSplit(absl::GetFlag(FLAGS_rows), ',')) {
    uint64_t rows = 0;
    if (!absl::SimpleAtoi(rs, &rows) || rows == 0) return 2;
    if (absl::GetFlag(FLAGS_pattern) == "contiguous" && rows / kShape.num_kv_heads > layer_tokens) {
      return 2;
    }
    if (!MeasureRows(rows, layer_tokens, **client, *echo, in_place.get(), rng)) return 1;
  }
  if (ep.echo_server != nullptr) ep.echo_server->Shutdown();
  if (in_place != nullptr) {
    const kvsparse::rpc::InPlaceStats st = in_place->in_place_stats();
    std::printf("direct (%s): %lu rows, %lu bytes, %lu GetPageTable calls, %lu fallbacks\n",
                absl::GetFlag(FLAGS_reader).c_str(), static_cast<unsigned long>(st.rows),
                static_cast<unsigned long>(st.bytes),
                static_cast<unsigned long>(st.page_table_calls),
                static_cast<unsigned long>(st.fallbacks));
  }
  if (!arena_path.empty() && connect.empty()) std::remove(arena_path.c_str());
  return 0;
}
