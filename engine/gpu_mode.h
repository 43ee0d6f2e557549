// Where an engine decodes and what its store's memory must be for that, decided in one place for
// every assembly of store and engine (kvsparse-server's main and Server, engine::Embedded, the
// PyTorch op): the GPU backend when the build has CUDA and the device is there, the CPU engine
// otherwise. AssembleEngine is the one assembly of an engine over a row source.
#ifndef KVSPARSE_ENGINE_GPU_MODE_H_
#define KVSPARSE_ENGINE_GPU_MODE_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/cuda/gpu_backend.h"
#include "engine/decode_engine.h"
#include "engine/engine_options.h"
#include "engine/row_source.h"
#include "kvstore/memory_resource.h"

namespace kvsparse::engine {

// "auto", "on" or "off"; INVALID_ARGUMENT otherwise.
absl::StatusOr<GpuMode> ParseGpuMode(absl::string_view name);

// The GPU options' ranges (row_cache a fraction in [0, 1], fetch_parallelism in [1, 64]):
// INVALID_ARGUMENT naming the first one outside as the caller spells its settings, the field's
// name after `prefix` (kvsparse-server: "--gpu_", the op: "gpu_").
absl::Status CheckGpuOptions(const GpuOptions& options, absl::string_view prefix);

// Host memory for a store whose rows an engine of `mode` reads: pinned and CUDA-mapped (mapped
// true: the GPU backend reads rows in place) unless kOff, or kAuto where pinning is not
// possible; the plain host resource otherwise. kOn: the pinning's error.
struct HostMemory {
  std::unique_ptr<kvstore::MemoryResource> resource;
  bool mapped = false;
};
absl::StatusOr<HostMemory> NewHostMemory(GpuMode mode, const kvstore::HostMemoryOptions& options);

// An engine over `source` as `options` say: the GPU backend of options.gpu.mode (its options from
// the engine's: fetch size, signatures, and options.gpu's device, capacity, row cache, timing
// and fetch helpers), or the CPU engine (kOff; kAuto without a usable device or build, saying
// why in cpu_reason). kOn without a device: the error. REQUIRES: source outlives the engine.
struct AssembledEngine {
  std::unique_ptr<DecodeEngine> engine;
  int device = -1;         // the GPU backend's device, -1 on the CPU engine
  std::string cpu_reason;  // why kAuto decodes on the CPU (empty otherwise)
};
absl::StatusOr<AssembledEngine> AssembleEngine(const EngineOptions& options, RowSource* source);

}  // namespace kvsparse::engine

#endif  // KVSPARSE_ENGINE_GPU_MODE_H_
