// The method table: one row per selection method, with its unit on each backend. Adding a method
// is adding its files and one row here (docs/DESIGN.md, "Adding a method").
#ifndef KVSPARSE_ENGINE_METHODS_REGISTRY_H_
#define KVSPARSE_ENGINE_METHODS_REGISTRY_H_

#include "absl/types/span.h"
#include "engine/method.h"

namespace kvsparse::engine {

class MethodUnit;
namespace gpu {
class GpuRunner;
}

struct MethodEntry {
  MethodKind kind;
  const char* name;           // metrics label, messages
  const MethodUnit* unit;     // validation and the CPU reference: engine/methods/<name>.cc
  const gpu::GpuRunner* gpu;  // the GPU path: engine/cuda/<name>_runner.cc; null without CUDA
};

// Every row, in MethodKind order.
absl::Span<const MethodEntry> AllMethods();
// The row of a kind. REQUIRES: a MethodKind value.
const MethodEntry& FindMethod(MethodKind kind);

}  // namespace kvsparse::engine

#endif  // KVSPARSE_ENGINE_METHODS_REGISTRY_H_
