// kvsparse-server: the KV store service and the decode worker (Attention service), in one
// process by default or split by --role. Flags are read here and nowhere else.
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "engine/engine_settings.h"
#include "engine/gpu_mode.h"
#include "kernels/hash_signatures.h"
#include "kernels/saap.h"
#include "kvstore/memory_resource.h"
#include "kvstore/shared_arena.h"
#include "rpc/build_info.h"
#include "rpc/flags_help.h"
#include "rpc/logging.h"
#include "server/byte_size.h"
#include "server/memory_trimmer.h"
#include "server/server.h"

using kvsparse::server::ByteSize;

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "gRPC address to serve on (host:port; 0.0.0.0:PORT for all interfaces, which needs "
          "--tls_cert/--tls_key or --insecure)");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain of this server: TLS on the gRPC port (with --tls_key); the files "
          "are re-read every --tls_reload, so a renewed certificate needs no restart");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA certificate(s): mutual TLS, clients must present a certificate they signed");
ABSL_FLAG(absl::Duration, tls_reload, absl::Seconds(60),
          "How often the TLS files (server and --store_tls_*) are re-read");
ABSL_FLAG(bool, insecure, false,
          "Allow a non-loopback --listen without TLS (a network you trust: K/V cross in clear)");
ABSL_FLAG(
    std::string, auth_tokens, "",
    "File of bearer tokens, one \"<token> <role> [tenant]\" per line (token: 16-512 printable "
    "characters, no spaces; role: read, write, admin; tenant: 1-64 of [A-Za-z0-9._-], its "
    "calls then see only its own sequences; '#' comments): every call must carry one (metadata "
    "\"authorization: Bearer <token>\"); empty: no tokens");
ABSL_FLAG(absl::Duration, auth_tokens_reload, absl::Seconds(10),
          "How often the --auth_tokens file is re-read; changed tokens apply without a restart "
          "(a file that does not parse is logged and the old tokens kept); 0: never");
ABSL_FLAG(std::string, store_tls_ca, "",
          "role=worker: PEM CA of the store's certificate (TLS towards the store)");
ABSL_FLAG(std::string, store_tls_cert, "",
          "role=worker: PEM certificate of this worker for a store with mutual TLS");
ABSL_FLAG(std::string, store_tls_key, "", "role=worker: PEM key of --store_tls_cert");
ABSL_FLAG(std::string, store_token_file, "",
          "role=worker: file holding the bearer token sent to the store (first line)");
ABSL_FLAG(std::string, store_arena_file, "",
          "role=worker: the store's --arena_file as mounted here (same host, e.g. a memory-backed "
          "volume of the pod): rows are read from its pages in place, not through Gather; reads "
          "fall back to Gather while it cannot be mapped");
ABSL_FLAG(std::string, store_data_plane, "gather",
          "role=worker: how rows of the store's pages travel: gather (the Gather RPC), ucx (UCX "
          "from a store with --data_plane=ucx, on any host: one batched gather message per read) "
          "or ucx-rma (one-sided UCX gets per row, for RDMA); ucx falls back to Gather while it "
          "cannot connect");
ABSL_FLAG(std::string, data_plane, "none",
          "role=store/all: none, or ucx: export the arena (needs --arena_file) for workers with "
          "--store_data_plane=ucx");
ABSL_FLAG(std::string, data_plane_transports, "",
          "UCX transports of the data plane, UCX_TLS syntax (e.g. tcp, sm, rc); empty: UCX's "
          "choice");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464",
          "Address of the Prometheus /metrics endpoint; empty disables it");
ABSL_FLAG(std::string, saap_weights, "",
          "SAAP partitions (format in kernels/saap.h, written by kvsparse-calibrate --saap_out): "
          "enables the saap method; each key's bucket is then its signature (sequences with "
          "signature_bits=32), and the hash methods are refused. Empty: none");
