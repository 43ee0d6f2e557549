// S2ANTA-prop over precomputed scores on the GPU: the sampler of kernels/santa.h run on scores a
// kernel wrote before (CompressedScores: the sequence's compressed keys), for S2ANTA over
// compressed keys with the ratio correction ("Scores from compressed keys" there). Per
// (sequence, query head) it computes the CPU reference's quantities, spread over the tiles (a
// warp per tile, a block per head where the tiles meet; santa_scores.cu):
//   tile statistics m_t, ell_t (fp32), W_t, Z (double), the fixed-point quotas and their prefix
//   sums, the budgets S_t by systematic rounding with the GQA group's offset
//   (RngTag::kPropRounding of the kv head), then systematic sampling inside each tile
//   (RngTag::kPropTileOffset, one draw per tile), without fused multiply-adds; its
//   floating-point sums run in a fixed parallel order (lanes' partial sums and warp or block
//   reductions and scans: the same result every call), not the reference's ascending one;
// and writes the sampled rows ascending (distinct), as UnionSelected reads them, with each row's
// ratio log-weight log2(c) - s~ log2(e) (c its count), which SelectedRowsDecode adds to the exact
// score: its softmax over the rows is then sum c e^{s - s~} V / sum c e^{s - s~}. The rows equal
// the CPU's except where the sums' rounding (their order, expf's last bit: CUDA's and the C
// library's differ by an ulp at most), or the scores' own (kernels/cuda/compressed_keys.h), moves
// a threshold across a cumulative sum.
//
// The group mixture proposal (kernels/santa.h, "The group mixture proposal"):
// GroupMixtureFromScores turns the G query heads' score rows of each (sequence, kv head) into the
// mixture's scores, and PropFromScores with heads_per_row = G samples those rows once per kv head
// (with the streams of the kv head's first query head, as the CPU reference draws) and writes the
// sample to each of the G heads' outputs: S + 1 rows at most per kv head, each head weighting them
// by its own exact scores against the mixture's.
#ifndef KVSPARSE_KERNELS_CUDA_SANTA_SCORES_H_
#define KVSPARSE_KERNELS_CUDA_SANTA_SCORES_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace kvsparse::kernels::cuda {

struct PropFromScoresParams {
  int32_t batch = 0;         // B
  int32_t num_q_heads = 0;   // H: score rows per sequence
  int32_t num_kv_heads = 0;  // Hkv
  // Query heads each score row serves (1, or G for the group mixture's rows, one per kv head
  // with num_q_heads = num_kv_heads): row h draws with query head h * heads_per_row's streams
  // and its outputs are written to heads h * heads_per_row .. (h + 1) * heads_per_row - 1.
  int32_t heads_per_row = 1;
  // device, shape: [B * H, score_stride]: scaled logits of tokens 0 .. seq_lens[b] - 1.
  const float* scores = nullptr;
  int64_t score_stride = 0;
  const int32_t* seq_lens = nullptr;  // device [B]
  int32_t max_seq_len = 0;            // host bound of seq_lens
  int32_t num_samples = 128;          // S, >= 1
  int32_t tile_size = 256;            // tokens per tile, 1 .. 512
  // Random numbers: streams (seeds[b], tag, 0, head) when seeds (device [B]) is given, else
  // (seed, tag, b, head): as kernels::SantaSelectCpu draws for sequence b of a batch-1 call.
  uint64_t seed = 0;
  const uint64_t* seeds = nullptr;
  // Outputs, device, per query head (H * heads_per_row of them a sequence): rows ascending in
  // indices [B, H', max_selected] (max_selected >= num_samples + 1: systematic rounding can hand
  // out one draw more than S), their number in counts [B, H'], S in budgets [B, H'] (optional),
  // log2 weights [B, H', max_selected].
  int32_t max_selected = 0;
  int32_t* indices = nullptr;
  int32_t* counts = nullptr;
  int32_t* budgets = nullptr;
  float* log2_weights = nullptr;
  // Optional [B, H', max_selected]: each row's draws c (also in its log2 weight), for the
  // estimate's standard error (SelectedRowsParams::row_counts).
  int32_t* row_counts = nullptr;
};

size_t PropFromScoresWorkspaceBytes(const PropFromScoresParams& p);
// Four launches on `stream`, capturable (no allocation, no synchronisation).
// cudaErrorInvalidValue for a bad shape, or B * H over 65535.
cudaError_t PropFromScores(const PropFromScoresParams& p, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream);

// The group mixture's scores: per (sequence b, kv head j), over its G = H / Hkv query heads' rows,
//   mix_t = log((1/G) sum_h softmax(s_h)_t) = logsumexp_h(s_h,t - lse_h) - ln G,
//   lse_h = m_h + ln sum_t e^{s_h,t - m_h},
// in fp32 (the CPU reference, kernels::GroupMixtureScores, in float64: the two agree to float
// rounding); -inf where no head has mass. Two launches (each head's lse by chunks of tokens, then
// the mixture), capturable.
struct GroupMixtureParams {
  int32_t batch = 0;              // B
  int32_t num_q_heads = 0;        // H
  int32_t num_kv_heads = 0;       // Hkv, dividing H with H / Hkv <= 8
  const float* scores = nullptr;  // device, shape: [B * H, score_stride]
  int64_t score_stride = 0;
  const int32_t* seq_lens = nullptr;  // device [B]
  int32_t max_seq_len = 0;            // host bound of seq_lens, at most 2^20
  float* mixture = nullptr;           // device, shape: [B * Hkv, mixture_stride]
  int64_t mixture_stride = 0;
};

size_t GroupMixtureWorkspaceBytes(const GroupMixtureParams& p);
// cudaErrorInvalidValue for a bad shape.
cudaError_t GroupMixtureFromScores(const GroupMixtureParams& p, void* workspace,
                                   size_t workspace_bytes, cudaStream_t stream);

// A uniform floor under a proposal (kernels::ProposalFloor, the defensive mixture of
// SantaParams::uniform_floor): each row's scores s_0 .. s_{n-1} (n = seq_lens[b] of its sequence)
// replaced in place by log((1 - a) softmax(s)_t + a / n), so that PropFromScores run on them draws
// from the mixture and weighs each row by e^{s - log p}. The row's max and sum in fp32 chunks, the
// chunks combined and each score turned in float64 as the CPU reference does (the two agree to
// float rounding). Tokens past n are not touched. Two launches, capturable.
struct ProposalFloorParams {
  int32_t batch = 0;         // B
  int32_t rows_per_seq = 0;  // score rows a sequence: H (per-head proposals) or Hkv (mixture)
  float* scores = nullptr;   // device, shape: [B * rows_per_seq, score_stride], in place
  int64_t score_stride = 0;
  const int32_t* seq_lens = nullptr;  // device [B]
  int32_t max_seq_len = 0;            // host bound of seq_lens, at most 2^20
  float floor = 0.f;                  // a in (0, 1)
};

size_t ProposalFloorWorkspaceBytes(const ProposalFloorParams& p);
// cudaErrorInvalidValue for a bad shape or a floor outside (0, 1).
cudaError_t ProposalFloorOnScores(const ProposalFloorParams& p, void* workspace,
                                  size_t workspace_bytes, cudaStream_t stream);

}  // namespace kvsparse::kernels::cuda

#endif  // KVSPARSE_KERNELS_CUDA_SANTA_SCORES_H_
