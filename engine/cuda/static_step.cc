#include "engine/cuda/static_step.h"

#include <cuda_runtime_api.h>

#include <array>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "engine/cuda/cuda_util.h"
#include "engine/cuda/gpu_runner.h"
#include "engine/cuda/launch_plan.h"
#include "engine/methods/registry.h"
#include "kernels/compressed_keys.h"
#include "kernels/cuda/compressed_keys.h"
#include "kernels/cuda/hash_topk.h"
#include "kernels/cuda/selected_rows.h"
#include "kernels/cuda/step_append.h"

namespace kvsparse::engine::gpu {
namespace {

namespace kc = kernels::cuda;

// Reads in flight while a side stream warms the next layer's pages (kc::WarmPagedRows): on the
// H200 here 64 chains warmed 18 pages/us and slowed a device-memory stream beside them by 3%
// (128: 35%; unbounded: 85%; docs/PERF.md, "Cold translations").
constexpr int32_t kWarmChains = 64;

// A device allocation of the plan's own (freed with it).
struct OwnedDev {
  void* ptr = nullptr;
  ~OwnedDev() {
    if (ptr != nullptr) cudaFree(ptr);
  }
};

class GpuStaticStep final : public StaticStep {
 public:
  GpuStaticStep(std::mutex* mu, DeviceState* state, int device, const DecodeCall& call,
                absl::Span<const SequenceDesc> descs, const StaticStepRequest& req)
      : mu_(mu),
        state_(state),
        device_(device),
        descs_(descs.begin(), descs.end()),
        req_(req),
        B_(static_cast<int32_t>(descs.size())),
        L_(descs[0].shape.num_layers),
        template_(call) {}

  ~GpuStaticStep() override {
    std::lock_guard<std::mutex> lock(*mu_);
    // Kernels of this plan may still be writing the store's pages: let them finish before the
    // reservations (which keep those pages alive) go.
    cudaSetDevice(device_);
    cudaDeviceSynchronize();
    if (held_) {
      const std::vector<bool> stale = Uncommitted();
      for (int32_t b = 0; b < B_; ++b) {
        state_->Release(descs_[b].sequence_id);
        // Rows the steps wrote past the store's length (never committed) may have moved the
        // device state past the store's (an open group of compressed keys): rebuilt from the
        // store at its next use.
        if (stale[b]) state_->Forget(descs_[b].sequence_id);
      }
    }
    for (const auto& ly : layers_) {
      for (const LayerGraph& g : ly->graphs) cudaGraphExecDestroy(g.exec);
    }
    layers_.clear();
    if (graph_stream_ != nullptr) cudaStreamDestroy(graph_stream_);
    if (warm_join_ != nullptr) cudaEventDestroy(warm_join_);
    if (warm_fork_ != nullptr) cudaEventDestroy(warm_fork_);
    if (warm_stream_ != nullptr) cudaStreamDestroy(warm_stream_);
  }