ABSL_FLAG(
    std::string, key_widths, "",
    "Per-channel widths of compressed keys (format in kernels/key_widths.h, written by "
    "kvsparse-key-widths): sequences of that model whose placement keeps compressed "
    "keys of its bits keep them at those widths, on the CPU engine and the GPU's. Empty: uniform "
    "widths");
ABSL_FLAG(
    uint64_t, max_sequences, 100000,
    "Most sequences the store holds at once; creating more is RESOURCE_EXHAUSTED (0: no bound)");
ABSL_FLAG(
    uint32_t, max_concurrent_calls, 256,
    "Calls (and decode stream steps) served at once; more are RESOURCE_EXHAUSTED (0: no bound)");
ABSL_FLAG(uint32_t, max_concurrent_streams, 256,
          "DecodeStreams open at once; more are RESOURCE_EXHAUSTED (0: no bound)");
ABSL_FLAG(uint32_t, max_calls_per_token, 0,
          "With --auth_tokens: unary calls plus open DecodeStreams one token may hold at once; "
          "more are RESOURCE_EXHAUSTED (0: no per-token bound)");
ABSL_FLAG(ByteSize, max_decode_bytes, ByteSize{kvsparse::engine::EngineOptions{}.max_call_bytes},
          "Most K+V bytes one Decode call may cover (its dense-equivalent bytes, what the CPU "
          "engine may gather for it); more is RESOURCE_EXHAUSTED");
ABSL_FLAG(absl::Duration, keepalive_time, absl::Minutes(2),
          "Ping an idle connection this often (HTTP/2 keepalive)");
ABSL_FLAG(absl::Duration, keepalive_timeout, absl::Seconds(20),
          "Drop a connection whose keepalive ping is not answered within this");
ABSL_FLAG(absl::Duration, min_client_ping_interval, absl::Seconds(10),
          "Clients may ping no more often than this (more often: the connection is closed)");
ABSL_FLAG(absl::Duration, stream_idle_timeout, absl::Minutes(5),
          "A DecodeStream with no request for this long is cancelled (frees its "
          "--max_concurrent_streams slot); 0 = never");
ABSL_FLAG(absl::Duration, max_connection_idle, absl::ZeroDuration(),
          "Close connections with no call for this long (0: never)");
ABSL_FLAG(uint32_t, max_call_sequences,
          static_cast<uint32_t>(kvsparse::engine::EngineOptions{}.max_call_sequences),
          "Most sequences one Decode call may name (each once); more is INVALID_ARGUMENT");
ABSL_FLAG(std::string, port_file, "",
          "Once serving, write '<grpc port> <metrics port>' (0: no metrics) to this file (written "
          "whole, by rename): with --listen=HOST:0 a launcher learns the ports the server bound");
ABSL_FLAG(ByteSize, capacity, ByteSize{4ull << 30},
          "Most bytes of K/V pages the store holds (e.g. 512M, 64G)");
ABSL_FLAG(std::string, capacity_policy, "reject",
          "When full: 'reject' (appends get RESOURCE_EXHAUSTED) or 'evict-lru' (evict whole idle "
          "sequences, least recently used first)");
ABSL_FLAG(ByteSize, page_size, ByteSize{64 << 10},
          "Bytes per store page (multiple of 4K); a page holds one (layer, kv head)'s rows");
ABSL_FLAG(bool, huge_pages, true, "Ask for transparent huge pages on the host arena");
ABSL_FLAG(absl::Duration, memory_trim_interval, absl::Seconds(10),
          "How often the heap's free memory goes back to the system (server/memory_trimmer.h; "
          "0: glibc's defaults, the RSS may stay above --capacity after bursts)");
ABSL_FLAG(ByteSize, max_message_size, ByteSize{256 << 20},
          "Largest gRPC request or response; larger gathers/appends get RESOURCE_EXHAUSTED");
