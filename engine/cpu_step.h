// One sequence of a Decode call on the CPU engine. The steps every method shares are written here
// once: sync the resident state and append the new token, the batch-1 problem, every K row for
// a method that scores them, the gather of exactly the selected rows, the estimate, the
// statistics and stage times. The method's own part is its MethodUnit::Select
// (engine/methods/<method>.cc), which reads what it needs through this class.
//
// The CPU engine is the reference the GPU backend is tested against, and it serves what the GPU
// backend does not take.
#ifndef KVSPARSE_ENGINE_CPU_STEP_H_
#define KVSPARSE_ENGINE_CPU_STEP_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/decode_call.h"
#include "engine/engine_options.h"
#include "engine/resident_cache.h"
#include "engine/row_source.h"
#include "kernels/compressed_keys.h"
#include "kernels/decode_problem.h"
#include "kernels/hash_topk.h"
#include "kernels/row_selection.h"

namespace kvsparse::engine {

class MethodUnit;  // engine/methods/method_unit.h: a unit includes this header, not the reverse

// Rows of the kv heads of one sequence, fetched for one stage: per head, tokens (ascending) and
// where their K / V rows sit in k / v ([total, d], the sequence's dtype).
struct FetchedRows {
  std::vector<std::vector<uint32_t>> tokens;  // [Hkv]
  std::vector<size_t> offset;                 // [Hkv] first row of each head
  std::vector<uint8_t> k, v;
  size_t total = 0;

  const uint8_t* KRow(uint32_t j, size_t i, size_t row) const {
    return k.data() + (offset[j] + i) * row;
  }
  const uint8_t* VRow(uint32_t j, size_t i, size_t row) const {
    return v.data() + (offset[j] + i) * row;
  }
  // Index of token t in head j's list; REQUIRES: present.
  size_t Find(uint32_t j, uint32_t t) const;
  // Offsets and total from the token lists.
  void Layout();
};

// d floats of a row of dtype t.
void RowToFloat(const uint8_t* row, int d, kernels::DType t, float* out);
// scale * q . row, fp32 in ascending order (the arithmetic of the kernels' references).
float Logit(const float* q, const uint8_t* row, int d, kernels::DType t, float scale);

class CpuStep {
 public:
  // What the engine lends every step. REQUIRES: all of it outlives the step.
  struct Env {
    RowSource* source = nullptr;
    ResidentCache* cache = nullptr;
    SignatureMaker* signatures = nullptr;
    const EngineOptions* options = nullptr;
  };
  // Sequence `index` of `call`, described by desc as the store held it before the call's
  // append.
  CpuStep(const Env& env, const DecodeCall& call, uint32_t index, const SequenceDesc& desc);
  CpuStep(const CpuStep&) = delete;
  CpuStep& operator=(const CpuStep&) = delete;

  // Decodes the sequence with unit's selection: its output goes to its place in
  // result->output, its Hkv HeadStats are appended to result->heads, its times added.
  absl::Status Run(const MethodUnit& unit, DecodeResult* result);

  // ---- What a unit's Select reads. ----
  const Method& method() const { return call_.method; }
  const SequenceDesc& desc() const { return desc_; }
  const EngineOptions& options() const { return *env_.options; }
  uint32_t layer() const { return call_.layer; }
  // kernels::SequenceSeed(call seed, index): the sequence's random stream.
  uint64_t seed() const { return seed_; }
  int32_t length() const { return n_; }
  // Batch 1, q in the sequence's dtype; k is set when the unit's plan reads every key.
  const kernels::DecodeProblem& problem() const { return p_; }
  // q of every head as floats, [H][d].
  std::vector<float> QueryFloats() const;
  // Signatures of every query head (`bits` each) against the resident key signatures; the key
  // signatures read are counted in the statistics.
  const kernels::SignatureView& Signatures(int32_t bits);
  // The resident key signatures alone (no query signatures: view.q is null), counted as read.
  const kernels::SignatureView& KeySignatures(int32_t bits);
  // The resident compressed keys of every kv head ([Hkv]), counted as read (device bytes).
  // REQUIRES: the placement keeps them (placement.compressed_key_bits > 0).
  absl::Span<const kernels::CompressedKeysView> CompressedKeys();
  // Reads the K and V rows of tokens[j] (ascending, distinct) of every kv head j for the
  // selection itself, resident halves in place; counted as gather time and fetched rows. The
  // gather after the selection reads only the selected rows not among them.
  absl::StatusOr<const FetchedRows*> FetchForSelection(std::vector<std::vector<uint32_t>> tokens);
  // Bernoulli qK^T's K-feature reads of kv head j (HeadStats::key_features_head / _group).
  void CountKeyFeatures(int32_t j, uint64_t head_pairs, uint64_t group_features) {
    stats_[j].key_features_head = head_pairs;
    stats_[j].key_features_group = group_features;
  }
  // vAttention's promised error of each query head of kv head j (HeadStats::epsilon).
  void StateEpsilon(int32_t j, std::vector<float> per_head) {
    stats_[j].epsilon = std::move(per_head);
  }
  // Per query head ([H]), the log-sum-exp of upper bounds of the logits its selection left out
  // (kernels::LogSumExpOutside): after the estimate, each head's HeadStats::missed_mass_bound
  // from it and the exact logits of the rows it used.
  void StateLeftOut(std::vector<double> log_left_out) { log_left_out_ = std::move(log_left_out); }

 private:
  // The resident state synced, the new token appended to it.
  absl::Status Sync(DecodeResult* result);
  void MakeProblem();
  // Every K row for the selection: resident, or fetched head by head in chunks.
  absl::Status ProvideKeys();
  // The selected rows not read for the selection, in one Gather for all heads, assembled per
  // head in selection order.
  absl::Status GatherSelected(const kernels::RowSelection& sel);
  // standard_error: also each query head's HeadStats::standard_error.
  absl::Status Estimate(const kernels::RowSelection& sel, bool standard_error,
                        DecodeResult* result);
  // HeadStats::missed_mass_bound of every query head, from log_left_out_ and the gathered K rows.
  void StateMissedMass(const kernels::RowSelection& sel);

  const Env env_;
  const DecodeCall& call_;
  const uint32_t index_;
  const SequenceDesc& desc_;
  const kvstore::ModelShape& shape_;
  const int32_t H_, hkv_, G_, d_;
  const size_t row_;
  const uint64_t seed_;
  const size_t src_tier_;

  std::optional<ResidentCache::Handle> handle_;
  ResidentLayer* res_ = nullptr;
  int32_t n_ = 0;
  std::vector<uint8_t> q_, out_;
  kernels::DecodeProblem p_;
  std::vector<HeadStats> stats_;
  std::vector<uint8_t> k_all_;  // every K row, when the selection needs them, not resident
  std::vector<uint32_t> qsig_;
  std::vector<kernels::CompressedKeysView> compressed_;
  kernels::SignatureView view_;
  FetchedRows base_;  // read for the selection
  FetchedRows rows_;  // the estimate's rows, per head in selection order
  double gather_seconds_ = 0;
  std::vector<double> log_left_out_;  // StateLeftOut
};

}  // namespace kvsparse::engine

#endif  // KVSPARSE_ENGINE_CPU_STEP_H_
