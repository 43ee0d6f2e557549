#include "kvstore/memory_resource.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

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

  // Private anonymous memory: the pages go back at once (RSS drops), zero pages come on the next
  // write.
  void Release(void* p, size_t bytes) override { madvise(p, bytes, MADV_DONTNEED); }

  absl::string_view name() const override { return "host"; }

 private:
  const HostMemoryOptions options_;
};

}  // namespace

std::unique_ptr<MemoryResource> NewHostMemoryResource(HostMemoryOptions options) {
  return std::make_unique<HostMemoryResource>(options);
}

}  // namespace kvsparse::kvstore
