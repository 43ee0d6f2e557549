// Little-endian binary files of the kernels' offline artifacts (learned hash weights, SAAP
// partitions): writers, a bounds-checked reader, and whole-file read/write with the status codes
// the loaders document (NOT_FOUND / INTERNAL for I/O, the parser's INVALID_ARGUMENT otherwise).
#ifndef KVSPARSE_KERNELS_BINARY_IO_H_
#define KVSPARSE_KERNELS_BINARY_IO_H_

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvsparse::kernels {

inline void PutU32(std::string* s, uint32_t v) {
  const char b[4] = {static_cast<char>(v & 0xff), static_cast<char>((v >> 8) & 0xff),
                     static_cast<char>((v >> 16) & 0xff), static_cast<char>((v >> 24) & 0xff)};
  s->append(b, 4);
}

inline void PutF32(std::string* s, float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  PutU32(s, u);
}

// Little-endian reader over a byte span; every read returns false past the end.
class ByteReader {
 public:
  explicit ByteReader(std::string_view b) : b_(b) {}
  bool U32(uint32_t* v) {
    if (b_.size() - pos_ < 4) return false;
    const auto* p = reinterpret_cast<const unsigned char*>(b_.data() + pos_);
    *v = static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
    pos_ += 4;
    return true;
  }
  bool F32s(float* out, size_t count) {
    for (size_t i = 0; i < count; ++i) {
      uint32_t u;
      if (!U32(&u)) return false;
      std::memcpy(&out[i], &u, 4);
    }
    return true;
  }
  bool Bytes(char* out, size_t count) {
    if (b_.size() - pos_ < count) return false;
    std::memcpy(out, b_.data() + pos_, count);
    pos_ += count;
    return true;
  }
  size_t remaining() const { return b_.size() - pos_; }

 private:
  std::string_view b_;
  size_t pos_ = 0;
};

// The whole file: NOT_FOUND when it cannot be opened, INTERNAL for a failed read / write.
[[nodiscard]] absl::StatusOr<std::string> ReadWholeFile(const std::string& path);
[[nodiscard]] absl::Status WriteWholeFile(const std::string& path, std::string_view bytes);

}  // namespace kvsparse::kernels

#endif  // KVSPARSE_KERNELS_BINARY_IO_H_
