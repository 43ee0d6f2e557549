// An engine's settings as its user gives them (kvsparse-server's flags, the PyTorch op's
// arguments), read into EngineOptions by one function for both, so that a setting means the same
// wherever it is given: the GPU mode by name, the GPU backend's capacity tied to the resident
// capacity unless given, every range checked and the files of signature weights and key widths
// loaded, each error naming the setting as that user spells it.
#ifndef KVSPARSE_ENGINE_ENGINE_SETTINGS_H_
#define KVSPARSE_ENGINE_ENGINE_SETTINGS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/engine_options.h"

namespace kvsparse::engine {

struct EngineSettings {
  std::string gpu = "auto";  // ParseGpuMode: auto, on or off
  // Every numeric setting, its default EngineOptions's; gpu.mode and gpu.capacity_bytes are set
  // from `gpu` and `gpu_capacity`, signatures' weights and key_widths from the files below.
  EngineOptions options;
  // GPU memory for per-sequence state; 0: options.resident_capacity_bytes (one bound for the
  // device-tier state on either backend).
  uint64_t gpu_capacity = 0;
  // Files (empty: none): learned HashAttention weights or SAAP partitions (LoadSignatureWeights),
  // per-channel key widths (LoadKeyWidths).
  std::string hash_weights, saap_weights, key_widths;
};

// The engine's options from its settings. INVALID_ARGUMENT naming the first setting that is wrong,
// as `prefix` + its field name here ("--" for kvsparse-server's flags, "" for the op's
// arguments): an unknown GPU mode, a capacity of 0, a GPU option outside its range
// (CheckGpuOptions), a weights or widths file that does not read.
absl::StatusOr<EngineOptions> EngineOptionsFrom(const EngineSettings& settings,
                                                absl::string_view prefix);

}  // namespace kvsparse::engine

#endif  // KVSPARSE_ENGINE_ENGINE_SETTINGS_H_