  // Under the backend's lock: reserve, sync, hold, plan every layer.
  absl::Status Init() {
    KVS_CUDA_OK(cudaSetDevice(device_), "cudaSetDevice");
    RowSource* source = state_->source();
    for (const SequenceDesc& d : descs_) {
      absl::StatusOr<std::unique_ptr<kvstore::Reservation>> r =
          source->Reserve(d.sequence_id, req_.max_tokens);
      if (!r.ok()) return r.status();
      reservations_.push_back(std::move(*r));
      // A call that began before the plan held the sequence may have appended since it was
      // described: the steps would then write over a committed row.
      absl::StatusOr<SequenceDesc> now = source->Describe(d.sequence_id, absl::InfiniteFuture());
      if (!now.ok()) return now.status();
      if (now->layer_lengths != d.layer_lengths || now->incarnation != d.incarnation) {
        return absl::AbortedError(
            absl::StrCat("sequence '", d.sequence_id, "' changed while the plan was made; retry"));
      }
    }
    const Method& m = req_.method;
    const GpuRunner* runner = FindMethod(m.kind).gpu;
    // A method that reads the new key's signature in the step that appends it has the step sign
    // it (MethodCall::ReadsStepSignatures).
    words_ = static_cast<int32_t>(descs_[0].placement.signature_bits / 32);
    sign_keys_ = words_ > 0 && runner->ReadsStepSignatures(m);
    ck_block_bytes_ = CompressedKeyBlockBytes(descs_[0]);
    if (sign_keys_) {
      sig_bytes_ = sizeof(uint32_t) * B_ * descs_[0].shape.num_kv_heads * words_;
      KVS_CUDA_OK(cudaMalloc(&sigs_.ptr, sig_bytes_), "captured step signatures");
    }
    layers_.reserve(L_);
    for (uint32_t l = 0; l < L_; ++l) {
      auto layer = std::make_unique<Layer>();
      layer->call = template_;
      layer->call.layer = l;
      DecodeResult scratch_result;
      if (absl::Status s = state_->Sync(layer->call, descs_, &layer->batch, &scratch_result);
          !s.ok()) {
        return s;
      }
      layer->batch.views.clear();  // the store's read locks: the plan holds reservations instead
      if (l == 0) {                // held from here on (released by the destructor)
        for (DeviceSequence* e : layer->batch.seqs) state_->Hold(e);
        held_ = true;
      }
      for (int32_t b = 0; b < B_; ++b) {
        if (absl::Status s =
                state_->HoldForSteps(layer->batch.seqs[b], l, descs_[b], *reservations_[b],
                                     req_.max_tokens, layer->batch.busy);
            !s.ok()) {
          return s;
        }
        // Every length may reach the bound: the kernels' grids and buffers are sized for it.
        layer->batch.lens[b] = static_cast<int32_t>(req_.max_tokens);
      }
      if (sign_keys_) {  // SimHash planes of the layer and each sequence's M (fixed by now)
        absl::StatusOr<const float*> planes =
            state_->simhash().Planes(l, static_cast<int32_t>(descs_[0].shape.num_kv_heads),
                                     words_ * 32, static_cast<int32_t>(descs_[0].shape.head_dim));
        if (!planes.ok()) return planes.status();
        layer->planes = *planes;
        for (DeviceSequence* e : layer->batch.seqs) {
          if (e->layers[l].norms.ptr == nullptr) {
            return absl::InternalError("a signed sequence without its SimHash M");
          }
          layer->norms.push_back(e->layers[l].norms.as<float>());
        }
      }
      layer->lp = std::make_unique<LaunchPlan>(layer->call, descs_, &layer->batch, state_);
      layer->mc = runner->Begin(m);
      LaunchPlan& lp = *layer->lp;
      if (absl::Status s = layer->mc->Plan(lp); !s.ok()) return s;
      if (absl::Status s = lp.BuildTables(&host_tables_); !s.ok()) return s;
      layer->mc->FillTables(lp);
      lp.BeginPass(nullptr, nullptr);
      size_t transient = 0;
      if (absl::Status s = Carve(*layer, &layer->method_bytes, &transient); !s.ok()) return s;
      shared_bytes_ = std::max(shared_bytes_, transient);
      const size_t bytes = lp.method_offset() + layer->method_bytes;
      KVS_CUDA_OK(cudaMalloc(&layer->scratch.ptr, bytes), "captured step scratch");
      lp.BeginPass(static_cast<char*>(layer->scratch.ptr), nullptr);
      layer->mc->FillScratchTables(lp);
      if (absl::Status s = lp.Upload(); !s.ok()) return s;
      KVS_CUDA_OK(cudaStreamSynchronize(lp.stream()), "captured step tables");
      PlanWarm(*layer, l);
      layers_.push_back(std::move(layer));
    }
    if (shared_bytes_ > 0) {
      KVS_CUDA_OK(cudaMalloc(&shared_.ptr, shared_bytes_), "captured step shared scratch");
    }
    if (absl::Status s = StartSideStream(); !s.ok()) return s;
    // Floors and tops: the committed lengths; the error and progress words 0.
    std::vector<int64_t> ctl(static_cast<size_t>(B_) * (L_ + 1) + 2, 0);
    for (int32_t b = 0; b < B_; ++b) {
      const int64_t n = static_cast<int64_t>(descs_[b].layer_lengths[0]);
      floor_host_.push_back(static_cast<uint64_t>(n));
      for (uint32_t l = 0; l <= L_; ++l) ctl[static_cast<size_t>(l) * B_ + b] = n;
    }
    control_bytes_ = sizeof(int64_t) * ctl.size();
    KVS_CUDA_OK(cudaMalloc(&ctl_.ptr, control_bytes_), "captured step control");
    for (auto& ly : layers_) ly->warm.stop = progress();
    KVS_CUDA_OK(
        cudaMemcpy(ctl_.ptr, ctl.data(), sizeof(int64_t) * ctl.size(), cudaMemcpyHostToDevice),
        "captured step control");
    return absl::OkStatus();
  }

