// Which model shapes the GPU backend's kernels take, in one place: bf16 or fp16 rows, head dim
// 64, 128 or 256, a GQA group (query heads per kv head) of 1, 2, 4 or 8, as their dispatch
// instantiates them (kernels/cuda/common.cuh, DispatchDecode). The backend's Supports reads it,
// and so do callers that choose before they decode (the op's gpu_shape_refusal, vLLM's CUDA
// backend); a build without CUDA answers by the same rule. Calls on sequences of a shape it
// refuses run on the CPU engine.
#ifndef KVSPARSE_ENGINE_GPU_SHAPE_H_
#define KVSPARSE_ENGINE_GPU_SHAPE_H_

#include "absl/status/status.h"
#include "kvstore/types.h"

namespace kvsparse::engine {

// OK, or FAILED_PRECONDITION naming every reason at once ("; " between them).
absl::Status GpuTakesShape(const kvstore::ModelShape& shape);

}  // namespace kvsparse::engine

#endif  // KVSPARSE_ENGINE_GPU_SHAPE_H_
