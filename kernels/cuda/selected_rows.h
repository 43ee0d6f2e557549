// Selected-row attention on the GPU, for methods that pick rows per query head and read K and V
// of only those rows (HashAttention top-k; dense over fetched rows as the no-selection control):
//   1. UnionSelected: per (sequence, kv head), the union of its G query heads' ascending token
//      lists (each row fetched once for the group), and each selected token's position in it;
//   2. PlaceRows (optional): with a row cache of C slots per (sequence, kv head) (consecutive
//      decode steps pick mostly the same rows), finds which union rows the cache holds and
//      where the others go, and lists the ones to fetch;
//   3. FetchRows: copies the K and V rows of a list into a row set (device memory), from
//      wherever they live (DecodeShape's K/V addressing: strided, per-head bases, or paged rows
//      read in place, e.g. the store's pinned host pages), to consecutive rows or to the
//      locations PlaceRows gave;
//   4. SelectedRowsDecode: per query head, exact softmax attention over its own rows (fp32,
//      output in the dtype), optionally with a weight per row (log2_weights).
// Where no row is kept from one step to the next, SelectedRowsDecode can instead read each query
// head's rows in place, by token (SelectedRowsParams::in_place): steps 1-3 are skipped.
// CPU reference: kernels/row_selection.h (EstimateFromGathered with a softmax RowSelection).
#ifndef KVSPARSE_KERNELS_CUDA_SELECTED_ROWS_H_
#define KVSPARSE_KERNELS_CUDA_SELECTED_ROWS_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/decode_params.h"

