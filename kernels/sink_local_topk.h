// The one rule of a sink + window + top-k selection that both devices apply per query head
// (kernels/hash_topk.h's header states the whole rule): how many top-k rows a sequence takes
// from the rest between its sink and its window. Header-only, host and device.
#ifndef KVSPARSE_KERNELS_SINK_LOCAL_TOPK_H_
#define KVSPARSE_KERNELS_SINK_LOCAL_TOPK_H_

#include <cmath>
#include <cstdint>

#include "kernels/dtype.h"

namespace kvsparse::kernels {

// The fixed set of a sink + window + top-k method, per query head: the first sink_tokens tokens,
// the last local_tokens, and k of the rest by the method's scores, k = top_k, or where top_k is 0
// top_k_fraction of the sequence rounded to nearest (kernels/hash_topk.h states the whole rule:
// ResolveTopK, ValidateFixedSet, MaxFixedSetRows). Every method that has one embeds it (the
// parameters of hash top-k, top-k by scores and vAttention, and their CUDA launch structs); the
// defaults are the methods' own (each proto message's text_default; vAttention's fraction 0.05).
struct FixedSet {
  int32_t sink_tokens = 128;
  int32_t local_tokens = 128;
  int32_t top_k = 0;           // rows per query head beyond sink and window
  float top_k_fraction = 0.f;  // used when top_k == 0, in [0, 1]
};

// k of a fixed set for n tokens before any bound: top_k, or where it is 0 top_k_fraction of n
// rounded to nearest, so that e.g. 0.02f (0.0199999995...) of 3000 tokens is 60, not 59. The one
// home of the rule for ResolveTopK, MaxFixedSetRows and the GPU selections' geometry.
KVSPARSE_HD int64_t FixedSetK(const FixedSet& f, int64_t n) {
  return f.top_k > 0 ? f.top_k
                     : static_cast<int64_t>(floor(static_cast<double>(f.top_k_fraction) * n + 0.5));
}

// The top-k rows of a sequence of n tokens whose sink ends at s_end and whose window begins at
// w_begin (rest = [s_end, w_begin)), for a resolved k: min(k, rest), or 1 where sink, window and
// top-k would leave the selection empty (so an output is always an estimate of attention).
KVSPARSE_HD int32_t SinkLocalTopKRest(int32_t n, int32_t s_end, int32_t w_begin, int32_t k) {
  const int32_t rest = w_begin - s_end;
  int32_t kk = k < 0 ? 0 : (k < rest ? k : rest);
  if (kk == 0 && rest > 0 && s_end == 0 && w_begin == n) kk = 1;
  return kk;
}

}  // namespace kvsparse::kernels

#endif  // KVSPARSE_KERNELS_SINK_LOCAL_TOPK_H_
