// Host memory for a GPU decode worker's host tier: anonymous mmap'd slabs (transparent huge
// pages) registered with CUDA as page-locked, mapped memory, so a GPU kernel reads the store's
// rows in place over PCIe/C2C (zero-copy), with no staging copy on the host. Built only with
// CUDA (target kvsparse_kvstore_cuda).
#ifndef KVSPARSE_KVSTORE_CUDA_HOST_MEMORY_H_
#define KVSPARSE_KVSTORE_CUDA_HOST_MEMORY_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kvstore/memory_resource.h"

namespace kvsparse::kvstore {

// FAILED_PRECONDITION without a CUDA device, or when the device cannot dereference registered
// host memory at its host address (cudaDevAttrCanUseHostPointerForRegisteredMem): then the row
// addresses of a PageView would not be valid in kernels. Every slab is registered with
// cudaHostRegisterMapped | cudaHostRegisterPortable; an allocation whose registration fails is
// RESOURCE_EXHAUSTED (pinned memory is limited by the OS).
absl::StatusOr<std::unique_ptr<MemoryResource>> NewPinnedHostMemoryResource(
    HostMemoryOptions options = {});

}  // namespace kvsparse::kvstore

#endif  // KVSPARSE_KVSTORE_CUDA_HOST_MEMORY_H_