namespace kvsparse::kernels::cuda {

// The rows of one step for every (sequence b, kv head j), i = b * Hkv + j; each a device pointer
// the caller owns (typically one allocation per sequence holding all its kv heads):
//   tokens[i]: int32 [capacity], ascending; count[i]: one int32, the number of rows;
//   k[i], v[i]: [capacity, head_dim] rows in the dtype, 16-byte aligned.
struct RowSetTables {
  int32_t* const* tokens = nullptr;
  int32_t* const* count = nullptr;
  void* const* k = nullptr;
  void* const* v = nullptr;
  int32_t capacity = 0;  // rows each set can hold
};

// A second row set beside a primary one: a location loc >= 0 is row loc of the primary set (a
// row cache's slot), loc < 0 is row -1 - loc of the second (PlaceRows' overflow rows). Null k / v:
// no second set.
struct SecondRows {
  void* const* k = nullptr;  // per (b, j): [rows, head_dim]
  void* const* v = nullptr;
};

// A row cache for every (b, j): C slots of K and V rows and the tokens they hold.
struct RowCacheTables {
  int32_t* const* tokens = nullptr;  // per (b, j): [C] ascending tokens held
  int32_t* const* slots = nullptr;   // per (b, j): [C], the slot of tokens[x]
  int32_t* const* count = nullptr;   // per (b, j): one int32, tokens held
  void* const* k = nullptr;          // per (b, j): [C, head_dim] rows
  void* const* v = nullptr;
  int32_t capacity = 0;                 // C: slots of every cache (the tables' stride)
  const int32_t* capacities = nullptr;  // optional device [B * Hkv]: slots of each, <= C
};

struct UnionSelectedParams {
  int32_t batch = 0;         // B
  int32_t num_q_heads = 0;   // H
  int32_t num_kv_heads = 0;  // Hkv; G = H / Hkv <= 32
  // device, shape: [B, H, max_selected]: ascending tokens, counts [B, H] of them used.
  const int32_t* indices = nullptr;
  const int32_t* counts = nullptr;
  int32_t max_selected = 0;
  const int32_t* seq_lens = nullptr;  // device [B]: every token < seq_lens[b]
  int32_t max_seq_len = 0;            // host bound of seq_lens
  // The longest union the caller's selections can give, when it knows better than the default
  // min(max_seq_len, G * max_selected) (e.g. the G heads share one selection: max_selected);
  // 0: the default. A union past it is cut there (the caller's promise; never written past).
  int32_t max_union = 0;
  RowSetTables out;  // tokens and count written; capacity >= the longest union above
  // device, shape: [B, H, max_selected]: position of indices[b, h, i] in the union of (b, h / G).
  int32_t* positions = nullptr;
};
size_t UnionSelectedWorkspaceBytes(const UnionSelectedParams& p);
cudaError_t UnionSelected(const UnionSelectedParams& p, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream);

// PlaceRows: one step's rows against a row cache, per (b, j). A union row the cache holds stays
// in its slot (a hit); the others (misses), in token order, take the slots whose rows this step
// did not select, and once those run out go to overflow rows (location -1 - m for the m-th miss
// without a slot; not kept). Afterwards the cache holds exactly the union rows with a slot.
// Writes the list of rows to fetch (fetch.tokens / fetch.count: the misses, ascending, and
// fetch_dest: their locations, for FetchRows), rewrites `positions` from union positions to
// locations (for SelectedRowsDecode with the overflow rows as SecondRows), and the hits per
// (b, j). With C = 0 (no cache) every row is a miss, fetched to overflow row = union position.
struct PlaceRowsParams {
  int32_t batch = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  RowSetTables rows;     // the step's union: tokens and count read; capacity = longest union
  RowCacheTables cache;  // tokens, slots, count updated (null tables when capacity is 0)
  int32_t* positions = nullptr;     // device [B, H, max_selected], as UnionSelected wrote them
  const int32_t* counts = nullptr;  // device [B, H]
  int32_t max_selected = 0;
  RowSetTables fetch;                    // tokens and count written (capacity >= rows.capacity)
  int32_t* const* fetch_dest = nullptr;  // per (b, j): [rows.capacity] locations written
  int32_t* hits = nullptr;               // optional device [B * Hkv]: hits written
};
size_t PlaceRowsWorkspaceBytes(const PlaceRowsParams& p);
cudaError_t PlaceRows(const PlaceRowsParams& p, void* workspace, size_t workspace_bytes,
                      cudaStream_t stream);

struct FetchRowsParams {
  // Where the rows live: batch, num_kv_heads, head_dim, dtype and the K/V addressing (k / v +
  // kv strides, k_heads / v_heads, or k_pages / v_pages). q, out and seq_lens are not used.
  DecodeShape shape;
  // Which rows: out.tokens / out.count of every (b, j) (as UnionSelected writes them), or, with
  // all_tokens, tokens 0 .. seq_lens[b] - 1 (then seq_lens and max_seq_len are used, and tokens
  // and count are written).
  bool all_tokens = false;
  const int32_t* seq_lens = nullptr;
  int32_t max_seq_len = 0;
  int32_t max_rows = 0;  // host bound of every count (grid size)
  RowSetTables out;      // k and v rows written
  // Optional: row r of the list goes to location dest[i][r] (PlaceRows' fetch_dest) instead of
  // row r: out.k / out.v row dest, or for dest < 0 row -1 - dest of `second`.
  const int32_t* const* dest = nullptr;
  SecondRows second;
  // Read row r of (b, j)'s list from row r of the source addressing instead of its token's row:
  // the rows were staged in list order (rows gathered from a store whose pages the GPU cannot
  // read, through shape's k_heads / v_heads). Not with all_tokens.
  bool source_by_position = false;
};
cudaError_t FetchRows(const FetchRowsParams& p, cudaStream_t stream);

// WarmPagedRows: one 4-byte read at the start of every page of paged rows, tokens 0 ..
// seq_lens[b] - 1 of every (b, j). Where the pages are host memory read over the host link, the
// first read of a page pays for its address translation: on the H200 here a FetchRows of 2 MB of
// rows scattered over a layer's 537 MB took 82-88 us with cold translations and 46-47 us once
// each page had been read (docs/PERF.md, "Cold translations"). Reading each page beforehand, on a
// side stream while other work runs, leaves the later FetchRows the warm cost. Reads that wait
// on translations hold the memory system's slots meanwhile: with thousands in flight a kernel
// streaming device memory beside them ran at half speed; `chains` bounds them (at most that many
// in flight: each chain reads its pages one after another, 18 pages/us at 64 chains here, with
// the stream beside it 3% slower). Pages are taken in the order (page, b, j), so a warm that
// stops early has covered every (b, j) evenly. No output but the optional counts. Capturable.
struct WarmPagedRowsParams {
  int32_t batch = 0;
  int32_t num_kv_heads = 0;
  PagedRows pages;                    // tables [B * Hkv] and page_shift used
  const int32_t* seq_lens = nullptr;  // device [B]
  int32_t max_seq_len = 0;            // host bound of every length
  int32_t chains = 0;                 // > 0: reads in flight at most; 0: every page at once
  // Optional: stop (before the next page) once *stop >= stop_at, e.g. when the caller's stream
  // reaches the layer whose pages these are (device; read each page).
  const int32_t* stop = nullptr;
  int32_t stop_at = 0;
  int32_t* pages_read = nullptr;  // optional device [B * Hkv]: pages read, added (zero it first)
};
cudaError_t WarmPagedRows(const WarmPagedRowsParams& p, cudaStream_t stream);

struct SelectedRowsParams {
  // q, out, batch, heads, head_dim, dtype, scale; in_place, also the K/V addressing and seq_lens
  // (the rows are read from there).
  DecodeShape shape;
  RowSetTables rows;  // k and v of each (b, j) (not in_place)
  SecondRows second;  // optional (PlaceRows' overflow rows; not in_place)
  // device [B, H, max_selected]: rows of query head (b, h) are the rows of (b, h / G) at
  // locations positions[b, h, 0 .. counts[b, h]).
  const int32_t* positions = nullptr;
  const int32_t* counts = nullptr;
  int32_t max_selected = 0;
  // Optional, device [B, H, max_selected]: added to each row's score in log2 units (the row's
  // weight w in w e^{s} / sum w e^{s}: S2ANTA's ratio weights, santa_scores.h), beside positions.
  const float* log2_weights = nullptr;
  // Rows read in place, instead of from rows / second: `positions` are tokens (each below
  // seq_lens[b]; others are skipped) of the shape's K/V addressing, e.g. the store's mapped host
  // pages over the host link. No union and no fetch before it: a token two heads of a group
  // select is read twice (S2ANTA's samples overlap little: their union was 99% of their sum
  // inside vLLM), and no row set is held. Zero-copy reads need many in flight, so a block takes
  // at most the rows it loads in one round: more splits, the splits of a head one thread block
  // cluster that merges them (no workspace; sm_90).
  bool in_place = false;
  // With in_place: the G query heads of each (b, j) select the same rows (S2ANTA's group mixture:
  // positions and counts of head b, j G stand for all G; each head keeps its own log2 weights),
  // read once for the group: a block per (b, j) and split scores each row against the G queries.
  // Its splits are not a cluster: their parts go to the workspace (SelectedRowsWorkspaceBytes)
  // and a merge kernel combines them.
  bool shared_rows = false;
  // Optional with in_place: per (b, j), one int32 written: the rows read for its G heads.
  int32_t* const* rows_read = nullptr;
  // Optional, device [B, H]: each query head's standard error of its estimate relative to its
  // output's norm, its rows taken as draws spread over the tokens in order (S2ANTA's systematic
  // samples), as the CPU reference states it for such draws (kernels/row_selection.h,
  // EstimateFromGathered: successive differences of each draw's linearised ratio deviation).
  // Stated where each head's rows are read in place (not shared_rows) and at most 8 rounds of
  // them (kMaxClusterSplits x 64 rows at d = 128, 128 at d = 64, 32 at d = 256): the splits then
  // hold one round each, kept in shared memory; NaN elsewhere. Its own kernel variant (the
  // flagship's captured steps leave it null and run the kernel without it).
  float* standard_errors = nullptr;
  // Optional with standard_errors, device [B, H, max_selected] beside positions: each row's
  // draws c (its weight's count; 1 when null).
  const int32_t* row_counts = nullptr;
};
size_t SelectedRowsWorkspaceBytes(const SelectedRowsParams& p);
cudaError_t SelectedRowsDecode(const SelectedRowsParams& p, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream);

}  // namespace kvsparse::kernels::cuda

#endif  // KVSPARSE_KERNELS_CUDA_SELECTED_ROWS_H_
