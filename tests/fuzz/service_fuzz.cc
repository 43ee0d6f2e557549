// libFuzzer targets over every request type of both services: a real kvsparse-server (store and
// CPU decode engine, in this process, on a loopback port) answers each input through the same
// handlers, conversion and validation a deployment runs. kvsparse_service_fuzz takes every type:
// an input is one byte naming the RPC (mod 10: CreateSequence, DropSequence, Append, Gather,
// GetSequenceInfo, ListSequences, GetStats, Decode, GetPageTable, ForkSequence) and, in
// (byte / 10) mod 6, the
// caller (its
// server checks bearer tokens: admin, writers of tenants t1 and t2, a reader of t1, no token, an
// unknown token; UNAUTHENTICATED and PERMISSION_DENIED are answers like any other), then that
// request's protobuf bytes. The
// targets kvsparse_<rpc>_fuzz (built with KVSPARSE_FUZZ_RPC=<index>) take one type, the input
// being its protobuf bytes alone, and start from a store holding the seed sequences. The store
// keeps its sequences across inputs, so inputs build on each other's state.
//
// A failure: an answer of UNKNOWN or INTERNAL (a client's mistake must get a code that says
// why), UNAVAILABLE (the server stopped serving), or a crash / leak / UB the sanitizers report.
//
// KVSPARSE_FUZZ_SEEDS=<dir> writes a seed corpus (valid requests of every type and method, as
// the tests send) there and exits.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvsparse/v1/attention.grpc.pb.h"
#include "kvsparse/v1/kvstore.grpc.pb.h"
#include "kvstore/shared_arena.h"
#include "server/server.h"

namespace v1 = kvsparse::v1;

namespace {

std::unique_ptr<kvsparse::kvstore::MemoryResource> arena;  // declared first: outlives the server
std::unique_ptr<kvsparse::server::Server> server;
std::unique_ptr<v1::KvStore::Stub> store;
std::unique_ptr<v1::Attention::Stub> attention;

enum Rpc : uint8_t {
  kCreate,
  kDrop,
  kAppend,
  kGather,
  kInfo,
  kList,
  kStats,
  kDecode,
  kPageTable,
  kFork,  // in kvsparse_service_fuzz only (no target of its own)
  kCount
};

void Check(const grpc::Status& s, int rpc) {
  const grpc::StatusCode c = s.error_code();
  if (c == grpc::StatusCode::UNKNOWN || c == grpc::StatusCode::INTERNAL ||
      c == grpc::StatusCode::UNAVAILABLE) {
    std::fprintf(stderr, "rpc %d answered %d: %s\n", rpc, static_cast<int>(c),
                 s.error_message().c_str());
    std::abort();
  }
}

// The callers of kvsparse_service_fuzz, by index: the token each sends ("" for none).
constexpr const char* kTokens[] = {"fuzz-admin-0123456789",
                                   "fuzz-t1-writer-0123456",
                                   "fuzz-t2-writer-0123456",
                                   "fuzz-t1-reader-0123456",
                                   "",
                                   "fuzz-unknown-012345678"};
[[maybe_unused]] constexpr int kCallers = 6;
[[maybe_unused]] constexpr char kTokenFile[] =
    "fuzz-admin-0123456789 admin\nfuzz-t1-writer-0123456 write t1\n"
    "fuzz-t2-writer-0123456 write t2\nfuzz-t1-reader-0123456 read t1\n";

template <typename Req, typename Resp, typename Call>
void Send(const uint8_t* data, size_t size, int rpc, int caller, Call call) {
  Req req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return;  // not a request of this type
  Resp resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  if (caller >= 0 && kTokens[caller][0] != '\0') {
    ctx.AddMetadata("authorization", std::string("Bearer ") + kTokens[caller]);
  }
  Check(call(&ctx, req, &resp), rpc);
}

// ---- Seeds ----------------------------------------------------------------------------------

v1::Tensor Rows(int layers, int tokens, int hkv, int d, float base) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_FP32);
  for (int64_t x : {layers, tokens, hkv, d}) t.add_shape(x);
  std::vector<float> f(static_cast<size_t>(layers) * tokens * hkv * d);
  for (size_t i = 0; i < f.size(); ++i) f[i] = base + 0.01f * static_cast<float>(i % 97);
  t.set_data(f.data(), f.size() * sizeof(float));
  return t;
}

