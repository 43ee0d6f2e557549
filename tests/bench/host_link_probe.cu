// How fast can a GPU kernel read scattered rows of pinned host memory, depending on how that
// memory was pinned and how far the rows are spread? A standalone probe (nvcc, the CUDA driver and
// tests/gpu/bench_util.h only) for the question behind the flagship's FetchRows: its rows (512-byte
// K+V slots, a few thousand a layer) lie anywhere in a store of up to tens of GB, and the GPU
// translates every address it reads.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -I. tests/bench/host_link_probe.cu -lcuda -o host_link_probe
//   ./host_link_probe [pool GiB list, default 1,4,16] [rows per call, default 4064] [modes]
//
// Pinning modes: "thp" (mmap + MADV_HUGEPAGE, written, then cudaHostRegister), "store" (the
// store's order: 64 MiB slabs each madvised and registered before anything touches it, then
// written: do its pages come as huge pages, and does a read every 256 KiB warm them?), "4k"
// (mmap + MADV_NOHUGEPAGE + cudaHostRegister), "hostalloc" (cudaHostAlloc), "vmm" (cuMemCreate
// on the host NUMA node at the allocation granularity the driver recommends, mapped for the
// device). Per call: `rows` uniformly random 512-byte slots of the pool (anywhere in it, or
// within a 1/32 window: one layer's pages of a 32-layer store), sorted, read by a grid-stride
// kernel with four 16-byte loads in flight per thread; median of 30 calls by CUDA events, beside
// a bulk 256 MiB host-to-device copy. With a 16 GiB pool of the "thp", "store" or "4k" mode, the
// experiments behind kernels::cuda::WarmPagedRows: the same gather after each page of its window
// was read once (at strides from 2 MiB down to 64 KiB, and 4 KiB; with 512 MiB of device memory
// streamed between), after the same rows were read once, and with the pages read by serial chains
// (a bounded number of reads in flight) or by the copy engine (not over the "store" mode's slabs,
// registered one by one: one copy across them is refused), each beside a 512 MiB device-memory
// stream on another stream, whose time shows what the reads in flight cost the rest of the GPU.
// Results on the H200 here: docs/PERF.md, "Cold translations".
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tests/gpu/bench_util.h"

#define CK(x) KVSPARSE_BENCH_CK(x)
#define CU(x)                                                             \
  do {                                                                    \
    CUresult r_ = (x);                                                    \
    if (r_ != CUDA_SUCCESS) {                                             \
      const char* s_ = nullptr;                                           \
      cuGetErrorString(r_, &s_);                                          \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_); \
      return false;                                                       \
    }                                                                     \
  } while (0)

constexpr int kThreads = 256, kIn = 4, kSlot = 512, kVecs = kSlot / 16;

__global__ void __launch_bounds__(kThreads)
    Gather(const uint4* __restrict__ pool, const int64_t* __restrict__ slots, int rows,
           uint4* __restrict__ out) {
  const int64_t total = static_cast<int64_t>(rows) * kVecs;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t base = blockIdx.x * kThreads + threadIdx.x; base < total; base += stride * kIn) {
    uint4 v[kIn];
#pragma unroll
    for (int i = 0; i < kIn; ++i) {
      const int64_t e = base + i * stride;
      if (e < total) {
        const uint4* p = pool + slots[e / kVecs] * kVecs + e % kVecs;
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v[i].x), "=r"(v[i].y), "=r"(v[i].z), "=r"(v[i].w)
                     : "l"(p));
      }
    }
#pragma unroll
    for (int i = 0; i < kIn; ++i) {
      const int64_t e = base + i * stride;
      if (e < total) out[e] = v[i];
    }
  }
}

// One 16-byte read every `stride` bytes of [base, base + bytes): touches the translations a
// later gather of rows in that region needs, at a small fraction of its bytes.
__global__ void Touch(const char* __restrict__ base, int64_t bytes, int64_t stride, uint4* sink) {
  const int64_t n = bytes / stride;
  uint4 acc = {};
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    uint32_t x;
    asm volatile("ld.global.cv.u32 %0, [%1];" : "=r"(x) : "l"(base + i * stride));
    acc.x ^= x;
  }
  if (acc.x == 0x12345678u) *sink = acc;  // keeps the loads
}

