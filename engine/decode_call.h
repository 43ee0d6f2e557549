// One Decode call of the engine and its result: one layer of one decode step for B sequences.
#ifndef KVSPARSE_ENGINE_DECODE_CALL_H_
#define KVSPARSE_ENGINE_DECODE_CALL_H_

#include <array>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/method.h"
#include "kernels/dtype.h"
#include "kvstore/types.h"

namespace kvsparse::engine {

struct DecodeCall {
  uint32_t layer = 0;
  std::vector<std::string> sequence_ids;  // B
  kernels::DType q_dtype = kernels::DType::kBf16;
  absl::Span<const uint8_t> q;  // [B, H, d] of q_dtype
  // The B, H and d q claims to have (0: take the call's and the sequences'); B must be the number
  // of sequences, H and d the model's. Required with q on the device, whose size the engine
  // cannot see.
  uint32_t q_batch = 0, q_heads = 0, q_dim = 0;
  // Optional new token per sequence, appended to `layer` first: [B, Hkv, d] each, in the
  // sequences' dtype (new_kv_dtype must match it).
  absl::Span<const uint8_t> new_k, new_v;
  kernels::DType new_kv_dtype = kernels::DType::kBf16;
  Method method;
  uint64_t seed = 0;
  // Optional [B]: sequence b draws from SequenceSeed(seed + seed_offsets[b], b) instead of
  // SequenceSeed(seed, b) (a step at position p draws as a captured step does: offset p).
  std::vector<uint64_t> seed_offsets;
  float scale = 0.f;  // 0: 1/sqrt(d); finite and >= 0 (CheckScale)
  bool return_indices = false;
  absl::Time deadline = absl::InfiniteFuture();
  // Optional: true once the caller has gone (its RPC cancelled, or the server shutting down
  // past its grace). The engine checks it with the deadline (CheckLive) before each sequence
  // and between the stages of a step on both backends, so abandoned work stops there.
  std::function<bool()> cancelled;
  // An in-process caller whose q and output live on the GPU backend's device (the PyTorch op):
  // q_device and out_device, [B, H, d] each, contiguous, 16-byte aligned, in q_dtype, which must
  // be the sequences' dtype; `q` stays empty and the result's output is not filled. The call's
  // kernels run after the work enqueued on `stream` (a cudaStream_t; null: the legacy default
  // stream) before the call, and work enqueued there after the call runs after them. Only the
  // GPU backend takes such a call: the engine answers FAILED_PRECONDITION, before anything is
  // appended, when the backend does not support it (the caller then passes q through host
  // memory instead).
  const void* q_device = nullptr;
  void* out_device = nullptr;
  void* stream = nullptr;

  bool on_device() const { return q_device != nullptr; }
  // DEADLINE_EXCEEDED past the deadline, CANCELLED once `cancelled` says so, else OK.
  absl::Status CheckLive() const {
    if (absl::Now() > deadline) return absl::DeadlineExceededError("deadline passed");
    if (cancelled && cancelled()) return absl::CancelledError("the caller cancelled the call");
    return absl::OkStatus();
  }
  // The base seed of sequence b's stream (kernels::SequenceSeed's argument).
  uint64_t SeedOf(size_t b) const {
    return b < seed_offsets.size() ? seed + seed_offsets[b] : seed;
  }
};

// INVALID_ARGUMENT unless a call's or a plan's scale is finite and >= 0 (0: 1/sqrt(d)): the one
// rule for every way in (the server's requests, the op's calls and plans), checked by the engine.
inline absl::Status CheckScale(float scale) {
  if (!(scale >= 0.f) || scale == std::numeric_limits<float>::infinity()) {
    return absl::InvalidArgumentError("scale must be >= 0 and finite (0 = 1/sqrt(d))");
  }
  return absl::OkStatus();
}

struct HeadStats {
  uint32_t sequence_index = 0;
  uint32_t kv_head = 0;
  // Over the group's query heads, counting repeats; except the GPU engine's S2ANTA over compressed
  // keys, whose sampler folds a row's repeats into its weight: its distinct rows per head, summed.
  uint64_t rows_selected = 0;
  // Rows read for the estimate and the selection: distinct, except where the GPU engine reads
  // each query head's rows in place (S2ANTA over compressed keys, per-head proposals): a row two
  // heads select is read, and counted, twice.
  uint64_t rows_fetched = 0;
  uint64_t rows_cached = 0;       // of rows_fetched: found in the GPU's row cache, not fetched
  std::vector<uint64_t> budgets;  // per query head of the group
  std::array<uint64_t, kvstore::kNumTiers> bytes{};  // read from each tier
  uint64_t dense_equivalent_bytes = 0;               // K and V of every row
  std::vector<uint32_t> fetched_tokens;              // with return_indices: the estimate's rows
  // Bernoulli qK^T (S2ANTA with bernoulli_qk_samples): the (query head, K feature) pairs the
  // group's score estimates read, and the K features read for the group (their union); 0 for
  // exact scores, which read all head_dim features of every query head.
  uint64_t key_features_head = 0;
  uint64_t key_features_group = 0;
  // Per query head of the group, the standard error the estimate states of itself, relative to
  // its output's norm (kernels::EstimateFromGathered's draw_standard_errors): S2ANTA's, from its
  // own draws, on the CPU engine, and on the GPU engine's eager calls where each head's rows are
  // read in place (kernels/cuda/selected_rows.h, standard_errors); empty where a method or path
  // states none.
  std::vector<float> standard_error;
  // Per query head of the group, the relative error of its output vAttention's budget promises
  // at probability 1 - delta: epsilon sqrt(b_needed / b) (at most the requested epsilon, below it
  // where the base-rate floor drew more than the bound asked), 0 where the residual was read
  // whole. The bound's own estimate from the base sample, on both engines (the GPU's eager
  // calls; a captured plan's statistics carry no epsilon); empty for other methods.
  std::vector<float> epsilon;
  // Per query head of the group, a certified upper bound on the share of its attention's
  // softmax mass that the rows it used leave out: top-k over compressed keys, from the stored
  // error norms (kernels::MissedMassBound), on the CPU engine; empty elsewhere.
  std::vector<float> missed_mass_bound;
};

struct DecodeTiming {
  double selection_seconds = 0, gather_seconds = 0, compute_seconds = 0, engine_seconds = 0;
  double sync_seconds = 0;  // resident state catch-up (one-off after a prefill)
  // GPU backend: host work after the sync until every copy and kernel of the call is enqueued,
  // and the wait from then until the stream is done (kernels, transfers, wake-up).
  double launch_seconds = 0, wait_seconds = 0;
  // How many calls the selection / gather / compute times stand for: 1 when every call is
  // timed (CPU engine); the GPU backend times one call in GpuOptions::stage_timing_every
  // (its CUDA events cost host time), which then stands for that many, and the others carry 0
  // here and in the stage times.
  double stage_weight = 1;
};

struct DecodeResult {
  std::string output;  // [B, H, d] in q's dtype
  uint32_t num_q_heads = 0, head_dim = 0;
  std::vector<HeadStats> heads;  // [B * Hkv]
  DecodeTiming timing;
  uint64_t sync_bytes = 0;  // rows read to bring resident state up to date (not per-step cost)
  // Why an engine with a GPU backend computed the call on the CPU (its backend's refusal,
  // DecodeBackend::Supports); empty when the backend computed it or the engine has none.
  std::string not_on_backend;
};

}  // namespace kvsparse::engine

#endif  // KVSPARSE_ENGINE_DECODE_CALL_H_
