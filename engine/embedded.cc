#include "engine/embedded.h"

#if KVSPARSE_ENGINE_CUDA
#include "engine/cuda/gpu_backend.h"
#include "kvstore/cuda_host_memory.h"
#endif

namespace kvsparse::engine {

Embedded::~Embedded() = default;

absl::StatusOr<std::unique_ptr<Embedded>> Embedded::Create(EmbeddedOptions options) {
  std::unique_ptr<Embedded> e(new Embedded());
  bool mapped = false;
#if KVSPARSE_ENGINE_CUDA
  if (options.gpu != EmbeddedOptions::Gpu::kOff) {
    // Pinned, CUDA-mapped pages: the GPU backend reads the rows it selects in place.
    absl::StatusOr<std::unique_ptr<kvstore::MemoryResource>> pinned =
        kvstore::NewPinnedHostMemoryResource(options.host);
    if (pinned.ok()) {
      e->memory_ = std::move(*pinned);
      mapped = true;
    } else if (options.gpu == EmbeddedOptions::Gpu::kOn) {
      return pinned.status();
    }
  }
#else
  if (options.gpu == EmbeddedOptions::Gpu::kOn) {
    return absl::FailedPreconditionError("this build has no CUDA (gpu on)");
  }
#endif
  if (e->memory_ == nullptr) e->memory_ = kvstore::NewHostMemoryResource(options.host);
  options.store.memory = e->memory_.get();
  absl::StatusOr<std::unique_ptr<kvstore::Store>> store = kvstore::Store::Create(options.store);
  if (!store.ok()) return store.status();
  e->store_ = std::move(*store);
  e->source_ = NewLocalRowSource(e->store_.get(), mapped);
  std::unique_ptr<DecodeBackend> backend;
#if KVSPARSE_ENGINE_CUDA
  if (mapped) {
    GpuBackendOptions go;
    go.device = options.gpu_device;
    go.capacity_bytes = options.gpu_capacity_bytes;
    go.max_fetch_bytes = options.engine.max_fetch_bytes;
    go.default_tile_size = options.engine.default_tile_size;
    go.signatures = options.engine.signatures;
    go.row_cache_fraction = options.gpu_row_cache;
    go.stage_timing_every = options.gpu_stage_timing_every;
    absl::StatusOr<std::unique_ptr<DecodeBackend>> b = NewGpuBackend(go, e->source_.get());
    if (b.ok()) {
      backend = std::move(*b);
      e->device_ = options.gpu_device;
    } else if (options.gpu == EmbeddedOptions::Gpu::kOn) {
      return b.status();
    }
  }
#endif
  e->engine_ = std::make_unique<DecodeEngine>(options.engine, e->source_.get(), std::move(backend));
  return e;
}

}  // namespace kvsparse::engine