  absl::Status Enqueue(uint32_t layer, const void* q, const void* new_k, const void* new_v,
                       const int64_t* positions, void* out, void* stream) override {
    if (layer >= L_) return absl::InvalidArgumentError("layer out of range");
    if (q == nullptr || new_k == nullptr || new_v == nullptr || positions == nullptr ||
        out == nullptr) {
      return absl::InvalidArgumentError("a captured step needs q, new_k, new_v, positions, out");
    }
    std::lock_guard<std::mutex> lock(*mu_);
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess || current != device_) {
      KVS_CUDA_OK(cudaSetDevice(device_), "cudaSetDevice");
    }
    // The caller's stream. Null is the legacy default stream (PyTorch's default stream), which
    // LaunchPlan reads as "none given: the backend's own": passed on as cudaStreamLegacy, or the
    // step's kernels ran on the backend's non-blocking stream, unordered with the caller's work
    // before and after them (an H200, 2026-11-30: planned steps on PyTorch's default stream gave
    // different tokens run to run; test_hf's planned-caches test, docs/data/planned-steps-race-*).
    cudaStream_t caller = stream != nullptr ? static_cast<cudaStream_t>(stream) : cudaStreamLegacy;
    Layer& ly = *layers_[layer];
    // The next layer's warm forks before this layer's kernels: it starts as soon as this layer's
    // step begins (the previous warm stops there) and has this layer's attention as well as the
    // model around it to read the next layer's pages. Except after layer 0, whose step resets the
    // progress word (the previous step's layers left it past 1).
    const bool warm_next = warm_ && layer + 1 < L_, early = warm_next && layer > 0;
    if (early) {
      if (absl::Status s = WarmNextLayer(layer + 1, caller); !s.ok()) return s;
    }
    if (absl::Status s = RunLayer(ly, layer, {q, new_k, new_v, positions, out}, caller); !s.ok()) {
      return s;
    }
    if (warm_next) return early ? absl::OkStatus() : WarmNextLayer(layer + 1, caller);
    if (warm_pending_) {  // the last layer: the side stream's work joins the caller's stream
      KVS_CUDA_OK(cudaStreamWaitEvent(caller, warm_join_, 0), "side stream join");
      warm_pending_ = false;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<uint64_t>> Commit(void* stream) override {
    std::lock_guard<std::mutex> lock(*mu_);
    KVS_CUDA_OK(cudaSetDevice(device_), "cudaSetDevice");
    KVS_CUDA_OK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "the steps");
    std::vector<int64_t> ctl(static_cast<size_t>(B_) * (L_ + 1) + 1);
    KVS_CUDA_OK(
        cudaMemcpy(ctl.data(), ctl_.ptr, sizeof(int64_t) * ctl.size(), cudaMemcpyDeviceToHost),
        "captured step control");
    const int32_t refused = reinterpret_cast<const int32_t*>(&ctl.back())[0];
    absl::Status status;
    for (int32_t b = 0; b < B_; ++b) {
      const int64_t t = ctl[static_cast<size_t>(B_) + b];  // layer 0's top
      bool even = true;
      for (uint32_t l = 1; l < L_; ++l) even &= ctl[static_cast<size_t>(l + 1) * B_ + b] == t;
      const std::string& id = descs_[b].sequence_id;
      if (!even) {
        status.Update(absl::FailedPreconditionError(
            absl::StrCat("sequence '", id,
                         "': its layers stand at different lengths (a step did not run "
                         "every layer); not committed")));
        continue;
      }
      const uint64_t n = static_cast<uint64_t>(t);
      if (n > floor_host_[b]) {
        if (absl::Status s =
                state_->source()->CommitWritten(id, L_, floor_host_[b], n - floor_host_[b]);
            !s.ok()) {
          status.Update(s);
          continue;
        }
        floor_host_[b] = n;
        ctl[b] = t;
        // The steps appended these tokens' compressed keys on the device: a later sync of the
        // committed rows leaves them be (it would re-read an open group the steps moved past).
        for (uint32_t l = 0; l < L_; ++l) layers_[l]->batch.seqs[b]->layers[l].ck_length = n;
      }
    }
    if (refused != 0) {
      ctl.back() = 0;
      status.Update(absl::OutOfRangeError(
          "a step's position was outside [committed length, one past the last row written] or "
          "at or past max_tokens: that sequence's output was zeros and its row not written"));
    }
    // New floors (and the cleared error word) back to the device.
    KVS_CUDA_OK(cudaMemcpy(ctl_.ptr, ctl.data(), sizeof(int64_t) * B_, cudaMemcpyHostToDevice),
                "floors");
    KVS_CUDA_OK(cudaMemcpy(error(), &ctl.back(), sizeof(int64_t), cudaMemcpyHostToDevice),
                "error word");
    if (!status.ok()) return status;
    return floor_host_;
  }

