// Every reason a configuration is refused, collected instead of returned at the first, so that
// one error names them all (as vLLM's validate_configuration does): a method's parameters
// (kernels/*.h Validate*), the GPU engine's support checks (engine/cuda/gpu_runner.h).
#ifndef KVSPARSE_KERNELS_REASONS_H_
#define KVSPARSE_KERNELS_REASONS_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvsparse::kernels {

class Reasons {
 public:
  // The code of the error ToStatus gives, unless the first reason came from a status (Add): its.
  explicit Reasons(absl::StatusCode code = absl::StatusCode::kInvalidArgument) : code_(code) {}

  // Adds the reason (its parts joined as absl::StrCat) when `refused`; a reason already there is
  // not added again (checks repeated per sequence of a call).
  template <typename... Parts>
  void AddIf(bool refused, const Parts&... why) {
    if (refused) AddOnce(absl::StrCat(why...));
  }
  // Adds a status's message (every reason it holds) when it is not OK.
  void Add(const absl::Status& s);

  bool empty() const { return reasons_.empty(); }
  const std::vector<std::string>& list() const { return reasons_; }

  // OK when there is no reason; otherwise one error whose message is every reason, in the order
  // added, joined by "; ".
  absl::Status ToStatus() const;

 private:
  void AddOnce(std::string why);

  absl::StatusCode code_;
  bool code_from_status_ = false;
  std::vector<std::string> reasons_;
};

}  // namespace kvsparse::kernels

#endif  // KVSPARSE_KERNELS_REASONS_H_
