// Compressed keys on the GPU: a decode step's append (AppendCompressedKeyStep) and the
// approximate scores they give (CPU reference: kernels/compressed_keys.h,
// ApproximateScores): scale * q . k~_t for every token of every (sequence, query head), the
// closed groups from their blocks (the host layout, one block per group, uploaded verbatim), the
// open group's tokens from their exact rows. 1- and 2-bit keys (head_dim a multiple of 32) are
// scored on the tensor cores (int8 MMA: the codes against each head's q_c * step_c written as
// three base-128 digits after a power-of-2 scaling; the group's codes staged in shared memory):
// their scores differ from the reference's by rounding only, within scale * (code_max d 2^-20
// max_c |q_c step_c| + 2^-14 sum_c (|q_c lo_c| + code_max |q_c step_c|)) (compressed_keys_test.cc
// checks it), so a top-k over them can differ from the CPU's only between near-ties. Other
// widths and the open group's rows are scored by the reference's arithmetic, term by term in its
// order (single roundings, no fused multiply-add): its scores bit for bit.
// The launcher never allocates or synchronises; a fixed-shape call can be captured in a graph.
#ifndef KVSPARSE_KERNELS_CUDA_COMPRESSED_KEYS_H_
#define KVSPARSE_KERNELS_CUDA_COMPRESSED_KEYS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/dtype.h"

namespace kvsparse::kernels::cuda {

struct CompressedScoreParams {
  int32_t num_seqs = 0;        // B
  int32_t num_q_heads = 0;     // H = G * Hkv, the GQA group G 1, 2, 4 or 8
  int32_t num_kv_heads = 0;    // Hkv
  int32_t head_dim = 0;        // d, with d * bits a multiple of 32
  int32_t bits = 2;            // 1, 2, 4 or 8
  int32_t group = 128;         // tokens per closed group, at most 1024
  int32_t max_groups = 0;      // the largest closed-group count of any (sequence, kv head)
  DType dtype = DType::kBf16;  // of q and of the open group's exact rows
  float scale = 0.f;
  const void* q = nullptr;  // device, shape: [B, H, d]
  // device, shape: [B * Hkv]: the closed groups' blocks of (b, kv head j), contiguous: group
  // g's block (kernels/compressed_keys.h's layout) at group_heads[b * Hkv + j] + g * block_bytes.
  const uint8_t* const* group_heads = nullptr;
  int64_t block_bytes = 0;  // KeyGroupBytes({bits, group}, head_dim), or more (a multiple of 4)
  // device, shape: [B * Hkv]: the open group's exact rows [open, d] of (b, j).
  const void* const* tails = nullptr;
  const int32_t* seq_lens = nullptr;  // device, shape: [B]: tokens scored (closed + open)
  // device, shape: [B, H, score_stride]: scores of tokens [0, seq_lens[b]) of (b, h).
  float* scores = nullptr;
  int64_t score_stride = 0;
  // Optional, device [Hkv, d] each: kv head j's channel map (kernels/key_widths.h:
  // KeyChannelMap's channel and part) of keys quantized with it; null: uniform widths. The
  // closed groups are scored with q through the map (q'_v = q[channel[v]]), the open group's rows
  // over the channels the map keeps, as ApproximateScores does. bits 1, 2 or 4 with one; both
  // tables 4-byte aligned.
  const uint8_t* map_channel = nullptr;
  const uint8_t* map_part = nullptr;
};

// Checks the shape parameters (not the pointers' contents): cudaErrorInvalidValue if wrong.
cudaError_t CompressedScores(const CompressedScoreParams& p, cudaStream_t stream);

// A decode step's key into the compressed keys, on the device (a captured step has no host
// quantization; CPU reference: CompressedKeys::Append): each (sequence, kv head)'s new key is
// written as row (n - 1) % group of its open group, and where that row fills the group (n a
// multiple of group) the group closes: its rows are quantized into block n / group - 1 by the
// arithmetic of kernels/key_quantization.h, the bits CompressKeyGroup gives on the host.
struct CompressedKeyStepParams {
  int32_t batch = 0;            // B
  int32_t num_kv_heads = 0;     // Hkv
  int32_t head_dim = 0;         // d, with d * bits a multiple of 32, at most 1024
  int32_t bits = 2;             // 1, 2, 4 or 8
  int32_t group = 128;          // tokens per closed group, at most 1024
  DType dtype = DType::kBf16;   // of new_k and of the open group's rows
  const void* new_k = nullptr;  // device, shape: [B, Hkv, d]
  // device, shape: [B]: each sequence's length after the step (n); 0 (a refused step): nothing
  // is written for it.
  const int32_t* seq_lens = nullptr;
  // device, shape: [B * Hkv]: the open group's rows [group, d] of (b, kv head j).
  void* const* tails = nullptr;
  // device, shape: [B * Hkv]: the closed groups' blocks of (b, j), block g at
  // group_heads[b * Hkv + j] + g * block_bytes; REQUIRES: room for block n / group - 1.
  uint8_t* const* group_heads = nullptr;
  int64_t block_bytes = 0;  // KeyGroupBytes({bits, group}, head_dim), or more (a multiple of 4)
  // Optional, device [Hkv, d] each: the channel maps a closing group is quantized with, as
  // CompressKeyGroupsParams's; null: uniform widths. bits 1, 2 or 4 and d <= 256 with one.
  const uint8_t* map_channel = nullptr;
  const uint8_t* map_part = nullptr;
};

// Checks the shape parameters: cudaErrorInvalidValue if wrong. Capturable (no allocation, no
// synchronisation).
cudaError_t AppendCompressedKeyStep(const CompressedKeyStepParams& p, cudaStream_t stream);

// Closed groups of keys into their blocks on the device (a prompt's sync: the groups a chunk of
// rows closes; CPU reference: CompressKeyGroup, the same bits): group i < groups of kv head j
// has its rows [group, d] at rows + j * head_stride + i * group * d * sizeof(dtype) and goes to
// blocks + j * block_head_stride + i * block_bytes. One block of threads per group.
struct CompressKeyGroupsParams {
  int32_t num_kv_heads = 0;       // Hkv
  int32_t groups = 0;             // per kv head
  int32_t head_dim = 0;           // d, with d * bits a multiple of 32, at most 1024
  int32_t bits = 2;               // 1, 2, 4 or 8
  int32_t group = 128;            // tokens per group, at most 1024
  DType dtype = DType::kBf16;     // of the rows
  const void* rows = nullptr;     // device
  int64_t head_stride = 0;        // bytes between kv heads' rows
  uint8_t* blocks = nullptr;      // device
  int64_t block_head_stride = 0;  // bytes between kv heads' blocks
  int64_t block_bytes = 0;  // KeyGroupBytes({bits, group}, head_dim), or more (a multiple of 4)
  // Optional, device [Hkv, d] each: kv head j's channel map (kernels/key_widths.h:
  // KeyChannelMap's channel and part), as CompressKeyGroup takes it; null: uniform widths. bits
  // 1, 2 or 4 with one.
  const uint8_t* map_channel = nullptr;
  const uint8_t* map_part = nullptr;
};

// Checks the shape parameters: cudaErrorInvalidValue if wrong. No allocation, no
// synchronisation.
cudaError_t CompressKeyGroups(const CompressKeyGroupsParams& p, cudaStream_t stream);

}  // namespace kvsparse::kernels::cuda

#endif  // KVSPARSE_KERNELS_CUDA_COMPRESSED_KEYS_H_
