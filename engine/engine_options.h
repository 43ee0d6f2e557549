// The decode engine's options: the defaults a request may leave to the engine (resolved once per
// call by the method's unit, MethodUnit::Resolve, before either backend sees the call) and the
// bounds of one call's work. Set by the server's flags (server/main.cc), the embedded engine and
// the in-process op.
#ifndef KVSPARSE_ENGINE_ENGINE_OPTIONS_H_
#define KVSPARSE_ENGINE_ENGINE_OPTIONS_H_

#include <cstddef>
#include <cstdint>

#include "engine/signatures.h"

namespace kvsparse::engine {

struct EngineOptions {
  int32_t default_tile_size = 256;              // S2ANTA tile when a request gives 0
  size_t resident_capacity_bytes = 4ull << 30;  // device-tier state (K, V, signatures)
  // Largest single read from the row source when many rows are needed at once (the resident
  // state's catch-up, or every K row when K is not resident): far under the message limit.
  size_t max_fetch_bytes = 32 << 20;
  SignatureConfig signatures;
  // Most sequences one Decode call may name (each distinct): bounds the work of one call.
  size_t max_call_sequences = 1024;
  // Most K+V bytes one Decode call may cover (its dense-equivalent bytes: what the CPU engine
  // may gather for it); more is RESOURCE_EXHAUSTED. 0: no bound.
  uint64_t max_call_bytes = 64ull << 30;
};

}  // namespace kvsparse::engine

#endif  // KVSPARSE_ENGINE_ENGINE_OPTIONS_H_
