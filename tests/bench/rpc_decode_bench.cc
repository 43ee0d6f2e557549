// Decode RPC overhead over loopback: Decode latency against a raw gRPC bytes echo with the same
// request and response sizes, measured in the same run, with the engine's own time and the
// server's time (both reported in every response) beside it.
//   server overhead = server_seconds - engine_seconds: what the service adds to the engine
//                     (conversion, validation, metrics), handler entry to response ready;
//   e2e over echo   = Decode - engine - echo: everything a Decode costs beyond the engine and a
//                     bare echo of the same bytes (adds gRPC parsing of the structured
//                     messages on both sides and the client's deadline).
//
//   rpc_decode_bench [--tokens=2048] [--batch=1,8] [--calls=300]
//   rpc_decode_bench --serve_echo [--gpu]   (serve both for tests/bench/py_rpc_bench.py)
//
// One process runs the real kvsparse server (store + worker, CPU engine, metrics on) and an
// Echo service on loopback ports; Llama-3.1-8B head shapes (H=32, Hkv=8, d=128, bf16).
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#if KVSPARSE_WITH_CUDA
#include "kvstore/cuda_host_memory.h"
#endif
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/attention_client.h"
#include "client/kvstore_client.h"
#include "echo.grpc.pb.h"
#include "kernels/synthetic.h"
#include "server/server.h"

ABSL_FLAG(int, tokens, 2048, "Tokens per sequence");
ABSL_FLAG(std::string, batch, "1,8", "Sequences per Decode call");
ABSL_FLAG(int, calls, 300, "Timed calls per configuration");
ABSL_FLAG(bool, serve_echo, false,
          "Only serve: start the server and the Echo service, print their ports, and run until "
          "stdin closes (for a client in another language: tests/bench/py_rpc_bench.py)");
ABSL_FLAG(bool, gpu, false,
          "Decode on the GPU backend (store pages pinned and mapped); fails without a GPU");

namespace {

using Clock = std::chrono::steady_clock;

class EchoService final : public kvsparse::bench::Echo::Service {
 public:
  grpc::Status Echo(grpc::ServerContext*, const kvsparse::bench::EchoRequest* req,
                    kvsparse::bench::EchoResponse* resp) override {
    resp->mutable_payload()->assign(req->response_bytes(), 'o');
    return grpc::Status::OK;
  }
};

double Pct(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * (v.size() - 1))];
}

namespace v1 = kvsparse::v1;

// B sequences "b<B>-<b>" of `tokens` tokens from the synthetic problem, with K resident on the
// worker (the S2ANTA placement) and V in the host tier. false on error.
bool LoadSequences(kvsparse::client::KvStoreClient& kv,
                   const kvsparse::kernels::SyntheticProblem& prob, int B, int tokens) {
  const auto& p = prob.problem;
  v1::Placement place;
  place.set_k_tier(v1::TIER_DEVICE);
  for (int b = 0; b < B; ++b) {
    const std::string id = absl::StrCat("b", B, "-", b);
    v1::ModelShape shape;
    shape.set_num_layers(1);
    shape.set_num_q_heads(p.num_q_heads);
    shape.set_num_kv_heads(p.num_kv_heads);
    shape.set_head_dim(p.head_dim);
    shape.set_dtype(v1::DTYPE_BF16);
    if (!kv.CreateSequence(id, shape, place).ok()) return false;
    v1::AppendRequest r;
    r.set_sequence_id(id);
    const size_t bytes = static_cast<size_t>(tokens) * p.num_kv_heads * p.head_dim * 2;
    for (auto [t, src] :
         {std::pair{r.mutable_k(), prob.k.data()}, {r.mutable_v(), prob.v.data()}}) {
      t->set_dtype(v1::DTYPE_BF16);
      for (int64_t d : {int64_t{1}, int64_t{tokens}, int64_t{p.num_kv_heads}, int64_t{p.head_dim}})
        t->add_shape(d);
      t->set_data(src + b * p.kv_layout.batch_stride * 2, bytes);
    }
    if (!kv.Append(r).ok()) return false;
  }
  return true;
}