// The same reads as `chains` serial chains: each thread's next address depends on its previous
// load's value (laundered to zero), so at most `chains` reads are in flight at once.
__global__ void TouchChains(const char* __restrict__ base, int64_t bytes, int64_t stride,
                            int chains, uint4* sink) {
  const int64_t n = bytes / stride;
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= chains) return;
  uint32_t dep = 0, acc = 0;
  for (int64_t i = t; i < n; i += chains) {
    uint32_t x;
    asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(x) : "l"(base + i * stride + dep));
    asm volatile("and.b32 %0, %1, 0;" : "=r"(dep) : "r"(x));
    acc ^= x;
  }
  if (acc == 0x12345678u) sink->x = acc;
}

// Streams `bytes` of device memory (a layer's weights between two fetches).
__global__ void Stream(const uint4* __restrict__ p, int64_t n, uint4* sink) {
  uint4 acc = {};
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const uint4 v = p[i];
    acc.x ^= v.x;
  }
  if (acc.x == 0x12345678u) *sink = acc;
}

struct Pool {
  std::string mode;
  void* host = nullptr;       // CPU address (null where the CPU cannot touch it)
  const void* dev = nullptr;  // the device's address
  size_t bytes = 0;
  CUmemGenericAllocationHandle handle = 0;
  CUdeviceptr va = 0;
};

// The process's anonymous huge pages (did MADV_HUGEPAGE take?).
void PrintHugePages(const char* mode) {
  FILE* f = std::fopen("/proc/self/smaps_rollup", "r");
  if (f == nullptr) return;
  char line[256];
  while (std::fgets(line, sizeof line, f)) {
    if (std::strncmp(line, "AnonHugePages:", 14) == 0) std::printf("  %s: %s", mode, line);
  }
  std::fclose(f);
}

// Host memory h, mapped for the device, as the pool's.
bool Mapped(Pool& p, void* h) {
  void* d = nullptr;
  CK(cudaHostGetDevicePointer(&d, h, 0));
  p.host = h;
  p.dev = d;
  return true;
}

// The store's slabs (kvstore/cuda_host_memory.cc): each 64 MiB registered right after its mmap and
// madvise, before anything touches it (the registration faults its pages in), then written.
constexpr size_t kStoreSlab = 64ull << 20;

