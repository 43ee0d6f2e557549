// --store_data_plane's one parser (data_plane.h); the planes are one file each.
#include "rpc/data_plane.h"

#include "absl/strings/str_cat.h"

namespace kvsparse::rpc {

absl::StatusOr<StoreDataPlane> ParseStoreDataPlane(absl::string_view name) {
  if (name.empty() || name == "gather") return StoreDataPlane::kGather;
  if (name == "ucx") return StoreDataPlane::kUcx;
  if (name == "ucx-rma") return StoreDataPlane::kUcxRma;
  return absl::InvalidArgumentError(
      absl::StrCat("--store_data_plane: '", name, "' is not gather, ucx or ucx-rma"));
}

}  // namespace kvsparse::rpc