ABSL_FLAG(ByteSize, max_append_bytes_in_flight, ByteSize{1ull << 30},
          "Bytes of append messages read at once: each append takes the size its client declares "
          "(kvsparse-request-bytes; the largest message when it declares none) before its body is "
          "read and waits for room until its deadline; 0 = no bound");
ABSL_FLAG(absl::Duration, default_deadline, absl::Seconds(30),
          "Deadline applied to calls that carry none");
ABSL_FLAG(absl::Duration, shutdown_grace, absl::Seconds(10),
          "On SIGTERM/SIGINT, how long in-flight calls may take before they are cancelled");
ABSL_FLAG(std::string, log_level, "info", "debug, info, warning or error");
ABSL_FLAG(std::string, log_format, "text",
          "text (\"I1127 05:50:00.123456 tid file:line] message\") or json (one object a line: "
          "time in RFC 3339 UTC, level, thread, source, message)");
ABSL_FLAG(std::string, role, "all",
          "all: store + decode worker in one process; store: KvStore service only; worker: "
          "Attention service only, reading rows from --store");
ABSL_FLAG(std::string, store, "",
          "role=worker: the store's address (host:port), or its shards' in shard order, "
          "comma-separated; NAME-{0..3}.SERVICE:PORT expands to the four pods of a StatefulSet "
          "behind a headless Service. Each sequence lives on the shard that rendezvous hashing "
          "of its id picks (the model server's client places it the same way)");
ABSL_FLAG(uint32_t, shard_index, 0,
          "role=store/all: this store's index among --shard_count shards (a StatefulSet pod's "
          "ordinal); creating a sequence that belongs to another shard is FAILED_PRECONDITION");
ABSL_FLAG(uint32_t, shard_count, 1,
          "role=store/all: how many store shards the fleet has (1: not sharded)");
ABSL_FLAG(std::string, arena_file, "",
          "role=store: keep the store's pages in this file (created, sized to --capacity, mapped "
          "shared), e.g. on a memory-backed volume another container of the pod mounts too");
ABSL_FLAG(ByteSize, resident_capacity,
          ByteSize{kvsparse::engine::EngineOptions{}.resident_capacity_bytes},
          "Most bytes of device-tier state the worker keeps (resident K/V, key signatures, "
          "compressed keys), on the GPU too unless --gpu_capacity is given");
ABSL_FLAG(ByteSize, gpu_capacity, ByteSize{0},
          "Most bytes of GPU memory the GPU engine holds for sequences (their K/V, signatures, "
          "compressed keys and row caches); 0 = --resident_capacity");
ABSL_FLAG(uint32_t, default_tile_size,
          static_cast<uint32_t>(kvsparse::engine::EngineOptions{}.default_tile_size),
          "S2ANTA tile size when a request gives 0");
ABSL_FLAG(std::string, gpu, "auto",
          "Decode on the GPU: auto (when this build has CUDA and a device is present; the store's "
          "pages are then pinned and mapped so the GPU reads host rows in place), on (fail "
          "without one) or off (CPU engine)");
ABSL_FLAG(int, gpu_device, kvsparse::engine::GpuOptions{}.device,
          "CUDA device ordinal of the GPU backend");
ABSL_FLAG(double, gpu_row_cache, kvsparse::engine::GpuOptions{}.row_cache,
          "HashAttention on the GPU: rows per kv head kept on the GPU from one step to the next "
          "(a row cache: consecutive steps select mostly the same rows), as a fraction of each "
          "sequence's tokens; 0 = no cache, every selected row crosses each step");
ABSL_FLAG(int, gpu_fetch_parallelism, kvsparse::engine::GpuOptions{}.fetch_parallelism,
          "GPU worker with --store (K/V in another process): how many of a batch's sequences "
          "have their selected rows fetched from the store at once (1: one after another)");
ABSL_FLAG(int, gpu_stage_timing_every, kvsparse::engine::GpuOptions{}.stage_timing_every,
          "GPU engine: time the selection / gather / compute stages (CUDA events) of one Decode "
          "call in this many (1: every call, 0: never); the events cost host time per call");