// Every seed request in order, for `put`.
void ForEachSeed(const std::function<void(Rpc, const google::protobuf::Message&)>& put) {
  for (int placement = 0; placement < 3; ++placement) {
    v1::CreateSequenceRequest c;
    c.set_sequence_id("f" + std::to_string(placement));
    v1::ModelShape* s = c.mutable_shape();
    s->set_num_layers(2);
    s->set_num_q_heads(4);
    s->set_num_kv_heads(2);
    s->set_head_dim(16);
    s->set_dtype(v1::DTYPE_FP32);
    if (placement == 1) c.mutable_placement()->set_k_tier(v1::TIER_DEVICE);
    if (placement == 2) c.mutable_placement()->set_signature_bits(32);
    put(kCreate, c);
    v1::AppendRequest a;
    a.set_sequence_id(c.sequence_id());
    a.set_num_layers(2);
    *a.mutable_k() = Rows(2, 40, 2, 16, 0.1f);
    *a.mutable_v() = Rows(2, 40, 2, 16, -0.2f);
    put(kAppend, a);
  }
  v1::GatherRequest g;
  g.set_sequence_id("f0");
  g.set_layer(1);
  v1::HeadSelection* hs = g.add_heads();
  hs->set_kv_head(1);
  for (uint32_t t : {0u, 3u, 3u, 39u}) hs->add_token_indices(t);
  g.set_unique(true);
  put(kGather, g);
  v1::GetSequenceInfoRequest info;
  info.set_sequence_id("f1");
  put(kInfo, info);
  v1::GetPageTableRequest pt;
  pt.set_sequence_id("f0");
  pt.set_layer(1);
  put(kPageTable, pt);
  v1::ForkSequenceRequest fork;  // f0's first 33 tokens: one page shared at most, the rest copied
  fork.set_source_id("f0");
  fork.set_sequence_id("f0-fork");
  fork.set_num_tokens(33);
  put(kFork, fork);
  put(kList, v1::ListSequencesRequest());
  put(kStats, v1::GetStatsRequest());
  for (int method = 0; method < 5; ++method) {
    v1::DecodeRequest d;
    d.set_layer(1);
    d.add_sequence_ids(method == 1 || method == 3 ? "f1" : method == 2 ? "f2" : "f0");
    *d.mutable_q() = Rows(1, 1, 4, 16, 0.3f);
    d.mutable_q()->clear_shape();
    for (int64_t x : {1, 4, 16}) d.mutable_q()->add_shape(x);
    d.set_seed(5);
    switch (method) {
      case 0:
        d.mutable_method()->mutable_dense();
        *d.mutable_new_k() = Rows(1, 1, 2, 16, 0.5f);
        *d.mutable_new_v() = Rows(1, 1, 2, 16, 0.5f);
        for (v1::Tensor* t : {d.mutable_new_k(), d.mutable_new_v()}) {
          t->clear_shape();
          for (int64_t x : {1, 2, 16}) t->add_shape(x);
        }
        break;
      case 1:
        d.mutable_method()->mutable_santa()->set_samples(16);
        break;
      case 2:
        d.mutable_method()->mutable_hash_top_k()->set_top_k(4);
        break;
      case 3:
        d.mutable_method()->mutable_vattention()->set_predictor(v1::TOP_K_PREDICTOR_EXACT);
        d.mutable_method()->mutable_vattention()->set_epsilon(0.1f);
        d.mutable_method()->mutable_vattention()->set_delta(0.1f);
        break;
      case 4:
        d.mutable_method()->mutable_saap()->set_probes(2);  // no partitions: FAILED_PRECONDITION
        break;
    }
    put(kDecode, d);
  }
  v1::DropSequenceRequest drop;
  drop.set_sequence_id("f2");
  put(kDrop, drop);
}

// The seed corpus: with a fixed RPC, its requests' bytes; else every request behind its byte.
void WriteSeeds(const std::string& dir) {
  int n = 0;
  ForEachSeed([&](Rpc rpc, const google::protobuf::Message& m) {
    std::string bytes;
#ifdef KVSPARSE_FUZZ_RPC
    if (rpc != KVSPARSE_FUZZ_RPC) return;
#else
    bytes.push_back(static_cast<char>(rpc));
#endif
    bytes += m.SerializeAsString();
    std::ofstream(dir + "/seed-" + std::to_string(n++), std::ios::binary) << bytes;
  });
  std::fprintf(stderr, "wrote %d seeds to %s\n", n, dir.c_str());
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  if (const char* dir = std::getenv("KVSPARSE_FUZZ_SEEDS")) {
    WriteSeeds(dir);
    std::exit(0);
  }
  kvsparse::server::ServerOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_listen = "";
  o.store.capacity_bytes = 64ull << 20;
  o.store.policy = kvsparse::kvstore::CapacityPolicy::kEvictLru;
  o.max_message_bytes = 16 << 20;
  o.engine.gpu.mode = kvsparse::engine::GpuMode::kOff;
  o.default_deadline = absl::Seconds(20);
  // The store's pages in an arena file (so GetPageTable has tables to give), unlinked at once:
  // the mapping keeps it, and nothing is left behind.
  const std::string arena_path = "/tmp/kvsparse-fuzz-arena-" + std::to_string(getpid());
  auto file = kvsparse::kvstore::NewFileMemoryResource(arena_path, o.store.capacity_bytes,
                                                       o.store.page_bytes);
  if (!file.ok()) {
    std::fprintf(stderr, "arena: %s\n", file.status().ToString().c_str());
    std::abort();
  }
  unlink(arena_path.c_str());
  arena = std::move(*file);
  o.store.memory = arena.get();
#ifndef KVSPARSE_FUZZ_RPC
  o.auth_tokens_file = "/tmp/kvsparse-fuzz-tokens-" + std::to_string(getpid());
  std::ofstream(o.auth_tokens_file) << kTokenFile;
#endif
  auto s = kvsparse::server::Server::Start(o);
  if (!s.ok()) {
    std::fprintf(stderr, "server: %s\n", s.status().ToString().c_str());
    std::abort();
  }
  server = std::move(*s);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  auto channel = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(server->port()),
                                           grpc::InsecureChannelCredentials(), args);
  store = v1::KvStore::NewStub(channel);
  attention = v1::Attention::NewStub(channel);
