// RowSelection: the one result type of every sparse method's *selection* stage, and the
// *estimate* stage that turns selected rows into the attention output.
//
// The contract with the decode worker: for each (sequence b, kv head), the selection lists the
// distinct token indices (ascending) whose K and/or V rows must be fetched: the union over the
// GQA group's G query heads. Per query head of the group it carries how often each row was
// selected (sampling with replacement selects a row several times) and the weight the estimator
// gives it, so the estimate needs nothing but the gathered rows and q.
//
// Two estimator kinds cover every method:
//   kLinear  (SANTA / S2ANTA, any allocation):  out_h = sum_r w[h,r] V_r.
//            Scores were consumed by the selection; only V rows are fetched.
//   kSoftmax (HashAttention top-k, vAttention):  out_h = sum_r w[h,r] e^{s_hr} V_r /
//                                                       sum_r w[h,r] e^{s_hr},
//            s_hr = scale * q_h . K_r: the importance-weighted softmax of vAttention Eq. 3 with
//            w = 1 / (inclusion probability). K and V rows are fetched. Rows with w = 0 take no
//            part (e.g. vAttention's base-sample rows, read only to set the budget).
// Every CPU reference in kernels/ is thread-compatible: no global state, so concurrent calls
// that write distinct outputs are safe.
#ifndef KVSPARSE_KERNELS_ROW_SELECTION_H_
#define KVSPARSE_KERNELS_ROW_SELECTION_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/decode_problem.h"

namespace kvsparse::kernels {

enum class EstimateKind : uint8_t {
  kLinear = 0,
  kSoftmax = 1,
};

// One query head's selection, as a per-head sampler produces it.
struct HeadRows {
  std::vector<int32_t> tokens;  // ascending, distinct
  std::vector<int32_t> counts;  // [tokens.size()] times selected (0: read but not used)
  std::vector<float> weights;   // [tokens.size()] estimator weight w[h, r]
  int64_t budget = 0;           // per method: S drawn, k chosen, or the vAttention sample size b

  void Clear() {
    tokens.clear();
    counts.clear();
    weights.clear();
    budget = 0;
  }
  // Appends one row; tokens must arrive in ascending order.
  void Push(int32_t token, int32_t count, float weight) {
    tokens.push_back(token);
    counts.push_back(count);
    weights.push_back(weight);
  }
};

// The rows of one (sequence, kv head): the union over its G query heads.
struct KvHeadSelection {
  std::vector<int32_t> tokens;       // [R] ascending, distinct: the rows to fetch
  std::vector<int32_t> counts;       // [R] sum over the group of head_counts (0: budget-only row)
  std::vector<int32_t> head_counts;  // [G, R] row-major: times query head g selected row r
  std::vector<float> weights;        // [G, R] row-major: estimator weight (0 where unused)
  std::vector<int64_t> budgets;      // [G] per query head: S, k or b (see the method's header)

  int32_t num_rows() const { return static_cast<int32_t>(tokens.size()); }
  // Rows selected counting repeats, summed over the group (HeadStats.rows_selected).
  int64_t rows_selected() const;
};

struct RowSelection {
  EstimateKind kind = EstimateKind::kLinear;
  int32_t batch = 0;
  int32_t num_kv_heads = 0;
  int32_t group_size = 0;
  std::vector<KvHeadSelection> heads;  // [B * Hkv], index b * Hkv + kv_head
  // The draws were spread over the tokens in order (stratified or systematic designs, prop's and
  // flash's tiles), not drawn independently: the stated standard error (EstimateFromGathered)
  // then comes from successive differences. Reset leaves it false.
  bool ordered_draws = false;

  bool needs_k_rows() const { return kind == EstimateKind::kSoftmax; }
  const KvHeadSelection& at(int32_t b, int32_t kv_head) const {
    return heads[static_cast<size_t>(b) * num_kv_heads + kv_head];
  }
  KvHeadSelection& at(int32_t b, int32_t kv_head) {
    return heads[static_cast<size_t>(b) * num_kv_heads + kv_head];
  }
  // Sizes `heads` for a problem and clears every entry.
  void Reset(EstimateKind k, int32_t b, int32_t hkv, int32_t g);
};

// Merges the G query heads' rows of one kv head into `out` (sorted union; a head that did not
// select a row gets count 0 and weight 0 there). shape: heads [G].
void MergeGroup(absl::Span<const HeadRows> heads, KvHeadSelection* out);

// Dense attention as a selection: every row of every (sequence, kv head), kind kSoftmax, weight
// 1, budgets[g] = n. Reads only p's shapes and seq_lens.
[[nodiscard]] absl::Status SelectAllRows(const DecodeProblem& p, RowSelection* sel);

// Rows of one (sequence, kv head), gathered in the order of KvHeadSelection::tokens: row r of
// K starts at k + r * row_stride elements (dtype of the problem). k may be null for kLinear.
struct GatheredRows {
  const void* k = nullptr;  // shape: [R, d], row stride row_stride
  const void* v = nullptr;  // shape: [R, d], row stride row_stride
  int64_t row_stride = 0;   // elements between consecutive rows (>= d)
};

// The estimate stage on gathered rows: writes p.out ([B, H, d], p.dtype) from p.q and the rows
// in `rows` ([B * Hkv], index b * Hkv + kv_head). p.k and p.v are not read. fp32 accumulation.
// A query head with no used row (sum of weights 0) gets zeros.
//
// draw_standard_errors (optional, [B * H] on return, index b * H + h): each query head's
// standard error of its output relative to the output's norm, sqrt(Var^) / |out|, estimated from
// its own rows taken as m = sum of its counts draws, a draw of row r weighing a_r = w_r / c_r
// (kSoftmax: times e^{s_r}), each with a value z whose mean over the draws is the output's
// deviation:
//   kLinear   out = mean over the draws of m a V:  z = m a V - out
//   kSoftmax  out = sum a V / L, L = sum_draws a:   z = m a (V - out) / L (the ratio linearised:
//             the delta method, the self-normalised importance estimator's usual estimate)
// Var^ = sum_draws |z|^2 / (m (m - 1)) for independent draws; for draws spread over the tokens
// in order (sel.ordered_draws: stratified, systematic, prop's and flash's tiles) sum over the m -
// 1 successive draws in token order of |z_{k+1} - z_k|^2 / 2, over m (m - 1): the successive-
// difference estimator of systematic sampling, which keeps most of what the design removes.
// Var^ estimates E|out - E out|^2 (the trace of the covariance): unbiased for i.i.d. draws
// (kLinear), consistent for the ratio, an overstatement for the ordered designs
// (kernels/santa_compressed_test.cc, SantaStandardErrorTest, measures both). It describes a
// selection whose every used row is a draw (S2ANTA's): rows chosen for certain (a fixed set) are
// no draws. Infinity where fewer than two draws stand behind a non-zero output; 0 for a zero
// output with no spread.
[[nodiscard]] absl::Status EstimateFromGathered(const DecodeProblem& p, const RowSelection& sel,
                                                absl::Span<const GatheredRows> rows,
                                                std::vector<float>* draw_standard_errors = nullptr);

// The same, reading the selected rows in place from p.k / p.v (the embedded, zero-copy case).
[[nodiscard]] absl::Status EstimateInPlace(const DecodeProblem& p, const RowSelection& sel,
                                           std::vector<float>* draw_standard_errors = nullptr);

}  // namespace kvsparse::kernels

#endif  // KVSPARSE_KERNELS_ROW_SELECTION_H_
