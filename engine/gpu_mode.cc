#include "engine/gpu_mode.h"

#include "absl/strings/str_cat.h"
#if KVSPARSE_ENGINE_CUDA
#include "kvstore/cuda_host_memory.h"
#endif

namespace kvsparse::engine {

absl::StatusOr<GpuMode> ParseGpuMode(absl::string_view name) {
  if (name == "auto") return GpuMode::kAuto;
  if (name == "on") return GpuMode::kOn;
  if (name == "off") return GpuMode::kOff;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown GPU mode '", name, "' (want auto, on or off)"));
}

absl::Status CheckGpuOptions(const GpuOptions& options, absl::string_view prefix) {
  if (!(options.row_cache >= 0.0 && options.row_cache <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "row_cache must be a fraction in [0, 1], not ", options.row_cache));
  }
  if (options.fetch_parallelism < 1 || options.fetch_parallelism > 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, "fetch_parallelism must be in [1, 64], not ", options.fetch_parallelism));
  }
  return absl::OkStatus();
}

absl::StatusOr<HostMemory> NewHostMemory(GpuMode mode, const kvstore::HostMemoryOptions& options) {
  HostMemory m;
#if KVSPARSE_ENGINE_CUDA
  if (mode != GpuMode::kOff) {
    absl::StatusOr<std::unique_ptr<kvstore::MemoryResource>> pinned =
        kvstore::NewPinnedHostMemoryResource(options);
    if (pinned.ok()) {
      m.resource = std::move(*pinned);
      m.mapped = true;
      return m;
    }
    if (mode == GpuMode::kOn) return pinned.status();
  }
#else
  if (mode == GpuMode::kOn) return absl::FailedPreconditionError("this build has no CUDA");
#endif
  m.resource = kvstore::NewHostMemoryResource(options);
  return m;
}

namespace {

// The GPU backend over `source` for `mode`, or null for the CPU engine (the reason in
// *cpu_reason). kOn: the error.
absl::StatusOr<std::unique_ptr<DecodeBackend>> NewBackend(GpuMode mode,
                                                          const EngineOptions& options,
                                                          RowSource* source,
                                                          std::string* cpu_reason) {
  if (mode == GpuMode::kOff) return nullptr;
#if KVSPARSE_ENGINE_CUDA
  absl::StatusOr<std::unique_ptr<DecodeBackend>> b = NewGpuBackend(options, source);
  if (b.ok() || mode == GpuMode::kOn) return b;
  if (cpu_reason != nullptr) *cpu_reason = std::string(b.status().message());
  return nullptr;
#else
  if (mode == GpuMode::kOn) return absl::FailedPreconditionError("this build has no CUDA");
  if (cpu_reason != nullptr) *cpu_reason = "this build has no CUDA";
  return nullptr;
#endif
}

}  // namespace

absl::StatusOr<AssembledEngine> AssembleEngine(const EngineOptions& options, RowSource* source) {
  AssembledEngine a;
  absl::StatusOr<std::unique_ptr<DecodeBackend>> backend =
      NewBackend(options.gpu.mode, options, source, &a.cpu_reason);
  if (!backend.ok()) return backend.status();
  if (*backend != nullptr) a.device = options.gpu.device;
  a.engine = std::make_unique<DecodeEngine>(options, source, std::move(*backend));
  return a;
}

}  // namespace kvsparse::engine
