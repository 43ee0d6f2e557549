#include "server/metrics.h"

#include <algorithm>
#include <cmath>
#include <exception>

#include "absl/strings/str_cat.h"
#include "engine/decode_engine.h"
#include "engine/methods/registry.h"
#include "kvstore/store.h"
#include "prometheus/metric_family.h"
#include "rpc/build_info.h"
#include "rpc/remote_row_source.h"

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

// 10 us .. ~21 s, doubling.
prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double s = 10e-6; s < 30; s *= 2) b.push_back(s);
  return b;
}

}  // namespace

RpcMetric::RpcMetric(std::string method, prometheus::Family<prometheus::Counter>* requests,
                     prometheus::Histogram* latency,
                     prometheus::Family<prometheus::Counter>* refusals)
    : method_(std::move(method)), requests_(requests), latency_(latency), refusals_(refusals) {
  // Zero-valued from the start, so rate() and the alert see a series before the first refusal.
  for (const char* limit : {"max_concurrent_calls", "max_concurrent_streams", "max_calls_per_token",
                            "max_append_bytes_in_flight"}) {
    refusals_->Add({{"method", method_}, {"limit", limit}});
  }
}

void RpcMetric::RecordRefusal(absl::string_view limit) {
  refusals_->Add({{"method", method_}, {"limit", std::string(limit)}}).Increment();
}

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
                    .Register(*registry_)),
      serving_(&prometheus::BuildGauge()
                    .Name("kvsparse_serving")
                    .Help("1 while health is SERVING, 0 from shutdown on")
                    .Register(*registry_)
                    .Add({})),
      refusals_(&prometheus::BuildCounter()
                     .Name("kvsparse_rpc_admission_refusals_total")
                     .Help("Calls and streams refused at admission (RESOURCE_EXHAUSTED: server "
                           "busy), by method and the limit (flag) they hit")
                     .Register(*registry_)),
      reloads_(&prometheus::BuildCounter()
                    .Name("kvsparse_config_reloads_total")
                    .Help("Files re-read while serving (tls, auth_tokens) whose change was "
                          "applied or refused (the last good one kept)")
                    .Register(*registry_)) {
  prometheus::BuildGauge()
      .Name("kvsparse_build_info")
      .Help("1, labelled with the build's version, git commit and whether CUDA was built")
      .Register(*registry_)
      .Add({{"version", BuildVersion()},
            {"commit", BuildCommit()},
            {"cuda", BuildCuda() ? "on" : "off"}})
      .Set(1);
}

void Metrics::SetServing(bool serving) { serving_->Set(serving ? 1.0 : 0.0); }

namespace {

class InFlightCollector final : public prometheus::Collectable {
 public:
  InFlightCollector(std::shared_ptr<const std::atomic<size_t>> calls,
                    std::shared_ptr<const std::atomic<size_t>> streams)
      : calls_(std::move(calls)), streams_(std::move(streams)) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    prometheus::MetricFamily f{"kvsparse_rpc_in_flight",
                               "Unary calls holding a server slot (kind=calls, bound "
                               "--max_concurrent_calls) and open decode streams (kind=streams)",
                               prometheus::MetricType::Gauge,
                               {}};
    for (const auto& [kind, count] :
         {std::pair{"calls", calls_.get()}, std::pair{"streams", streams_.get()}}) {
      prometheus::ClientMetric m;
      m.label.push_back({"kind", kind});
      m.gauge.value = static_cast<double>(count->load(std::memory_order_relaxed));
      f.metric.push_back(std::move(m));
    }
    return {std::move(f)};
  }

 private:
  const std::shared_ptr<const std::atomic<size_t>> calls_, streams_;
};

class RequestBytesCollector final : public prometheus::Collectable {
 public:
  explicit RequestBytesCollector(std::shared_ptr<const std::atomic<size_t>> bytes)
      : bytes_(std::move(bytes)) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    prometheus::MetricFamily f{"kvsparse_rpc_in_flight_request_bytes",
                               "Bytes of append messages being read or parsed, held against "
                               "--max_append_bytes_in_flight",
                               prometheus::MetricType::Gauge,
                               {}};
    prometheus::ClientMetric m;
    m.gauge.value = static_cast<double>(bytes_->load(std::memory_order_relaxed));
    f.metric.push_back(std::move(m));
    return {std::move(f)};
  }

 private:
  const std::shared_ptr<const std::atomic<size_t>> bytes_;
};

}  // namespace

