// A small C ABI over the CUDA launchers, for harnesses that load the kernels with dlopen/ctypes
// (tests/bench/kernel_bench.py). Every function returns a cudaError_t value (0 = success) or a
// byte count; pointers are device pointers; `stream` is a cudaStream_t (e.g. torch's current
// stream). Nothing here allocates or synchronises.
#ifndef KVSPARSE_KERNELS_CUDA_CAPI_H_
#define KVSPARSE_KERNELS_CUDA_CAPI_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Mirrors kvsparse::kernels::cuda::DecodeShape with fixed-width fields.
typedef struct KvsDecodeArgs {
  int32_t batch, num_q_heads, num_kv_heads, head_dim;
  int32_t dtype;  // kvsparse::kernels::DType: 1 = fp16, 2 = bf16
  int32_t max_seq_len;
  const void* q;  // [B, H, d]
  const void* k;  // element strides below
  const void* v;
  int64_t batch_stride, head_stride, token_stride;
  const int32_t* seq_lens;  // [B]
  float scale;
  void* out;  // [B, H, d]
} KvsDecodeArgs;

// method: 0 = dense, 1 = SANTA iid, 2 = S2ANTA-prop, 3 = S2ANTA-flash, 5 = dense with two block
// waves (4, the former fp16-stash prop, is gone: prop keeps no stash).
size_t kvs_decode_workspace_bytes(const KvsDecodeArgs* args, int32_t method, int32_t samples);
// rows_read: optional [B, Hkv] int32 accumulator of distinct V rows read (sampling methods).
int32_t kvs_decode(const KvsDecodeArgs* args, int32_t method, int32_t samples, uint64_t seed,
                   void* workspace, size_t workspace_bytes, int32_t* rows_read, void* stream);

// HashAttention top-k (see hash_topk.h): q_sigs [B, H, words], k_sigs [.., n, words] with word
// strides. With workspace == NULL it returns the workspace bytes it needs (no launch).
int32_t kvs_hash_topk(int32_t batch, int32_t num_q_heads, int32_t num_kv_heads, int32_t bits,
                      const uint32_t* q_sigs, const uint32_t* k_sigs, int64_t k_batch_stride,
                      int64_t k_head_stride, const int32_t* seq_lens, int32_t max_seq_len,
                      int32_t sink, int32_t window, int32_t top_k, int32_t* indices,
                      int32_t* counts, void* workspace, size_t workspace_bytes, void* stream);

// SALE prefill of one prompt (see sale.h), the paper's blocks (64 query, 32 key) with `sink` and
// `local` tokens: q and out [H, n, d], k and v [Hkv, n, d] (dtype as KvsDecodeArgs), tau [H]
// floats, mask [H, ceil(n / 64), ceil(n / 32)] bytes. kvs_sale_select with workspace == NULL
// returns the workspace bytes it needs (no launch).
int32_t kvs_sale_select(int32_t tokens, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
                        int32_t dtype, float scale, const void* q, const void* k, const float* tau,
                        int32_t sink, int32_t local, uint8_t* mask, void* workspace,
                        size_t workspace_bytes, void* stream);
int32_t kvs_sale_attend(int32_t tokens, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
                        int32_t dtype, float scale, const void* q, const void* k, const void* v,
                        void* out, const uint8_t* mask, void* stream);

const char* kvs_error_string(int32_t err);

#ifdef __cplusplus
}
#endif

#endif  // KVSPARSE_KERNELS_CUDA_CAPI_H_
