#include "engine/embedded.h"

namespace kvsparse::engine {

Embedded::~Embedded() = default;

absl::StatusOr<std::unique_ptr<Embedded>> Embedded::Create(EmbeddedOptions options) {
  std::unique_ptr<Embedded> e(new Embedded());
  absl::StatusOr<HostMemory> memory = NewHostMemory(options.gpu, options.host);
  if (!memory.ok()) return memory.status();
  e->memory_ = std::move(memory->resource);
  options.store.memory = e->memory_.get();
  absl::StatusOr<std::unique_ptr<kvstore::Store>> store = kvstore::Store::Create(options.store);
  if (!store.ok()) return store.status();
  e->store_ = std::move(*store);
  e->source_ = NewLocalRowSource(e->store_.get(), memory->mapped);
  // Without mapped pages the GPU backend could not read the host rows in place.
  GpuBackendOptions go = BackendOptionsFor(options.engine);
  go.device = options.gpu_device;
  go.capacity_bytes = options.gpu_capacity_bytes;
  go.row_cache_fraction = options.gpu_row_cache;
  go.stage_timing_every = options.gpu_stage_timing_every;
  absl::StatusOr<std::unique_ptr<DecodeBackend>> backend =
      NewBackend(memory->mapped ? options.gpu : GpuMode::kOff, go, e->source_.get());
  if (!backend.ok()) return backend.status();
  if (*backend != nullptr) e->device_ = options.gpu_device;
  e->engine_ =
      std::make_unique<DecodeEngine>(options.engine, e->source_.get(), std::move(*backend));
  return e;
}

}  // namespace kvsparse::engine
