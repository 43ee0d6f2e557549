#include "engine/gpu_shape.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvsparse::engine {

absl::Status GpuTakesShape(const kvstore::ModelShape& s) {
  std::vector<std::string> why;
  if (s.dtype != kernels::DType::kBf16 && s.dtype != kernels::DType::kFp16) {
    why.push_back("the GPU kernels take bf16 or fp16 rows");
  }
  if (s.head_dim != 64 && s.head_dim != 128 && s.head_dim != 256) {
    why.push_back(absl::StrCat("head dim ", s.head_dim, " (the GPU's: 64, 128, 256)"));
  }
  const bool grouped = s.num_kv_heads != 0 && s.num_q_heads % s.num_kv_heads == 0;
  const uint32_t g = grouped ? s.num_q_heads / s.num_kv_heads : 0;
  if (g != 1 && g != 2 && g != 4 && g != 8) {
    why.push_back(grouped ? absl::StrCat("GQA group of ", g, " (the GPU's: 1, 2, 4, 8)")
                          : absl::StrCat(s.num_q_heads, " query heads over ", s.num_kv_heads,
                                         " kv heads (the GPU's groups: 1, 2, 4, 8)"));
  }
  if (why.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrJoin(why, "; "));
}

}  // namespace kvsparse::engine
