// kvsparse-server assembled: the store and the decode engine with their gRPC services,
// grpc.health.v1, server reflection and the Prometheus endpoint, with graceful shutdown. One
// binary serves every role:
//   kAll    store + decode worker in one process (rows gathered in process, zero RPCs)
//   kStore  KvStore service only
//   kWorker Attention service only, reading rows from a remote store (one Gather RPC per
//           sequence per stage)
// main() fills ServerOptions from flags; tests start it on port 0.
#ifndef KVSPARSE_SERVER_SERVER_H_
#define KVSPARSE_SERVER_SERVER_H_

#include <grpcpp/server.h>

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "engine/decode_engine.h"
#include "engine/gpu_mode.h"
#include "kvstore/store.h"
#include "kvstore/ucx_plane.h"
#include "rpc/security.h"
#include "server/metrics.h"
#include "server/request_budget.h"
#include "server/rpc.h"
#include "server/stream_reaper.h"

namespace kvsparse::server {

class AttentionService;
class KvStoreService;

enum class ServerRole { kAll, kStore, kWorker };
// "all", "store" or "worker"; INVALID_ARGUMENT otherwise.
absl::StatusOr<ServerRole> ParseServerRole(absl::string_view name);

struct ServerOptions {
  ServerRole role = ServerRole::kAll;
  // kWorker: the store's KvStore address (host:port).
  std::string store_target;
  // gRPC address, host:port; port 0 picks a free port (see Server::port()).
  std::string listen = "127.0.0.1:50051";
  // Prometheus /metrics address; empty = no metrics endpoint.
  std::string metrics_listen = "127.0.0.1:9464";
  // Largest request or response message. Gathers and appends whose payload would not fit are
  // refused with RESOURCE_EXHAUSTED before any work is done.
  size_t max_message_bytes = 256ull << 20;
  // Bytes of append messages read at once (server/request_budget.h): an append takes its
  // declared size (or max_message_bytes when it declares none) before its body is read, and
  // waits for room until its deadline; one over the whole budget is refused. 0: no bound.
  size_t max_append_bytes_in_flight = 1ull << 30;
  // Deadline applied to calls that carry none.
  absl::Duration default_deadline = absl::Seconds(30);
  // Calls served at once and DecodeStreams open at once (RESOURCE_EXHAUSTED beyond); 0: no bound.
  size_t max_concurrent_calls = 256;
  size_t max_concurrent_streams = 256;
  // With auth_tokens_file: unary calls plus open DecodeStreams one token may hold at once
  // (RESOURCE_EXHAUSTED beyond), so one client cannot take every slot. 0: no per-token bound
  // (the default: one worker's token may rightly carry all of its decode calls' Gathers).
  size_t max_calls_per_token = 0;
  // HTTP/2 keepalive (gRPC's keepalive guidance): the server pings an idle connection every
  // keepalive_time and drops it if the ping is not answered within keepalive_timeout; clients may
  // ping no more often than min_client_ping_interval (more often: GOAWAY); connections with no
  // call for max_connection_idle are closed (0: never).
  absl::Duration keepalive_time = absl::Minutes(2);
  absl::Duration keepalive_timeout = absl::Seconds(20);
  absl::Duration min_client_ping_interval = absl::Seconds(10);
  absl::Duration max_connection_idle = absl::ZeroDuration();
  // A DecodeStream with no request for this long is cancelled (server/stream_reaper.h); 0: never.
  absl::Duration stream_idle_timeout = absl::Minutes(5);
  // On shutdown, in-flight calls get this long to finish before they are cancelled.
  absl::Duration shutdown_grace = absl::Seconds(10);
  // TLS on the gRPC port (cert + key; ca: mutual TLS, clients must present a certificate it
  // signed). Without TLS the server listens on loopback addresses only, unless `insecure`.
  rpc::TlsFiles tls;
  bool insecure = false;
  // Bearer tokens with roles every call must carry (rpc/security.h TokenAuth); empty: none.
  std::string auth_tokens_file;
  // The token file is re-read this often and, when its text changed, swapped in whole (a file that
  // does not parse is logged and the old tokens kept); 0: read once at start.
  absl::Duration auth_tokens_reload = absl::Seconds(10);
  // kWorker: TLS towards the store (ca: the store's CA; cert + key: this worker's identity for
  // a store with mutual TLS) and the token sent to it.
  rpc::TlsFiles store_tls;
  std::string store_token;
  // kWorker: the store's --arena_file as mounted in this process (the shared-arena pod): rows are
  // copied from its pages in place instead of through Gather (rpc/remote_row_source.h).
  std::string store_arena_file;
  // kWorker: "ucx" reads rows over UCX from a store exporting its arena (data_plane below), on
  // any host, one batched gather message per read; "ucx-rma" with one-sided gets per row;
  // "gather" (or empty): through the Gather RPC.
  std::string store_data_plane;
  // kStore / kAll: "ucx" exports the arena (store.memory must be an arena file) over UCX for
  // workers with store_data_plane=ucx; "none" (or empty): no data plane.
  std::string data_plane;
  // UCX transports of both sides (UCX_TLS syntax, e.g. "tcp" or "sm"); empty: UCX's choice.
  std::string data_plane_transports;
  kvstore::StoreOptions store;
  // The decode engine's options, where it decodes among them (engine.gpu: in builds with CUDA,
  // kAuto uses the GPU backend when a CUDA device is present, kOn refuses to start without one,
  // kOff never uses it).
  engine::EngineOptions engine;
  // The store's memory (store.memory) is pinned and CUDA-mapped
  // (kvstore::NewPinnedHostMemoryResource): the GPU reads host rows in place.
  bool store_pages_mapped = false;
};

class Server {
 public:
  // UNAVAILABLE if an address cannot be bound; INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<Server>> Start(ServerOptions options);
  ~Server();  // shuts down if Shutdown() was not called
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int port() const { return port_; }
  int metrics_port() const { return metrics_->port(); }
  kvstore::Store* store() { return store_.get(); }          // null for kWorker
  engine::DecodeEngine* engine() { return engine_.get(); }  // null for kStore

