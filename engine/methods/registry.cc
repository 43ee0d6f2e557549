#include "engine/methods/registry.h"

#include "engine/methods/method_unit.h"
#if KVSPARSE_ENGINE_CUDA
#include "engine/cuda/gpu_runner.h"
#define KVSPARSE_GPU_RUNNER(runner) (&gpu::runner())
#else
#define KVSPARSE_GPU_RUNNER(runner) nullptr
#endif

namespace kvsparse::engine {
namespace {

// In MethodKind order (FindMethod indexes it). Built on first use, so that it is there for
// callers during static initialisation too.
absl::Span<const MethodEntry> Table() {
  static const MethodEntry kMethods[] = {
      {MethodKind::kDense, "dense", &DenseUnit(), KVSPARSE_GPU_RUNNER(DenseRunner)},
      {MethodKind::kSanta, "santa", &SantaUnit(), KVSPARSE_GPU_RUNNER(SantaRunner)},
      {MethodKind::kHashTopK, "hash_top_k", &HashTopKUnit(), KVSPARSE_GPU_RUNNER(HashTopKRunner)},
      {MethodKind::kVAttention, "vattention", &VAttentionUnit(),
       KVSPARSE_GPU_RUNNER(VAttentionRunner)},
      {MethodKind::kSaap, "saap", &SaapUnit(), KVSPARSE_GPU_RUNNER(SaapRunner)},
      // Compressed-key scores on the GPU; exact scores (the oracle) on the CPU engine.
      {MethodKind::kTopK, "top_k", &TopKUnit(), KVSPARSE_GPU_RUNNER(TopKRunner)},
  };
  return kMethods;
}

}  // namespace

absl::Span<const MethodEntry> AllMethods() { return Table(); }

const MethodEntry& FindMethod(MethodKind kind) { return Table()[static_cast<size_t>(kind)]; }

const char* MethodName(MethodKind kind) { return FindMethod(kind).name; }

}  // namespace kvsparse::engine
