#include "server/server.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include "absl/strings/str_cat.h"
#include "kvstore/placement.h"
#include "rpc/data_plane.h"
#include "rpc/logging.h"
#include "rpc/remote_row_source.h"
#include "rpc/store_connection.h"
#include "server/attention_service.h"
#include "server/kvstore_service.h"
#if KVSPARSE_WITH_CUDA
#endif

namespace kvsparse::server {

absl::StatusOr<ServerRole> ParseServerRole(absl::string_view name) {
  if (name == "all") return ServerRole::kAll;
  if (name == "store") return ServerRole::kStore;
  if (name == "worker") return ServerRole::kWorker;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown role '", name, "' (want all, store or worker)"));
}

namespace {
const char* RoleName(ServerRole r) {
  return r == ServerRole::kAll ? "all" : r == ServerRole::kStore ? "store" : "worker";
}

// The listening port's credentials: TLS from checked copies of --tls_cert / --tls_key (kept in
// *tls_files for the reloads), or plaintext on a loopback address or with --insecure.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const ServerOptions& options, std::unique_ptr<rpc::TlsFileGuard>* tls_files) {
  if (!options.tls.cert.empty() || !options.tls.key.empty()) {
    absl::StatusOr<std::unique_ptr<rpc::TlsFileGuard>> guard =
        rpc::TlsFileGuard::Create(options.tls);
    if (!guard.ok()) return guard.status();
    *tls_files = *std::move(guard);
    return rpc::TlsServerCredentials((*tls_files)->served());
  }
  if (!options.tls.ca.empty()) {
    return absl::InvalidArgumentError("--tls_client_ca needs --tls_cert and --tls_key");
  }
  if (!rpc::IsLoopbackAddress(options.listen) && !options.insecure) {
    return absl::InvalidArgumentError(absl::StrCat(
        "refusing to listen on ", options.listen,
        " without TLS: K/V and queries would cross the network in clear text; give --tls_cert "
        "and --tls_key, or --insecure on a network you trust"));
  }
  return grpc::InsecureServerCredentials();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::Start(ServerOptions options) {
  if (options.role == ServerRole::kWorker && options.store_target.empty()) {
    return absl::InvalidArgumentError(
        "a worker needs the store's address (--store=HOST:PORT, or its shards': "
        "--store=HOST0:PORT,HOST1:PORT or NAME-{0..3}.SERVICE:PORT)");
  }
  if (options.max_message_bytes < (1 << 20) || options.max_message_bytes > (1ull << 31) - 1) {
    return absl::InvalidArgumentError("max_message_bytes must be in 1 MiB .. 2 GiB - 1");
  }
  if (options.max_append_bytes_in_flight != 0 &&
      options.max_append_bytes_in_flight < options.max_message_bytes) {
    // An append that declares no size is charged the largest message: it must fit.
    return absl::InvalidArgumentError(
        "--max_append_bytes_in_flight must be 0 (no bound) or at least --max_message_size");
  }
  // Payload limits leave room for the message's other fields.
  const uint64_t payload_limit = options.max_message_bytes - (64 << 10);
  options.store.max_gather_bytes = std::min(options.store.max_gather_bytes, payload_limit);
  options.store.max_append_bytes = std::min(options.store.max_append_bytes, payload_limit / 2);

  // Transport security first: a server that would expose K/V in clear text refuses to start.
  const bool tls = !options.tls.cert.empty() || !options.tls.key.empty();
  std::unique_ptr<rpc::TlsFileGuard> tls_files;
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds =
      ServerCredentialsFor(options, &tls_files);
  if (!creds.ok()) return creds.status();
  std::unique_ptr<Server> s(new Server());
  s->options_ = options;
  s->tls_files_ = std::move(tls_files);
  if (!options.auth_tokens_file.empty()) {
    absl::StatusOr<std::unique_ptr<rpc::TokenAuth>> auth =
        rpc::TokenAuth::Load(options.auth_tokens_file);
    if (!auth.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--auth_tokens: ", auth.status().message()));
    }
    s->auth_ = std::move(*auth);
  }
  absl::StatusOr<std::unique_ptr<Metrics>> metrics = Metrics::Create(options.metrics_listen);
  if (!metrics.ok()) return metrics.status();
  s->metrics_ = std::move(*metrics);
  s->rpc_ = std::make_unique<RpcRunner>(
      options.default_deadline,
      RpcLimits{options.max_concurrent_calls, options.max_concurrent_streams,
                options.max_calls_per_token},
      s->auth_.get());
  s->metrics_->WatchInFlight(s->rpc_->calls_in_flight(), s->rpc_->streams_open());
  if (options.role != ServerRole::kWorker) {
    if (absl::Status st = s->StartStore(); !st.ok()) return st;
  }
  if (options.role != ServerRole::kStore) {
    if (absl::Status st = s->StartEngine(); !st.ok()) return st;
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, *creds, &s->port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  auto ms = [](absl::Duration d) { return static_cast<int>(absl::ToInt64Milliseconds(d)); };
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, ms(options.keepalive_time));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ms(options.keepalive_timeout));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             ms(options.min_client_ping_interval));
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 2);
  if (options.max_connection_idle > absl::ZeroDuration()) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, ms(options.max_connection_idle));
  }
  if (s->kvstore_service_) builder.RegisterService(s->kvstore_service_.get());
  if (s->attention_service_) builder.RegisterService(s->attention_service_.get());
  s->grpc_ = builder.BuildAndStart();
  if (s->grpc_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen));
  }
  grpc::HealthCheckServiceInterface* health = s->grpc_->GetHealthCheckService();
  health->SetServingStatus(true);
  if (s->kvstore_service_) health->SetServingStatus(v1::KvStore::service_full_name(), true);
  if (s->attention_service_) health->SetServingStatus(v1::Attention::service_full_name(), true);
  s->metrics_->SetServing(true);
  if (s->auth_ != nullptr && options.auth_tokens_reload > absl::ZeroDuration()) {
    s->token_reload_ = std::thread([server = s.get()] { server->ReloadTokens(); });
  }
  if (s->tls_files_ != nullptr && options.tls.reload > absl::ZeroDuration()) {
    s->tls_reload_ = std::thread([server = s.get()] { server->ReloadTls(); });
  }
  KVSPARSE_LOG(Info)
      << "kvsparse-server (role " << RoleName(options.role) << ", "
      << (s->engine_ ? s->engine_->backend() : "no") << " decode engine"
      << (options.role == ServerRole::kWorker ? absl::StrCat(", store at ", options.store_target)
                                              : std::string())
      << ") listening on " << options.listen << " (port " << s->port_ << "), "
      << (tls ? (options.tls.ca.empty() ? "TLS" : "mutual TLS") : "plaintext")
      << (s->auth_ ? absl::StrCat(", ", s->auth_->size(), " bearer tokens") : std::string())
      << (options.metrics_listen.empty() ? std::string(", metrics off")
                                         : absl::StrCat(", metrics on ", options.metrics_listen,
                                                        " (port ", s->metrics_->port(), ")"))
      << (s->store_
              ? absl::StrCat("; store capacity ", options.store.capacity_bytes, " bytes, policy ",
                             kvstore::CapacityPolicyName(options.store.policy),
                             options.store.shard.count > 1
                                 ? absl::StrCat(", shard ", options.store.shard.index, " of ",
                                                options.store.shard.count)
                                 : std::string())
              : std::string());
  return s;
}

