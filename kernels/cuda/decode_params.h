// Shapes and pointers shared by every CUDA decode launcher in kernels/cuda/. Plain C++ (no CUDA
// and no absl), so both nvcc and the host compiler see the same layout.
//
// Conventions for every launcher in this directory (FlashInfer style):
//   - raw device pointers, documented shapes; the caller owns every buffer;
//   - a launcher returns cudaError_t, never allocates, never synchronises and is safe to record
//     into a CUDA graph (grid sizes depend only on host-side fields, never on device data);
//   - scratch memory is a caller-owned workspace of at least XxxWorkspaceBytes(params) bytes,
//     256-byte aligned; its contents need not be initialised and are clobbered;
//   - cudaErrorInvalidValue for a shape or alignment the kernels do not support (head_dim not in
//     {64, 128, 256}, group size not in {1, 2, 4, 8}, dtype not bf16/fp16, misaligned rows).
#ifndef KVSPARSE_KERNELS_CUDA_DECODE_PARAMS_H_
#define KVSPARSE_KERNELS_CUDA_DECODE_PARAMS_H_

#include <cstddef>
#include <cstdint>

#include "kernels/dtype.h"

namespace kvsparse::kernels::cuda {

// Where row (b, kv_head, token) of K or V starts, in elements:
//   b * batch_stride + kv_head * head_stride + token * token_stride   (same as kernels::KvLayout).
// Rows are head_dim contiguous elements; every stride must be a multiple of 8 elements and the
// K/V base pointers 16-byte aligned (rows are read as 16-byte vectors).
struct KvStrides {
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
  int64_t token_stride = 0;
};

// Rows kept in fixed-size pages and read in place, e.g. the store's pinned, mapped host tier
// (kvstore::PageView): row (b, j, t) starts at
//   tables[b * Hkv + j][t >> page_shift] + (t & (2^page_shift - 1)) * slot_bytes + offset_bytes.
// Page addresses must be device-visible (device memory, or mapped host memory whose host
// addresses the device can use) and every row 16-byte aligned.
struct PagedRows {
  const void* const* const* tables = nullptr;  // device, shape: [B * Hkv] page lists
  int32_t page_shift = 0;                      // a page holds 2^page_shift tokens
  int32_t slot_bytes = 0;                      // bytes from one token's slot to the next
  int32_t offset_bytes = 0;                    // where the row sits in its slot

  bool enabled() const { return tables != nullptr; }
};

// V rows staged in list order and read by token (a store whose pages the GPU cannot read: the
// engine gathers the rows a call samples into pinned staging, LaunchPlan::StageListed): row
// (b, j, t) of V is row r of V's strided or per-head addressing (v / v_heads) where
// tokens[(b * Hkv + j) * capacity + r] == t. Each list ascending, of counts[b * Hkv + j] tokens;
// only listed tokens may be read (the single-row readers find r by binary search). Device.
struct ListedRows {
  const int32_t* tokens = nullptr;
  const int32_t* counts = nullptr;
  int32_t capacity = 0;

  bool enabled() const { return tokens != nullptr; }
};

// One decode step: one query token per sequence, H query heads over Hkv kv heads (GQA).
struct DecodeShape {
  int32_t batch = 0;           // B
  int32_t num_q_heads = 0;     // H, a multiple of num_kv_heads
  int32_t num_kv_heads = 0;    // Hkv; group size G = H / Hkv in {1, 2, 4, 8}
  int32_t head_dim = 0;        // d in {64, 128, 256}
  DType dtype = DType::kBf16;  // of q, K, V and out: kBf16 or kFp16
  const void* q = nullptr;     // device, shape: [B, H, d], contiguous, 16-byte aligned
  const void* k = nullptr;     // device (or mapped host), per kv
  const void* v = nullptr;     // device (or mapped host), per kv
  KvStrides kv;
  // Optional per-(sequence, kv head) row bases, for sequences that live in separate allocations
  // (the decode worker's resident state): when set, row (b, j, t) of K starts at
  // k_heads[b * Hkv + j] + t * kv.token_stride (elements) and k, kv.batch_stride and
  // kv.head_stride are not used for K. Same for v_heads. Device, shape: [B * Hkv], 16-byte
  // aligned.
  const void* const* k_heads = nullptr;
  const void* const* v_heads = nullptr;
  // Optional paged rows (see PagedRows), used instead of k / k_heads (v / v_heads). Only the
  // kernels that read single rows accept them: V in SantaIid, S2antaProp and S2antaFlash (K is
  // streamed and must be strided), K and V in VAttentionDecode; the others return
  // cudaErrorInvalidValue.
  PagedRows k_pages, v_pages;
  // Optional V rows by list (see ListedRows), with v / v_heads strided: the kernels that read
  // single V rows through RowReader (SantaIid, S2antaProp, S2antaFlash) take them.
  ListedRows v_listed;
  const int32_t* seq_lens = nullptr;  // device, shape: [B]; 0 <= seq_lens[b] <= max_seq_len
  // Host-side upper bound of seq_lens: sets grid and workspace sizes (so a captured graph stays
  // valid while every sequence stays within it).
  int32_t max_seq_len = 0;
  float scale = 0.f;    // softmax scale applied to q.k, usually 1/sqrt(d)
  void* out = nullptr;  // device, shape: [B, H, d], dtype; a sequence of length 0 gets zeros

  int32_t group_size() const { return num_kv_heads > 0 ? num_q_heads / num_kv_heads : 0; }
};

}  // namespace kvsparse::kernels::cuda

#endif  // KVSPARSE_KERNELS_CUDA_DECODE_PARAMS_H_