void Metrics::WatchInFlight(std::shared_ptr<const std::atomic<size_t>> calls,
                            std::shared_ptr<const std::atomic<size_t>> streams) {
  AddCollectable(std::make_shared<InFlightCollector>(std::move(calls), std::move(streams)));
}

void Metrics::WatchRequestBytes(std::shared_ptr<const std::atomic<size_t>> bytes) {
  AddCollectable(std::make_shared<RequestBytesCollector>(std::move(bytes)));
}

void Metrics::CountReload(absl::string_view file, bool applied) {
  reloads_->Add({{"file", std::string(file)}, {"result", applied ? "applied" : "refused"}})
      .Increment();
}

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
  rpcs_.push_back(std::make_unique<RpcMetric>(std::string(method), requests_, h, refusals_));
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

namespace {

prometheus::Histogram::BucketBoundaries BudgetBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double x = 1; x <= (1 << 24); x *= 2) b.push_back(x);
  return b;
}

// Relative standard errors: 2^-14 (6e-5) to 2 by doubling, then +Inf (also fewer than two draws).
prometheus::Histogram::BucketBoundaries StandardErrorBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (int e = -14; e <= 1; ++e) b.push_back(std::ldexp(1.0, e));
  return b;
}

// Shares of attention mass: 2^-20 (1e-6) to 1 by doubling.
prometheus::Histogram::BucketBoundaries MassBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (int e = -20; e <= 0; ++e) b.push_back(std::ldexp(1.0, e));
  return b;
}

// One call's observations of one histogram series, summed before the one update.
class Tally {
 public:
  explicit Tally(const prometheus::Histogram::BucketBoundaries& bounds)
      : bounds_(bounds), counts_(bounds.size() + 1, 0.0) {}
  void Add(double x) {
    ++n_;
    if (std::isfinite(x)) sum_ += x;  // an infinite one lands in +Inf, not in the sum
    counts_[std::lower_bound(bounds_.begin(), bounds_.end(), x) - bounds_.begin()] += 1;
  }
  void Flush(prometheus::Histogram* h) const {
    if (n_ > 0) h->ObserveMultiple(counts_, sum_);
  }

 private:
  const prometheus::Histogram::BucketBoundaries& bounds_;
  std::vector<double> counts_;
  double sum_ = 0, n_ = 0;
};

const char* kTierNames[] = {"host", "device", "remote"};

}  // namespace

DecodeMetrics::DecodeMetrics(prometheus::Registry& registry)
    : rows_(prometheus::BuildCounter()
                .Name("kvsparse_decode_fetched_rows_total")
                .Help("K and V rows read by decode steps, by method and the tier read")
                .Register(registry)),
      bytes_(prometheus::BuildCounter()
                 .Name("kvsparse_decode_fetched_bytes_total")
                 .Help("Bytes read by decode steps, by method and the tier read")
                 .Register(registry)),
      dense_bytes_(prometheus::BuildCounter()
                       .Name("kvsparse_decode_dense_equivalent_bytes_total")
                       .Help("Bytes dense attention would have read for the same steps")
                       .Register(registry)),
      gather_seconds_(prometheus::BuildCounter()
                          .Name("kvsparse_decode_gather_seconds_total")
                          .Help("Time spent fetching rows (the GPU engine times one call in "
                                "--gpu_stage_timing_every and counts it that many times); GB/s = "
                                "rate(fetched bytes) / rate(this)")
                          .Register(registry)),
      sequences_(prometheus::BuildCounter()
                     .Name("kvsparse_decode_sequence_layers_total")
                     .Help("Sequence-layers decoded (one per sequence of a Decode call)")
                     .Register(registry)),
      cached_rows_(prometheus::BuildCounter()
                       .Name("kvsparse_decode_cached_rows_total")
                       .Help("Fetched rows found in the GPU's row cache (read on the device, not "
                             "fetched again); hit rate = rate(this) / rate(fetched rows)")
                       .Register(registry)),
      stage_(prometheus::BuildHistogram()
                 .Name("kvsparse_decode_stage_seconds")
                 .Help("Engine time per Decode call by stage: selection, gather, compute (the "
                       "calls timed: one in --gpu_stage_timing_every on the GPU engine); the "
                       "whole is kvsparse_decode_engine_seconds")
                 .Register(registry)),
      budget_(prometheus::BuildHistogram()
                  .Name("kvsparse_decode_budget_rows")
                  .Help("Per query head budget, in rows: samples S, top-k k, or the vAttention "
                        "sample b")
                  .Register(registry)),
      standard_error_(prometheus::BuildHistogram()
                          .Name("kvsparse_decode_standard_error")
                          .Help("Per query head, the standard error an estimate states of itself, "
                                "relative to its output's norm (S2ANTA on the CPU engine: from its "
                                "own draws; HeadStats.standard_error)")
                          .Register(registry)),
      missed_mass_(prometheus::BuildHistogram()
                       .Name("kvsparse_decode_missed_mass_bound")
                       .Help("Per query head, a certified upper bound on the share of its "
                             "attention the rows it used leave out (top-k over compressed keys "
                             "on the CPU engine; HeadStats.missed_mass_bound)")
                       .Register(registry)),
      engine_(&prometheus::BuildHistogram()
                   .Name("kvsparse_decode_engine_seconds")
                   .Help("Whole engine time per Decode call (the stages of "
                         "kvsparse_decode_stage_seconds are parts of it)")
                   .Register(registry)
                   .Add({}, LatencyBuckets())) {
  for (const engine::MethodEntry& m : engine::AllMethods()) {
    PerMethod& pm = per_method_.emplace_back();
    for (int t = 0; t < kTiers; ++t) {
      pm.rows[t] = &rows_.Add({{"method", m.name}, {"tier", kTierNames[t]}});
      pm.bytes[t] = &bytes_.Add({{"method", m.name}, {"tier", kTierNames[t]}});
    }
    pm.dense = &dense_bytes_.Add({{"method", m.name}});
    pm.gather = &gather_seconds_.Add({{"method", m.name}});
    pm.sequences = &sequences_.Add({{"method", m.name}});
    pm.cached = &cached_rows_.Add({{"method", m.name}});
    pm.budget = &budget_.Add({{"method", m.name}}, BudgetBuckets());
    pm.standard_error = &standard_error_.Add({{"method", m.name}}, StandardErrorBuckets());
    pm.missed_mass = &missed_mass_.Add({{"method", m.name}}, MassBuckets());
  }
  selection_ = &stage_.Add({{"stage", "selection"}}, LatencyBuckets());
  gather_ = &stage_.Add({{"stage", "gather"}}, LatencyBuckets());
  compute_ = &stage_.Add({{"stage", "compute"}}, LatencyBuckets());
}

