// A byte count flag type: "64K", "256M", "8G", "1T" (binary multiples), "4096", "1.5G"; also
// Kubernetes' "256Mi", "8Gi" and "8GiB" (the same binary multiples).
#ifndef KVSPARSE_SERVER_BYTE_SIZE_H_
#define KVSPARSE_SERVER_BYTE_SIZE_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace kvsparse::server {

struct ByteSize {
  uint64_t bytes = 0;
};

// absl flags hooks.
bool AbslParseFlag(absl::string_view text, ByteSize* out, std::string* error);
std::string AbslUnparseFlag(ByteSize size);

}  // namespace kvsparse::server

#endif  // KVSPARSE_SERVER_BYTE_SIZE_H_