// The store (role store or all): the store, its collector and service, and the UCX export of
// its arena (--data_plane=ucx).
absl::Status Server::StartStore() {
  absl::StatusOr<std::unique_ptr<kvstore::Store>> store = kvstore::Store::Create(options_.store);
  if (!store.ok()) return store.status();
  store_ = std::move(*store);
  metrics_->AddCollectable(NewStoreCollector(store_.get()));
  appends_ = std::make_unique<RequestBudget>(options_.max_append_bytes_in_flight);
  metrics_->WatchRequestBytes(appends_->in_use_counter());
  kvstore_service_ = std::make_unique<KvStoreService>(store_.get(), rpc_.get(), metrics_.get(),
                                                      appends_.get(), options_.max_message_bytes);
  if (options_.data_plane == "ucx") {
    kvstore::SharedArena* arena =
        options_.store.memory != nullptr ? options_.store.memory->shared_arena() : nullptr;
    if (arena == nullptr) {
      return absl::InvalidArgumentError("--data_plane=ucx needs --arena_file");
    }
    absl::StatusOr<std::unique_ptr<kvstore::UcxExport>> plane =
        kvstore::UcxExport::Create(arena, options_.data_plane_transports);
    if (!plane.ok()) {
      return absl::UnavailableError(absl::StrCat("--data_plane=ucx: ", plane.status().message()));
    }
    data_plane_ = std::move(*plane);
    kvstore_service_->set_data_plane(data_plane_.get());
  } else if (!options_.data_plane.empty() && options_.data_plane != "none") {
    return absl::InvalidArgumentError(
        absl::StrCat("--data_plane: '", options_.data_plane, "' is not none or ucx"));
  }
  return absl::OkStatus();
}

