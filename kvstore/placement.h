// Which store shard holds a sequence: rendezvous (highest-random-weight) hashing of the sequence
// id over the shards' indices. Every party computes it alone (the model server's client, each
// worker, each store checking its own sequences), so the same id lands on the same shard
// everywhere without a directory; a shard that goes away takes only its own sequences with it.
// The hash is fixed here and in the Python package (kvsparse.placement), byte for byte: both are
// tested against the same vectors. docs/SCALE.md explains the choice (tests/scale simulates it).
#ifndef KVSPARSE_KVSTORE_PLACEMENT_H_
#define KVSPARSE_KVSTORE_PLACEMENT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvsparse::kvstore {

// FNV-1a (64-bit) of the id's bytes: the sequence's key.
uint64_t SequenceKey(absl::string_view sequence_id);
// The weight of shard `shard` for a key (splitmix64 mixes of both, as tests/scale simulates).
uint64_t ShardWeight(uint64_t key, uint32_t shard);
// The shard of [0, num_shards) with the largest weight (ties: the lowest index).
// REQUIRES: num_shards >= 1.
uint32_t ShardOf(absl::string_view sequence_id, uint32_t num_shards);

// A store's place in a sharded fleet (--shard_index/--shard_count): which sequences it may hold.
struct ShardSpec {
  uint32_t index = 0;
  uint32_t count = 1;  // 1: not sharded
  bool Holds(absl::string_view sequence_id) const {
    return count <= 1 || ShardOf(sequence_id, count) == index;
  }
};

// The shards' addresses from a flag: comma-separated host:port in shard order, where one range
// "{A..B}" in an item expands to B-A+1 items (kvsparse-store-{0..3}.kvsparse-store:50051: the
// four pods of a StatefulSet through its headless Service). INVALID_ARGUMENT for an empty list,
// an empty item, a malformed or reversed range, a duplicate address, or more than 4096 shards.
absl::StatusOr<std::vector<std::string>> ExpandShardList(absl::string_view list);

}  // namespace kvsparse::kvstore

#endif  // KVSPARSE_KVSTORE_PLACEMENT_H_
