#include "engine/cuda/static_step.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <limits>
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
        template_(call) {
    bounds_ = req.bounds;
  }

  ~GpuStaticStep() override {
    std::lock_guard<std::mutex> lock(*mu_);
    // Kernels of this plan may still be writing the store's pages: let them finish before the
    // reservations (which keep those pages alive) go.
    cudaSetDevice(device_);
    cudaDeviceSynchronize();
    ReleaseSequences();
    for (const auto& ly : layers_) DropLayerGraphs(*ly);
    layers_.clear();
    if (graph_stream_ != nullptr) cudaStreamDestroy(graph_stream_);
  }

  // Under the backend's lock: the plan's device memory, laid out for its first sequences and
  // bound to them (Bind).
  absl::Status Init() {
    KVS_CUDA_OK(cudaSetDevice(device_), "cudaSetDevice");
    const Method& m = req_.method;
    runner_ = FindMethod(m.kind).gpu;
    // A method that reads the new key's signature in the step that appends it has the step sign
    // it (MethodCall::ReadsStepSignatures).
    words_ = static_cast<int32_t>(descs_[0].placement.signature_bits / 32);
    sign_keys_ = words_ > 0 && runner_->ReadsStepSignatures(m);
    ck_block_bytes_ = CompressedKeyBlockBytes(descs_[0]);
    const size_t hkv = descs_[0].shape.num_kv_heads;
    if (sign_keys_) {
      sig_bytes_ = sizeof(uint32_t) * B_ * hkv * words_;
      KVS_CUDA_OK(cudaMalloc(&sigs_.ptr, sig_bytes_), "captured step signatures");
      norm_bytes_ = sizeof(float) * L_ * B_ * hkv;
      KVS_CUDA_OK(cudaMalloc(&norms_.ptr, norm_bytes_), "captured step SimHash M");
    }
    control_bytes_ = sizeof(int64_t) * (static_cast<size_t>(B_) * (L_ + 2) + 2);
    KVS_CUDA_OK(cudaMalloc(&ctl_.ptr, control_bytes_), "captured step control");
    for (uint32_t l = 0; l < L_; ++l) layers_.push_back(std::make_unique<Layer>());
    if (absl::Status s = Bind(/*first=*/true); !s.ok()) return s;
    if (shared_bytes_ > 0) {
      KVS_CUDA_OK(cudaMalloc(&shared_.ptr, shared_bytes_), "captured step shared scratch");
    }
    return StartSideStream();
  }

  absl::Status Rebind(const std::vector<std::string>& sequence_ids,
                      const std::vector<uint64_t>& bounds, void* stream) override {
    if (sequence_ids.size() != static_cast<size_t>(B_) ||
        (!bounds.empty() && bounds.size() != sequence_ids.size())) {
      return absl::InvalidArgumentError("a plan rebinds to as many sequences as it has slots");
    }
    std::lock_guard<std::mutex> lock(*mu_);
    KVS_CUDA_OK(cudaSetDevice(device_), "cudaSetDevice");
    // The caller's replays (and the side stream's warms they joined) read the old tables.
    KVS_CUDA_OK(cudaStreamSynchronize(CallerStream(stream)), "the steps");
    KVS_CUDA_OK(cudaDeviceSynchronize(), "the steps");
    ReleaseSequences();
    Disarm();
    std::vector<SequenceDesc> descs;
    for (const std::string& id : sequence_ids) {
      absl::StatusOr<SequenceDesc> d = state_->source()->Describe(id, absl::InfiniteFuture());
      if (!d.ok()) return d.status();
      if (!SameLayout(*d, descs_[0])) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sequence '", id, "': a plan rebinds to sequences of its shape and placement"));
      }
      descs.push_back(*std::move(d));
    }
    // In place: the layers' launch plans not yet rebuilt keep a view of this storage.
    std::move(descs.begin(), descs.end(), descs_.begin());
    bounds_ = bounds;
    template_.sequence_ids = sequence_ids;
    for (const auto& ly : layers_) DropLayerGraphs(*ly);
    if (absl::Status s = Bind(/*first=*/false); !s.ok()) {
      ReleaseSequences();
      Disarm();
      return s;
    }
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
    cudaStream_t caller = CallerStream(stream);
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
      if (absl::Status s = warm_stream_.JoinRecorded(caller); !s.ok()) return s;
      warm_pending_ = false;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<uint64_t>> Commit(void* stream) override {
    std::lock_guard<std::mutex> lock(*mu_);
    KVS_CUDA_OK(cudaSetDevice(device_), "cudaSetDevice");
    KVS_CUDA_OK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "the steps");
    if (!held_) {
      KVS_CUDA_OK(cudaMemset(error(), 0, sizeof(int32_t)), "error word");
      return absl::FailedPreconditionError(
          "the plan holds no sequences (its last Rebind failed): its steps wrote nothing");
    }
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
    uint64_t bytes = shared_bytes_ + control_bytes_ + sig_bytes_ + norm_bytes_;
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
    size_t method_bytes = 0, scratch_bytes = 0;
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

  // Binds descs_: reserves each sequence's pages up to its bound, syncs and holds it, and builds
  // every layer's tables in the plan's memory (first: allocates and sizes it; later: the layout
  // must come out the same, or a graph recorded before would read the wrong places).
  absl::Status Bind(bool first) {
    RowSource* source = state_->source();
    floor_host_.clear();
    for (int32_t b = 0; b < B_; ++b) {
      const SequenceDesc& d = descs_[b];
      absl::StatusOr<std::unique_ptr<kvstore::Reservation>> r =
          source->Reserve(d.sequence_id, Bound(b));
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
      floor_host_.push_back(d.layer_lengths[0]);
    }
    for (uint32_t l = 0; l < L_; ++l) {
      if (absl::Status s = BindLayer(*layers_[l], l, first); !s.ok()) return s;
    }
    // Floors and tops: the committed lengths; the error and progress words 0; the limits.
    std::vector<int64_t> ctl(control_bytes_ / sizeof(int64_t), 0);
    for (int32_t b = 0; b < B_; ++b) {
      const int64_t n = static_cast<int64_t>(floor_host_[b]);
      for (uint32_t l = 0; l <= L_; ++l) ctl[static_cast<size_t>(l) * B_ + b] = n;
      ctl[static_cast<size_t>(B_) * (L_ + 1) + 2 + b] = static_cast<int64_t>(Bound(b));
    }
    KVS_CUDA_OK(cudaMemcpy(ctl_.ptr, ctl.data(), control_bytes_, cudaMemcpyHostToDevice),
                "captured step control");
    return absl::OkStatus();
  }

  // Layer l of Bind.
  absl::Status BindLayer(Layer& ly, uint32_t l, bool first) {
    ly.call = template_;
    ly.call.layer = l;
    ly.batch = SyncedBatch{};
    ly.norms.clear();
    DecodeResult scratch_result;
    if (absl::Status s = state_->Sync(ly.call, descs_, &ly.batch, &scratch_result); !s.ok()) {
      return s;
    }
    ly.batch.views.clear();  // the store's read locks: the plan holds reservations instead
    if (l == 0) {            // held from here on (released by ReleaseSequences)
      for (DeviceSequence* e : ly.batch.seqs) state_->Hold(e);
      held_ = true;
    }
    for (int32_t b = 0; b < B_; ++b) {
      if (absl::Status s = state_->HoldForSteps(ly.batch.seqs[b], l, descs_[b], *reservations_[b],
                                                Bound(b), ly.batch.busy);
          !s.ok()) {
        return s;
      }
      // Every length may reach the plan's bound: the kernels' grids and buffers are sized for
      // it, whatever the sequence's own bound.
      ly.batch.lens[b] = static_cast<int32_t>(req_.max_tokens);
    }
    if (sign_keys_) {  // SimHash planes of the layer and each sequence's M (fixed by now)
      const int32_t hkv = static_cast<int32_t>(descs_[0].shape.num_kv_heads);
      absl::StatusOr<const float*> planes = state_->simhash().Planes(
          l, hkv, words_ * 32, static_cast<int32_t>(descs_[0].shape.head_dim));
      if (!planes.ok()) return planes.status();
      ly.planes = *planes;
      for (int32_t b = 0; b < B_; ++b) {
        const DeviceLayer& dl = ly.batch.seqs[b]->layers[l];
        if (dl.norms.ptr == nullptr) return absl::InternalError("a signed sequence without its M");
        // The plan's copy: the step's kernels read one address per slot, whichever sequence
        // holds it.
        float* mine = static_cast<float*>(norms_.ptr) + (static_cast<size_t>(l) * B_ + b) * hkv;
        KVS_CUDA_OK(cudaMemcpy(mine, dl.norms.ptr, sizeof(float) * hkv, cudaMemcpyDeviceToDevice),
                    "SimHash M");
        ly.norms.push_back(mine);
      }
    }
    ly.lp = std::make_unique<LaunchPlan>(ly.call, descs_, &ly.batch, state_);
    ly.lp->set_captured();
    ly.mc = runner_->Begin(req_.method);
    LaunchPlan& lp = *ly.lp;
    if (absl::Status s = ly.mc->Plan(lp); !s.ok()) return s;
    if (absl::Status s = lp.BuildTables(&host_tables_); !s.ok()) return s;
    ly.mc->FillTables(lp);
    // Before the first step the side stream's warm reads pages up to each lengths entry: the
    // committed lengths, within every sequence's reservation (the steps write theirs).
    for (int32_t b = 0; b < B_; ++b) {
      lp.SetHostLength(b, static_cast<int32_t>(floor_host_[b]));
    }
    lp.BeginPass(nullptr, nullptr);
    size_t bytes = 0, transient = 0;
    if (absl::Status s = Carve(ly, &bytes, &transient); !s.ok()) return s;
    if (first) {
      ly.method_bytes = bytes;
      ly.scratch_bytes = lp.method_offset() + bytes;
      shared_bytes_ = std::max(shared_bytes_, transient);
      KVS_CUDA_OK(cudaMalloc(&ly.scratch.ptr, ly.scratch_bytes), "captured step scratch");
    } else if (bytes != ly.method_bytes || lp.method_offset() + bytes != ly.scratch_bytes ||
               transient > shared_bytes_) {
      return absl::InternalError(
          "a rebound plan's layout differs from the one its steps were recorded with");
    }
    lp.BeginPass(static_cast<char*>(ly.scratch.ptr), nullptr);
    ly.mc->FillScratchTables(lp);
    if (absl::Status s = lp.Upload(); !s.ok()) return s;
    KVS_CUDA_OK(cudaStreamSynchronize(lp.stream()), "captured step tables");
    PlanWarm(ly, l);
    ly.warm.stop = progress();
    return absl::OkStatus();
  }

  // The reservation bound of slot b's sequence: the request's bound for it, else max_tokens.
  uint64_t Bound(int32_t b) const {
    const uint64_t n = static_cast<size_t>(b) < bounds_.size() ? bounds_[b] : 0;
    return n != 0 ? n : req_.max_tokens;
  }

  // Releases the sequences the plan holds (their rows written past the committed lengths
  // dropped) and their reservations. REQUIRES: the device is idle.
  void ReleaseSequences() {
    if (held_) {
      const std::vector<bool> stale = Uncommitted();
      for (int32_t b = 0; b < B_; ++b) {
        state_->Release(descs_[b].sequence_id);
        // Rows the steps wrote past the store's length (never committed) may have moved the
        // device state past the store's (an open group of compressed keys): rebuilt from the
        // store at its next use.
        if (stale[b]) state_->Forget(descs_[b].sequence_id);
      }
      held_ = false;
    }
    reservations_.clear();
  }

  // A plan holding no sequence: every position refused (no row written, lengths 0, so the
  // kernels read nothing of the tables left behind), the lengths the next warm reads 0.
  void Disarm() {
    std::vector<int64_t> ctl(control_bytes_ / sizeof(int64_t), 0);
    for (size_t i = 0; i < static_cast<size_t>(B_) * (L_ + 1); ++i) {
      ctl[i] = std::numeric_limits<int64_t>::max();
    }
    cudaMemcpy(ctl_.ptr, ctl.data(), control_bytes_, cudaMemcpyHostToDevice);
    for (const auto& ly : layers_) {
      if (ly->lp != nullptr && ly->scratch.ptr != nullptr) {
        ly->lp->BeginPass(static_cast<char*>(ly->scratch.ptr), nullptr);
        cudaMemset(ly->lp->lens_table(), 0, sizeof(int32_t) * B_);
      }
    }
  }

  void DropLayerGraphs(Layer& ly) {
    for (const LayerGraph& g : ly.graphs) cudaGraphExecDestroy(g.exec);
    ly.graphs.clear();
    ly.seen = {};
  }

  static cudaStream_t CallerStream(void* stream) {
    return stream != nullptr ? static_cast<cudaStream_t>(stream) : cudaStreamLegacy;
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
    p.limits = limits();
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
      cp.map_channel = lp.key_map().channel;  // the deployment's key widths, where they apply
      cp.map_part = lp.key_map().part;
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
    return warm_stream_.Create();
  }
  // Before layer l - 1's kernels, on the side stream (after the previous warm, which stops where
  // layer l - 1's step begins): one read of each of layer l's pages (kernels::cuda::WarmPagedRows,
  // kWarmChains at a time), so that the host link's address translations of its rows are warm
  // when its FetchRows runs, while the caller's stream runs layer l - 1's attention and the
  // model up to layer l's; it stops where layer l's step begins (the progress word StepAppend
  // writes). The side stream joins the caller's at the end of the last layer: a graph captures
  // whole steps, layers 0 .. L - 1 in order.
  absl::Status WarmNextLayer(uint32_t l, cudaStream_t caller) {
    if (absl::Status s = warm_stream_.Fork(caller); !s.ok()) return s;
    KVS_CUDA_OK(kc::WarmPagedRows(layers_[l]->warm, warm_stream_.stream()), "WarmPagedRows");
    if (absl::Status s = warm_stream_.RecordJoin(); !s.ok()) return s;
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
  // The control block: floors [B], tops [L][B], the error word, the progress word, limits [B]
  // (each slot's bound).
  int64_t* floor() const { return static_cast<int64_t*>(ctl_.ptr); }
  int64_t* top(uint32_t l) const { return floor() + static_cast<size_t>(l + 1) * B_; }
  int32_t* error() const {
    return reinterpret_cast<int32_t*>(floor() + static_cast<size_t>(L_ + 1) * B_);
  }
  // The layer whose step began last (StepAppendParams::progress).
  int32_t* progress() const {
    return reinterpret_cast<int32_t*>(floor() + static_cast<size_t>(L_ + 1) * B_ + 1);
  }
  const int64_t* limits() const { return floor() + static_cast<size_t>(L_ + 1) * B_ + 2; }

  std::mutex* const mu_;
  DeviceState* const state_;
  const int device_;
  std::vector<SequenceDesc> descs_;  // the sequences bound (Bind), one per slot
  const StaticStepRequest req_;
  std::vector<uint64_t> bounds_;  // per slot, 0: max_tokens (StaticStepRequest::bounds)
  const int32_t B_;
  const uint32_t L_;
  DecodeCall template_;  // its sequence_ids: descs_'
  const GpuRunner* runner_ = nullptr;
  std::vector<std::unique_ptr<kvstore::Reservation>> reservations_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<uint64_t> floor_host_;
  PinnedBuf host_tables_;
  OwnedDev ctl_;
  OwnedDev sigs_;   // the step's key signatures [B * Hkv][words] (sign_keys_)
  OwnedDev norms_;  // each slot's SimHash M per layer [L][B][Hkv] (sign_keys_)
  // The layers' transient buffers (Carver::TakeTransient: the scores of every token and head),
  // one region for all layers: they run one after another on the caller's stream.
  OwnedDev shared_;
  size_t shared_bytes_ = 0;
  size_t control_bytes_ = 0, sig_bytes_ = 0, norm_bytes_ = 0;  // ctl_'s, sigs_', norms_' sizes
  int32_t words_ = 0;
  bool sign_keys_ = false;
  size_t ck_block_bytes_ = 0;  // of the placement's compressed keys (0: it keeps none)
  bool held_ = false;
  // Translation warming (WarmNextLayer): rows in host pages, more than one layer.
  bool warm_ = false;
  bool warm_pending_ = false;  // side work not yet joined to the caller's stream
  SideStream warm_stream_;     // where the next layer's pages are warmed
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
          "S2ANTA prop or flash, hash top-k with SimHash signatures, top-k, S2ANTA-prop and "
          "vAttention's importance sampler over compressed keys do); run it as eager calls"));
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
