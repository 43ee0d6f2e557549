#include "kvstore/placement.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace kvsparse::kvstore {
namespace {

constexpr uint32_t kMaxShards = 4096;

uint64_t Mix64(uint64_t x) {  // splitmix64's finaliser
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t SequenceKey(absl::string_view sequence_id) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : sequence_id) {
    h ^= c;
    h *= 0x100000001B3ull;
  }
  return h;
}

uint64_t ShardWeight(uint64_t key, uint32_t shard) {
  const uint64_t s = Mix64(key + 0x9E3779B97F4A7C15ull);
  const uint64_t h = Mix64(uint64_t{shard} * 0xD6E8FEB86659FD93ull + 1);
  return Mix64(s ^ h);
}

uint32_t ShardOf(absl::string_view sequence_id, uint32_t num_shards) {
  const uint64_t key = SequenceKey(sequence_id);
  uint32_t best = 0;
  uint64_t best_weight = ShardWeight(key, 0);
  for (uint32_t i = 1; i < num_shards; ++i) {
    const uint64_t w = ShardWeight(key, i);
    if (w > best_weight) best = i, best_weight = w;
  }
  return best;
}

absl::StatusOr<std::vector<std::string>> ExpandShardList(absl::string_view list) {
  std::vector<std::string> out;
  absl::flat_hash_set<std::string> seen;
  auto add = [&](std::string address) -> absl::Status {
    if (out.size() >= kMaxShards) {
      return absl::InvalidArgumentError(absl::StrCat("more than ", kMaxShards, " store shards"));
    }
    if (!seen.insert(address).second) {
      return absl::InvalidArgumentError(absl::StrCat("store shard '", address, "' listed twice"));
    }
    out.push_back(std::move(address));
    return absl::OkStatus();
  };
  for (absl::string_view item : absl::StrSplit(list, ',')) {
    item = absl::StripAsciiWhitespace(item);
    if (item.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("empty address in the store list '", list, "'"));
    }
    const size_t open = item.find('{');
    if (open == absl::string_view::npos) {
      if (absl::Status s = add(std::string(item)); !s.ok()) return s;
      continue;
    }
    const size_t close = item.find('}', open);
    const size_t dots = item.find("..", open);
    uint32_t first = 0, last = 0;
    if (close == absl::string_view::npos || dots == absl::string_view::npos || dots > close ||
        !absl::SimpleAtoi(item.substr(open + 1, dots - open - 1), &first) ||
        !absl::SimpleAtoi(item.substr(dots + 2, close - dots - 2), &last) || last < first ||
        item.find('{', close) != absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "store address '", item, "': a range must read {FIRST..LAST} with FIRST <= LAST"));
    }
    if (last - first >= kMaxShards) {
      return absl::InvalidArgumentError(absl::StrCat("more than ", kMaxShards, " store shards"));
    }
    for (uint32_t i = first; i <= last; ++i) {
      if (absl::Status s = add(absl::StrCat(item.substr(0, open), i, item.substr(close + 1)));
          !s.ok()) {
        return s;
      }
    }
  }
  return out;
}

}  // namespace kvsparse::kvstore
