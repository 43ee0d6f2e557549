#include "kernels/cuda/capi.h"

#include <cuda_runtime_api.h>

#include "kernels/cuda/dense_decode.h"
#include "kernels/cuda/hash_topk.h"
#include "kernels/cuda/sale.h"
#include "kernels/cuda/santa.h"

namespace {

using kvsparse::kernels::DType;
namespace kc = kvsparse::kernels::cuda;

kc::DecodeShape ToShape(const KvsDecodeArgs& a) {
  kc::DecodeShape s;
  s.batch = a.batch;
  s.num_q_heads = a.num_q_heads;
  s.num_kv_heads = a.num_kv_heads;
  s.head_dim = a.head_dim;
  s.dtype = static_cast<DType>(a.dtype);
  s.q = a.q;
  s.k = a.k;
  s.v = a.v;
  s.kv.batch_stride = a.batch_stride;
  s.kv.head_stride = a.head_stride;
  s.kv.token_stride = a.token_stride;
  s.seq_lens = a.seq_lens;
  s.max_seq_len = a.max_seq_len;
  s.scale = a.scale;
  s.out = a.out;
  return s;
}

kc::SantaLaunchParams ToSanta(const KvsDecodeArgs& a, int32_t samples, uint64_t seed,
                              int32_t* rows_read) {
  kc::SantaLaunchParams p;
  p.shape = ToShape(a);
  p.num_samples = samples;
  p.seed = seed;
  p.rows_read = rows_read;
  return p;
}

kvsparse::kernels::SalePrefill SalePrompt(int32_t tokens, int32_t num_q_heads, int32_t num_kv_heads,
                                          int32_t head_dim, int32_t dtype, float scale,
                                          const void* q, const void* k) {
  kvsparse::kernels::SalePrefill p;
  p.tokens = tokens;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.dtype = static_cast<DType>(dtype);
  p.scale = scale;
  p.q = q;
  p.k = k;
  return p;
}

}  // namespace

extern "C" {

size_t kvs_decode_workspace_bytes(const KvsDecodeArgs* args, int32_t method, int32_t samples) {
  const kc::SantaLaunchParams p = ToSanta(*args, samples, 0, nullptr);
  switch (method) {
    case 0:
      return kc::DenseDecodeWorkspaceBytes(p.shape);
    case 1:
      return kc::SantaIidWorkspaceBytes(p);
    case 2:
      return kc::S2antaPropWorkspaceBytes(p);
    case 3:
      return kc::S2antaFlashWorkspaceBytes(p);
    case 5:
      return kc::DenseDecodeWorkspaceBytes(p.shape, 2);
    default:
      return 0;
  }
}

int32_t kvs_decode(const KvsDecodeArgs* args, int32_t method, int32_t samples, uint64_t seed,
                   void* workspace, size_t workspace_bytes, int32_t* rows_read, void* stream) {
  const kc::SantaLaunchParams p = ToSanta(*args, samples, seed, rows_read);
  const auto st = static_cast<cudaStream_t>(stream);
  switch (method) {
    case 0:
      return kc::DenseDecode(p.shape, workspace, workspace_bytes, st);
    case 1:
      return kc::SantaIid(p, workspace, workspace_bytes, st);
    case 2:
      return kc::S2antaProp(p, workspace, workspace_bytes, st);
    case 3:
      return kc::S2antaFlash(p, workspace, workspace_bytes, st);
    case 5:
      return kc::DenseDecode(p.shape, workspace, workspace_bytes, st, 2);
    default:
      return cudaErrorInvalidValue;
  }
}

int32_t kvs_hash_topk(int32_t batch, int32_t num_q_heads, int32_t num_kv_heads, int32_t bits,
                      const uint32_t* q_sigs, const uint32_t* k_sigs, int64_t k_batch_stride,
                      int64_t k_head_stride, const int32_t* seq_lens, int32_t max_seq_len,
                      int32_t sink, int32_t window, int32_t top_k, int32_t* indices,
                      int32_t* counts, void* workspace, size_t workspace_bytes, void* stream) {
  kc::HashTopKLaunchParams p;
  p.batch = batch;
  p.num_q_heads = num_q_heads;
  p.key_heads = num_kv_heads;
  p.bits = bits;
  p.q_sigs = q_sigs;
  p.k_sigs = k_sigs;
  p.k_batch_stride = k_batch_stride;
  p.k_head_stride = k_head_stride;
  p.k_token_stride = bits / 32;
  p.seq_lens = seq_lens;
  p.max_seq_len = max_seq_len;
  p.fixed.sink_tokens = sink;
  p.fixed.local_tokens = window;
  p.fixed.top_k = top_k;
  p.indices = indices;
  p.counts = counts;
  if (workspace == nullptr) return static_cast<int32_t>(kc::HashTopKWorkspaceBytes(p));
  return kc::HashTopK(p, workspace, workspace_bytes, static_cast<cudaStream_t>(stream));
}

int32_t kvs_sale_select(int32_t tokens, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
                        int32_t dtype, float scale, const void* q, const void* k, const float* tau,
                        int32_t sink, int32_t local, uint8_t* mask, void* workspace,
                        size_t workspace_bytes, void* stream) {
  kc::SaleSelectParams p;
  p.prompt = SalePrompt(tokens, num_q_heads, num_kv_heads, head_dim, dtype, scale, q, k);
  p.tau = tau;
  p.blocks.sink_tokens = sink;
  p.blocks.local_tokens = local;
  p.mask = mask;
  if (workspace == nullptr) return static_cast<int32_t>(kc::SaleSelectWorkspaceBytes(p));
  return kc::SaleSelect(p, workspace, workspace_bytes, static_cast<cudaStream_t>(stream));
}

int32_t kvs_sale_attend(int32_t tokens, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
                        int32_t dtype, float scale, const void* q, const void* k, const void* v,
                        void* out, const uint8_t* mask, void* stream) {
  kc::SaleAttendParams p;
  p.prompt = SalePrompt(tokens, num_q_heads, num_kv_heads, head_dim, dtype, scale, q, k);
  p.prompt.v = v;
  p.prompt.out = out;
  p.mask = mask;
  return kc::SaleAttend(p, static_cast<cudaStream_t>(stream));
}

const char* kvs_error_string(int32_t err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}

}  // extern "C"
