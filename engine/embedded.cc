#include "engine/embedded.h"

namespace kvsparse::engine {

Embedded::~Embedded() = default;

absl::StatusOr<std::unique_ptr<Embedded>> Embedded::Create(EmbeddedOptions options) {
  std::unique_ptr<Embedded> e(new Embedded());
  absl::StatusOr<HostMemory> memory = NewHostMemory(options.engine.gpu.mode, options.host);
  if (!memory.ok()) return memory.status();
  e->memory_ = std::move(memory->resource);
  options.store.memory = e->memory_.get();
  absl::StatusOr<std::unique_ptr<kvstore::Store>> store = kvstore::Store::Create(options.store);
  if (!store.ok()) return store.status();
  e->store_ = std::move(*store);
  // Without mapped pages (kAuto where pinning failed) the GPU backend stages the rows it reads,
  // as kvsparse-server's does (the row source says the pages are not device-visible).
  e->source_ = NewLocalRowSource(e->store_.get(), memory->mapped);
  absl::StatusOr<AssembledEngine> a = AssembleEngine(options.engine, e->source_.get());
  if (!a.ok()) return a.status();
  e->engine_ = std::move(a->engine);
  e->device_ = a->device;
  return e;
}

}  // namespace kvsparse::engine
