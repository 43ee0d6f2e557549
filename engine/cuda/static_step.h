// The GPU backend's captured steps (engine/static_step.h): the plan of a fixed batch, built on
// the host once, and its per-layer launches with nothing of the host per call.
#ifndef KVSPARSE_ENGINE_CUDA_STATIC_STEP_H_
#define KVSPARSE_ENGINE_CUDA_STATIC_STEP_H_

#include <memory>
#include <mutex>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/cuda/device_state.h"
#include "engine/decode_call.h"
#include "engine/row_source.h"
#include "engine/static_step.h"

namespace kvsparse::engine::gpu {

// REQUIRES: the backend supports `call` (the plan's template: q_device / out_device
// placeholders) over descs; the runner of call.method says Capturable for each; the row source's
// pages are device-visible. mu: the backend's lock, held by every step of the plan that touches
// the state; state and mu outlive the plan.
absl::StatusOr<std::unique_ptr<StaticStep>> NewGpuStaticStep(std::mutex* mu, DeviceState* state,
                                                             int device, const DecodeCall& call,
                                                             absl::Span<const SequenceDesc> descs,
                                                             const StaticStepRequest& request);

}  // namespace kvsparse::engine::gpu

#endif  // KVSPARSE_ENGINE_CUDA_STATIC_STEP_H_