  absl::Status CopyStats(int32_t* dst, void* stream) override {
    std::lock_guard<std::mutex> lock(*mu_);
    for (uint32_t l = 0; l < L_; ++l) {
      const LaunchPlan& lp = *layers_[l]->lp;
      const size_t bytes = lp.stats_bytes();
      KVS_CUDA_OK(
          cudaMemcpyAsync(reinterpret_cast<char*>(dst) + l * bytes,
                          static_cast<char*>(layers_[l]->scratch.ptr) + lp.stats_offset(), bytes,
                          cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)),
          "statistics copy");
    }
    return absl::OkStatus();
  }
  uint32_t num_layers() const override { return L_; }
  uint32_t batch() const override { return static_cast<uint32_t>(B_); }
  uint32_t num_q_heads() const override { return descs_[0].shape.num_q_heads; }
  uint32_t num_kv_heads() const override { return descs_[0].shape.num_kv_heads; }
  uint32_t head_dim() const override { return descs_[0].shape.head_dim; }
  LayerGraphCounts layer_graph_counts() const override {
    std::lock_guard<std::mutex> lock(*mu_);
    return graph_counts_;
  }
  uint64_t device_bytes() const override {
    uint64_t bytes = shared_bytes_ + control_bytes_ + sig_bytes_;
    for (const auto& ly : layers_) bytes += ly->lp->method_offset() + ly->method_bytes;
    return bytes;
  }

 private:
  // A layer call's buffers: q, new_k, new_v, positions, out.
  using Buffers = std::array<const void*, 5>;

  // A layer's kernels recorded for one set of buffers (RecordLayer).
  struct LayerGraph {
    Buffers io;
    cudaGraphExec_t exec = nullptr;
  };
  static constexpr size_t kLayerGraphs = 4;