void DecodeMetrics::Record(engine::MethodKind method, const engine::DecodeResult& r) {
  const size_t m = static_cast<size_t>(method);
  if (m >= per_method_.size()) return;
  PerMethod& pm = per_method_[m];
  // Sum over the call first: one update per series (a Decode of B sequences has B x Hkv heads).
  std::array<double, kTiers> bytes{}, rows{};
  double dense = 0, cached = 0;
  static const prometheus::Histogram::BucketBoundaries kBudgetBounds = BudgetBuckets();
  static const prometheus::Histogram::BucketBoundaries kErrorBounds = StandardErrorBuckets();
  static const prometheus::Histogram::BucketBoundaries kMassBounds = MassBuckets();
  Tally budgets(kBudgetBounds), errors(kErrorBounds), missed(kMassBounds);
  uint64_t seqs = 0;
  for (const engine::HeadStats& h : r.heads) {
    // Rows are counted on the tier most of the head's bytes came from.
    int tier = 0;
    for (int t = 0; t < kTiers; ++t) {
      bytes[t] += static_cast<double>(h.bytes[t]);
      if (h.bytes[t] > h.bytes[tier]) tier = t;
    }
    rows[tier] += static_cast<double>(h.rows_fetched);
    cached += static_cast<double>(h.rows_cached);
    dense += static_cast<double>(h.dense_equivalent_bytes);
    for (uint64_t b : h.budgets) budgets.Add(static_cast<double>(b));
    for (float e : h.standard_error) errors.Add(e);
    for (float e : h.missed_mass_bound) missed.Add(e);
    seqs = std::max<uint64_t>(seqs, h.sequence_index + 1);
  }
  for (int t = 0; t < kTiers; ++t) {
    if (bytes[t] > 0) pm.bytes[t]->Increment(bytes[t]);
    if (rows[t] > 0) pm.rows[t]->Increment(rows[t]);
  }
  pm.dense->Increment(dense);
  if (cached > 0) pm.cached->Increment(cached);
  budgets.Flush(pm.budget);
  errors.Flush(pm.standard_error);
  missed.Flush(pm.missed_mass);
  pm.sequences->Increment(static_cast<double>(seqs));
  if (r.timing.stage_weight > 0) {  // stage times of a timed call stand for stage_weight calls
    pm.gather->Increment(r.timing.gather_seconds * r.timing.stage_weight);
    selection_->Observe(r.timing.selection_seconds);
    gather_->Observe(r.timing.gather_seconds);
    compute_->Observe(r.timing.compute_seconds);
  }
  engine_->Observe(r.timing.engine_seconds);
}