// One row of the table: `calls` Decode calls of method `mname` over the B sequences, then as
// many echoes of the same request and response sizes. false on error.
bool MeasureMethod(const char* mname, int B, const kvsparse::kernels::SyntheticProblem& prob,
                   kvsparse::client::AttentionClient& attn, kvsparse::bench::Echo::Stub& echo) {
  const auto& p = prob.problem;
  v1::DecodeRequest req;
  for (int b = 0; b < B; ++b) req.add_sequence_ids(absl::StrCat("b", B, "-", b));
  req.mutable_q()->set_dtype(v1::DTYPE_BF16);
  for (int64_t d : {int64_t{B}, int64_t{p.num_q_heads}, int64_t{p.head_dim}})
    req.mutable_q()->add_shape(d);
  req.mutable_q()->set_data(prob.q.data(), prob.q.size());
  if (std::string(mname) == "dense") {
    req.mutable_method()->mutable_dense();
  } else {
    req.mutable_method()->mutable_santa()->set_samples(128);
  }
  std::vector<double> dec, eng, ech, srv;
  v1::DecodeResponse resp;
  for (int i = -10; i < absl::GetFlag(FLAGS_calls); ++i) {
    req.set_seed(i);
    resp.Clear();
    const auto t0 = Clock::now();
    absl::Status s = attn.Decode(req, &resp);
    const auto t1 = Clock::now();
    if (!s.ok()) {
      std::fprintf(stderr, "decode: %s\n", s.ToString().c_str());
      return false;
    }
    if (i >= 0) {
      dec.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      eng.push_back(resp.timing().engine_seconds() * 1e6);
      srv.push_back((resp.timing().server_seconds() - resp.timing().engine_seconds()) * 1e6);
    }
  }
  // The echo carries the same request bytes and returns the same response bytes.
  kvsparse::bench::EchoRequest ereq;
  ereq.set_payload(std::string(req.ByteSizeLong(), 'q'));
  ereq.set_response_bytes(resp.ByteSizeLong());
  kvsparse::bench::EchoResponse eresp;
  for (int i = -10; i < absl::GetFlag(FLAGS_calls); ++i) {
    grpc::ClientContext ctx;
    eresp.Clear();
    const auto t0 = Clock::now();
    grpc::Status s = echo.Echo(&ctx, ereq, &eresp);
    const auto t1 = Clock::now();
    if (!s.ok()) return false;
    if (i >= 0) ech.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  const double d50 = Pct(dec, 0.5), e50 = Pct(eng, 0.5), x50 = Pct(ech, 0.5);
  std::printf("%-11s %3d %10.0f %10.0f %10.0f %10.0f %10.0f %15.1f %13.0f\n", mname, B, d50,
              Pct(dec, 0.99), e50, x50, Pct(ech, 0.99), Pct(srv, 0.5), d50 - e50 - x50);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int tokens = absl::GetFlag(FLAGS_tokens);
  kvsparse::server::ServerOptions so;
  so.listen = "127.0.0.1:0";
  so.metrics_listen = "127.0.0.1:0";
  so.store.capacity_bytes = 4ull << 30;
  so.engine.gpu.mode = kvsparse::engine::GpuMode::kOff;
  std::unique_ptr<kvsparse::kvstore::MemoryResource> memory;
#if KVSPARSE_WITH_CUDA
  if (absl::GetFlag(FLAGS_gpu)) {
    auto pinned = kvsparse::kvstore::NewPinnedHostMemoryResource();
    if (!pinned.ok()) {
      std::fprintf(stderr, "%s\n", pinned.status().ToString().c_str());
      return 1;
    }
    memory = std::move(*pinned);
    so.store.memory = memory.get();
    so.store_pages_mapped = true;
    so.engine.gpu.mode = kvsparse::engine::GpuMode::kOn;
  }
#endif
  auto server = kvsparse::server::Server::Start(so);
  if (!server.ok()) {
    std::fprintf(stderr, "%s\n", server.status().ToString().c_str());
    return 1;
  }
  std::printf("# decode engine: %s; %d tokens per sequence\n", (*server)->engine()->backend(),
              tokens);
  EchoService echo_service;
  grpc::ServerBuilder eb;
  int echo_port = 0;
  eb.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &echo_port);
  eb.RegisterService(&echo_service);
  auto echo_server = eb.BuildAndStart();
  if (absl::GetFlag(FLAGS_serve_echo)) {
    std::printf("serving kvsparse=127.0.0.1:%d echo=127.0.0.1:%d\n", (*server)->port(), echo_port);
    std::fflush(stdout);
    while (std::fgetc(stdin) != EOF) {
    }
    echo_server->Shutdown();
    return 0;
  }

  kvsparse::client::ClientOptions co;
  co.target = absl::StrCat("127.0.0.1:", (*server)->port());
  auto kv = kvsparse::client::KvStoreClient::Connect(co);
  auto attn = kvsparse::client::AttentionClient::Connect(co);
  auto echo = kvsparse::bench::Echo::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", echo_port), grpc::InsecureChannelCredentials()));

  std::printf("%-11s %3s %10s %10s %10s %10s %10s %15s %13s\n", "method", "B", "decode p50",
              "decode p99", "engine p50", "echo p50", "echo p99", "server ovh p50", "e2e-echo p50");
  for (absl::string_view bs : absl::StrSplit(absl::GetFlag(FLAGS_batch), ',')) {
    int B = 0;
    if (!absl::SimpleAtoi(bs, &B) || B < 1) return 2;
    kvsparse::kernels::SyntheticOptions o;
    o.batch = B;
    o.seq_lens.assign(B, tokens);
    auto prob = kvsparse::kernels::SyntheticProblem::Make(o);
    if (!LoadSequences(**kv, prob, B, tokens)) return 1;
    for (const char* mname : {"dense", "santa_prop"}) {
      if (!MeasureMethod(mname, B, prob, **attn, *echo)) return 1;
    }
  }
  echo_server->Shutdown();
  return 0;
}
