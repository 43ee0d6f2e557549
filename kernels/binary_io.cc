#include "kernels/binary_io.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace kvsparse::kernels {

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) return absl::InternalError(absl::StrCat("read of ", path, " failed"));
  return ss.str();
}

absl::Status WriteWholeFile(const std::string& path, std::string_view bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return absl::InternalError(absl::StrCat("cannot open ", path, " for writing"));
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  f.close();
  if (!f) return absl::InternalError(absl::StrCat("write to ", path, " failed"));
  return absl::OkStatus();
}

}  // namespace kvsparse::kernels
