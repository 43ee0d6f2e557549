#include "engine/cuda/gpu_backend.h"

#include <cuda_runtime_api.h>

#include <memory>
#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "engine/cuda/cuda_util.h"
#include "engine/cuda/device_state.h"
#include "engine/cuda/gpu_runner.h"
#include "engine/cuda/launch_plan.h"
#include "engine/cuda/static_step.h"
#include "engine/gpu_shape.h"
#include "engine/methods/registry.h"
#include "kernels/reasons.h"

namespace kvsparse::engine {
namespace {

using gpu::LaunchPlan;
using gpu::MethodCall;

class GpuBackend final : public DecodeBackend {
 public:
  GpuBackend(EngineOptions options, RowSource* source, cudaStream_t stream)
      : options_(std::move(options)),
        source_(source),
        stream_(stream),
        caps_{options_.signatures.learned.get(), options_.signatures.saap.get(),
              !source->pages_device_visible(), options_.key_widths.get()} {
    state_ = std::make_unique<gpu::DeviceState>(options_, source_, stream_);
    for (cudaEvent_t& e : events_) cudaEventCreate(&e);
    cudaEventCreateWithFlags(&caller_event_, cudaEventDisableTiming);
    cudaEventCreateWithFlags(&done_event_, cudaEventDisableTiming);
  }
  ~GpuBackend() override {
    std::lock_guard<std::mutex> lock(mu_);
    state_.reset();  // frees on the stream and synchronises it
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    cudaEventDestroy(caller_event_);
    cudaEventDestroy(done_event_);
    cudaStreamDestroy(stream_);
  }

  const char* name() const override { return "cuda"; }

  absl::Status Supports(const DecodeCall& call,
                        absl::Span<const SequenceDesc> descs) const override {
    // Every reason at once (kernels::Reasons), each once. The sequences of a call are decoded
    // together: they must share their placement.
    kernels::Reasons reasons(absl::StatusCode::kFailedPrecondition);
    const SequenceDesc& d0 = descs[0];
    const gpu::GpuRunner* runner = FindMethod(call.method.kind).gpu;
    reasons.AddIf(runner == nullptr, "the method has no GPU path");
    for (const SequenceDesc& d : descs) {
      reasons.AddIf(d.placement.k_tier != d0.placement.k_tier ||
                        d.placement.v_tier != d0.placement.v_tier ||
                        d.placement.signature_bits != d0.placement.signature_bits ||
                        d.placement.compressed_key_bits != d0.placement.compressed_key_bits ||
                        d.page_tokens != d0.page_tokens,
                    "the call's sequences differ in placement or page size");
      SupportsShape(call, d, reasons);
      if (runner != nullptr) reasons.Add(runner->Supports(call.method, d, caps_));
    }
    return reasons.ToStatus();
  }

  absl::Status Decode(const DecodeCall& call, absl::Span<const SequenceDesc> descs,
                      DecodeResult* result) override;

  absl::StatusOr<std::unique_ptr<StaticStep>> PlanStatic(const DecodeCall& call,
                                                         absl::Span<const SequenceDesc> descs,
                                                         const StaticStepRequest& req) override {
    return gpu::NewGpuStaticStep(&mu_, state_.get(), options_.gpu.device, call, descs, req);
  }

  void Forget(const std::string& sequence_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    state_->Forget(sequence_id);
  }
  size_t resident_bytes() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return state_->bytes();
  }
  size_t resident_capacity() const override { return options_.gpu.capacity_bytes; }

 private:
  // What every GPU method needs of a call and a sequence: dtype, head dim, group size, and for a
  // half kept in host memory pages the GPU can read in place (power-of-two pages) or a runner
  // that gathers its rows into staging (GpuCaps::staged_rows).
  void SupportsShape(const DecodeCall& call, const SequenceDesc& desc,
                     kernels::Reasons& reasons) const {
    // The CPU engine lists the rows it read.
    reasons.AddIf(call.return_indices, "the call asks for the rows read (return_indices)");
    reasons.Add(GpuTakesShape(desc.shape));
    const kvstore::Placement& pl = desc.placement;
    const bool host_half =
        pl.k_tier != kvstore::Tier::kDevice || pl.v_tier != kvstore::Tier::kDevice;
    reasons.AddIf(host_half && !caps_.staged_rows && !gpu::IsPow2(desc.page_tokens),
                  "a host half read in place needs a power-of-two page size");
  }
  // One pass over the method's launch sequence, framed by the start and end events; *carved:
  // the method's scratch bytes.
  static absl::Status Enqueue(LaunchPlan& lp, MethodCall& mc, size_t* carved) {
    gpu::Carver c(lp.base() == nullptr ? nullptr : lp.base() + lp.method_offset());
    if (absl::Status s = lp.Mark(0); !s.ok()) return s;
    if (absl::Status s = mc.Enqueue(lp, c); !s.ok()) return s;
    *carved = c.used();
    return lp.Mark(3);
  }
  // The stage times of a timed call (CUDA events), or zeros standing for none.
  void StageTimes(bool timed, DecodeResult* result) const;
  // A call with q on the device: its kernels wait for the caller's stream to reach the call
  // (FollowCaller), and the caller's stream waits for them (LeadCaller).
  absl::Status FollowCaller(const DecodeCall& call) {
    if (!call.on_device()) return absl::OkStatus();
    KVS_CUDA_OK(cudaEventRecord(caller_event_, static_cast<cudaStream_t>(call.stream)),
                "caller stream event");
    KVS_CUDA_OK(cudaStreamWaitEvent(stream_, caller_event_, 0), "wait for the caller");
    return absl::OkStatus();
  }
  absl::Status LeadCaller(const DecodeCall& call) {
    if (!call.on_device()) return absl::OkStatus();
    KVS_CUDA_OK(cudaEventRecord(done_event_, stream_), "decode event");
    KVS_CUDA_OK(cudaStreamWaitEvent(static_cast<cudaStream_t>(call.stream), done_event_, 0),
                "caller waits");
    return absl::OkStatus();
  }

