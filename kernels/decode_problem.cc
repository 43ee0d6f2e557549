#include "kernels/decode_problem.h"

#include "absl/strings/str_cat.h"

namespace kvsparse::kernels {

absl::Status ValidateDecodeProblem(const DecodeProblem& p, bool lens_on_host) {
  if (p.batch < 0) return absl::InvalidArgumentError(absl::StrCat("batch ", p.batch, " < 0"));
  if (p.num_kv_heads <= 0 || p.num_q_heads <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("head counts must be positive (H=",
                                                   p.num_q_heads, ", Hkv=", p.num_kv_heads, ")"));
  }
  if (p.num_q_heads % p.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("H=", p.num_q_heads,
                                                   " is not a multiple of Hkv=", p.num_kv_heads));
  }
  if (p.head_dim <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("head_dim ", p.head_dim, " must be positive"));
  }
  if (p.batch > 0 && (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.out == nullptr ||
                      p.seq_lens == nullptr)) {
    return absl::InvalidArgumentError("q, k, v, out and seq_lens must be non-null");
  }
  if (!(p.scale > 0.f)) {
    return absl::InvalidArgumentError(absl::StrCat("scale ", p.scale, " must be positive"));
  }
  if (lens_on_host) {
    for (int32_t b = 0; b < p.batch; ++b) {
      if (p.seq_lens[b] < 0) {
        return absl::InvalidArgumentError(absl::StrCat("seq_lens[", b, "] = ", p.seq_lens[b]));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvsparse::kernels
