#include "kernels/reasons.h"

#include <algorithm>

#include "absl/strings/str_join.h"

namespace kvsparse::kernels {

void Reasons::Add(const absl::Status& s) {
  if (s.ok()) return;
  if (!code_from_status_ && reasons_.empty()) {
    code_ = s.code();
    code_from_status_ = true;
  }
  AddOnce(std::string(s.message()));
}

void Reasons::AddOnce(std::string why) {
  if (std::find(reasons_.begin(), reasons_.end(), why) == reasons_.end()) {
    reasons_.push_back(std::move(why));
  }
}

absl::Status Reasons::ToStatus() const {
  if (reasons_.empty()) return absl::OkStatus();
  return absl::Status(code_, absl::StrJoin(reasons_, "; "));
}

}  // namespace kvsparse::kernels
