#include "rpc/dtype.h"

#include "absl/strings/str_cat.h"

namespace kvsparse::rpc {

using kernels::DType;

absl::StatusOr<DType> FromProto(v1::DType dtype, const char* field) {
  switch (dtype) {
    case v1::DTYPE_FP32:
      return DType::kFp32;
    case v1::DTYPE_FP16:
      return DType::kFp16;
    case v1::DTYPE_BF16:
      return DType::kBf16;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": dtype must be FP32, FP16 or BF16, got ", static_cast<int>(dtype)));
  }
}

v1::DType ToProto(DType dtype) {
  switch (dtype) {
    case DType::kFp32:
      return v1::DTYPE_FP32;
    case DType::kFp16:
      return v1::DTYPE_FP16;
    case DType::kBf16:
      return v1::DTYPE_BF16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

}  // namespace kvsparse::rpc
