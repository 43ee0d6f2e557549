#include "kvstore/cuda_host_memory.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"

namespace kvsparse::kvstore {
namespace {

// Host slabs (the plain host resource: mmap + THP) registered with CUDA while they live.
class PinnedHostMemoryResource final : public MemoryResource {
 public:
  explicit PinnedHostMemoryResource(HostMemoryOptions options)
      : host_(NewHostMemoryResource(options)) {}

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    absl::StatusOr<void*> p = host_->Allocate(bytes);
    if (!p.ok()) return p;
    const cudaError_t e =
        cudaHostRegister(*p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
    if (e != cudaSuccess) {
      host_->Deallocate(*p, bytes);
      return absl::ResourceExhaustedError(
          absl::StrCat("cudaHostRegister of ", bytes, " bytes failed: ", cudaGetErrorString(e)));
    }
    return p;
  }

  void Deallocate(void* p, size_t bytes) override {
    cudaHostUnregister(p);
    host_->Deallocate(p, bytes);
  }

  absl::string_view name() const override { return "pinned-host"; }

 private:
  const std::unique_ptr<MemoryResource> host_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<MemoryResource>> NewPinnedHostMemoryResource(
    HostMemoryOptions options) {
  int device = 0, count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError("pinned host memory needs a CUDA device; none found");
  }
  if (cudaGetDevice(&device) != cudaSuccess) {
    return absl::FailedPreconditionError("cudaGetDevice failed");
  }
  int host_ptr_ok = 0;
  cudaDeviceGetAttribute(&host_ptr_ok, cudaDevAttrCanUseHostPointerForRegisteredMem, device);
  if (!host_ptr_ok) {
    return absl::FailedPreconditionError(
        "this device cannot use registered host memory at its host address; the zero-copy "
        "host tier needs it");
  }
  return std::unique_ptr<MemoryResource>(new PinnedHostMemoryResource(options));
}

}  // namespace kvsparse::kvstore