  struct Layer {
    DecodeCall call;
    SyncedBatch batch;
    std::unique_ptr<LaunchPlan> lp;
    std::unique_ptr<MethodCall> mc;
    OwnedDev scratch;
    size_t method_bytes = 0;
    const float* planes = nullptr;    // SimHash planes of the layer (sign_keys_)
    std::vector<const float*> norms;  // each sequence's M of the layer (sign_keys_)
    kc::WarmPagedRowsParams warm;     // its pages, read ahead by the previous layer (warm_)
    Buffers seen{};                   // the buffers of the last call without a graph
    std::vector<LayerGraph> graphs;   // recorded for the buffers of earlier calls (layer_graphs)
  };

  // The layer's kernels on `caller`: launched, or, outside a capture with layer graphs on,
  // replayed from the layer's graph for these buffers (recorded at their second call: buffers
  // seen once may not come back).
  absl::Status RunLayer(Layer& ly, uint32_t layer, const Buffers& io, cudaStream_t caller) {
    if (!req_.layer_graphs || Capturing(caller)) return LaunchLayer(ly, layer, io, caller);
    for (const LayerGraph& g : ly.graphs) {
      if (g.io == io) {
        KVS_CUDA_OK(cudaGraphLaunch(g.exec, caller), "layer graph launch");
        ++graph_counts_.replayed;
        return absl::OkStatus();
      }
    }
    if (ly.seen != io) {
      ly.seen = io;
      return LaunchLayer(ly, layer, io, caller);
    }
    return RecordLayer(ly, layer, io, caller);
  }

  // Records the layer's kernels for these buffers as a graph (on the plan's own stream, in a
  // capture of this thread's), keeps it (kLayerGraphs a layer, the oldest dropped: an
  // executable graph still in flight is freed when it completes) and launches it on `caller`.
  absl::Status RecordLayer(Layer& ly, uint32_t layer, const Buffers& io, cudaStream_t caller) {
    if (graph_stream_ == nullptr) {
      KVS_CUDA_OK(cudaStreamCreateWithFlags(&graph_stream_, cudaStreamNonBlocking),
                  "layer graph stream");
    }
    KVS_CUDA_OK(cudaStreamBeginCapture(graph_stream_, cudaStreamCaptureModeThreadLocal),
                "layer graph capture");
    const absl::Status launched = LaunchLayer(ly, layer, io, graph_stream_);
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(graph_stream_, &graph);
    if (!launched.ok() || ended != cudaSuccess) {
      if (graph != nullptr) cudaGraphDestroy(graph);
      cudaGetLastError();
      if (!launched.ok()) return launched;
      KVS_CUDA_OK(ended, "layer graph capture");
    }
    cudaGraphExec_t exec = nullptr;
    const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    KVS_CUDA_OK(made, "layer graph instantiate");
    if (ly.graphs.size() == kLayerGraphs) {
      cudaGraphExecDestroy(ly.graphs.front().exec);
      ly.graphs.erase(ly.graphs.begin());
    }
    ly.graphs.push_back({io, exec});
    ++graph_counts_.recorded;
    KVS_CUDA_OK(cudaGraphLaunch(exec, caller), "layer graph launch");
    ++graph_counts_.replayed;
    return absl::OkStatus();
  }

