#include "kernels/cuda/common.cuh"
#include "kernels/cuda/step_append.h"
#include "kernels/philox.h"

namespace kvsparse::kernels::cuda {
namespace {

constexpr int kThreads = 64;

// Whether sequence b's position is one a step may write.
__device__ __forceinline__ bool Writable(const StepAppendParams& p, int32_t b, int64_t pos) {
  const int64_t limit = p.limits != nullptr ? min(p.limits[b], p.max_tokens) : p.max_tokens;
  return pos >= p.floor[b] && pos == p.top[b] && pos < limit;
}

// One block per (sequence, kv head); a block's threads copy the K and V rows 16 bytes at a time.
__global__ void __launch_bounds__(kThreads) StepAppendKernel(StepAppendParams p) {
  GridDependencyWait();  // LaunchDependent: the earlier kernels' writes first
  const int32_t i = blockIdx.x;
  const int32_t b = i / p.num_kv_heads;
  const int64_t pos = p.positions[b];
  if (!Writable(p, b, pos)) return;
  const int chunks = p.row_bytes / 16;
  const size_t src_off = static_cast<size_t>(i) * p.row_bytes;
  const auto* k_src = reinterpret_cast<const uint4*>(static_cast<const char*>(p.new_k) + src_off);
  const auto* v_src = reinterpret_cast<const uint4*>(static_cast<const char*>(p.new_v) + src_off);
  const void* const* lane = p.pages.tables[i];
  char* slot = static_cast<char*>(const_cast<void*>(lane[pos >> p.pages.page_shift])) +
               (pos & ((int64_t{1} << p.pages.page_shift) - 1)) * p.pages.slot_bytes;
  auto* k_slot = reinterpret_cast<uint4*>(slot);
  auto* v_slot = reinterpret_cast<uint4*>(slot + p.row_bytes);
  uint4* k_dev =
      p.k_heads == nullptr
          ? nullptr
          : reinterpret_cast<uint4*>(static_cast<char*>(p.k_heads[i]) + pos * p.row_bytes);
  uint4* v_dev =
      p.v_heads == nullptr
          ? nullptr
          : reinterpret_cast<uint4*>(static_cast<char*>(p.v_heads[i]) + pos * p.row_bytes);
  if (p.new_sigs != nullptr && static_cast<int>(threadIdx.x) < p.sig_words) {
    p.sig_heads[i][pos * p.sig_words + threadIdx.x] =
        p.new_sigs[static_cast<size_t>(i) * p.sig_words + threadIdx.x];
  }
#pragma unroll 1
  for (int c = threadIdx.x; c < chunks; c += kThreads) {
    const uint4 k = k_src[c], v = v_src[c];
    k_slot[c] = k;
    v_slot[c] = v;
    if (k_dev != nullptr) k_dev[c] = k;
    if (v_dev != nullptr) v_dev[c] = v;
  }
}

// Per sequence, after every block read the old tops (blocks have no order, so a second kernel):
// the step's length, seed and top, or length 0 and the error word.
__global__ void StepLengthsKernel(StepAppendParams p) {
  GridDependencyWait();  // LaunchDependent: the earlier kernels' writes first
  const int32_t b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b == 0 && p.progress != nullptr) *p.progress = p.layer;
  for (int32_t x = b; x < p.zero_words; x += gridDim.x * blockDim.x) p.zero[x] = 0;
  if (b >= p.batch) return;
  const int64_t pos = p.positions[b];
  const bool ok = Writable(p, b, pos);
  p.seq_lens[b] = ok ? static_cast<int32_t>(pos + 1) : 0;
  if (p.seeds != nullptr) {
    p.seeds[b] =
        SequenceSeed(p.seed + static_cast<uint64_t>(ok ? pos : 0), static_cast<uint32_t>(b));
  }
  if (ok) {
    p.top[b] = pos + 1;
  } else if (pos >= 0) {  // a negative position is an inactive slot, not an error
    atomicExch(p.error, 1);
  }
}

}  // namespace

cudaError_t StepAppend(const StepAppendParams& p, cudaStream_t stream) {
  if (p.batch <= 0 || p.num_kv_heads <= 0 || p.row_bytes <= 0 || p.row_bytes % 16 != 0 ||
      p.positions == nullptr || p.new_k == nullptr || p.new_v == nullptr || !p.pages.enabled() ||
      p.floor == nullptr || p.top == nullptr || p.error == nullptr || p.seq_lens == nullptr ||
      p.max_tokens <= 0 || p.max_tokens > (int64_t{1} << 30) ||
      p.pages.slot_bytes < 2 * p.row_bytes || p.zero_words < 0 ||
      (p.zero_words > 0 && p.zero == nullptr) ||
      (p.new_sigs != nullptr &&
       (p.sig_heads == nullptr || p.sig_words <= 0 || p.sig_words > kThreads))) {
    return cudaErrorInvalidValue;
  }
  KVSPARSE_CUDA_RETURN_IF_ERROR(LaunchDependent(&StepAppendKernel, dim3(p.batch * p.num_kv_heads),
                                                dim3(kThreads), 0, stream, p));
  return LaunchDependent(&StepLengthsKernel, dim3((p.batch + 127) / 128), dim3(128), 0, stream, p);
}

}  // namespace kvsparse::kernels::cuda