bool Allocate(Pool& p) {
  if (p.mode == "store") {
    p.bytes = (p.bytes + kStoreSlab - 1) / kStoreSlab * kStoreSlab;
    void* h = mmap(nullptr, p.bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (h == MAP_FAILED) return false;
    std::printf("  %s: mapped at %p (%s 2 MiB boundary)\n", p.mode.c_str(), h,
                reinterpret_cast<uintptr_t>(h) % (2u << 20) == 0 ? "on a" : "off a");
    for (size_t off = 0; off < p.bytes; off += kStoreSlab) {
      char* slab = static_cast<char*>(h) + off;
      madvise(slab, kStoreSlab, MADV_HUGEPAGE);
      if (cudaHostRegister(slab, kStoreSlab, cudaHostRegisterMapped | cudaHostRegisterPortable) !=
          cudaSuccess) {
        return false;
      }
      void* d = nullptr;
      CK(cudaHostGetDevicePointer(&d, slab, 0));
      if (d != slab) return false;  // one contiguous device range needs the host's addresses
    }
    PrintHugePages((p.mode + ", registered").c_str());
    std::memset(h, 1, p.bytes);
    PrintHugePages((p.mode + ", written").c_str());
    p.host = h;
    p.dev = h;
    return true;
  }
  if (p.mode == "thp" || p.mode == "4k") {
    void* h = mmap(nullptr, p.bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (h == MAP_FAILED) return false;
    madvise(h, p.bytes, p.mode == "thp" ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    std::memset(h, 1, p.bytes);
    PrintHugePages(p.mode.c_str());
    if (cudaHostRegister(h, p.bytes, cudaHostRegisterMapped | cudaHostRegisterPortable) !=
        cudaSuccess) {
      return false;
    }
    return Mapped(p, h);
  }
  if (p.mode == "hostalloc") {
    void* h = nullptr;
    if (cudaHostAlloc(&h, p.bytes, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
      return false;
    }
    std::memset(h, 1, p.bytes);
    return Mapped(p, h);
  }
  if (p.mode == "vmm") {
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    prop.location.id = 0;
    size_t gran = 0;
    CU(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    std::printf("  vmm granularity %zu bytes\n", gran);
    p.bytes = (p.bytes + gran - 1) / gran * gran;
    CU(cuMemCreate(&p.handle, p.bytes, &prop, 0));
    CU(cuMemAddressReserve(&p.va, p.bytes, gran, 0, 0));
    CU(cuMemMap(p.va, p.bytes, 0, p.handle, 0));
    CUmemAccessDesc acc[2] = {};
    acc[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc[0].location.id = 0;
    acc[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    acc[1].location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
    acc[1].location.id = 0;
    acc[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (cuMemSetAccess(p.va, p.bytes, acc, 2) == CUDA_SUCCESS) {
      p.host = reinterpret_cast<void*>(p.va);
      std::printf("  vmm: the CPU may touch it at the same address\n");
      std::memset(p.host, 1, p.bytes);
    } else {
      std::printf("  vmm: no CPU access granted; device access only\n");
      CU(cuMemSetAccess(p.va, p.bytes, acc, 1));
      CK(cudaMemset(reinterpret_cast<void*>(p.va), 1, p.bytes));
    }
    p.dev = reinterpret_cast<void*>(p.va);
    return true;
  }
  return false;
}

void Free(Pool& p) {
  if (p.mode == "store") {
    for (size_t off = 0; off < p.bytes; off += kStoreSlab) {
      cudaHostUnregister(static_cast<char*>(p.host) + off);
    }
    munmap(p.host, p.bytes);
  } else if (p.mode == "thp" || p.mode == "4k") {
    cudaHostUnregister(p.host);
    munmap(p.host, p.bytes);
  } else if (p.mode == "hostalloc") {
    cudaFreeHost(p.host);
  } else if (p.mode == "vmm") {
    cuMemUnmap(p.va, p.bytes);
    cuMemAddressFree(p.va, p.bytes);
    cuMemRelease(p.handle);
  }
}

using kvsparse::bench::Median;

// Rows within a cold 1/32 window of the pool (a layer's pages), with the window's translations
// touched first at several strides, and with a stream of device memory between touch and gather.
void Experiments(const Pool& p, int rows, int blocks, int64_t* d_slots, uint4* d_out) {
  cudaEvent_t a, b, c;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaEventCreate(&c));
  const size_t hbm_bytes = 512ull << 20;
  uint4* hbm;
  CK(cudaMalloc(&hbm, hbm_bytes));
  CK(cudaMemset(hbm, 0, hbm_bytes));
  const int64_t nslots = static_cast<int64_t>(p.bytes / kSlot), span = nslots / 32;
  std::mt19937_64 rng(11);
  struct Case {
    const char* name;
    int64_t touch_stride;  // 0: none
    bool hbm_between;
    bool gather_twice;
  };
  const Case cases[] = {{"cold", 0, false, false},
                        {"touch 2M", 2 << 20, false, false},
                        {"touch 1M", 1 << 20, false, false},
                        {"touch 512K", 512 << 10, false, false},
                        {"touch 256K", 256 << 10, false, false},
                        {"touch 128K", 128 << 10, false, false},
                        {"touch 64K", 64 << 10, false, false},
                        {"touch 4K", 4 << 10, false, false},
                        {"touch 64K+hbm", 64 << 10, true, false},
                        {"touch 4K+hbm", 4 << 10, true, false},
                        {"same rows again", 0, false, true},
                        {"again+hbm", 0, true, true}};
  std::printf("experiments: 16 GiB pool (%s), %d rows within a cold 1/32 window per call\n",
              p.mode.c_str(), rows);
  for (const Case& k : cases) {
    std::vector<float> touch_ms, gather_ms;
    for (int rep = -3; rep < 30; ++rep) {
      const int64_t off = ((rep + 3) * 7 % 32) * span;
      std::vector<int64_t> sl(rows);
      for (auto& x : sl) x = off + static_cast<int64_t>(rng() % span);
      std::sort(sl.begin(), sl.end());
      CK(cudaMemcpy(d_slots, sl.data(), rows * sizeof(int64_t), cudaMemcpyHostToDevice));
      const char* wbase = static_cast<const char*>(p.dev) + off * kSlot;
      CK(cudaEventRecord(a));
      if (k.touch_stride > 0) {
        Touch<<<264, 256>>>(wbase, span * kSlot, k.touch_stride, d_out);
      }
      if (k.gather_twice) {
        Gather<<<blocks, kThreads>>>(static_cast<const uint4*>(p.dev), d_slots, rows, d_out);
      }
      if (k.hbm_between) {
        Stream<<<264 * 4, 256>>>(hbm, hbm_bytes / 16, d_out);
      }
      CK(cudaEventRecord(b));
      Gather<<<blocks, kThreads>>>(static_cast<const uint4*>(p.dev), d_slots, rows, d_out);
      CK(cudaEventRecord(c));
      CK(cudaEventSynchronize(c));
      CK(cudaGetLastError());
      float t0, t1;
      CK(cudaEventElapsedTime(&t0, a, b));
      CK(cudaEventElapsedTime(&t1, b, c));
      if (rep >= 0) {
        touch_ms.push_back(t0);
        gather_ms.push_back(t1);
      }
    }
    std::printf("  %-18s before %8.1f us   gather %7.1f us\n", k.name, Median(touch_ms) * 1e3,
                Median(gather_ms) * 1e3);
  }
  // Serial chains: the touch's length, the gather after it, and a device-memory stream's time
  // run beside the touch (on another stream) against the stream alone.
  cudaStream_t s1, s2;
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  cudaEvent_t d0, d1;
  CK(cudaEventCreate(&d0));
  CK(cudaEventCreate(&d1));
  uint4* ce_dst;
  CK(cudaMalloc(&ce_dst, (span * kSlot / (64 << 10)) * 16));
  // 0: stream alone; -1: parallel touch; -2: the copy engine (a 2D copy of 16 bytes every 64 KiB)
  for (const int chains : {0, 32, 64, 96, -1, -2}) {
    // One copy over slabs registered one by one is refused (invalid argument): no copy engine.
    if (chains == -2 && p.mode == "store") continue;
    std::vector<float> touch_ms, gather_ms, stream_ms;
    for (int rep = -3; rep < 20; ++rep) {
      const int64_t off = ((rep + 3) * 7 % 32) * span;
      std::vector<int64_t> sl(rows);
      for (auto& x : sl) x = off + static_cast<int64_t>(rng() % span);
      std::sort(sl.begin(), sl.end());
      CK(cudaMemcpy(d_slots, sl.data(), rows * sizeof(int64_t), cudaMemcpyHostToDevice));
      CK(cudaDeviceSynchronize());
      const char* wbase = static_cast<const char*>(p.dev) + off * kSlot;
      CK(cudaEventRecord(a, s2));
      if (chains > 0) {
        TouchChains<<<(chains + 127) / 128, 128, 0, s2>>>(wbase, span * kSlot, 64 << 10, chains,
                                                          d_out);
      } else if (chains == -1) {
        Touch<<<264, 256, 0, s2>>>(wbase, span * kSlot, 64 << 10, d_out);
      } else if (chains == -2) {
        CK(cudaMemcpy2DAsync(ce_dst, 16, wbase, 64 << 10, 16, span * kSlot / (64 << 10),
                             cudaMemcpyDefault, s2));
      }
      CK(cudaEventRecord(b, s2));
      CK(cudaEventRecord(d0, s1));
      Stream<<<264 * 4, 256, 0, s1>>>(hbm, hbm_bytes / 16, d_out);
      CK(cudaEventRecord(d1, s1));
      CK(cudaStreamWaitEvent(s2, d1));
      Gather<<<blocks, kThreads, 0, s2>>>(static_cast<const uint4*>(p.dev), d_slots, rows, d_out);
      CK(cudaEventRecord(c, s2));
      CK(cudaEventSynchronize(c));
      CK(cudaGetLastError());
      float t0, t1, t2, t3;
      CK(cudaEventElapsedTime(&t0, a, b));
      CK(cudaEventElapsedTime(&t1, d1, c));
      CK(cudaEventElapsedTime(&t2, d0, d1));
      CK(cudaEventElapsedTime(&t3, b, c));
      if (rep >= 0) {
        touch_ms.push_back(t0);
        gather_ms.push_back(std::min(t1, t3));
        stream_ms.push_back(t2);
      }
    }
    std::printf(
        "  chains %4d: touch %7.1f us  512 MiB device stream beside it %7.1f us  gather after both "
        "%6.1f us\n",
        chains, Median(touch_ms) * 1e3, Median(stream_ms) * 1e3, Median(gather_ms) * 1e3);
  }
  CK(cudaFree(ce_dst));
  CK(cudaFree(hbm));
}

int main(int argc, char** argv) {
  std::vector<double> gibs = {1, 4, 16};
  if (argc > 1) {
    gibs.clear();
    for (char* t = std::strtok(argv[1], ","); t; t = std::strtok(nullptr, ",")) {
      gibs.push_back(std::atof(t));
    }
  }
  const int rows = argc > 2 ? std::atoi(argv[2]) : 4064;
  CK(cudaSetDevice(0));
  CK(cudaFree(nullptr));
  cuInit(0);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::printf("%s, %d SMs; bulk host-to-device 256 MiB: %.1f GB/s\n", prop.name,
              prop.multiProcessorCount, kvsparse::bench::BulkHostToDeviceGBs());
  int64_t* d_slots;
  uint4* d_out;
  CK(cudaMalloc(&d_slots, rows * sizeof(int64_t)));
  CK(cudaMalloc(&d_out, static_cast<size_t>(rows) * kSlot));
  const int blocks =
      std::min(prop.multiProcessorCount * 8,
               static_cast<int>((static_cast<int64_t>(rows) * kVecs + kThreads * kIn - 1) /
                                (kThreads * kIn)));
  std::printf("%-10s %6s %6s %8s %10s %8s\n", "mode", "GiB", "rows", "MB", "kernel us", "GB/s");
  std::mt19937_64 rng(7);
  for (double gib : gibs) {
    for (const char* mode : {"thp", "store", "4k", "hostalloc", "vmm"}) {
      if (argc > 3 && std::strstr(argv[3], mode) == nullptr) continue;  // modes asked for
      Pool p;
      p.mode = mode;
      p.bytes = static_cast<size_t>(gib * (1ull << 30));
      if (!Allocate(p)) {
        std::printf("%-10s %6.0f  (allocation failed)\n", mode, gib);
        continue;
      }
      const int64_t nslots = static_cast<int64_t>(p.bytes / kSlot);
      for (const bool local : {false, true}) {
        // local: the call's rows within one 1/32 of the pool (a layer's slice), else anywhere.
        std::vector<float> ms;
        for (int rep = -3; rep < 30; ++rep) {
          const int64_t span = local ? nslots / 32 : nslots;
          const int64_t off = local ? ((rep + 3) % 32) * span : 0;
          std::vector<int64_t> s(rows);
          for (auto& x : s) x = off + static_cast<int64_t>(rng() % span);
          std::sort(s.begin(), s.end());
          CK(cudaMemcpy(d_slots, s.data(), rows * sizeof(int64_t), cudaMemcpyHostToDevice));
          CK(cudaEventRecord(e0));
          Gather<<<blocks, kThreads>>>(static_cast<const uint4*>(p.dev), d_slots, rows, d_out);
          CK(cudaEventRecord(e1));
          CK(cudaEventSynchronize(e1));
          CK(cudaGetLastError());
          float t;
          CK(cudaEventElapsedTime(&t, e0, e1));
          if (rep >= 0) ms.push_back(t);
        }
        const float m = Median(ms);
        const double mb = static_cast<double>(rows) * kSlot / 1e6;
        std::printf("%-10s %6.0f %6d %8.2f %10.1f %8.1f  %s\n", mode, gib, rows, mb, m * 1e3,
                    mb / m, local ? "(rows within 1/32 of the pool)" : "(rows anywhere)");
      }
      if (gib >= 16 && (std::string(mode) == "thp" || std::string(mode) == "store" ||
                        std::string(mode) == "4k")) {
        Experiments(p, rows, blocks, d_slots, d_out);
      }
      Free(p);
    }
  }
  return 0;
}
