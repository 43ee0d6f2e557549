#include "server/metrics.h"

#include <exception>

#include "absl/strings/str_cat.h"
#include "kvstore/store.h"
#include "prometheus/metric_family.h"

namespace kvsparse::server {
namespace {

const char* CodeName(absl::StatusCode code) {
  static constexpr const char* kNames[] = {"OK",
                                           "CANCELLED",
                                           "UNKNOWN",
                                           "INVALID_ARGUMENT",
                                           "DEADLINE_EXCEEDED",
                                           "NOT_FOUND",
                                           "ALREADY_EXISTS",
                                           "PERMISSION_DENIED",
                                           "RESOURCE_EXHAUSTED",
                                           "FAILED_PRECONDITION",
                                           "ABORTED",
                                           "OUT_OF_RANGE",
                                           "UNIMPLEMENTED",
                                           "INTERNAL",
                                           "UNAVAILABLE",
                                           "DATA_LOSS",
                                           "UNAUTHENTICATED"};
  const int i = static_cast<int>(code);
  return i >= 0 && i < 17 ? kNames[i] : "UNKNOWN";
}

// 50 us .. ~26 s, doubling.
prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double s = 50e-6; s < 30; s *= 2) b.push_back(s);
  return b;
}

}  // namespace

RpcMetric::RpcMetric(std::string method, prometheus::Family<prometheus::Counter>* requests,
                     prometheus::Histogram* latency)
    : method_(std::move(method)), requests_(requests), latency_(latency) {}

void RpcMetric::Record(absl::StatusCode code, double seconds) {
  const int i = static_cast<int>(code) < kNumCodes ? static_cast<int>(code) : 2;
  prometheus::Counter* c = by_code_[i].load(std::memory_order_acquire);
  if (c == nullptr) {
    // Family::Add is thread-safe and returns the existing series for the same labels.
    c = &requests_->Add(
        {{"method", method_}, {"code", CodeName(static_cast<absl::StatusCode>(i))}});
    by_code_[i].store(c, std::memory_order_release);
  }
  c->Increment();
  latency_->Observe(seconds);
}

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      requests_(&prometheus::BuildCounter()
                     .Name("kvsparse_rpc_requests_total")
                     .Help("RPCs finished, by method and gRPC status code")
                     .Register(*registry_)),
      latency_(&prometheus::BuildHistogram()
                    .Name("kvsparse_rpc_duration_seconds")
                    .Help("Server-side RPC latency, from handler entry to status")
                    .Register(*registry_)) {}

Metrics::~Metrics() = default;

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Create(const std::string& listen) {
  std::unique_ptr<Metrics> m(new Metrics());
  if (!listen.empty()) {
    try {
      m->exposer_ = std::make_unique<prometheus::Exposer>(listen);
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat("cannot serve /metrics on ", listen, ": ", e.what()));
    }
    m->exposer_->RegisterCollectable(m->registry_);
  }
  return m;
}

RpcMetric* Metrics::Rpc(absl::string_view method) {
  absl::MutexLock lock(&mu_);
  for (auto& r : rpcs_) {
    if (r->method() == method) return r.get();
  }
  prometheus::Histogram* h = &latency_->Add({{"method", std::string(method)}}, LatencyBuckets());
  rpcs_.push_back(std::make_unique<RpcMetric>(std::string(method), requests_, h));
  return rpcs_.back().get();
}

void Metrics::AddCollectable(std::shared_ptr<prometheus::Collectable> collectable) {
  if (exposer_) exposer_->RegisterCollectable(collectable);
  collectables_.push_back(std::move(collectable));
}

int Metrics::port() const {
  if (!exposer_) return 0;
  auto ports = exposer_->GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

namespace {

class StoreCollector final : public prometheus::Collectable {
 public:
  explicit StoreCollector(const kvstore::Store* store) : store_(store) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    const kvstore::StoreStats s = store_->Stats();
    std::vector<prometheus::MetricFamily> out;
    auto add = [&](const char* name, const char* help, prometheus::MetricType type, double value,
                   std::vector<prometheus::ClientMetric::Label> labels = {}) {
      if (out.empty() || out.back().name != name) {
        out.push_back({name, help, type, {}});
      }
      prometheus::ClientMetric m;
      m.label = std::move(labels);
      if (type == prometheus::MetricType::Counter) {
        m.counter.value = value;
      } else {
        m.gauge.value = value;
      }
      out.back().metric.push_back(std::move(m));
    };
    using prometheus::MetricType;
    add("kvsparse_store_capacity_bytes", "Bytes of pages the store may hold", MetricType::Gauge,
        static_cast<double>(s.capacity_bytes),
        {{"policy", std::string(kvstore::CapacityPolicyName(s.policy))}});
    add("kvsparse_store_used_bytes", "Bytes of pages in use", MetricType::Gauge,
        static_cast<double>(s.bytes_used));
    add("kvsparse_store_sequences", "Sequences held", MetricType::Gauge,
        static_cast<double>(s.num_sequences));
    add("kvsparse_store_evictions_total", "Sequences evicted to make room", MetricType::Counter,
        static_cast<double>(s.evictions));
    add("kvsparse_store_rejections_total", "Appends refused for capacity", MetricType::Counter,
        static_cast<double>(s.rejections));
    add("kvsparse_store_appended_rows_total", "K and V rows appended", MetricType::Counter,
        static_cast<double>(s.rows_appended));
    add("kvsparse_store_appended_bytes_total", "K and V bytes appended", MetricType::Counter,
        static_cast<double>(s.bytes_appended));
    for (int t = 0; t < kvstore::kNumTiers; ++t) {
      add("kvsparse_store_gathered_rows_total", "Rows returned by gathers, by tier read",
          MetricType::Counter, static_cast<double>(s.rows_gathered[t]),
          {{"tier", std::string(kvstore::TierName(static_cast<kvstore::Tier>(t)))}});
    }
    for (int t = 0; t < kvstore::kNumTiers; ++t) {
      add("kvsparse_store_gathered_bytes_total", "Bytes returned by gathers, by tier read",
          MetricType::Counter, static_cast<double>(s.bytes_gathered[t]),
          {{"tier", std::string(kvstore::TierName(static_cast<kvstore::Tier>(t)))}});
    }
    return out;
  }

 private:
  const kvstore::Store* store_;
};

}  // namespace

std::shared_ptr<prometheus::Collectable> NewStoreCollector(const kvstore::Store* store) {
  return std::make_shared<StoreCollector>(store);
}

}  // namespace kvsparse::server
