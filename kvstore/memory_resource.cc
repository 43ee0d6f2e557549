#include "kvstore/memory_resource.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace kvsparse::kvstore {
namespace {

class HostMemoryResource final : public MemoryResource {
 public:
  explicit HostMemoryResource(HostMemoryOptions options) : options_(options) {}

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("host mmap of ", bytes, " bytes failed: ", std::strerror(errno)));
    }
    if (options_.huge_pages) madvise(p, bytes, MADV_HUGEPAGE);  // advisory; failure is harmless
    return p;
  }

  void Deallocate(void* p, size_t bytes) override { munmap(p, bytes); }

  absl::string_view name() const override { return "host"; }

 private:
  const HostMemoryOptions options_;
};

class FileMemoryResource final : public MemoryResource {
 public:
  FileMemoryResource(std::string path, uint8_t* base, size_t bytes)
      : path_(std::move(path)), base_(base), bytes_(bytes) {}
  ~FileMemoryResource() override { munmap(base_, bytes_); }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    absl::MutexLock lock(&mu_);
    const size_t aligned = (bytes + 4095) / 4096 * 4096;
    if (aligned > bytes_ - used_) {
      return absl::ResourceExhaustedError(absl::StrCat("arena file ", path_, " is full (", bytes_,
                                                       " bytes; --capacity fits in it)"));
    }
    void* p = base_ + used_;
    used_ += aligned;
    ++live_;
    return p;
  }

  void Deallocate(void*, size_t) override {
    absl::MutexLock lock(&mu_);
    if (--live_ == 0) used_ = 0;
  }

  absl::string_view name() const override { return "file"; }

 private:
  const std::string path_;
  uint8_t* const base_;
  const size_t bytes_;
  absl::Mutex mu_;
  size_t used_ ABSL_GUARDED_BY(mu_) = 0;
  size_t live_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

std::unique_ptr<MemoryResource> NewHostMemoryResource(HostMemoryOptions options) {
  return std::make_unique<HostMemoryResource>(options);
}

absl::StatusOr<std::unique_ptr<MemoryResource>> NewFileMemoryResource(const std::string& path,
                                                                      size_t bytes) {
  auto fail = [&](absl::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat("--arena_file ", path, ": ", what, ": ", std::strerror(errno)));
  };
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return fail("cannot open");
  if (ftruncate(fd, 0) != 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    close(fd);
    return fail("cannot size it");
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);  // the mapping keeps the file's pages
  if (p == MAP_FAILED) return fail("cannot map it");
  return std::unique_ptr<MemoryResource>(
      new FileMemoryResource(path, static_cast<uint8_t*>(p), bytes));
}

}  // namespace kvsparse::kvstore