  // Whether `s` is being captured (or cannot be asked: treated as captured, launched as is).
  static bool Capturing(cudaStream_t s) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(s, &status) != cudaSuccess) {
      cudaGetLastError();  // not left for the next launch's check
      return true;
    }
    return status != cudaStreamCaptureStatusNone;
  }

  // The layer's kernels, launched on `stream`: the step's token appended, the method's kernels.
  absl::Status LaunchLayer(Layer& ly, uint32_t layer, const Buffers& io, cudaStream_t stream) {
    const auto [q, new_k, new_v, pos, out] = io;
    const int64_t* positions = static_cast<const int64_t*>(pos);
    LaunchPlan& lp = *ly.lp;
    ly.call.q_device = q;
    ly.call.out_device = const_cast<void*>(out);
    lp.set_stream(stream);
    lp.BeginPass(static_cast<char*>(ly.scratch.ptr), nullptr);
    kc::StepAppendParams p;
    p.zero = lp.stats();  // the statistics, zeroed by the step
    p.zero_words = static_cast<int32_t>(lp.stats_bytes() / sizeof(int32_t));
    p.batch = B_;
    p.num_kv_heads = lp.hkv;
    p.row_bytes = static_cast<int32_t>(lp.row);
    p.positions = positions;
    p.new_k = new_k;
    p.new_v = new_v;
    p.k_heads = lp.k_tier() == kDeviceTier ? lp.k_heads_table() : nullptr;
    p.v_heads = lp.v_tier() == kDeviceTier ? lp.v_heads_table() : nullptr;
    p.pages.tables = lp.page_lists();
    p.pages.page_shift = Log2(descs_[0].page_tokens);
    p.pages.slot_bytes = static_cast<int32_t>(2 * lp.row);
    p.floor = floor();
    p.top = top(layer);
    p.max_tokens = static_cast<int64_t>(req_.max_tokens);
    p.error = error();
    p.seq_lens = lp.lens_table();
    p.seeds = lp.seeds_table();
    p.seed = req_.seed + (static_cast<uint64_t>(layer) << 32);  // layers draw apart
    if (warm_) {  // stops the side stream's warm of this layer's pages (WarmNextLayer)
      p.progress = progress();
      p.layer = static_cast<int32_t>(layer);
    }
    if (sign_keys_) {
      const size_t row_stride = static_cast<size_t>(lp.hkv) * lp.row;
      for (int32_t b = 0; b < B_; ++b) {
        kc::SimHashSignParams sp;
        sp.num_seqs = 1;
        sp.heads = lp.hkv;
        sp.group = 1;
        sp.dim = lp.d;
        sp.bits = words_ * 32;
        sp.dtype = lp.dtype;
        sp.x = static_cast<const char*>(new_k) + b * row_stride;
        sp.planes = ly.planes;
        sp.max_norm = ly.norms[b];
        sp.out = static_cast<uint32_t*>(sigs_.ptr) + static_cast<size_t>(b) * lp.hkv * words_;
        sp.out_batch_stride = static_cast<int64_t>(lp.hkv) * words_;
        sp.out_head_stride = words_;
        KVS_CUDA_OK(kc::SimHashSign(sp, lp.stream()), "SimHashSign (the step's keys)");
      }
      p.new_sigs = static_cast<const uint32_t*>(sigs_.ptr);
      p.sig_heads = lp.sig_heads_table();
      p.sig_words = words_;
    }
    KVS_CUDA_OK(kc::StepAppend(p, lp.stream()), "StepAppend");
    if (ck_block_bytes_ > 0) {  // the placement keeps compressed keys: the step's key joins them
      kc::CompressedKeyStepParams cp;
      cp.batch = B_;
      cp.num_kv_heads = lp.hkv;
      cp.head_dim = lp.d;
      cp.bits = static_cast<int32_t>(descs_[0].placement.compressed_key_bits);
      cp.group = kernels::kKeyGroupTokens;
      cp.dtype = lp.dtype;
      cp.new_k = new_k;
      cp.seq_lens = lp.lens_table();
      cp.tails = lp.ck_tails_table();
      cp.group_heads = lp.ck_heads_table();
      cp.block_bytes = static_cast<int64_t>(ck_block_bytes_);
      KVS_CUDA_OK(kc::AppendCompressedKeyStep(cp, lp.stream()), "AppendCompressedKeyStep");
    }
    size_t bytes = 0, transient = 0;
    if (absl::Status s = Carve(ly, &bytes, &transient); !s.ok()) return s;
    if (bytes != ly.method_bytes) {
      return absl::InternalError("a captured step's buffers changed size between plan and run");
    }
    return absl::OkStatus();
  }

  // Layer l's warm (WarmNextLayer) where its K or V rows are in the store's pages (host memory
  // read over the host link) and the request asks for it.
  void PlanWarm(Layer& layer, uint32_t l) {
    const LaunchPlan& lp = *layer.lp;
    warm_ = req_.warm_pages && (lp.k_tier() != kDeviceTier || lp.v_tier() != kDeviceTier);
    layer.warm.batch = B_;
    layer.warm.num_kv_heads = lp.hkv;
    layer.warm.pages.tables = lp.page_lists();
    layer.warm.pages.page_shift = Log2(descs_[0].page_tokens);
    layer.warm.seq_lens = lp.lens_table();
    layer.warm.max_seq_len = static_cast<int32_t>(req_.max_tokens);
    layer.warm.chains = kWarmChains;
    layer.warm.stop_at = static_cast<int32_t>(l);  // its step reached: too late to help
  }
  // The side stream and its events, where layers are warmed (more than one layer).
  absl::Status StartSideStream() {
    if (!warm_ || L_ < 2) {
      warm_ = false;
      return absl::OkStatus();
    }
    int lowest = 0, highest = 0;
    KVS_CUDA_OK(cudaDeviceGetStreamPriorityRange(&lowest, &highest), "stream priorities");
    KVS_CUDA_OK(cudaStreamCreateWithPriority(&warm_stream_, cudaStreamNonBlocking, lowest),
                "captured step side stream");
    KVS_CUDA_OK(cudaEventCreateWithFlags(&warm_fork_, cudaEventDisableTiming), "side event");
    KVS_CUDA_OK(cudaEventCreateWithFlags(&warm_join_, cudaEventDisableTiming), "side event");
    return absl::OkStatus();
  }
  // Before layer l - 1's kernels, on the side stream (after the previous warm, which stops where
  // layer l - 1's step begins): one read of each of layer l's pages (kernels::cuda::WarmPagedRows,
  // kWarmChains at a time), so that the host link's address translations of its rows are warm
  // when its FetchRows runs, while the caller's stream runs layer l - 1's attention and the
  // model up to layer l's; it stops where layer l's step begins (the progress word StepAppend
  // writes). The side stream joins the caller's at the end of the last layer: a graph captures
  // whole steps, layers 0 .. L - 1 in order.
  absl::Status WarmNextLayer(uint32_t l, cudaStream_t caller) {
    KVS_CUDA_OK(cudaEventRecord(warm_fork_, caller), "side stream fork");
    KVS_CUDA_OK(cudaStreamWaitEvent(warm_stream_, warm_fork_, 0), "side stream fork");
    KVS_CUDA_OK(kc::WarmPagedRows(layers_[l]->warm, warm_stream_), "WarmPagedRows");
    KVS_CUDA_OK(cudaEventRecord(warm_join_, warm_stream_), "side stream join");
    warm_pending_ = true;
    return absl::OkStatus();
  }

  // Per sequence, whether a step wrote a row of some layer past the committed length (the
  // control block read back; true where it cannot be read). REQUIRES: the device is idle.
  std::vector<bool> Uncommitted() const {
    std::vector<bool> stale(B_, true);
    if (ctl_.ptr == nullptr) return std::vector<bool>(B_, false);  // no step ran
    std::vector<int64_t> ctl(static_cast<size_t>(B_) * (L_ + 1));
    if (cudaMemcpy(ctl.data(), ctl_.ptr, sizeof(int64_t) * ctl.size(), cudaMemcpyDeviceToHost) !=
        cudaSuccess) {
      return stale;
    }
    for (int32_t b = 0; b < B_; ++b) {
      stale[b] = false;
      for (uint32_t l = 0; l < L_; ++l) {
        stale[b] = stale[b] || ctl[static_cast<size_t>(l + 1) * B_ + b] > ctl[b];
      }
    }
    return stale;
  }
  // One pass of the method over the layer's plan (sizing when the pass has no base): *bytes of
  // the layer's own scratch, *transient of the region the layers share (shared_, which holds
  // the largest; null while sizing).
  absl::Status Carve(Layer& ly, size_t* bytes, size_t* transient) const {
    LaunchPlan& lp = *ly.lp;
    const bool sizing = lp.base() == nullptr;
    Carver c(sizing ? nullptr : lp.base() + lp.method_offset(), sizing ? nullptr : shared_.ptr);
    if (absl::Status s = ly.mc->Enqueue(lp, c); !s.ok()) return s;
    *bytes = c.used();
    *transient = c.transient_used();
    if (!sizing && *transient > shared_bytes_) {
      return absl::InternalError("a layer's transient scratch outgrew the shared region");
    }
    return absl::OkStatus();
  }
  // The control block: floors [B], tops [L][B], the error word, the progress word.
  int64_t* floor() const { return static_cast<int64_t*>(ctl_.ptr); }
  int64_t* top(uint32_t l) const { return floor() + static_cast<size_t>(l + 1) * B_; }
  int32_t* error() const {
    return reinterpret_cast<int32_t*>(floor() + static_cast<size_t>(L_ + 1) * B_);
  }
  // The layer whose step began last (StepAppendParams::progress).
  int32_t* progress() const {
    return reinterpret_cast<int32_t*>(floor() + static_cast<size_t>(L_ + 1) * B_ + 1);
  }

  std::mutex* const mu_;
  DeviceState* const state_;
  const int device_;
  const std::vector<SequenceDesc> descs_;
  const StaticStepRequest req_;
  const int32_t B_;
  const uint32_t L_;
  const DecodeCall template_;
  std::vector<std::unique_ptr<kvstore::Reservation>> reservations_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<uint64_t> floor_host_;
  PinnedBuf host_tables_;
  OwnedDev ctl_;
  OwnedDev sigs_;  // the step's key signatures [B * Hkv][words] (sign_keys_)
  // The layers' transient buffers (Carver::TakeTransient: the scores of every token and head),
  // one region for all layers: they run one after another on the caller's stream.
  OwnedDev shared_;
  size_t shared_bytes_ = 0;
  size_t control_bytes_ = 0, sig_bytes_ = 0;  // ctl_'s and sigs_' sizes
  int32_t words_ = 0;
  bool sign_keys_ = false;
  size_t ck_block_bytes_ = 0;  // of the placement's compressed keys (0: it keeps none)
  bool held_ = false;
  // Translation warming (WarmNextLayer): rows in host pages, more than one layer.
  bool warm_ = false;
  bool warm_pending_ = false;  // side work not yet joined to the caller's stream
  cudaStream_t warm_stream_ = nullptr;
  cudaEvent_t warm_fork_ = nullptr, warm_join_ = nullptr;
  // Layer graphs (RunLayer): the stream they are recorded on, and their counts.
  cudaStream_t graph_stream_ = nullptr;
  LayerGraphCounts graph_counts_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<StaticStep>> NewGpuStaticStep(std::mutex* mu, DeviceState* state,
                                                             int device, const DecodeCall& call,
                                                             absl::Span<const SequenceDesc> descs,
                                                             const StaticStepRequest& request) {
  for (const SequenceDesc& d : descs) {
    if (!FindMethod(call.method.kind).gpu->Capturable(call.method, d)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "this method and placement have no captured step (dense with K and V on the device, "
          "S2ANTA prop or flash, hash top-k with SimHash signatures, top-k and S2ANTA-prop over "
          "compressed keys do); run it as eager calls"));
    }
  }
  if (!state->source()->pages_device_visible()) {
    return absl::FailedPreconditionError(
        "captured steps write the store's pages from the GPU: the store must be in this process "
        "with pinned, mapped memory");
  }
  std::unique_lock<std::mutex> lock(*mu);
  auto step = std::make_unique<GpuStaticStep>(mu, state, device, call, descs, request);
  if (absl::Status s = step->Init(); !s.ok()) {
    lock.unlock();  // the destructor takes the lock
    return s;
  }
  return std::unique_ptr<StaticStep>(std::move(step));
}

}  // namespace kvsparse::engine::gpu
