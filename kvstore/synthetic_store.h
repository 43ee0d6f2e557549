// A store loaded from a synthetic problem (kernels/synthetic.h), for tests and benchmarks: the
// one fixture the engine, GPU engine and store tests build their stores with.
#ifndef KVSPARSE_KVSTORE_SYNTHETIC_STORE_H_
#define KVSPARSE_KVSTORE_SYNTHETIC_STORE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/synthetic.h"
#include "kvstore/store.h"

namespace kvsparse::kvstore {

// The problem's shape with `layers` layers.
ModelShape ShapeOf(const kernels::SyntheticProblem& prob, uint32_t layers);

// Creates the problem's sequences as `prefix`0, `prefix`1, ... with `placement` and appends each
// one's K and V, the same rows in each of `layers` layers (SyntheticProblem::LayerRows). The
// first error, naming the sequence.
absl::Status LoadSynthetic(Store& store, const kernels::SyntheticProblem& prob,
                           const Placement& placement, uint32_t layers,
                           absl::string_view prefix = "s");

}  // namespace kvsparse::kvstore

#endif  // KVSPARSE_KVSTORE_SYNTHETIC_STORE_H_