// A worker's row source over its store (one shard, or several by rendezvous placement):
// rpc::ConnectStore (a channel per shard, the chosen data plane), metered per shard.
absl::StatusOr<std::unique_ptr<engine::RowSource>> Server::RemoteStoreSource() {
  rpc::StoreConnectionOptions o;
  o.target = options_.store_target;
  o.tls = options_.store_tls;
  o.rows = {options_.store_token, options_.store_arena_file, options_.store_data_plane,
            options_.data_plane_transports};
  o.max_message_bytes = static_cast<int>(options_.max_message_bytes);
  absl::StatusOr<rpc::StoreConnection> c = rpc::ConnectStore(o);
  if (!c.ok()) {
    return absl::Status(
        c.status().code(),
        absl::StrCat("the store (--store, --store_tls_*, --store_arena_file, --store_data_plane): ",
                     c.status().message()));
  }
  std::vector<StoreShardSource> metered;
  for (size_t i = 0; i < c->shards.size(); ++i) metered.push_back({c->targets[i], c->shards[i]});
  metrics_->AddCollectable(NewStoreShardCollector(std::move(metered)));
  return std::move(c->source);
}

// The decode engine (role worker or all): its row source (the store here, or the remote
// store's), the GPU backend or the CPU engine, and the Attention service.
absl::Status Server::StartEngine() {
  if (options_.role == ServerRole::kAll) {
    row_source_ = engine::NewLocalRowSource(store_.get(), options_.store_pages_mapped);
  } else {
    absl::StatusOr<std::unique_ptr<engine::RowSource>> remote = RemoteStoreSource();
    if (!remote.ok()) return remote.status();
    row_source_ = *std::move(remote);
  }
  absl::StatusOr<engine::AssembledEngine> assembled =
      engine::AssembleEngine(options_.engine, row_source_.get());
  if (!assembled.ok()) return assembled.status();
  if (!assembled->cpu_reason.empty()) {
    KVSPARSE_LOG(Info) << "decoding on the CPU: " << assembled->cpu_reason;
  }
  engine_ = std::move(assembled->engine);
  metrics_->AddCollectable(NewResidentCollector(engine_.get()));
  if (kvstore_service_ != nullptr) {  // one process: a drop frees the engine's state too
    engine::DecodeEngine* e = engine_.get();
    kvstore_service_->set_drop_listener([e](const std::string& id) { e->Forget(id); });
  }
  reaper_ = std::make_unique<StreamReaper>(options_.stream_idle_timeout);
  attention_service_ =
      std::make_unique<AttentionService>(engine_.get(), rpc_.get(), metrics_.get(), reaper_.get());
  return absl::OkStatus();
}

Server::~Server() {
  Shutdown();
  if (token_reload_.joinable() || tls_reload_.joinable()) stop_reload_.Notify();
  if (token_reload_.joinable()) token_reload_.join();
  if (tls_reload_.joinable()) tls_reload_.join();
}

void Server::ReloadTokens() {
  std::string last_error;  // a file that stays unreadable is logged once
  while (!stop_reload_.WaitForNotificationWithTimeout(options_.auth_tokens_reload)) {
    absl::StatusOr<bool> swapped = auth_->Reload();
    if (swapped.ok()) {
      last_error.clear();
      if (*swapped) {
        metrics_->CountReload("auth_tokens", true);
        KVSPARSE_LOG(Info) << "--auth_tokens: " << options_.auth_tokens_file << " reloaded, "
                           << auth_->size() << " bearer tokens";
      }
    } else if (std::string(swapped.status().message()) != last_error) {
      last_error = std::string(swapped.status().message());
      metrics_->CountReload("auth_tokens", false);
      KVSPARSE_LOG(Warning) << "--auth_tokens: keeping the tokens loaded before: "
                            << swapped.status();
    }
  }
}

void Server::ReloadTls() {
  // A refused text is reported once (TlsFileGuard::Reload answers false until it changes).
  while (!stop_reload_.WaitForNotificationWithTimeout(options_.tls.reload)) {
    absl::StatusOr<bool> swapped = tls_files_->Reload();
    if (swapped.ok() && *swapped) {
      metrics_->CountReload("tls", true);
      KVSPARSE_LOG(Info) << "TLS: new certificate files applied (" << options_.tls.cert << ")";
    } else if (!swapped.ok()) {
      metrics_->CountReload("tls", false);
      KVSPARSE_LOG(Warning) << "TLS: keeping the last good certificate and key: "
                            << swapped.status();
    }
  }
}

void Server::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_ || grpc_ == nullptr) return;
    shut_down_ = true;
  }
  KVSPARSE_LOG(Info) << "shutting down: health NOT_SERVING, in-flight calls get "
                     << absl::FormatDuration(options_.shutdown_grace);
  grpc_->GetHealthCheckService()->SetServingStatus(false);
  metrics_->SetServing(false);
  grpc_->Shutdown(absl::ToChronoTime(absl::Now() + options_.shutdown_grace));
  KVSPARSE_LOG(Info) << "shut down";
}

void Server::Wait() {
  if (grpc_ != nullptr) grpc_->Wait();
}

}  // namespace kvsparse::server
