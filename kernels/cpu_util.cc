#include "kernels/cpu_util.h"

#include "absl/strings/str_cat.h"

namespace kvsparse::kernels {
namespace {

template <typename T>
float DotTyped(const float* q, const T* row, int d) {
  float s = 0.f;
  for (int i = 0; i < d; ++i) s += q[i] * ToFloat(row[i]);
  return s;
}

template <typename T>
float SparseDotTyped(const float* q, const int32_t* idx, int count, const T* row) {
  float s = 0.f;
  for (int j = 0; j < count; ++j) s += q[idx[j]] * ToFloat(row[idx[j]]);
  return s;
}

template <typename T>
void AxpyTyped(float w, const T* row, int d, float* acc) {
  for (int i = 0; i < d; ++i) acc[i] += w * ToFloat(row[i]);
}

}  // namespace

absl::Status ValidateProblemFor(const DecodeProblem& p, ProblemNeeds needs) {
  if (p.batch < 0) return absl::InvalidArgumentError(absl::StrCat("batch ", p.batch, " < 0"));
  if (p.num_kv_heads <= 0 || p.num_q_heads <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head counts must be positive (H=", p.num_q_heads, ", Hkv=", p.num_kv_heads, ")"));
  }
  if (p.num_q_heads % p.num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("H=", p.num_q_heads, " is not a multiple of Hkv=", p.num_kv_heads));
  }
  if (p.num_q_heads >= 65536) {
    return absl::InvalidArgumentError("num_q_heads must be < 65536 (Philox head field)");
  }
  if (p.head_dim <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("head_dim ", p.head_dim, " must be positive"));
  }
  if (!(p.scale > 0.f)) {
    return absl::InvalidArgumentError(absl::StrCat("scale ", p.scale, " must be positive"));
  }
  if (p.batch == 0) return absl::OkStatus();
  if (p.seq_lens == nullptr) return absl::InvalidArgumentError("seq_lens must be non-null");
  if (needs.q && p.q == nullptr) return absl::InvalidArgumentError("q must be non-null");
  if (needs.k && p.k == nullptr) return absl::InvalidArgumentError("k must be non-null");
  if (needs.v && p.v == nullptr) return absl::InvalidArgumentError("v must be non-null");
  if (needs.out && p.out == nullptr) return absl::InvalidArgumentError("out must be non-null");
  for (int32_t b = 0; b < p.batch; ++b) {
    if (p.seq_lens[b] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("seq_lens[", b, "] = ", p.seq_lens[b]));
    }
  }
  return absl::OkStatus();
}

void LoadRowAsFloat(const void* base, int64_t offset, int d, DType t, float* out) {
  switch (t) {
    case DType::kFp32: {
      const float* r = static_cast<const float*>(base) + offset;
      for (int i = 0; i < d; ++i) out[i] = r[i];
      break;
    }
    case DType::kFp16: {
      const Fp16* r = static_cast<const Fp16*>(base) + offset;
      for (int i = 0; i < d; ++i) out[i] = Fp16ToFloat(r[i]);
      break;
    }
    case DType::kBf16: {
      const Bf16* r = static_cast<const Bf16*>(base) + offset;
      for (int i = 0; i < d; ++i) out[i] = Bf16ToFloat(r[i]);
      break;
    }
  }
}

void LoadQuery(const DecodeProblem& p, int32_t b, int32_t h, float* out) {
  LoadRowAsFloat(p.q, (static_cast<int64_t>(b) * p.num_q_heads + h) * p.head_dim, p.head_dim,
                 p.dtype, out);
}

float DotRow(const float* q, const void* base, int64_t offset, int d, DType t) {
  switch (t) {
    case DType::kFp32:
      return DotTyped(q, static_cast<const float*>(base) + offset, d);
    case DType::kFp16:
      return DotTyped(q, static_cast<const Fp16*>(base) + offset, d);
    case DType::kBf16:
      return DotTyped(q, static_cast<const Bf16*>(base) + offset, d);
  }
  return 0.f;
}

float SparseDotRow(const float* q, const int32_t* idx, int count, const void* base, int64_t offset,
                   DType t) {
  switch (t) {
    case DType::kFp32:
      return SparseDotTyped(q, idx, count, static_cast<const float*>(base) + offset);
    case DType::kFp16:
      return SparseDotTyped(q, idx, count, static_cast<const Fp16*>(base) + offset);
    case DType::kBf16:
      return SparseDotTyped(q, idx, count, static_cast<const Bf16*>(base) + offset);
  }
  return 0.f;
}

void AxpyRow(float w, const void* base, int64_t offset, int d, DType t, float* acc) {
  switch (t) {
    case DType::kFp32:
      AxpyTyped(w, static_cast<const float*>(base) + offset, d, acc);
      break;
    case DType::kFp16:
      AxpyTyped(w, static_cast<const Fp16*>(base) + offset, d, acc);
      break;
    case DType::kBf16:
      AxpyTyped(w, static_cast<const Bf16*>(base) + offset, d, acc);
      break;
  }
}

void ComputeScores(const DecodeProblem& p, int32_t b, int32_t h, const float* q, float* scores) {
  const int32_t n = p.seq_lens[b];
  const int32_t kvh = h / p.group_size();
  for (int32_t t = 0; t < n; ++t) {
    scores[t] = DotRow(q, p.k, KvRowOffset(p, b, kvh, t), p.head_dim, p.dtype) * p.scale;
  }
}

}  // namespace kvsparse::kernels
