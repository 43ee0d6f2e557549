// Prometheus metrics of the server: a registry, the /metrics HTTP endpoint (prometheus-cpp's
// civetweb exposer), per-RPC counters and latency histograms, and collectors that read engine
// state at scrape time.
#ifndef KVSPARSE_SERVER_METRICS_H_
#define KVSPARSE_SERVER_METRICS_H_

#include <array>
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace kvsparse::kvstore {
class Store;
}
namespace kvsparse::engine {
class DecodeEngine;
struct DecodeResult;
enum class MethodKind;
}  // namespace kvsparse::engine

namespace kvsparse::rpc {
class RemoteRowSource;
}  // namespace kvsparse::rpc

namespace kvsparse::server {

// Counters and a latency histogram for one RPC method. Thread-safe.
class RpcMetric {
 public:
  RpcMetric(std::string method, prometheus::Family<prometheus::Counter>* requests,
            prometheus::Histogram* latency, prometheus::Family<prometheus::Counter>* refusals);
  // Counts one finished call with its status code and duration.
  void Record(absl::StatusCode code, double seconds);
  // Counts one call or stream refused at admission (RESOURCE_EXHAUSTED) by `limit`, the flag
  // whose bound it hit: kvsparse_rpc_admission_refusals_total{method, limit}.
  void RecordRefusal(absl::string_view limit);
  const std::string& method() const { return method_; }

 private:
  static constexpr int kNumCodes = 17;
  const std::string method_;
  prometheus::Family<prometheus::Counter>* const requests_;
  prometheus::Histogram* const latency_;
  prometheus::Family<prometheus::Counter>* const refusals_;
  std::array<std::atomic<prometheus::Counter*>, kNumCodes> by_code_{};
};

// Decode-step metrics: rows and bytes fetched per method and tier, dense-equivalent bytes (so
// the saving is one query away), time per stage (GB/s = rate(fetched bytes) / rate(gather
// seconds)), per-head budgets, the standard errors estimates state of themselves. Thread-safe.
class DecodeMetrics {
 public:
  explicit DecodeMetrics(prometheus::Registry& registry);
  // One DecodeResult of a successful call of a method.
  void Record(engine::MethodKind method, const engine::DecodeResult& result);

 private:
  static constexpr int kTiers = 3;
  prometheus::Family<prometheus::Counter>& rows_;
  prometheus::Family<prometheus::Counter>& bytes_;
  prometheus::Family<prometheus::Counter>& dense_bytes_;
  prometheus::Family<prometheus::Counter>& gather_seconds_;
  prometheus::Family<prometheus::Counter>& sequences_;
  prometheus::Family<prometheus::Counter>& cached_rows_;
  prometheus::Family<prometheus::Histogram>& stage_;
  prometheus::Family<prometheus::Histogram>& budget_;
  prometheus::Family<prometheus::Histogram>& standard_error_;
  prometheus::Family<prometheus::Histogram>& missed_mass_;
  struct PerMethod {
    std::array<prometheus::Counter*, kTiers> rows{}, bytes{};
    prometheus::Counter* dense = nullptr;
    prometheus::Counter* gather = nullptr;
    prometheus::Counter* sequences = nullptr;
    prometheus::Counter* cached = nullptr;
    prometheus::Histogram* budget = nullptr;
    prometheus::Histogram* standard_error = nullptr;
    prometheus::Histogram* missed_mass = nullptr;
  };
  std::vector<PerMethod> per_method_;  // one per row of the method table, in its order
  prometheus::Histogram* selection_;
  prometheus::Histogram* gather_;
  prometheus::Histogram* compute_;
  prometheus::Histogram* engine_;  // the whole engine time: its own metric (stages overlap it)
};

class Metrics {
 public:
  // Serves /metrics on `listen` ("host:port"; port 0 picks a free one); an empty `listen`
  // keeps the registry without an HTTP endpoint. UNAVAILABLE if the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<Metrics>> Create(const std::string& listen);
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // The metric handles of a method; stable for the lifetime of Metrics.
  RpcMetric* Rpc(absl::string_view method);
  // Exposes a collector's families at every scrape. Metrics keeps it alive.
  void AddCollectable(std::shared_ptr<prometheus::Collectable> collectable);

  // kvsparse_serving: 1 while the server's health is SERVING, 0 once it shuts down (alerts tell a
  // draining worker from a dead one).
  void SetServing(bool serving);
  // kvsparse_rpc_in_flight{kind}: unary calls holding a server slot ("calls") and open decode
  // streams ("streams"), read at scrape time from the two counters.
  void WatchInFlight(std::shared_ptr<const std::atomic<size_t>> calls,
                     std::shared_ptr<const std::atomic<size_t>> streams);
  // kvsparse_rpc_in_flight_request_bytes: bytes of append messages being read or parsed, held
  // against --max_append_bytes_in_flight (server/request_budget.h).
  void WatchRequestBytes(std::shared_ptr<const std::atomic<size_t>> bytes);
  // kvsparse_config_reloads_total{file, result}: a file re-read while serving ("tls",
  // "auth_tokens") whose change was applied, or refused (the last good one kept).
  void CountReload(absl::string_view file, bool applied);

  prometheus::Registry& registry() { return *registry_; }
  // The bound port of /metrics, or 0 when there is no endpoint.
  int port() const;

 private:
  Metrics();
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::vector<std::shared_ptr<prometheus::Collectable>> collectables_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Family<prometheus::Histogram>* latency_;
  prometheus::Gauge* serving_;
  prometheus::Family<prometheus::Counter>* refusals_;
  prometheus::Family<prometheus::Counter>* reloads_;
  absl::Mutex mu_;
  std::vector<std::unique_ptr<RpcMetric>> rpcs_ ABSL_GUARDED_BY(mu_);
};

// Resident (device-tier) state of a decode engine read at scrape time: bytes held, capacity,
// evictions. REQUIRES: engine outlives the collector.
std::shared_ptr<prometheus::Collectable> NewResidentCollector(const engine::DecodeEngine* engine);

// Store state read at scrape time: bytes used and capacity, sequences, rows/bytes appended and
// gathered (by tier), evictions and rejections. REQUIRES: store outlives the collector.
std::shared_ptr<prometheus::Collectable> NewStoreCollector(const kvstore::Store* store);

// One store shard of a worker: its address (as in --store) and the source reading it.
struct StoreShardSource {
  std::string address;
  const rpc::RemoteRowSource* source = nullptr;
};
// A worker's store shards, labelled shard="INDEX" and address: whether its channel is up
// (kvsparse_worker_store_shard_up), and the reads of its arena in place (--store_arena_file or
// --store_data_plane=ucx): rows and bytes copied, reads that went through Gather instead,
// GetPageTable calls. REQUIRES: the sources outlive the collector.
std::shared_ptr<prometheus::Collectable> NewStoreShardCollector(
    std::vector<StoreShardSource> shards);

}  // namespace kvsparse::server

#endif  // KVSPARSE_SERVER_METRICS_H_