namespace {

class ResidentCollector final : public prometheus::Collectable {
 public:
  explicit ResidentCollector(const engine::DecodeEngine* engine) : engine_(engine) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    const engine::ResidentCache& c = engine_->resident();
    auto one = [](const char* name, const char* help, prometheus::MetricType type, double v) {
      prometheus::MetricFamily f{name, help, type, {}};
      prometheus::ClientMetric m;
      if (type == prometheus::MetricType::Counter) {
        m.counter.value = v;
      } else {
        m.gauge.value = v;
      }
      f.metric.push_back(m);
      return f;
    };
    std::vector<prometheus::MetricFamily> r = {
        one("kvsparse_resident_bytes",
            "Bytes of the CPU engine's device-tier state (resident K/V, signatures)",
            prometheus::MetricType::Gauge, static_cast<double>(c.bytes())),
        one("kvsparse_resident_capacity_bytes", "Most bytes of device-tier state",
            prometheus::MetricType::Gauge, static_cast<double>(c.capacity())),
        one("kvsparse_resident_evictions_total", "Idle resident entries evicted for room",
            prometheus::MetricType::Counter, static_cast<double>(c.evictions()))};
    if (const engine::DecodeBackend* b = engine_->device_backend(); b != nullptr) {
      r.push_back(one("kvsparse_gpu_resident_bytes",
                      "Bytes of GPU memory the GPU engine holds for sequences (K/V, signatures, "
                      "page lists, row caches)",
                      prometheus::MetricType::Gauge, static_cast<double>(b->resident_bytes())));
      r.push_back(one("kvsparse_gpu_resident_capacity_bytes",
                      "Most bytes of GPU memory the GPU engine may hold for sequences",
                      prometheus::MetricType::Gauge, static_cast<double>(b->resident_capacity())));
    }
    return r;
  }

 private:
  const engine::DecodeEngine* engine_;
};

class StoreShardCollector final : public prometheus::Collectable {
 public:
  explicit StoreShardCollector(std::vector<StoreShardSource> shards) : shards_(std::move(shards)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> out = {
        {"kvsparse_worker_store_shard_up",
         "1 while the worker's connection to this store shard is up (or idle), 0 while it is "
         "connecting or failing: Decode calls of its sequences fail with UNAVAILABLE",
         prometheus::MetricType::Gauge,
         {}},
        {"kvsparse_worker_in_place_rows_total",
         "Rows the worker read from the store's arena without the Gather RPC (mapped file or UCX; "
         "K and V rows count separately)",
         prometheus::MetricType::Counter,
         {}},
        {"kvsparse_worker_in_place_bytes_total",
         "Bytes the worker read from the store's arena without the Gather RPC",
         prometheus::MetricType::Counter,
         {}},
        {"kvsparse_worker_in_place_fallbacks_total",
         "Row reads that went through the Gather RPC instead (arena not reachable yet, the "
         "store without one, pages freed while read)",
         prometheus::MetricType::Counter,
         {}},
        {"kvsparse_worker_page_table_calls_total",
         "GetPageTable RPCs the worker made",
         prometheus::MetricType::Counter,
         {}}};
    for (size_t i = 0; i < shards_.size(); ++i) {
      const rpc::InPlaceStats s = shards_[i].source->in_place_stats();
      const double values[] = {shards_[i].source->reachable() ? 1.0 : 0.0,
                               static_cast<double>(s.rows), static_cast<double>(s.bytes),
                               static_cast<double>(s.fallbacks),
                               static_cast<double>(s.page_table_calls)};
      for (size_t f = 0; f < out.size(); ++f) {
        prometheus::ClientMetric m;
        m.label = {{"shard", std::to_string(i)}, {"address", shards_[i].address}};
        if (f == 0) {
          m.gauge.value = values[f];
        } else {
          m.counter.value = values[f];
        }
        out[f].metric.push_back(std::move(m));
      }
    }
    return out;
  }

 private:
  const std::vector<StoreShardSource> shards_;
};

}  // namespace

std::shared_ptr<prometheus::Collectable> NewStoreShardCollector(
    std::vector<StoreShardSource> shards) {
  return std::make_shared<StoreShardCollector>(std::move(shards));
}

std::shared_ptr<prometheus::Collectable> NewResidentCollector(const engine::DecodeEngine* engine) {
  return std::make_shared<ResidentCollector>(engine);
}

}  // namespace kvsparse::server
