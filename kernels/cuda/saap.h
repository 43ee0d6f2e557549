// SAAP on the GPU (the CPU reference and the maths: kernels/saap.h). Two kernels:
//   SaapAssignKeys  each key's bucket, as SaapAssignKey: un-RoPE at its position, the nearest
//                   unit centroid by dot product, ties to the lower index (kept as the key's
//                   one-word signature, appended once);
//   SaapSelect      per (sequence, kv head): the group's queries un-RoPEd at n - 1, each through
//                   its classifier to softmax probabilities summed over the group, the `probes`
//                   buckets of largest mass (ties to the lower index; a block per (b, j)), then
//                   sink + window + every other token whose key is in one of them, ascending
//                   (chunks of 1024 tokens counted, then compacted, a block each). It writes the
//                   rows as a union (one list per (b, j), shared by the group) and every query
//                   head's positions in it, so the estimate is SelectedRowsDecode's
//                   (kernels/cuda/selected_rows.h), after PlaceRows / FetchRows.
// Both follow the reference's arithmetic order (fp32 dot products accumulated in ascending
// coordinates with separate multiply and add, the RoPE angle and the softmax normaliser in
// double), so buckets and selections equal the CPU's except where a library's expf and the
// device's differ in the last bit at an exact tie of bucket masses.
#ifndef KVSPARSE_KERNELS_CUDA_SAAP_H_
#define KVSPARSE_KERNELS_CUDA_SAAP_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/cuda/selected_rows.h"
#include "kernels/dtype.h"
#include "kernels/saap.h"

namespace kvsparse::kernels::cuda {

// Largest partition and classifier the kernels take (C and hidden live in shared memory).
constexpr int32_t kSaapMaxClusters = 1024;
constexpr int32_t kSaapMaxHidden = 1024;
// Whether the kernels take these partitions (C, hidden and head_dim within their limits).
bool SaapSupports(const SaapWeights& w);

// One layer of the partitions on the device, fp32, the matrices transposed from SaapWeights'
// layout (input-major: a thread per output reads a column, a warp one coalesced row).
struct SaapLayerWeights {
  int32_t num_q_heads = 0, num_kv_heads = 0, head_dim = 0, clusters = 0, hidden = 0;
  float rope_scale = 1.f;
  const float* inv_freq = nullptr;   // [d / 2]
  const float* centroids = nullptr;  // [Hkv, d, C]
  const float* w1 = nullptr;         // [H, d, hidden]
  const float* b1 = nullptr;         // [H, hidden]
  const float* w2 = nullptr;         // [H, hidden, C]
  const float* b2 = nullptr;         // [H, C]
};
// Floats of one layer packed as SaapLayerWeights reads them (inv_freq, centroids, w1, b1, w2,
// b2, each 16-byte aligned), and the packing of layer `layer` of w (host).
size_t SaapLayerFloats(const SaapWeights& w);
void PackSaapLayer(const SaapWeights& w, int32_t layer, std::vector<float>* out);
// The device view of a packed layer at `packed` (device).
SaapLayerWeights SaapLayerView(const SaapWeights& w, const float* packed);

struct SaapAssignParams {
  SaapLayerWeights w;
  int32_t kv_head = 0;   // whose centroids
  int32_t num_keys = 0;  // keys of consecutive positions first_position, first_position + 1, ...
  int64_t first_position = 0;
  DType dtype = DType::kBf16;  // of x
  const void* x = nullptr;     // device, shape: [num_keys, d] contiguous (post-RoPE keys)
  uint32_t* out = nullptr;     // device: the bucket of key i at out[i * out_stride]
  int64_t out_stride = 1;
};
cudaError_t SaapAssignKeys(const SaapAssignParams& p, cudaStream_t stream);

struct SaapSelectParams {
  SaapLayerWeights w;
  int32_t batch = 0;
  DType dtype = DType::kBf16;  // of q
  const void* q = nullptr;     // device, shape: [B, H, d] contiguous (post-RoPE, at n - 1)
  // Key buckets of (b, j): bucket_heads[b * Hkv + j][t * bucket_stride] (device).
  const uint32_t* const* bucket_heads = nullptr;
  int64_t bucket_stride = 1;
  const int32_t* seq_lens = nullptr;  // device [B]
  int32_t max_seq_len = 0;            // host bound of seq_lens (every count <= it)
  int32_t probes = 8;
  int32_t sink_tokens = 128;
  int32_t local_tokens = 128;
  // Outputs: per (b, j) the rows (tokens ascending and count: out.capacity >= max_seq_len), per
  // query head its positions in them ([B, H, max_seq_len], 0 .. count - 1), its row count [B, H]
  // and its budget [B, H] (rows from the buckets, sink and window excluded; optional).
  RowSetTables out;
  int32_t* positions = nullptr;
  int32_t* counts = nullptr;
  int32_t* budgets = nullptr;
};
size_t SaapSelectWorkspaceBytes(const SaapSelectParams& p);
cudaError_t SaapSelect(const SaapSelectParams& p, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream);

}  // namespace kvsparse::kernels::cuda

#endif  // KVSPARSE_KERNELS_CUDA_SAAP_H_
