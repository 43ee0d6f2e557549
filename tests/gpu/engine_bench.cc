// Per-layer latency of the decode engine on the GPU (no RPC), each placement and method against
// dense attention with the KV resident on the GPU and against dense attention that fetches every
// row from host memory, measured in the same run on the same GPU (issue 5's benchmark).
//
//   engine_bench [--lens=32768,131072] [--batches=1,8] [--reps=20] [--hash_fraction=0.0125]
//                [--drift=0.05] [--ballast_free_gb=0] [--methods=all] [--saap_probes=4]
//
// Llama-3.1-8B attention shapes (H = 32, Hkv = 8, d = 128, bf16), one layer. Every sequence of a
// batch holds the same synthetic K and V (kernels/synthetic.h, peaked family: sink, local window
// and needles, as real attention has), loaded into the store (pinned, CUDA-mapped host pages)
// under three placements: K and V on the GPU; K on the GPU and V in host memory (S2ANTA); K and
// V in host memory with 32-bit SimHash signatures on the GPU (HashAttention, vAttention).
//
// Rows printed (median over --reps calls, a 512 MB write between calls so that no call finds the
// previous one's rows in L2; accuracy = relative L2 error of the output against the engine's
// dense output for the same q):
//   kernel dense (GPU-resident)   DenseDecode on a contiguous [B, n, Hkv, d] cache, CUDA events:
//                                 the baseline "dense attention with the KV resident on the GPU";
//   kernel dense (bulk H2D)       one cudaMemcpy of that cache from pinned host memory, then
//                                 DenseDecode: dense attention fetching every row from host memory;
//   engine <method> / <placement> DecodeEngine::Decode wall time (upload of q and the tables,
//                                 kernels, download of the output), the engine's own overhead
//                                 included. Hash top-k runs twice: with a fresh random q each call
//                                 (row cache cold) and with q drifting step to step
//                                 (q_t = q_{t-1} + drift * |q| * noise: the row cache's case).
//                                 SAAP (random partitions, --saap_probes of 128 buckets) runs
//                                 the same three rows on an engine of its own.
// Also printed: bytes that crossed from host memory per call and their rate, rows fetched per
// kv head (density), row-cache hit rate, and GPU bytes per token of each placement.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "engine/cuda/gpu_backend.h"
#include "engine/decode_engine.h"
#include "kernels/cuda/dense_decode.h"
#include "kernels/cuda/santa.h"
#include "kernels/synthetic.h"
#include "kvstore/cuda_host_memory.h"
#include "kvstore/store.h"
#include "tests/gpu/bench_util.h"

ABSL_FLAG(std::string, lens, "32768,131072", "Context lengths n");
ABSL_FLAG(std::string, batches, "1,8", "Batch sizes B");
ABSL_FLAG(int, reps, 20, "Timed calls per row (median)");
ABSL_FLAG(double, hash_fraction, 0.0125,
          "HashAttention top-k fraction per query head (the union over a GQA group of 4 is ~4x)");
ABSL_FLAG(double, drift, 0.05, "Step-to-step query drift for the row-cache rows");
ABSL_FLAG(std::string, methods, "all", "Comma list: dense,prop,flash,hash,vatt,saap (or all)");
ABSL_FLAG(int, saap_probes, 4,
          "SAAP rows: buckets probed of 128 (random partitions and classifiers; 4 = 1/32 of the "
          "keys on average, compare --hash_fraction=0.03125)");
ABSL_FLAG(int, stage_timing_every, 3,
          "GpuOptions::stage_timing_every: the [gpu] and gather-stage columns are medians "
          "over the timed calls (odd: a row makes two engine calls per step, its own and the "
          "dense reference's)");
ABSL_FLAG(double, row_cache, 0.04,
          "The GPU engine's row cache, rows per kv head / tokens (GpuOptions::row_cache; "
          "0: none)");
ABSL_FLAG(int, capacity_batch, 0,
          "Capacity mode (instead of the table): serve this many sequences of --capacity_len "
          "tokens and --capacity_layers layers with K and V in host memory (hash top-k), whose "
          "K and V would not fit on the GPU, and report decode tokens per second");
ABSL_FLAG(int, capacity_layers, 32, "Capacity mode: layers (Llama-3.1-8B: 32)");
ABSL_FLAG(int, capacity_len, 131072, "Capacity mode: tokens per sequence");
ABSL_FLAG(int, capacity_steps, 4, "Capacity mode: decode steps timed (after one warm-up step)");

