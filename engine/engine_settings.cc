#include "engine/engine_settings.h"

#include "absl/strings/str_cat.h"
#include "engine/gpu_mode.h"
#include "engine/signatures.h"

namespace kvsparse::engine {

absl::StatusOr<EngineOptions> EngineOptionsFrom(const EngineSettings& settings,
                                                absl::string_view prefix) {
  auto bad = [&](absl::string_view field, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, field, ": ", why));
  };
  EngineOptions o = settings.options;
  absl::StatusOr<GpuMode> mode = ParseGpuMode(settings.gpu);
  if (!mode.ok()) return bad("gpu", mode.status().message());
  o.gpu.mode = *mode;
  if (o.gpu.device < 0) return bad("gpu_device", "a CUDA device ordinal is >= 0");
  if (o.resident_capacity_bytes == 0) return bad("resident_capacity", "must be positive");
  o.gpu.capacity_bytes =
      settings.gpu_capacity != 0 ? settings.gpu_capacity : o.resident_capacity_bytes;
  if (o.gpu.stage_timing_every < 0) {
    return bad("gpu_stage_timing_every", "must be >= 0 (0: never)");
  }
  if (absl::Status s = CheckGpuOptions(o.gpu, absl::StrCat(prefix, "gpu_")); !s.ok()) return s;
  if (absl::Status s = LoadSignatureWeights(settings.hash_weights, settings.saap_weights,
                                            absl::StrCat(prefix, "hash_weights"),
                                            absl::StrCat(prefix, "saap_weights"), &o.signatures);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = LoadKeyWidths(settings.key_widths, absl::StrCat(prefix, "key_widths"), &o);
      !s.ok()) {
    return s;
  }
  return o;
}

}  // namespace kvsparse::engine
