// The decode engine's options, the one struct every assembly of an engine takes (kvsparse-server's
// flags in server/main.cc, engine::Embedded, the PyTorch op; engine/gpu_mode.h AssembleEngine):
// the defaults a request may leave to the engine (resolved once per call by the method's unit,
// MethodUnit::Resolve, before either backend sees the call), the bounds of one call's work, and
// where it decodes (GpuOptions).
#ifndef KVSPARSE_ENGINE_ENGINE_OPTIONS_H_
#define KVSPARSE_ENGINE_ENGINE_OPTIONS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "engine/signatures.h"
#include "kernels/key_widths.h"

namespace kvsparse::engine {

// kAuto: the GPU backend when the build has CUDA and the device is usable; kOn: fail without
// it; kOff: the CPU engine.
enum class GpuMode { kAuto, kOn, kOff };

// Where the engine decodes: the GPU backend (engine/cuda/gpu_backend.h) and its device state read
// these and a few of EngineOptions' fields from the engine's options, their one home.
struct GpuOptions {
  GpuMode mode = GpuMode::kAuto;
  int device = 0;  // CUDA device ordinal
  // GPU memory for per-sequence state (rows, signatures, page lists, row caches), evicted least
  // recently used first.
  size_t capacity_bytes = 4ull << 30;
  // Rows per kv head kept from the last step's selection, as a fraction of the tokens (0: none,
  // every selected row crosses the host link each step).
  double row_cache = 0.04;
  // Selection / gather / compute times from CUDA events on one call in this many (1: every call;
  // 0: never): recording the events costs a few us of host time a call.
  int stage_timing_every = 16;
  // A store in another process: the rows of this many of a batch's sequences are fetched at
  // once (each its own Gather or UCX read; 1: one after another).
  int fetch_parallelism = 8;
};

struct EngineOptions {
  int32_t default_tile_size = 256;              // S2ANTA tile when a request gives 0
  size_t resident_capacity_bytes = 4ull << 30;  // device-tier state (K, V, signatures)
  // Largest single read from the row source when many rows are needed at once (the resident
  // state's catch-up, or every K row when K is not resident): far under the message limit.
  size_t max_fetch_bytes = 32 << 20;
  SignatureConfig signatures;
  // Compressed keys at per-channel widths (kernels/key_widths.h; kvsparse-server's --key_widths,
  // the op's key_widths): for every sequence whose compressed keys have its bits and whose model
  // has its layers, kv heads and head dim (others keep uniform widths). Null: uniform widths.
  std::shared_ptr<const kernels::KeyWidths> key_widths;
  // Most sequences one Decode call may name (each distinct): bounds the work of one call.
  size_t max_call_sequences = 1024;
  // Most K+V bytes one Decode call may cover (its dense-equivalent bytes: what the CPU engine
  // may gather for it); more is RESOURCE_EXHAUSTED. 0: no bound.
  uint64_t max_call_bytes = 64ull << 30;
  GpuOptions gpu;  // where the engine decodes
};

// The key widths a deployment names by file (kvsparse-server's --key_widths, the op's key_widths;
// written by kvsparse-key-widths, kvsparse.tools.key_widths) into options->key_widths; empty path:
// none. INVALID_ARGUMENT naming the setting (`name`) and the reader's reason.
[[nodiscard]] absl::Status LoadKeyWidths(const std::string& path, absl::string_view name,
                                         EngineOptions* options);

}  // namespace kvsparse::engine

#endif  // KVSPARSE_ENGINE_ENGINE_OPTIONS_H_
