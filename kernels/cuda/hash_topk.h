// HashAttention on the GPU: SimHash signatures of new keys and queries, and the sink + local
// window + Hamming top-k selection (CPU references: kernels/hash_signatures.h, hash_topk.h).
// Both reproduce the CPU results exactly: the signature dot products are evaluated in the
// reference's order without fused multiply-add, and the top-k rule is a total order
// (similarity descending, then token index ascending).
#ifndef KVSPARSE_KERNELS_CUDA_HASH_TOPK_H_
#define KVSPARSE_KERNELS_CUDA_HASH_TOPK_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/dtype.h"
#include "kernels/hash_signatures.h"
#include "kernels/sink_local_topk.h"

namespace kvsparse::kernels::cuda {

// SimHash signatures of num_seqs * heads vectors (kernels/hash_signatures.h: max-norm augmented
// keys, aug = 0 for queries).
struct SimHashSignParams {
  int32_t num_seqs = 0;           // B
  int32_t heads = 0;              // vectors per sequence: Hkv for keys, H for queries
  int32_t group = 1;              // vectors per signature head: 1 for keys, G for queries
  int32_t dim = 0;                // d (any positive value)
  int32_t bits = 32;              // multiple of 32 in [32, 256]
  DType dtype = DType::kBf16;     // of x: bf16, fp16 or fp32
  const void* x = nullptr;        // device, shape: [B, heads, d] contiguous
  const float* planes = nullptr;  // device, shape: [heads / group, bits, d + 1] (MakeSimHashPlanes)
  // device, shape: [heads / group]: M of each signature head; nullptr for queries (aug = 0).
  const float* max_norm = nullptr;
  // Output word w of vector (b, j) goes to
  //   out + b * out_batch_stride + j * out_head_stride + pos * out_token_stride + w
  // with pos = positions[b] (device, [B]) or 0 when positions is nullptr. E.g. appending the new
  // key of each sequence to a [B, Hkv, n_max, words] cache: strides {Hkv*n_max*words,
  // n_max*words, words} and positions = the old lengths; queries: {H*words, words, 0}, nullptr.
  uint32_t* out = nullptr;
  int64_t out_batch_stride = 0;
  int64_t out_head_stride = 0;
  int64_t out_token_stride = 0;
  const int32_t* positions = nullptr;
};

cudaError_t SimHashSign(const SimHashSignParams& p, cudaStream_t stream);

// Learned signatures (kernels/hash_signatures.h's MLPs, bit for bit HashMlp::Sign) of
// num_seqs * heads vectors; vector (b, j) goes through MLP j / group of `mlps`.
constexpr int32_t kLearnedMaxLinear = 8;  // linears per MLP the kernel takes
constexpr int32_t kLearnedMaxDim = 512;   // widest layer (input, hidden or bits) it takes
struct LearnedSignParams {
  int32_t num_seqs = 0;                      // B
  int32_t heads = 0;                         // vectors per sequence
  int32_t group = 1;                         // vectors per MLP
  int32_t num_linear = 0;                    // N in [1, kLearnedMaxLinear]
  int32_t dims[kLearnedMaxLinear + 1] = {};  // dims[0] = d, dims[N] = bits (32..256, x32)
  DType dtype = DType::kBf16;                // of x
  const void* x = nullptr;                   // device, shape: [B, heads, d] contiguous
  // device: MLP m at mlps + m * mlp_floats (LearnedMlpFloats(dims)); in it, per linear i, the
  // weight transposed to [dims[i]][dims[i+1]] (input-major) and then the bias [dims[i+1]].
  const float* mlps = nullptr;
  // Output as SimHashSignParams.
  uint32_t* out = nullptr;
  int64_t out_batch_stride = 0;
  int64_t out_head_stride = 0;
  int64_t out_token_stride = 0;
  const int32_t* positions = nullptr;
};

// Floats of one packed MLP of these dims.
int64_t LearnedMlpFloats(const int32_t* dims, int32_t num_linear);
// Appends `m` to `out` in the packed layout above (host).
void AppendPackedMlp(const HashMlp& m, std::vector<float>* out);
// Whether LearnedSign takes MLPs of these dims (linears and widths within its limits).
bool LearnedSignSupports(const std::vector<int32_t>& dims);

cudaError_t LearnedSign(const LearnedSignParams& p, cudaStream_t stream);

// Sink + local window + top-k by Hamming similarity, per (sequence, query head).
struct HashTopKLaunchParams {
  int32_t batch = 0;                 // B
  int32_t num_q_heads = 0;           // H
  int32_t key_heads = 0;             // signature heads of the keys: Hkv (h / G) or H (h)
  int32_t bits = 32;                 // multiple of 32 in [32, 256]
  const uint32_t* q_sigs = nullptr;  // device, shape: [B, H, bits / 32]
  // device; key signature of (b, j, t) at k_sigs + b * k_batch_stride + j * k_head_stride +
  // t * k_token_stride (words).
  const uint32_t* k_sigs = nullptr;
  // Optional, device, shape: [B * key_heads]: when set, the key signatures of (b, j) start at
  // k_sig_heads[b * key_heads + j] (k_sigs, k_batch_stride and k_head_stride are not used).
  const uint32_t* const* k_sig_heads = nullptr;
  int64_t k_batch_stride = 0;
  int64_t k_head_stride = 0;
  int64_t k_token_stride = 0;
  const int32_t* seq_lens = nullptr;  // device, shape: [B]
  int32_t max_seq_len = 0;            // host upper bound of seq_lens
  FixedSet fixed;                     // kernels/sink_local_topk.h
  // device, shape: [B, H, max_out] with max_out = MaxSelected(): the chosen tokens, ascending,
  // in the first counts[b, h] entries (the rest untouched).
  int32_t* indices = nullptr;
  int32_t* counts = nullptr;   // device, shape: [B, H]
  int32_t* budgets = nullptr;  // optional device [B, H]: top-k rows chosen (without sink/window)

  int32_t MaxSelected() const;
};

// Scratch: per (b, h) and chunk of the sequence a similarity histogram and the chunk's offsets
// into the output, and per (b, h) the threshold.
size_t HashTopKWorkspaceBytes(const HashTopKLaunchParams& p);
cudaError_t HashTopK(const HashTopKLaunchParams& p, void* workspace, size_t workspace_bytes,
                     cudaStream_t stream);

}  // namespace kvsparse::kernels::cuda

#endif  // KVSPARSE_KERNELS_CUDA_HASH_TOPK_H_
