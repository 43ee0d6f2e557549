// The store and the decode engine in one process, without any RPC: what an in-process user
// (the PyTorch op, op/) holds. With a CUDA device (and a CUDA build) the store's
// pages are pinned and CUDA-mapped and the engine decodes on the GPU backend, which reads the
// selected host rows in place; otherwise everything runs on the CPU engine.
#ifndef KVSPARSE_ENGINE_EMBEDDED_H_
#define KVSPARSE_ENGINE_EMBEDDED_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/decode_engine.h"
#include "engine/gpu_mode.h"
#include "engine/row_source.h"
#include "kvstore/memory_resource.h"
#include "kvstore/store.h"

namespace kvsparse::engine {

struct EmbeddedOptions {
  kvstore::StoreOptions store;  // store.memory is ignored: the embedded store owns its memory
  kvstore::HostMemoryOptions host;
  EngineOptions engine;  // engine.gpu: where it decodes
};

class Embedded {
 public:
  // INVALID_ARGUMENT for bad store options; FAILED_PRECONDITION for GpuMode::kOn without a device.
  // Pages that cannot be pinned and mapped (kAuto) are staged by the GPU backend for its kernels,
  // as kvsparse-server's store pages are.
  static absl::StatusOr<std::unique_ptr<Embedded>> Create(EmbeddedOptions options);
  Embedded(const Embedded&) = delete;
  Embedded& operator=(const Embedded&) = delete;
  ~Embedded();

  kvstore::Store& store() { return *store_; }
  DecodeEngine& engine() { return *engine_; }
  // The engine's view of the store (rows read as a decode call reads them).
  RowSource& source() { return *source_; }
  // "cuda" or "cpu", and the device of the GPU backend (-1 without one).
  const char* backend() const { return engine_->backend(); }
  int device() const { return device_; }

 private:
  Embedded() = default;
  std::unique_ptr<kvstore::MemoryResource> memory_;
  std::unique_ptr<kvstore::Store> store_;
  std::unique_ptr<RowSource> source_;
  std::unique_ptr<DecodeEngine> engine_;
  int device_ = -1;
};

}  // namespace kvsparse::engine

#endif  // KVSPARSE_ENGINE_EMBEDDED_H_
