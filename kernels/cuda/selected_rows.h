// Selected-row attention on the GPU, for methods that pick rows per query head and read K and V
// of only those rows (HashAttention top-k; dense over fetched rows as the no-selection control):
//   1. UnionSelected: per (sequence, kv head), the union of its G query heads' ascending token
//      lists (each row fetched once for the group), and each selected token's position in it;
//   2. FetchRows: copies the K and V rows of each union list into a row set (device memory),
//      from wherever they live (DecodeShape's K/V addressing: strided, per-head bases, or paged
//      rows read in place, e.g. the store's pinned host pages) or, when given, from the row set
//      of an earlier step (a cache of recently fetched rows: consecutive decode steps pick
//      mostly the same rows, so only the new ones cross the host link);
//   3. SelectedRowsDecode: per query head, exact softmax attention over its own rows of the row
//      set (fp32, output in the dtype).
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
  RowSetTables out;  // tokens and count written; capacity >= min(max_seq_len, G * max_selected)
  // device, shape: [B, H, max_selected]: position of indices[b, h, i] in the union of (b, h / G).
  int32_t* positions = nullptr;
};
size_t UnionSelectedWorkspaceBytes(const UnionSelectedParams& p);
cudaError_t UnionSelected(const UnionSelectedParams& p, void* workspace, size_t workspace_bytes,
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
  // Optional row sets of an earlier step (tokens, count, k, v of each (b, j); null tables or a
  // null tokens[i]: none): a token found there is copied from it instead of the source.
  RowSetTables cache;
  int32_t* hits = nullptr;  // optional device [B * Hkv]: rows taken from the cache (added)
};
cudaError_t FetchRows(const FetchRowsParams& p, cudaStream_t stream);

struct SelectedRowsParams {
  DecodeShape shape;  // q, out, batch, heads, head_dim, dtype, scale (K/V fields not used)
  RowSetTables rows;  // k and v of each (b, j)
  // device [B, H, max_selected]: rows of query head (b, h) are rows.k/v[b * Hkv + h / G] at
  // positions[b, h, 0 .. counts[b, h]).
  const int32_t* positions = nullptr;
  const int32_t* counts = nullptr;
  int32_t max_selected = 0;
};
size_t SelectedRowsWorkspaceBytes(const SelectedRowsParams& p);
cudaError_t SelectedRowsDecode(const SelectedRowsParams& p, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream);

}  // namespace kvsparse::kernels::cuda

#endif  // KVSPARSE_KERNELS_CUDA_SELECTED_ROWS_H_
