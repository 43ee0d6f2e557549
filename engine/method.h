// A selection method as a Decode call names it: its kind and its parameters. What each method
// does lives in one unit per backend (engine/methods/<method>.cc on the CPU,
// engine/cuda/<method>_runner.cc on the GPU), listed in one table (engine/methods/registry.h).
#ifndef KVSPARSE_ENGINE_METHOD_H_
#define KVSPARSE_ENGINE_METHOD_H_

#include "kernels/hash_topk.h"
#include "kernels/saap.h"
#include "kernels/santa.h"
#include "kernels/score_topk.h"
#include "kernels/vattention.h"

namespace kvsparse::engine {

// One value per row of the method table, in its order.
enum class MethodKind { kDense, kSanta, kHashTopK, kVAttention, kSaap, kTopK };

struct Method {
  MethodKind kind = MethodKind::kDense;
  kernels::SantaParams santa;            // kSanta (tile_size 0: the engine's, MethodUnit::Resolve)
  kernels::HashTopKParams hash;          // kHashTopK (bits 0: the sequence's signature bits)
  kernels::VAttentionParams vattention;  // kVAttention (bits 0: the sequence's)
  kernels::SaapParams saap;              // kSaap (the server's partitions: --saap_weights)
  kernels::ScoreTopKParams top_k;        // kTopK (compressed keys: the sequence's placement)
  bool learned_signatures = false;       // the request asked for learned (not SimHash) signatures
};

// The method's name in metrics labels and messages ("dense", "santa", "hash_top_k",
// "vattention", "saap", "top_k"): the method table's.
const char* MethodName(MethodKind kind);

}  // namespace kvsparse::engine

#endif  // KVSPARSE_ENGINE_METHOD_H_