  // Health goes NOT_SERVING, new calls are refused, in-flight calls get shutdown_grace to
  // finish and are then cancelled. Idempotent; thread-safe.
  void Shutdown();
  // Blocks until the server has shut down.
  void Wait();

 private:
  Server() = default;
  // The steps of Start, over options_.
  absl::Status StartStore();
  absl::Status StartEngine();
  absl::StatusOr<std::unique_ptr<engine::RowSource>> RemoteStoreSource();
  // Re-reads the token file every options_.auth_tokens_reload until stop_reload_.
  void ReloadTokens();
  // Re-reads the TLS files every options_.tls.reload until stop_reload_ (TlsFileGuard).
  void ReloadTls();

  ServerOptions options_;
  std::unique_ptr<kvstore::Store> store_;
  std::unique_ptr<kvstore::UcxExport> data_plane_;  // exports store_'s arena (data_plane=ucx)
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<rpc::TokenAuth> auth_;
  std::unique_ptr<RpcRunner> rpc_;
  std::unique_ptr<StreamReaper> reaper_;
  std::unique_ptr<RequestBudget> appends_;  // the append bytes read at once (KvStoreService)
  std::unique_ptr<KvStoreService> kvstore_service_;
  std::unique_ptr<engine::RowSource> row_source_;
  std::unique_ptr<engine::DecodeEngine> engine_;
  std::unique_ptr<AttentionService> attention_service_;
  std::unique_ptr<grpc::Server> grpc_;
  int port_ = 0;
  absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::Notification stop_reload_;
  std::thread token_reload_;                      // runs ReloadTokens; joined in ~Server
  std::unique_ptr<rpc::TlsFileGuard> tls_files_;  // with TLS: the checked copies gRPC serves
  std::thread tls_reload_;                        // runs ReloadTls; joined in ~Server
};

}  // namespace kvsparse::server

#endif  // KVSPARSE_SERVER_SERVER_H_