  const EngineOptions options_;
  RowSource* const source_;
  const cudaStream_t stream_;
  const gpu::GpuCaps caps_;
  cudaEvent_t events_[4] = {};
  cudaEvent_t caller_event_ = nullptr, done_event_ = nullptr;
  mutable std::mutex mu_;  // serialises calls; guards everything below
  std::unique_ptr<gpu::DeviceState> state_;
  uint64_t calls_ = 0;  // for stage_timing_every
  gpu::PinnedBuf call_host_, out_host_;
};

absl::Status GpuBackend::Decode(const DecodeCall& call, absl::Span<const SequenceDesc> descs,
                                DecodeResult* result) {
  std::lock_guard<std::mutex> lock(mu_);
  const absl::Time start = absl::Now();
  // The caller's thread may have another device current (CUDA's is per thread).
  KVS_CUDA_OK(cudaSetDevice(options_.gpu.device), "cudaSetDevice");
  gpu::SyncedBatch batch;
  if (absl::Status s = state_->Sync(call, descs, &batch, result); !s.ok()) return s;
  const absl::Time synced = absl::Now();
  if (absl::Status s = call.CheckLive(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(s.message(), " while syncing the GPU state"));
  }
  result->timing.sync_seconds += absl::ToDoubleSeconds(synced - start);

  // Plan: the method's bounds and tables, then the shared tables.
  LaunchPlan lp(call, descs, &batch, state_.get());
  std::unique_ptr<MethodCall> mc = FindMethod(call.method.kind).gpu->Begin(call.method);
  if (absl::Status s = mc->Plan(lp); !s.ok()) return s;
  if (absl::Status s = lp.BuildTables(&call_host_); !s.ok()) return s;
  mc->FillTables(lp);

  // Size the method's buffers, place the scratch, upload the tables, enqueue.
  size_t method_bytes = 0;
  lp.BeginPass(nullptr, nullptr);
  if (absl::Status s = Enqueue(lp, *mc, &method_bytes); !s.ok()) return s;
  absl::StatusOr<char*> scratch = lp.PlaceScratch(method_bytes);
  if (!scratch.ok()) return scratch.status();
  const int every = options_.gpu.stage_timing_every;
  const bool timed = every > 0 && calls_++ % static_cast<uint64_t>(every) == 0;
  lp.BeginPass(*scratch, timed ? events_ : nullptr);
  mc->FillScratchTables(lp);
  if (absl::Status s = lp.Upload(); !s.ok()) return s;
  if (absl::Status s = FollowCaller(call); !s.ok()) return s;
  const size_t sized = method_bytes;
  if (absl::Status s = Enqueue(lp, *mc, &method_bytes); !s.ok()) return s;
  if (method_bytes != sized) {  // its kernels, enqueued, may have written past their scratch
    return absl::InternalError("a method's buffers changed size between sizing and the call");
  }
  if (absl::Status s = LeadCaller(call); !s.ok()) return s;
  if (absl::Status s = lp.Download(&out_host_); !s.ok()) return s;
  if (absl::Status s = mc->Download(lp); !s.ok()) return s;

  const absl::Time enqueued = absl::Now();
  KVS_CUDA_OK(cudaStreamSynchronize(stream_), "decode");
  const absl::Time done = absl::Now();
  result->timing.launch_seconds += absl::ToDoubleSeconds(enqueued - synced);
  result->timing.wait_seconds += absl::ToDoubleSeconds(done - enqueued);
  StageTimes(timed, result);
  batch.views.clear();  // pages may move again

  // Output in q's dtype and the per-kv-head statistics.
  lp.WriteOutput(result);
  for (int32_t b = 0; b < lp.B; ++b) {
    for (int32_t j = 0; j < lp.hkv; ++j) {
      HeadStats hs;
      hs.sequence_index = static_cast<uint32_t>(b);
      hs.kv_head = static_cast<uint32_t>(j);
      hs.dense_equivalent_bytes = 2 * static_cast<uint64_t>(lp.len(b)) * lp.row;
      mc->Stats(lp, b, j, &hs);
      result->heads.push_back(std::move(hs));
    }
  }
  return absl::OkStatus();
}

void GpuBackend::StageTimes(bool timed, DecodeResult* result) const {
  if (!timed) {
    result->timing.stage_weight = 0;
    return;
  }
  float ms[3] = {0, 0, 0};
  for (int i = 0; i < 3; ++i) cudaEventElapsedTime(&ms[i], events_[i], events_[i + 1]);
  result->timing.selection_seconds += ms[0] * 1e-3;
  result->timing.gather_seconds += ms[1] * 1e-3;
  result->timing.compute_seconds += ms[2] * 1e-3;
  result->timing.stage_weight = options_.gpu.stage_timing_every;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DecodeBackend>> NewGpuBackend(EngineOptions options,
                                                             RowSource* source) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count <= options.gpu.device ||
      options.gpu.device < 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError("no usable CUDA device");
  }
  KVS_CUDA_OK(cudaSetDevice(options.gpu.device), "cudaSetDevice");
  cudaStream_t stream = nullptr;
  KVS_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  return std::unique_ptr<DecodeBackend>(new GpuBackend(std::move(options), source, stream));
}

}  // namespace kvsparse::engine