#ifdef KVSPARSE_FUZZ_RPC
  // One request type alone would rarely meet a sequence to act on: start from the seeds' store.
  ForEachSeed([](Rpc rpc, const google::protobuf::Message& m) {
    if (rpc != kCreate && rpc != kAppend) return;
    grpc::ClientContext ctx;
    if (rpc == kCreate) {
      v1::SequenceInfo info;
      store->CreateSequence(&ctx, static_cast<const v1::CreateSequenceRequest&>(m), &info);
    } else {
      v1::AppendResponse resp;
      store->Append(&ctx, static_cast<const v1::AppendRequest&>(m), &resp);
    }
  });
#endif
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
#ifdef KVSPARSE_FUZZ_RPC
  const int rpc = KVSPARSE_FUZZ_RPC;
  const uint8_t* body = data;
  const size_t n = size;
  const int caller = -1;  // no tokens
#else
  if (size < 1) return 0;
  const int rpc = data[0] % kCount;
  const int caller = (data[0] / kCount) % kCallers;
  const uint8_t* body = data + 1;
  const size_t n = size - 1;
#endif
  switch (rpc) {
    case kCreate:
      Send<v1::CreateSequenceRequest, v1::SequenceInfo>(
          body, n, rpc, caller,
          [](auto* c, const auto& r, auto* p) { return store->CreateSequence(c, r, p); });
      break;
    case kDrop:
      Send<v1::DropSequenceRequest, v1::DropSequenceResponse>(
          body, n, rpc, caller,
          [](auto* c, const auto& r, auto* p) { return store->DropSequence(c, r, p); });
      break;
    case kAppend:
      Send<v1::AppendRequest, v1::AppendResponse>(
          body, n, rpc, caller,
          [](auto* c, const auto& r, auto* p) { return store->Append(c, r, p); });
      break;
    case kGather:
      Send<v1::GatherRequest, v1::GatherResponse>(
          body, n, rpc, caller,
          [](auto* c, const auto& r, auto* p) { return store->Gather(c, r, p); });
      break;
    case kInfo:
      Send<v1::GetSequenceInfoRequest, v1::SequenceInfo>(
          body, n, rpc, caller,
          [](auto* c, const auto& r, auto* p) { return store->GetSequenceInfo(c, r, p); });
      break;
    case kList:
      Send<v1::ListSequencesRequest, v1::ListSequencesResponse>(
          body, n, rpc, caller,
          [](auto* c, const auto& r, auto* p) { return store->ListSequences(c, r, p); });
      break;
    case kStats:
      Send<v1::GetStatsRequest, v1::StoreStats>(
          body, n, rpc, caller,
          [](auto* c, const auto& r, auto* p) { return store->GetStats(c, r, p); });
      break;
    case kDecode:
      Send<v1::DecodeRequest, v1::DecodeResponse>(
          body, n, rpc, caller,
          [](auto* c, const auto& r, auto* p) { return attention->Decode(c, r, p); });
      break;
    case kPageTable:
      Send<v1::GetPageTableRequest, v1::PageTable>(
          body, n, rpc, caller,
          [](auto* c, const auto& r, auto* p) { return store->GetPageTable(c, r, p); });
      break;
    case kFork:
      Send<v1::ForkSequenceRequest, v1::SequenceInfo>(
          body, n, rpc, caller,
          [](auto* c, const auto& r, auto* p) { return store->ForkSequence(c, r, p); });
      break;
  }
  return 0;
}
