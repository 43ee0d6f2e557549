// What every torch.ops.kvsparse source file shares (torch_ops.cc, sale_ops.cc): failures raised
// as RuntimeError("kvsparse <CODE>: <message>"), which kvsparse.torch.ops turns into the kvsparse
// exception of that code, the dtype of a tensor argument, and device operands laid out as the
// kernels read them.
#ifndef KVSPARSE_OP_TORCH_ARGS_H_
#define KVSPARSE_OP_TORCH_ARGS_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"

namespace kvsparse::torch_ops {

[[noreturn]] inline void Raise(const absl::Status& s) {
  TORCH_CHECK(false, "kvsparse ", absl::StatusCodeToString(s.code()), ": ", s.message());
}
inline void Check(const absl::Status& s) {
  if (!s.ok()) Raise(s);
}
[[noreturn]] inline void Invalid(const std::string& what) {
  Raise(absl::InvalidArgumentError(what));
}

inline kernels::DType DTypeOf(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return kernels::DType::kFp32;
    case at::kHalf:
      return kernels::DType::kFp16;
    case at::kBFloat16:
      return kernels::DType::kBf16;
    default:
      Invalid(absl::StrCat(name, ": kvsparse moves float32, float16 and bfloat16, not ",
                           c10::toString(t.scalar_type())));
  }
}

// Whether t's data starts on a 16-byte boundary, as the CUDA kernels read and write rows and
// queries (16 bytes a load or store).
inline bool OnA16ByteBoundary(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// t contiguous and starting on a 16-byte boundary: a strided tensor is copied by contiguous(), a
// contiguous view that starts off the boundary (a slice of a larger buffer) by clone(); t itself
// where it is both already.
inline at::Tensor Aligned16(const at::Tensor& t) {
  at::Tensor r = t.contiguous();
  if (!OnA16ByteBoundary(r)) r = r.clone();
  return r;
}

}  // namespace kvsparse::torch_ops

#endif  // KVSPARSE_OP_TORCH_ARGS_H_
