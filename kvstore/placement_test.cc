#include "kvstore/placement.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace kvsparse::kvstore {
namespace {

// The same vectors are in client/python/tests/test_placement.py: the Python client must place
// every sequence where the C++ worker looks for it.
TEST(PlacementTest, FixedVectors) {
  EXPECT_EQ(SequenceKey(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(SequenceKey("s0"), 0x08d8fe07b578cf96ull);
  EXPECT_EQ(SequenceKey("chat-42"), 0x1fe9ed462e2cb5e0ull);
  EXPECT_EQ(ShardWeight(SequenceKey("s0"), 0), 0x9e08b15a2623020dull);
  EXPECT_EQ(ShardWeight(SequenceKey("chat-42"), 0), 0x309737ece042ea97ull);
  const struct {
    const char* id;
    std::vector<uint32_t> shard;  // for 1, 2, 3, 4, 7 shards
  } cases[] = {{"", {0, 1, 2, 2, 2}},
               {"s0", {0, 0, 0, 3, 5}},
               {"s1", {0, 1, 1, 1, 5}},
               {"chat-42", {0, 1, 1, 3, 3}},
               {"sequence/\xc3\xbc", {0, 1, 1, 1, 1}}};
  for (const auto& c : cases) {
    const uint32_t counts[] = {1, 2, 3, 4, 7};
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(ShardOf(c.id, counts[i]), c.shard[i]) << c.id << " over " << counts[i];
    }
  }
}

// Rendezvous hashing's two properties: every shard gets its share, and a shard added to the
// fleet takes sequences only from the others (none moves between two old shards).
TEST(PlacementTest, BalancedAndMinimalMovement) {
  constexpr int kIds = 40000;
  for (uint32_t n : {2u, 5u, 16u}) {
    std::vector<int> load(n, 0);
    int moved = 0, moved_elsewhere = 0;
    for (int i = 0; i < kIds; ++i) {
      const std::string id = absl::StrCat("seq-", i);
      const uint32_t a = ShardOf(id, n);
      ++load[a];
      const uint32_t b = ShardOf(id, n + 1);
      if (b != a) {
        ++moved;
        if (b != n) ++moved_elsewhere;
      }
    }
    // Each shard's count is Binomial(kIds, 1/n): within 5 standard deviations of kIds / n.
    const double mean = static_cast<double>(kIds) / n;
    const double sd = std::sqrt(kIds * (1.0 / n) * (1 - 1.0 / n));
    for (uint32_t s = 0; s < n; ++s) EXPECT_NEAR(load[s], mean, 5 * sd) << s << " of " << n;
    EXPECT_EQ(moved_elsewhere, 0);
    const double expect_moved = static_cast<double>(kIds) / (n + 1);
    EXPECT_NEAR(moved, expect_moved, 5 * std::sqrt(expect_moved));
  }
}

TEST(PlacementTest, ShardSpecHoldsItsOwnSequences) {
  const ShardSpec unsharded;
  EXPECT_TRUE(unsharded.Holds("anything"));
  int held = 0;
  for (uint32_t i = 0; i < 3; ++i) held += ShardSpec{i, 3}.Holds("chat-42");
  EXPECT_EQ(held, 1);
  EXPECT_TRUE((ShardSpec{1, 3}.Holds("chat-42")));
}

TEST(PlacementTest, ExpandsShardLists) {
  using V = std::vector<std::string>;
  EXPECT_EQ(*ExpandShardList("127.0.0.1:5000"), V{"127.0.0.1:5000"});
  EXPECT_EQ(*ExpandShardList("a:1, b:2"), (V{"a:1", "b:2"}));
  EXPECT_EQ(*ExpandShardList("kvsparse-store-{0..2}.kvsparse-store:50051"),
            (V{"kvsparse-store-0.kvsparse-store:50051", "kvsparse-store-1.kvsparse-store:50051",
               "kvsparse-store-2.kvsparse-store:50051"}));
  EXPECT_EQ(*ExpandShardList("10.0.0.{7..8}:1,x:2"), (V{"10.0.0.7:1", "10.0.0.8:1", "x:2"}));
  for (const char* bad :
       {"", "a:1,", "a:1,,b:2", "s-{3..1}:1", "s-{0..}:1", "s-{a..2}:1", "s-{0..1:1",
        "s-{0..1}-{0..1}:1", "a:1,a:1", "s-{0..1}:1,s-1:1", "s-{0..5000}:1"}) {
    absl::StatusOr<std::vector<std::string>> r = ExpandShardList(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace kvsparse::kvstore