ABSL_FLAG(uint64_t, signature_seed, kvsparse::engine::SignatureConfig{}.simhash_seed,
          "Seed of the SimHash hyperplanes (fixed per deployment: cached signatures depend on it)");
ABSL_FLAG(double, signature_norm_margin, kvsparse::engine::SignatureConfig{}.norm_margin,
          "SimHash M = this x the largest key norm seen at a layer's first sync");
ABSL_FLAG(std::string, hash_weights, "",
          "Learned HashAttention MLP weights (kernels/hash_signatures.h format); empty = SimHash");

namespace {

namespace kv = kvsparse::kvstore;
namespace rpc = kvsparse::rpc;
namespace srv = kvsparse::server;

// What the flags ask for that must outlive Server::Start: the store's memory (host pages, or
// the arena file of a store that shares it).
struct Resources {
  std::unique_ptr<kv::MemoryResource> host;
  std::unique_ptr<kv::MemoryResource> arena;
};

// A flag's error: INVALID_ARGUMENT (exit code 2) with the message the user sees.
absl::Status Bad(absl::string_view message) { return absl::InvalidArgumentError(message); }

absl::Status LoggingFromFlags() {
  const std::string level = absl::GetFlag(FLAGS_log_level);
  if (level == "debug") {
    rpc::SetMinLogLevel(rpc::LogLevel::kDebug);
  } else if (level == "warning") {
    rpc::SetMinLogLevel(rpc::LogLevel::kWarning);
  } else if (level == "error") {
    rpc::SetMinLogLevel(rpc::LogLevel::kError);
  } else if (level != "info") {
    return Bad("--log_level must be debug, info, warning or error");
  }
  const std::string format = absl::GetFlag(FLAGS_log_format);
  if (format == "json") {
    rpc::SetLogFormat(rpc::LogFormat::kJson);
  } else if (format != "text") {
    return Bad("--log_format must be text or json");
  }
  return absl::OkStatus();
}

// Ports, limits, keepalive, TLS and tokens, and how a worker reaches its store.
absl::Status NetworkFromFlags(srv::ServerOptions* o) {
  o->listen = absl::GetFlag(FLAGS_listen);
  o->metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  o->max_message_bytes = absl::GetFlag(FLAGS_max_message_size).bytes;
  o->max_append_bytes_in_flight = absl::GetFlag(FLAGS_max_append_bytes_in_flight).bytes;
  o->default_deadline = absl::GetFlag(FLAGS_default_deadline);
  o->max_concurrent_calls = absl::GetFlag(FLAGS_max_concurrent_calls);
  o->max_concurrent_streams = absl::GetFlag(FLAGS_max_concurrent_streams);
  o->max_calls_per_token = absl::GetFlag(FLAGS_max_calls_per_token);
  o->keepalive_time = absl::GetFlag(FLAGS_keepalive_time);
  o->keepalive_timeout = absl::GetFlag(FLAGS_keepalive_timeout);
  o->min_client_ping_interval = absl::GetFlag(FLAGS_min_client_ping_interval);
  o->max_connection_idle = absl::GetFlag(FLAGS_max_connection_idle);
  o->stream_idle_timeout = absl::GetFlag(FLAGS_stream_idle_timeout);
  o->shutdown_grace = absl::GetFlag(FLAGS_shutdown_grace);
  const absl::Duration tls_reload = absl::GetFlag(FLAGS_tls_reload);
  o->tls = {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
            absl::GetFlag(FLAGS_tls_client_ca), tls_reload};
  o->insecure = absl::GetFlag(FLAGS_insecure);
  o->auth_tokens_file = absl::GetFlag(FLAGS_auth_tokens);
  o->auth_tokens_reload = absl::GetFlag(FLAGS_auth_tokens_reload);
  o->store_tls = {absl::GetFlag(FLAGS_store_tls_cert), absl::GetFlag(FLAGS_store_tls_key),
                  absl::GetFlag(FLAGS_store_tls_ca), tls_reload};
  if (const std::string f = absl::GetFlag(FLAGS_store_token_file); !f.empty()) {
    absl::StatusOr<std::string> token = rpc::ReadTokenFile(f);
    if (!token.ok()) return Bad(absl::StrCat("--store_token_file: ", token.status().message()));
    o->store_token = *token;
  }
  o->store_arena_file = absl::GetFlag(FLAGS_store_arena_file);
  o->store_data_plane = absl::GetFlag(FLAGS_store_data_plane);
  o->data_plane = absl::GetFlag(FLAGS_data_plane);
  o->data_plane_transports = absl::GetFlag(FLAGS_data_plane_transports);
  return absl::OkStatus();
}

// The role, the store (capacity, pages, policy, shard, its memory) and the worker's store.
absl::Status StoreFromFlags(srv::ServerOptions* o, Resources* r) {
  o->store.max_sequences = absl::GetFlag(FLAGS_max_sequences);
  o->store.shard = {absl::GetFlag(FLAGS_shard_index), absl::GetFlag(FLAGS_shard_count)};
  o->store.capacity_bytes = absl::GetFlag(FLAGS_capacity).bytes;
  o->store.page_bytes = absl::GetFlag(FLAGS_page_size).bytes;
  absl::StatusOr<kv::CapacityPolicy> policy =
      kv::ParseCapacityPolicy(absl::GetFlag(FLAGS_capacity_policy));
  if (!policy.ok()) return Bad(absl::StrCat("--capacity_policy: ", policy.status().message()));
  o->store.policy = *policy;
  absl::StatusOr<srv::ServerRole> role = srv::ParseServerRole(absl::GetFlag(FLAGS_role));
  if (!role.ok()) return Bad(absl::StrCat("--role: ", role.status().message()));
  o->role = *role;
  o->store_target = absl::GetFlag(FLAGS_store);
  if (!o->store_arena_file.empty() && o->role != srv::ServerRole::kWorker) {
    return Bad("--store_arena_file needs --role=worker");
  }
  // Pinned, CUDA-mapped pages when the GPU backend may run: it reads the rows it selects in
  // place (not a flag error when it fails: exit code 1).
  kv::HostMemoryOptions host;
  host.huge_pages = absl::GetFlag(FLAGS_huge_pages);
  absl::StatusOr<kvsparse::engine::HostMemory> memory =
      kvsparse::engine::NewHostMemory(o->engine.gpu.mode, host);
  if (!memory.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--gpu=", absl::GetFlag(FLAGS_gpu), ": ", memory.status().ToString()));
  }
  o->store_pages_mapped = memory->mapped;
  r->host = std::move(memory->resource);
  o->store.memory = r->host.get();
  if (const std::string f = absl::GetFlag(FLAGS_arena_file); !f.empty()) {
    if (o->role != srv::ServerRole::kStore) return Bad("--arena_file needs --role=store");
    absl::StatusOr<std::unique_ptr<kv::MemoryResource>> file =
        kv::NewFileMemoryResource(f, o->store.capacity_bytes, o->store.page_bytes);
    if (!file.ok()) return Bad(file.status().message());
    r->arena = std::move(*file);
    o->store.memory = r->arena.get();
    o->store_pages_mapped = false;
  }
  return absl::OkStatus();
}

// The engine's flags (read before the store's memory, which depends on --gpu): its limits,
// defaults, GPU backend and signature keys (SimHash, or learned or SAAP weights), read by the
// engine's one reader of settings (the op's arguments go through it too).
absl::Status EngineFromFlags(srv::ServerOptions* o) {
  kvsparse::engine::EngineSettings s;
  s.gpu = absl::GetFlag(FLAGS_gpu);
  kvsparse::engine::EngineOptions& e = s.options;
  e.gpu.device = absl::GetFlag(FLAGS_gpu_device);
  e.gpu.row_cache = absl::GetFlag(FLAGS_gpu_row_cache);
  e.gpu.stage_timing_every = absl::GetFlag(FLAGS_gpu_stage_timing_every);
  e.gpu.fetch_parallelism = absl::GetFlag(FLAGS_gpu_fetch_parallelism);
  e.max_call_bytes = absl::GetFlag(FLAGS_max_decode_bytes).bytes;
  e.resident_capacity_bytes = absl::GetFlag(FLAGS_resident_capacity).bytes;
  s.gpu_capacity = absl::GetFlag(FLAGS_gpu_capacity).bytes;
  e.max_call_sequences = absl::GetFlag(FLAGS_max_call_sequences);
  e.default_tile_size = static_cast<int32_t>(absl::GetFlag(FLAGS_default_tile_size));
  e.signatures.simhash_seed = absl::GetFlag(FLAGS_signature_seed);
  e.signatures.norm_margin = static_cast<float>(absl::GetFlag(FLAGS_signature_norm_margin));
  s.hash_weights = absl::GetFlag(FLAGS_hash_weights);
  s.saap_weights = absl::GetFlag(FLAGS_saap_weights);
  s.key_widths = absl::GetFlag(FLAGS_key_widths);
  absl::StatusOr<kvsparse::engine::EngineOptions> options =
      kvsparse::engine::EngineOptionsFrom(s, "--");
  if (!options.ok()) return Bad(options.status().message());
  o->engine = *std::move(options);
  return absl::OkStatus();
}

// "PORT METRICS_PORT\n" into --port_file (written whole: a temporary file renamed).
bool WritePortFile(const std::string& path, int port, int metrics_port) {
  const std::string tmp = path + ".tmp";
  std::ofstream f(tmp, std::ios::trunc);
  f << port << " " << metrics_port << "\n";
  f.close();
  return f && std::rename(tmp.c_str(), path.c_str()) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "KV-offloaded sparse decoding service.\n"
      "  kvsparse-server --listen=127.0.0.1:50051 --metrics_listen=127.0.0.1:9464 "
      "--capacity=8G --capacity_policy=evict-lru");
  absl::FlagsUsageConfig usage;
  usage.version_string = [] { return kvsparse::BuildInfoLine("kvsparse-server") + "\n"; };
  absl::SetFlagsUsageConfig(usage);
  rpc::HandleHelp(argc, argv, "server/main.");
  absl::ParseCommandLine(argc, argv);

