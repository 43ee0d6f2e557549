// One selection method behind one interface: what it accepts, what it needs of a sequence, and
// its CPU reference selection. The engine drives every method through it, in the spirit of
// FlashInfer's plan/run split:
//   Resolve    the engine's defaults for what the request left to it (S2ANTA's tile size), once
//              per call before anything else: both backends see the resolved method;
//   Validate   the call's parameters alone (before any sequence is looked up);
//   CheckFits  what the method needs of each sequence's placement and shape (before anything is
//              appended);
//   Plan       what the CPU selection reads besides q (every key, for scores);
//   Select     the rows of one sequence, per kv head (the union over its query heads), with the
//              budgets and weights the estimate needs.
// The gather of the selected rows and the estimate are the engine's, the same for every method
// (engine/cpu_step.h). The GPU path of a method is its runner (engine/cuda/gpu_runner.h).
// One file per method: engine/methods/<method>.cc, listed in engine/methods/registry.cc.
#ifndef KVSPARSE_ENGINE_METHODS_METHOD_UNIT_H_
#define KVSPARSE_ENGINE_METHODS_METHOD_UNIT_H_

#include <cstdint>

#include "absl/status/status.h"
#include "engine/engine_options.h"
#include "engine/method.h"
#include "engine/row_source.h"
#include "engine/signatures.h"
#include "kernels/row_selection.h"

namespace kvsparse::engine {

class CpuStep;

// What a method's CPU selection reads besides q.
struct CpuPlan {
  // Every K row of the layer (scores): read in place when resident, else fetched first.
  bool all_keys = false;
  // The estimate states a standard error from its own draws (HeadStats::standard_error): the
  // methods whose every used row is a draw.
  bool states_standard_error = false;
};

class MethodUnit {
 public:
  virtual ~MethodUnit() = default;
  // Fills what m left to the engine from options; true when it changed anything.
  virtual bool Resolve(Method* m, const EngineOptions& options) const { return false; }
  // INVALID_ARGUMENT for parameters no sequence could serve (per-sequence parts, such as
  // k <= n, are checked by the selection).
  virtual absl::Status Validate(const Method& m, const EngineOptions& options) const = 0;
  // FAILED_PRECONDITION when the sequence's placement does not keep what the method reads (key
  // signatures, say); INVALID_ARGUMENT for parameters that contradict it (bits).
  virtual absl::Status CheckFits(const Method& m, const SequenceDesc& desc,
                                 const SignatureMaker& signatures) const {
    return absl::OkStatus();
  }
  virtual CpuPlan Plan(const Method& m) const { return {}; }
  // The CPU reference selection of one sequence (batch 1) into sel. It may read rows for the
  // selection itself (CpuStep::FetchForSelection); the step then gathers only the others.
  virtual absl::Status Select(CpuStep& step, kernels::RowSelection* sel) const = 0;
};

// CheckFits of a method that selects with key signatures of `bits` (0: the sequence's).
absl::Status CheckSignatures(const Method& m, int32_t bits, const char* method,
                             const SequenceDesc& desc, const SignatureMaker& signatures);

// CheckFits of a method that reads the sequence's compressed keys (`method` names it as a user
// wrote it): they must be there (`alternative`, when not null, says what else to ask for), and
// keys of fewer than `min_bits` bits are refused because `why` (its promise fails there).
absl::Status CheckCompressedKeys(const char* method, const SequenceDesc& desc, uint32_t min_bits,
                                 const char* alternative, const char* why);

// The units, one per file of engine/methods/.
const MethodUnit& DenseUnit();
const MethodUnit& SantaUnit();
const MethodUnit& HashTopKUnit();
const MethodUnit& VAttentionUnit();
const MethodUnit& SaapUnit();
const MethodUnit& TopKUnit();

}  // namespace kvsparse::engine

#endif  // KVSPARSE_ENGINE_METHODS_METHOD_UNIT_H_
