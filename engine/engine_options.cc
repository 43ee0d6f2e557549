#include "engine/engine_options.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace kvsparse::engine {

absl::Status LoadKeyWidths(const std::string& path, absl::string_view name,
                           EngineOptions* options) {
  if (path.empty()) return absl::OkStatus();
  absl::StatusOr<kernels::KeyWidths> w = kernels::ReadKeyWidths(path);
  if (!w.ok()) return absl::InvalidArgumentError(absl::StrCat(name, ": ", w.status().ToString()));
  options->key_widths = std::make_shared<const kernels::KeyWidths>(*std::move(w));
  return absl::OkStatus();
}

}  // namespace kvsparse::engine