  srv::ServerOptions options;
  Resources resources;
  // In order, stopping at the first error: --gpu (the engine's flags) decides the store's memory.
  absl::Status s = LoggingFromFlags();
  if (s.ok()) s = NetworkFromFlags(&options);
  if (s.ok()) s = EngineFromFlags(&options);
  if (s.ok()) s = StoreFromFlags(&options, &resources);
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", std::string(s.message()).c_str());
    return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }

  // Signals are taken by sigwait below, so block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  srv::MemoryTrimmer trimmer(absl::GetFlag(FLAGS_memory_trim_interval));
  auto server = srv::Server::Start(options);
  if (!server.ok()) {
    KVSPARSE_LOG(Error) << "cannot start: " << server.status();
    return 1;
  }
  if (const std::string path = absl::GetFlag(FLAGS_port_file); !path.empty()) {
    const int metrics = absl::GetFlag(FLAGS_metrics_listen).empty() ? 0 : (*server)->metrics_port();
    if (!WritePortFile(path, (*server)->port(), metrics)) {
      KVSPARSE_LOG(Error) << "--port_file: cannot write " << path;
      (*server)->Shutdown();
      (*server)->Wait();
      return 1;
    }
  }
  int sig = 0;
  sigwait(&signals, &sig);
  KVSPARSE_LOG(Info) << "received " << strsignal(sig);
  (*server)->Shutdown();
  (*server)->Wait();
  return 0;
}
