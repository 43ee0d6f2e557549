// SANTA / S2ANTA decode on the GPU (the S2ANTA paper, Section 3 and Appendices P, Q). K is read
// in full to score every token; V is read only at the sampled rows.
//   SantaIid:     S i.i.d. draws from softmax(q K^T) per query head (inverse CDF), mean of V rows.
//   S2antaProp:   pass 1 scores every tile of kSantaTile tokens, keeps its statistics (max, sum
//                 of u = exp(s - m_tile)) and a 32-byte record of the tokens systematic sampling
//                 would pick for each budget up to 7; a budget kernel splits S over the tiles by
//                 systematic rounding of their quotas (kernels/santa.h: unbiased, unlike the
//                 paper's largest remainder); pass 2 gathers the sampled V rows of the tiles
//                 that got samples (Algorithm 5); a tile where a head's budget exceeds 7
//                 (peaked attention: sink, window, needles) is rescored from K by a kernel with
//                 a block per such tile, between the two. No per-token stash crosses DRAM.
//   S2antaFlash:  one fused pass: each tile samples max(1, S / T) rows systematically on its own
//                 and the partials are merged with deferred normalisation (Algorithms 7-8).
// Random numbers follow kernels/philox.h exactly (tags kSantaIid, kPropTileOffset,
// kPropRounding, kFlashTileOffset; sequence = b; head = query head h; draw = sample index, tile
// index, or 0 for the rounding offset, drawn per kv head), so the
// sampled indices equal the CPU references' except where float rounding of a cumulative sum
// lands on the other side of a sampling threshold.
#ifndef KVSPARSE_KERNELS_CUDA_SANTA_H_
#define KVSPARSE_KERNELS_CUDA_SANTA_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/decode_params.h"

namespace kvsparse::kernels::cuda {

// Tokens per tile (B_tile) of the prop and flash kernels and of the i.i.d. sampler's pass 1.
constexpr int kSantaTile = 256;

struct SantaLaunchParams {
  DecodeShape shape;
  int32_t num_samples = 128;  // S per query head, >= 1
  uint64_t seed = 0;
  // Optional, device, shape: [B]: sequence b draws its random numbers from seeds[b] as a batch-1
  // problem would (streams (seeds[b], tag, 0, head)) instead of (seed, tag, b, head).
  const uint64_t* seeds = nullptr;
  // Optional diagnostics (nullptr to skip; not needed for the output):
  // device, shape: [B, Hkv]; the distinct V rows each (sequence, kv head) read are ADDED here
  // (atomicAdd): zero it first.
  int32_t* rows_read = nullptr;
  // device, shape: [B, H, max_seq_len]; prop/flash: sample counts c_{h,n} (flash writes every
  // token of every tile, prop adds its samples' counts: zero it first).
  int32_t* sample_counts = nullptr;
  // device, shape: [B, H, S]; iid only: the sampled token indices, in draw order.
  int32_t* indices = nullptr;
};

size_t SantaIidWorkspaceBytes(const SantaLaunchParams& p);
cudaError_t SantaIid(const SantaLaunchParams& p, void* workspace, size_t workspace_bytes,
                     cudaStream_t stream);

// Output summation over tiles uses fp32 atomics: results agree run to run up to rounding.
size_t S2antaPropWorkspaceBytes(const SantaLaunchParams& p);
cudaError_t S2antaProp(const SantaLaunchParams& p, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream);

size_t S2antaFlashWorkspaceBytes(const SantaLaunchParams& p);
cudaError_t S2antaFlash(const SantaLaunchParams& p, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream);

// The distinct tokens a call sampled per (sequence, kv head), ascending: from the sample counts
// of S2antaProp / S2antaFlash ([B, H, max_seq_len], zero where nothing was sampled) or from
// SantaIid's indices ([B, H, num_samples]). Written as DecodeShape::v_listed reads them: tokens
// [B * Hkv, max_seq_len], counts [B * Hkv]. A worker whose V rows are in another process runs a
// sampler once with sample_counts (or indices) to learn the rows, stages them (the same Philox
// streams draw the same samples), and runs it again reading V through v_listed.
struct SampledRowsParams {
  int32_t batch = 0, num_q_heads = 0, num_kv_heads = 0;
  const int32_t* seq_lens = nullptr;       // device [B]
  int32_t max_seq_len = 0;                 // host bound of seq_lens
  const int32_t* sample_counts = nullptr;  // device [B, H, max_seq_len], or
  const int32_t* indices = nullptr;        // device [B, H, num_samples]
  // > 0 with indices, 0 with sample_counts: the mode, and the workspace's size
  // (SampledRowsWorkspaceBytes), follow it, so that a sizing pass may leave the pointers null.
  int32_t num_samples = 0;
  int32_t* tokens = nullptr;  // device [B * Hkv, max_seq_len]
  int32_t* counts = nullptr;  // device [B * Hkv]
};
size_t SampledRowsWorkspaceBytes(const SampledRowsParams& p);
cudaError_t SampledRows(const SampledRowsParams& p, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream);

}  // namespace kvsparse::kernels::cuda

#endif  // KVSPARSE_KERNELS_CUDA_SANTA_H_