namespace {

namespace kv = kvsparse::kvstore;
namespace ks = kvsparse::engine;
namespace kk = kvsparse::kernels;
using Clock = std::chrono::steady_clock;

#define CK(x) KVSPARSE_BENCH_CK(x)

using kvsparse::bench::Median;

// One Llama-3.1-8B-shaped sequence of n tokens (H = 32, Hkv = 8, d = 128, bf16), peaked family.
kk::SyntheticOptions LlamaSequence(int n) {
  kk::SyntheticOptions so;
  so.family = kk::ScoreFamily::kPeaked;
  so.batch = 1;
  so.num_q_heads = 32;
  so.num_kv_heads = 8;
  so.head_dim = 128;
  so.seq_lens = {n};
  so.seed = 3;
  return so;
}

std::vector<int> Ints(const std::string& s) {
  std::vector<int> r;
  for (absl::string_view p : absl::StrSplit(s, ',')) {
    int x;
    if (absl::SimpleAtoi(p, &x)) r.push_back(x);
  }
  return r;
}

double RelL2(const std::string& got, const std::string& ref) {
  double num = 0, den = 0;
  const size_t n = ref.size() / 2;
  for (size_t i = 0; i < n; ++i) {
    const double a = kk::LoadAsFloat(got.data(), i, kk::DType::kBf16);
    const double b = kk::LoadAsFloat(ref.data(), i, kk::DType::kBf16);
    num += (a - b) * (a - b);
    den += b * b;
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// Overwrites 512 MB so that the next call starts with a cold L2.
struct Thrash {
  void* buf = nullptr;
  size_t bytes = 512ull << 20;
  Thrash() { CK(cudaMalloc(&buf, bytes)); }
  void Run() {
    CK(cudaMemsetAsync(buf, ++v, bytes, nullptr));
    CK(cudaDeviceSynchronize());
  }
  int v = 0;
};

struct Row {
  std::string name;
  double us = 0;
  double err = -1;
  double host_mb = 0;  // per call, from host memory
  double rows_per_head = 0;
  double hit = -1;
  double gpu_us = -1;     // the engine's GPU time (events around its launches)
  double engine_us = -1;  // the engine's own wall time (DecodeResult::timing.engine_seconds)
  double sync_us = -1;    // of which bringing the GPU state up to date (and finding it)
  double launch_us = -1;  // of which the backend's host work until all is enqueued
  double wait_us = -1;    // of which waiting for the stream (kernels, transfers, wake-up)
  double gather_us = -1;  // of which the gather stage (selection-row methods)
};

void Print(const Row& r, double dense_us, double h2d_gbs, int n) {
  std::printf("%-44s %9.1f us  x%6.2f of resident dense", r.name.c_str(), r.us, r.us / dense_us);
  if (r.err >= 0) std::printf("  relL2 %.4f", r.err);
  if (r.host_mb > 0) {
    const double gbs = r.host_mb / r.us * 1e3;
    std::printf("  host %.2f MB/call = %.1f GB/s over the call (%.0f%% of bulk H2D)", r.host_mb,
                gbs, 100.0 * gbs / h2d_gbs);
  }
  if (r.rows_per_head > 0)
    std::printf("  rows/kv head %.0f (%.2f%%)", r.rows_per_head, 100.0 * r.rows_per_head / n);
  if (r.hit >= 0) std::printf("  cache hits %.1f%%", 100.0 * r.hit);
  if (r.gpu_us >= 0) std::printf("  [gpu %.1f us]", r.gpu_us);
  if (r.engine_us >= 0) {
    std::printf("  [engine %.1f us: sync %.1f, launch %.1f, wait %.1f]", r.engine_us, r.sync_us,
                r.launch_us, r.wait_us);
  }
  if (r.gather_us > 2 && r.host_mb > 0) {  // methods with a gather stage of their own
    std::printf("  [gather stage %.1f us: %.1f GB/s]", r.gather_us, r.host_mb / r.gather_us * 1e3);
  }
  std::printf("\n");
  std::fflush(stdout);
}

// Appends the synthetic sequence's K and V (all its tokens) to one layer of sequence id.
bool AppendLayer(kv::Store* store, const std::string& id, int layer,
                 const kk::SyntheticProblem& sp) {
  const kk::DecodeProblem& p = sp.problem;
  kv::AppendRequest r;
  r.sequence_id = id;
  r.first_layer = static_cast<uint32_t>(layer);
  r.num_layers = 1;
  r.num_tokens = static_cast<uint64_t>(p.seq_lens[0]);
  r.dtype = p.dtype;
  r.num_kv_heads = static_cast<uint32_t>(p.num_kv_heads);
  r.head_dim = static_cast<uint32_t>(p.head_dim);
  r.k = sp.k;
  r.v = sp.v;
  if (absl::Status st = store->Append(r).status(); !st.ok()) {
    std::fprintf(stderr, "append: %s\n", st.ToString().c_str());
    return false;
  }
  return true;
}

// Capacity mode: B sequences x L layers x n tokens whose K and V (B * n * L * 4 KiB for these
// shapes) exceed the GPU's memory, served with K and V in pinned host memory and 32-bit
// signatures on the GPU (hash top-k, drifting queries): one decode step = one Decode call per
// layer for the whole batch; tokens per second = B / step time.
int Capacity(double h2d_gbs) {
  constexpr int H = 32, hkv = 8, d = 128;
  constexpr size_t row = d * 2;
  const int B = absl::GetFlag(FLAGS_capacity_batch), L = absl::GetFlag(FLAGS_capacity_layers);
  const int n = absl::GetFlag(FLAGS_capacity_len), steps = absl::GetFlag(FLAGS_capacity_steps);
  size_t gpu_free = 0, gpu_total = 0;
  CK(cudaMemGetInfo(&gpu_free, &gpu_total));
  const double kv_bytes = 2.0 * B * n * L * hkv * row;
  std::printf(
      "# capacity: B = %d x n = %d x %d layers: K+V %.1f GB; GPU memory %.1f GB (%.1f GB "
      "free)\n",
      B, n, L, kv_bytes / 1e9, gpu_total / 1e9, gpu_free / 1e9);
  std::fprintf(stderr, "making the synthetic sequence...\n");
  kk::SyntheticProblem sp = kk::SyntheticProblem::Make(LlamaSequence(n));
  auto mem = kv::NewPinnedHostMemoryResource();
  if (!mem.ok()) {
    std::fprintf(stderr, "%s\n", mem.status().ToString().c_str());
    return 1;
  }
  kv::StoreOptions sto;
  sto.capacity_bytes = static_cast<size_t>(kv_bytes) + (1ull << 30);
  sto.max_append_bytes = 1ull << 34;
  sto.memory = mem->get();
  auto store = kv::Store::Create(sto);
  if (!store.ok()) return 1;
  auto source = ks::NewLocalRowSource(store->get(), /*pages_device_visible=*/true);
  const kv::ModelShape shape{static_cast<uint32_t>(L), H, hkv, d, kk::DType::kBf16};
  kv::Placement place;
  place.signature_bits = 32;
  const auto t_load = Clock::now();
  for (int b = 0; b < B; ++b) {
    const std::string id = "c" + std::to_string(b);
    if (!(*store)->CreateSequence(id, shape, place).ok()) return 1;
    for (int l = 0; l < L; ++l) {
      if (!AppendLayer(store->get(), id, l, sp)) return 1;
    }
    std::fprintf(stderr, "loaded sequence %d of %d (%.0f s)\n", b + 1, B,
                 std::chrono::duration<double>(Clock::now() - t_load).count());
  }
  ks::EngineOptions eo;
  eo.gpu.capacity_bytes = 16ull << 30;
  auto backend = ks::NewGpuBackend(eo, source.get());
  if (!backend.ok()) return 1;
  ks::DecodeEngine engine(eo, source.get(), std::move(*backend));
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal;
  std::vector<float> qf(static_cast<size_t>(B) * H * d);
  for (size_t i = 0; i < qf.size(); ++i) {
    qf[i] = kk::LoadAsFloat(sp.q.data(), i % (H * d), kk::DType::kBf16);
  }
  double ms = 0;
  for (float x : qf) ms += static_cast<double>(x) * x;
  const float q_rms = static_cast<float>(std::sqrt(ms / qf.size()));
  ks::Method m;
  m.kind = ks::MethodKind::kHashTopK;
  m.hash.fixed.top_k_fraction = static_cast<float>(absl::GetFlag(FLAGS_hash_fraction));
  std::vector<uint8_t> q(qf.size() * 2);
  double hits = 0, fetched = 0, host = 0;
  std::vector<double> step_s;
  for (int step = -1; step < steps; ++step) {
    const auto t0 = Clock::now();
    for (int l = 0; l < L; ++l) {
      for (size_t i = 0; i < qf.size(); ++i) {
        kk::StoreFromFloat(q.data(), i, kk::DType::kBf16,
                           qf[i] + absl::GetFlag(FLAGS_drift) * q_rms * normal(rng));
      }
      ks::DecodeCall c;
      c.layer = static_cast<uint32_t>(l);
      for (int b = 0; b < B; ++b) c.sequence_ids.push_back("c" + std::to_string(b));
      c.q = q;
      c.method = m;
      c.seed = step;
      auto r = engine.Decode(c);
      if (!r.ok()) {
        std::fprintf(stderr, "decode: %s\n", r.status().ToString().c_str());
        return 1;
      }
      if (step >= 0) {
        for (const ks::HeadStats& hs : r->heads) {
          hits += hs.rows_cached;
          fetched += hs.rows_fetched;
          host += hs.bytes[static_cast<int>(kv::Tier::kHost)];
        }
      }
    }
    const double sec = std::chrono::duration<double>(Clock::now() - t0).count();
    if (step < 0) {
      std::fprintf(stderr, "first step (syncs the signatures of every layer): %.1f s\n", sec);
    } else {
      step_s.push_back(sec);
    }
  }
  const double step = Median(step_s);
  size_t free_after = 0;
  CK(cudaMemGetInfo(&free_after, &gpu_total));
  std::printf(
      "# capacity: served; decode step (%d layers, B = %d) median %.2f ms over %d steps = "
      "%.0f tokens/s; row-cache hits %.1f%%; host %.1f MB/step (%.1f GB/s at bulk %.1f); "
      "backend GPU state %.2f GB (%.2f%% of the K+V bytes); GPU memory in use %.1f GB\n",
      L, B, step * 1e3, steps, B / step, 100.0 * hits / std::max(fetched, 1.0), host / steps / 1e6,
      host / steps / step / 1e9, h2d_gbs, engine.device_backend()->resident_bytes() / 1e9,
      100.0 * engine.device_backend()->resident_bytes() / kv_bytes, (gpu_total - free_after) / 1e9);
  return 0;
}

// What every (n, B) configuration shares: the flags, the L2 thrash, the timing events and the
// bulk copy rate.
struct Env {
  int reps = 20;
  std::string methods;
  Thrash thrash;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  double h2d_gbs = 0;
  bool want(const char* m) const {
    return methods == "all" || methods.find(m) != std::string::npos;
  }
  // The median over env.reps calls of body's GPU time (CUDA events), three untimed first.
  template <typename Body>
  double TimeEvents(Body&& body) {
    std::vector<double> us;
    for (int r = -3; r < reps; ++r) {
      thrash.Run();
      CK(cudaEventRecord(e0));
      body();
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      if (r >= 0) us.push_back(ms * 1e3);
    }
    return Median(us);
  }
};

constexpr int kH = 32, kHkv = 8, kD = 128;
constexpr size_t kRow = kD * 2;

// One (n, B) configuration: B copies of the synthetic sequence under three placements in one
// store ("dev": K and V on the GPU, with signatures; "kdev": K on the GPU; "host": K and V in
// host memory, with signatures), the engine over it (and SAAP's own engine), and the queries.
class Config {
 public:
  Config(Env& env, const kk::SyntheticProblem& sp, int n, int B)
      : env_(env), sp_(sp), n_(n), B_(B), seq_bytes_(static_cast<size_t>(n) * kHkv * kRow) {}

  // The store, its sequences and the engines; false on error (printed).
  bool Load() {
    auto mem = kv::NewPinnedHostMemoryResource();
    if (!mem.ok()) {
      std::fprintf(stderr, "%s\n", mem.status().ToString().c_str());
      return false;
    }
    mem_ = std::move(*mem);
    kv::StoreOptions sto;
    sto.capacity_bytes = 3 * 2 * B_ * seq_bytes_ + (256ull << 20);
    sto.max_append_bytes = 1ull << 34;
    sto.memory = mem_.get();
    auto store = kv::Store::Create(sto);
    if (!store.ok()) return false;
    store_ = std::move(*store);
    source_ = ks::NewLocalRowSource(store_.get(), /*pages_device_visible=*/true);
    const kv::ModelShape shape{1, kH, kHkv, kD, kk::DType::kBf16};
    kv::Placement dev, kdev, host;
    dev.k_tier = dev.v_tier = kv::Tier::kDevice;
    dev.signature_bits = 32;  // hash top-k over resident rows too
    kdev.k_tier = kv::Tier::kDevice;
    host.signature_bits = 32;
    const std::pair<const char*, kv::Placement> sets[] = {
        {"dev", dev}, {"kdev", kdev}, {"host", host}};
    std::fprintf(stderr, "loading %d sequences x 3 placements (%.1f GB pinned)...\n", B_,
                 3.0 * 2 * B_ * seq_bytes_ / 1e9);
    for (const auto& [name, placement] : sets) {
      for (int b = 0; b < B_; ++b) {
        const std::string id = std::string(name) + std::to_string(b);
        if (!store_->CreateSequence(id, shape, placement).ok()) return false;
        if (!AppendLayer(store_.get(), id, 0, sp_)) return false;
      }
    }
    return MakeEngines();
  }

  // GPU bytes per token of each placement, after its first call syncs it.
  void PrintPlacementBytes() {
    const char* sets[] = {"dev", "kdev", "host"};
    std::vector<double> bytes_per_token(3);
    for (int i = 0; i < 3; ++i) {
      const size_t before = engine_->device_backend()->resident_bytes();
      ks::Method m;
      if (i == 2) {  // signatures and the row sets the hash path keeps
        m.kind = ks::MethodKind::kHashTopK;
        m.hash.fixed.top_k_fraction = static_cast<float>(absl::GetFlag(FLAGS_hash_fraction));
      }
      std::fprintf(stderr, "syncing placement %s...\n", sets[i]);
      (void)Decode(Call(sets[i], m, q_));
      bytes_per_token[i] =
          static_cast<double>(engine_->device_backend()->resident_bytes() - before) / (B_ * n_);
    }
    const double resident_layout = 2.0 * kHkv * kRow;  // K and V of one token, one layer
    std::printf(
        "# GPU bytes per token and layer: K+V resident %.0f (layout %.0f); K resident "
        "%.0f; host placement (signatures + row cache) %.1f = %.2f%% of the layout\n",
        bytes_per_token[0], resident_layout, bytes_per_token[1], bytes_per_token[2],
        100.0 * bytes_per_token[2] / resident_layout);
  }

  // The kernel rows on a contiguous [B, n, Hkv, d] cache (GPU-resident, and bulk-copied from
  // pinned memory), without the engine; returns the GPU-resident dense time, every row's
  // reference.
  double KernelRows() {
    void *dk = nullptr, *dv = nullptr, *dq = nullptr, *dout = nullptr, *dlens = nullptr;
    void *hk = nullptr, *hv = nullptr, *ws = nullptr;
    const size_t bytes = B_ * seq_bytes_;
    CK(cudaMalloc(&dk, bytes));
    CK(cudaMalloc(&dv, bytes));
    CK(cudaMallocHost(&hk, bytes));
    CK(cudaMallocHost(&hv, bytes));
    for (int b = 0; b < B_; ++b) {
      std::memcpy(static_cast<char*>(hk) + b * seq_bytes_, sp_.k.data(), seq_bytes_);
      std::memcpy(static_cast<char*>(hv) + b * seq_bytes_, sp_.v.data(), seq_bytes_);
    }
    CK(cudaMemcpy(dk, hk, bytes, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dv, hv, bytes, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&dq, q_.size()));
    CK(cudaMemcpy(dq, q_.data(), q_.size(), cudaMemcpyHostToDevice));
    CK(cudaMalloc(&dout, q_.size()));
    std::vector<int32_t> lens(B_, n_);
    CK(cudaMalloc(&dlens, B_ * 4));
    CK(cudaMemcpy(dlens, lens.data(), B_ * 4, cudaMemcpyHostToDevice));
    kk::cuda::DecodeShape ds;
    ds.batch = B_;
    ds.num_q_heads = kH;
    ds.num_kv_heads = kHkv;
    ds.head_dim = kD;
    ds.q = dq;
    ds.k = dk;
    ds.v = dv;
    ds.kv = {static_cast<int64_t>(n_) * kHkv * kD, kD, kHkv * kD};
    ds.seq_lens = static_cast<int32_t*>(dlens);
    ds.max_seq_len = n_;
    ds.scale = 1.f / std::sqrt(static_cast<float>(kD));
    ds.out = dout;
    const size_t wsb = kk::cuda::DenseDecodeWorkspaceBytes(ds);
    CK(cudaMalloc(&ws, std::max<size_t>(wsb, 256)));
    const double dense_us =
        env_.TimeEvents([&] { CK(kk::cuda::DenseDecode(ds, ws, wsb, nullptr)); });
    Print({"kernel dense, KV resident on the GPU", dense_us}, dense_us, env_.h2d_gbs, n_);
    const double bulk_us = env_.TimeEvents([&] {
      CK(cudaMemcpyAsync(dk, hk, bytes, cudaMemcpyHostToDevice, nullptr));
      CK(cudaMemcpyAsync(dv, hv, bytes, cudaMemcpyHostToDevice, nullptr));
      CK(kk::cuda::DenseDecode(ds, ws, wsb, nullptr));
    });
    Row bulk{"kernel dense, every row bulk-copied from host", bulk_us};
    bulk.host_mb = 2.0 * bytes / 1e6;
    Print(bulk, dense_us, env_.h2d_gbs, n_);
    SantaKernelRows(ds, dense_us);
    for (void* p : {dk, dv, dq, dout, dlens, ws}) CK(cudaFree(p));
    CK(cudaFreeHost(hk));
    CK(cudaFreeHost(hv));
    return dense_us;
  }

  // The engine rows: each method on the placements it serves, against the engine's dense output
  // for the same q.
  void EngineRows(double dense_us) {
    dense_us_ = dense_us;
    const std::string dense_ref = Decode(Call("dev", ks::Method{}, q_)).output;
    if (env_.want("dense")) {
      TimeEngine("dev", ks::Method{}, dense_ref, false, "engine dense / K,V on GPU");
      TimeEngine("host", ks::Method{}, dense_ref, false, "engine dense / K,V in host (zero-copy)");
    }
    for (const char* set : {"kdev", "dev"}) {
      for (int variant = 0; variant < 2; ++variant) {
        if (!env_.want(variant == 0 ? "prop" : "flash")) continue;
        ks::Method m;
        m.kind = ks::MethodKind::kSanta;
        m.santa.allocation =
            variant == 0 ? kk::SantaAllocation::kProp : kk::SantaAllocation::kFlash;
        m.santa.samples = variant == 0 ? 128 : 2048;
        TimeEngine(set, m, dense_ref, false,
                   std::string("engine S2ANTA-") + (variant == 0 ? "prop S=128" : "flash S=2048") +
                       (std::string(set) == "kdev" ? " / K GPU, V host" : " / K,V on GPU"));
      }
    }
    if (env_.want("hash")) {
      ks::Method m;
      m.kind = ks::MethodKind::kHashTopK;
      m.hash.fixed.top_k_fraction = static_cast<float>(absl::GetFlag(FLAGS_hash_fraction));
      TimeEngine("host", m, dense_ref, false, "engine hash top-k / host, fresh q");
      TimeEngine("host", m, dense_ref, true, "engine hash top-k / host, drifting q");
      TimeEngine("dev", m, dense_ref, true, "engine hash top-k / K,V on GPU, drifting q");
    }
    if (saap_engine_ != nullptr) {
      ks::Method m;
      m.kind = ks::MethodKind::kSaap;
      m.saap.probes = absl::GetFlag(FLAGS_saap_probes);
      active_ = saap_engine_.get();
      const std::string name = "engine SAAP C=128 probes=" + std::to_string(m.saap.probes);
      TimeEngine("host", m, dense_ref, false, name + " / host, fresh q");
      TimeEngine("host", m, dense_ref, true, name + " / host, drifting q");
      TimeEngine("dev", m, dense_ref, true, name + " / K,V on GPU, drifting q");
      active_ = engine_.get();
    }
    if (env_.want("vatt")) {
      ks::Method m;
      m.kind = ks::MethodKind::kVAttention;
      m.vattention.fixed.top_k_fraction = 0.01f;
      TimeEngine("host", m, dense_ref, false, "engine vAttention eps=delta=0.05 / host");
    }
  }

 private:
  // The engine, and SAAP's own (random partitions of C = 128 and classifiers of width 128: they
  // replace the SimHash signatures) over the same store; the queries.
  bool MakeEngines() {
    ks::EngineOptions eo;
    eo.resident_capacity_bytes = 64ull << 30;
    eo.gpu.capacity_bytes = 64ull << 30;
    eo.gpu.row_cache = absl::GetFlag(FLAGS_row_cache);
    eo.gpu.stage_timing_every = absl::GetFlag(FLAGS_stage_timing_every);
    auto backend = ks::NewGpuBackend(eo, source_.get());
    if (!backend.ok()) {
      std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
      return false;
    }
    engine_ = std::make_unique<ks::DecodeEngine>(eo, source_.get(), std::move(*backend));
    active_ = engine_.get();
    if (env_.want("saap")) {
      ks::EngineOptions so = eo;
      so.signatures.saap = std::make_shared<const kk::SaapWeights>(
          kk::RandomSaapWeights(1, kH, kHkv, kD, 128, 128, 23));
      auto sb = ks::NewGpuBackend(so, source_.get());
      if (!sb.ok()) {
        std::fprintf(stderr, "%s\n", sb.status().ToString().c_str());
        return false;
      }
      saap_engine_ = std::make_unique<ks::DecodeEngine>(so, source_.get(), std::move(*sb));
    }
    // q for B sequences: the synthetic anchor query with a little per-sequence noise.
    qf_.resize(static_cast<size_t>(B_) * kH * kD);
    for (int b = 0; b < B_; ++b) {
      for (size_t i = 0; i < static_cast<size_t>(kH) * kD; ++i) {
        qf_[b * kH * kD + i] =
            kk::LoadAsFloat(sp_.q.data(), i, kk::DType::kBf16) + 0.02f * normal_(rng_);
      }
    }
    q_ = QBytes(qf_);
    return true;
  }

  // The same S2ANTA kernels on the contiguous GPU-resident cache, without the engine.
  void SantaKernelRows(const kk::cuda::DecodeShape& ds, double dense_us) {
    for (int variant = 0; variant < 2; ++variant) {
      if (!env_.want(variant == 0 ? "prop" : "flash")) continue;
      kk::cuda::SantaLaunchParams p;
      p.shape = ds;
      p.num_samples = variant == 0 ? 128 : 2048;
      p.seed = 5;
      const size_t wb = variant == 0 ? kk::cuda::S2antaPropWorkspaceBytes(p)
                                     : kk::cuda::S2antaFlashWorkspaceBytes(p);
      void* sws = nullptr;
      CK(cudaMalloc(&sws, std::max<size_t>(wb, 256)));
      const double us = env_.TimeEvents([&] {
        CK(variant == 0 ? kk::cuda::S2antaProp(p, sws, wb, nullptr)
                        : kk::cuda::S2antaFlash(p, sws, wb, nullptr));
      });
      Print({variant == 0 ? "kernel S2ANTA-prop S=128, GPU-resident"
                          : "kernel S2ANTA-flash S=2048, GPU-resident",
             us},
            dense_us, env_.h2d_gbs, n_);
      CK(cudaFree(sws));
    }
  }

  static std::vector<uint8_t> QBytes(const std::vector<float>& f) {
    std::vector<uint8_t> q(f.size() * 2);
    for (size_t i = 0; i < f.size(); ++i) kk::StoreFromFloat(q.data(), i, kk::DType::kBf16, f[i]);
    return q;
  }

  ks::DecodeCall Call(const char* set, const ks::Method& m, const std::vector<uint8_t>& qb) const {
    ks::DecodeCall c;
    c.layer = 0;
    for (int b = 0; b < B_; ++b) c.sequence_ids.push_back(std::string(set) + std::to_string(b));
    c.q_dtype = kk::DType::kBf16;
    c.q = qb;
    c.method = m;
    c.seed = 5;
    return c;
  }

  // A call on the active engine; exits on error.
  ks::DecodeResult Decode(const ks::DecodeCall& c) {
    auto r = active_->Decode(c);
    if (!r.ok()) {
      std::fprintf(stderr, "decode: %s\n", r.status().ToString().c_str());
      std::exit(1);
    }
    return std::move(*r);
  }

  // One engine row: env.reps timed calls (three untimed first) of m on placement `set`; the
  // selection methods with signatures take a fresh random q each call around the anchor, or
  // (drift) a small step from the last, and are compared with the engine's dense output for
  // the same q; the others with ref.
  void TimeEngine(const char* set, const ks::Method& m, const std::string& ref, bool drift,
                  const std::string& name) {
    const bool signed_q = m.kind == ks::MethodKind::kHashTopK || m.kind == ks::MethodKind::kSaap;
    std::vector<double> us, gpu, gather, eng, syn, lau, wai;
    double host = 0, rows = 0, hits = 0, fetched = 0, err = 0;
    std::vector<float> qd = qf_;
    std::mt19937_64 qr(99);
    double ms = 0;
    for (float x : qf_) ms += static_cast<double>(x) * x;
    const float q_rms = static_cast<float>(std::sqrt(ms / qf_.size()));
    const float step = static_cast<float>(absl::GetFlag(FLAGS_drift));
    int counted = 0;
    for (int i = -3; i < env_.reps; ++i) {
      std::vector<uint8_t> qb = q_;
      if (signed_q) {
        for (size_t k = 0; k < qd.size(); ++k) {
          qd[k] = drift ? qd[k] + step * q_rms * normal_(qr) : qf_[k] + q_rms * normal_(qr);
        }
        qb = QBytes(qd);
      }
      env_.thrash.Run();
      const auto t0 = Clock::now();
      ks::DecodeResult res = Decode(Call(set, m, qb));
      const double t = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      if (i < 0) continue;
      us.push_back(t);
      if (res.timing.stage_weight > 0) {  // a timed call
        gpu.push_back((res.timing.selection_seconds + res.timing.gather_seconds +
                       res.timing.compute_seconds) *
                      1e6);
        gather.push_back(res.timing.gather_seconds * 1e6);
      }
      eng.push_back(res.timing.engine_seconds * 1e6);
      syn.push_back(res.timing.sync_seconds * 1e6);
      lau.push_back(res.timing.launch_seconds * 1e6);
      wai.push_back(res.timing.wait_seconds * 1e6);
      for (const ks::HeadStats& hs : res.heads) {
        host += hs.bytes[static_cast<int>(kv::Tier::kHost)];
        rows += hs.rows_fetched;
        hits += hs.rows_cached;
        fetched += hs.rows_fetched;
      }
      if (signed_q) {
        ks::DecodeEngine* was = active_;
        active_ = engine_.get();
        err += RelL2(res.output, Decode(Call("dev", ks::Method{}, qb)).output);
        active_ = was;
      } else {
        err += RelL2(res.output, ref);
      }
      ++counted;
    }
    Row r;
    r.name = name;
    r.us = Median(us);
    r.gpu_us = Median(gpu);
    r.gather_us = Median(gather);
    r.engine_us = Median(eng);
    r.launch_us = Median(lau);
    r.wait_us = Median(wai);
    r.sync_us = Median(syn);
    r.err = err / counted;
    r.host_mb = host / counted / 1e6;
    r.rows_per_head = rows / counted / (B_ * kHkv);
    if (signed_q) r.hit = fetched > 0 ? hits / fetched : 0;
    Print(r, dense_us_, env_.h2d_gbs, n_);
  }

  Env& env_;
  const kk::SyntheticProblem& sp_;
  const int n_, B_;
  const size_t seq_bytes_;  // K (or V) of one sequence
  std::unique_ptr<kv::MemoryResource> mem_;
  std::unique_ptr<kv::Store> store_;
  std::unique_ptr<ks::RowSource> source_;
  std::unique_ptr<ks::DecodeEngine> engine_, saap_engine_;
  ks::DecodeEngine* active_ = nullptr;  // the engine Decode calls
  std::mt19937_64 rng_{11};
  std::normal_distribution<float> normal_;
  std::vector<float> qf_;
  std::vector<uint8_t> q_;
  double dense_us_ = 0;
};

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  Env env;
  env.reps = absl::GetFlag(FLAGS_reps);
  env.methods = absl::GetFlag(FLAGS_methods);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  CK(cudaEventCreate(&env.e0));
  CK(cudaEventCreate(&env.e1));
  // Bulk host-to-device bandwidth (pinned, 256 MiB), the reference for rows that cross.
  env.h2d_gbs = kvsparse::bench::BulkHostToDeviceGBs();
  std::printf("# device %s (%d SMs); bulk host-to-device copy %.1f GB/s\n", prop.name,
              prop.multiProcessorCount, env.h2d_gbs);
  const kvsparse::bench::ApiCost api = kvsparse::bench::MeasureApiCost();
  std::printf(
      "# host cost per CUDA call (us): event record %.2f, memset launch %.2f, 4 KB H2D copy "
      "%.2f, 4 KB D2H copy %.2f, idle stream sync %.2f\n",
      api.event_record, api.memset_launch, api.small_h2d, api.small_d2h, api.sync_idle);

  if (absl::GetFlag(FLAGS_capacity_batch) > 0) return Capacity(env.h2d_gbs);
  for (int n : Ints(absl::GetFlag(FLAGS_lens))) {
    std::fprintf(stderr, "n=%d: making the synthetic sequence...\n", n);
    kk::SyntheticProblem sp = kk::SyntheticProblem::Make(LlamaSequence(n));
    for (int B : Ints(absl::GetFlag(FLAGS_batches))) {
      std::printf("\n## n = %d, B = %d (K+V per layer: %.1f MB)\n", n, B,
                  2.0 * B * n * kHkv * kRow / 1e6);
      Config config(env, sp, n, B);
      if (!config.Load()) return 1;
      config.PrintPlacementBytes();
      const double dense_us = config.KernelRows();
      config.EngineRows(dense_us);
    }
  }
  return 0;
}
