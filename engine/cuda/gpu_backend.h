// The decode engine's GPU backend: one decode call, batched over its sequences, on a CUDA device
// with the kernels of kernels/cuda/. Built only with CUDA (part of kvsparse_engine then).
//
// What it keeps on the GPU per (sequence, layer) is engine/cuda/device_state.h's: the K and V
// rows and key signatures the placement keeps there, the device-visible addresses of the
// store's pages for a half kept in host memory (kernels read the selected rows in place over
// the host link: the store's memory must be pinned and mapped, NewLocalRowSource(...,
// pages_device_visible = true)), and HashAttention's row cache. All of it is a cache of the
// store, evicted least recently used first to stay under the capacity.
//
// A store whose pages the GPU cannot read (another process: the server's RemoteRowSource, or
// pageable memory): dense, hash top-k and vAttention read their host rows from pinned staging,
// where each call gathers the rows it selected (hash top-k: only the row cache's misses;
// vAttention: the group's union for the statistics, then the final sample's new rows) through
// RowSource::Gather once its selection is known; S2ANTA selects inside the kernel that reads
// the rows, so its calls with a host half run on the CPU engine there.
//
// A call: sync the device state (engine/cuda/device_state.h), plan the launch
// (engine/cuda/launch_plan.h), then the method's runner (engine/cuda/<method>_runner.cc): one
// batched kernel sequence per method, one upload of q and the per-sequence tables, one download
// of the output and statistics. Sequence i draws with SequenceSeed(seed, i), as on the CPU.
// Calls are serialised on one CUDA stream.
#ifndef KVSPARSE_ENGINE_CUDA_GPU_BACKEND_H_
#define KVSPARSE_ENGINE_CUDA_GPU_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "engine/decode_engine.h"
#include "engine/engine_options.h"
#include "engine/row_source.h"
#include "engine/signatures.h"

namespace kvsparse::engine {

// The backend reads options.gpu (device, capacity, row cache, timing, fetch parallelism),
// max_fetch_bytes, signatures and key_widths (the engine's: EngineOptions is their one home).
// FAILED_PRECONDITION without a usable CUDA device. REQUIRES: source outlives the backend.
absl::StatusOr<std::unique_ptr<DecodeBackend>> NewGpuBackend(EngineOptions options,
                                                             RowSource* source);

}  // namespace kvsparse::engine

#endif  // KVSPARSE_ENGINE_CUDA_GPU_BACKEND_H_
