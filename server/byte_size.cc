#include "server/byte_size.h"

#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvsparse::server {

bool AbslParseFlag(absl::string_view text, ByteSize* out, std::string* error) {
  text = absl::StripAsciiWhitespace(text);
  if (text.empty()) {
    *error = "empty byte size";
    return false;
  }
  // An optional "B" after a unit, and Kubernetes' "Ki", "Mi", "Gi", "Ti": the same binary
  // multiples ("8Gi" = "8G" = "8GiB" = 8 x 2^30).
  const absl::string_view number = text;
  if (text.size() > 1 && absl::ascii_toupper(text.back()) == 'B') text.remove_suffix(1);
  bool binary_i = false;
  if (text.size() > 1 && text.back() == 'i') {
    text.remove_suffix(1);
    binary_i = true;
  }
  double mult = 1;
  const char last = absl::ascii_toupper(text.back());
  const char* const kUnits = "KMGT";
  for (int i = 0; i < 4; ++i) {
    if (last == kUnits[i]) {
      mult = std::ldexp(1.0, 10 * (i + 1));
      text.remove_suffix(1);
      break;
    }
  }
  if (mult == 1 && binary_i) text = number;  // an "i" needs a unit before it
  double value;
  if (!absl::SimpleAtod(text, &value) || value < 0 || !std::isfinite(value) ||
      value * mult > 1.8e19) {
    *error = absl::StrCat("not a byte size: '", number, "' (want e.g. 4096, 64K, 256Mi, 8G)");
    return false;
  }
  out->bytes = static_cast<uint64_t>(value * mult);
  return true;
}

std::string AbslUnparseFlag(ByteSize size) {
  const char* const kUnits = "KMGT";
  for (int i = 3; i >= 0; --i) {
    const uint64_t unit = uint64_t{1} << (10 * (i + 1));
    if (size.bytes >= unit && size.bytes % unit == 0) {
      return absl::StrCat(size.bytes / unit, std::string(1, kUnits[i]));
    }
  }
  return absl::StrCat(size.bytes);
}

}  // namespace kvsparse::server
