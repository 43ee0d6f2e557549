#include "kvstore/store.h"

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kvstore/memory_resource.h"
#include "kvstore/shared_arena.h"

namespace kvsparse::kvstore {
namespace {

using kernels::DType;

// Byte b of the K (kv=0) or V (kv=1) row of (layer, head, token): a value a test can recompute.
uint8_t RowByte(uint32_t layer, uint32_t head, uint64_t token, int kv, size_t b) {
  uint64_t x = (layer * 1000003ull) ^ (head * 7919ull) ^ (token * 104729ull) ^ (kv * 31ull) ^
               (b * 2654435761ull);
  x ^= x >> 29;
  x *= 0xbf58476d1ce4e5b9ull;
  return kernels::AcceptedByte(static_cast<uint8_t>(x >> 32), b);  // a value the store accepts
}

// K and V for tokens [t0, t0 + n) of layers [l0, l0 + nl): [nl, n, Hkv, row_bytes] each.
void MakeRows(const ModelShape& s, uint32_t l0, uint32_t nl, uint64_t t0, uint64_t n,
              std::vector<uint8_t>* k, std::vector<uint8_t>* v) {
  const size_t row = s.row_bytes();
  k->resize(nl * n * s.num_kv_heads * row);
  v->resize(k->size());
  for (uint32_t li = 0; li < nl; ++li)
    for (uint64_t t = 0; t < n; ++t)
      for (uint32_t h = 0; h < s.num_kv_heads; ++h)
        for (size_t b = 0; b < row; ++b) {
          const size_t off = ((li * n + t) * s.num_kv_heads + h) * row + b;
          (*k)[off] = RowByte(l0 + li, h, t0 + t, 0, b);
          (*v)[off] = RowByte(l0 + li, h, t0 + t, 1, b);
        }
}

ModelShape Shape(DType dt, uint32_t layers = 2, uint32_t kv_heads = 2, uint32_t dim = 64) {
  return ModelShape{layers, 4 * kv_heads, kv_heads, dim, dt};
}

std::unique_ptr<Store> NewStore(size_t capacity = 64 << 20,
                                CapacityPolicy policy = CapacityPolicy::kReject,
                                MemoryResource* memory = nullptr) {
  StoreOptions o;
  o.capacity_bytes = capacity;
  o.policy = policy;
  o.page_bytes = 8192;  // small pages: many page boundaries in small tests
  o.slab_bytes = 1 << 20;
  o.memory = memory;
  auto s = Store::Create(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return std::move(*s);
}

void SetShape(const ModelShape& s, AppendRequest* r) {
  r->dtype = s.dtype;
  r->num_kv_heads = s.num_kv_heads;
  r->head_dim = s.head_dim;
}

// An append of n tokens to layers [l0, l0 + nl) with the rows k and v (which must outlive it).
AppendRequest RequestOf(absl::string_view id, const ModelShape& s, uint32_t l0, uint32_t nl,
                        uint64_t n, const std::vector<uint8_t>& k, const std::vector<uint8_t>& v) {
  AppendRequest r;
  r.sequence_id = id;
  r.first_layer = l0;
  r.num_layers = nl;
  r.num_tokens = n;
  SetShape(s, &r);
  r.k = k;
  r.v = v;
  return r;
}

absl::Status AppendTokens(Store& store, absl::string_view id, const ModelShape& s, uint32_t l0,
                          uint32_t nl, uint64_t t0, uint64_t n) {
  std::vector<uint8_t> k, v;
  MakeRows(s, l0, nl, t0, n, &k, &v);
  return store.Append(RequestOf(id, s, l0, nl, n, k, v)).status();
}

struct Gathered {
  GatherResult result;
  std::vector<uint8_t> k, v;
};

absl::StatusOr<Gathered> DoGather(Store& store, absl::string_view id, uint32_t layer,
                                  std::vector<HeadSelection> heads, RowKind kind = RowKind::kKV,
                                  bool unique = false) {
  Gathered g;
  GatherRequest r;
  r.sequence_id = id;
  r.layer = layer;
  r.kind = kind;
  r.heads = heads;
  r.unique = unique;
  auto res = store.Gather(r, [&](uint64_t rows, size_t row) -> absl::StatusOr<GatherBuffers> {
    GatherBuffers b;
    if (kind != RowKind::kV) {
      g.k.assign(rows * row, 0xEE);
      b.k = g.k.data();
    }
    if (kind != RowKind::kK) {
      g.v.assign(rows * row, 0xEE);
      b.v = g.v.data();
    }
    return b;
  });
  if (!res.ok()) return res.status();
  g.result = std::move(*res);
  return g;
}

void ExpectRow(const ModelShape& s, const uint8_t* got, uint32_t layer, uint32_t head,
               uint64_t token, int kv) {
  for (size_t b = 0; b < s.row_bytes(); ++b) {
    ASSERT_EQ(got[b], RowByte(layer, head, token, kv, b))
        << "layer " << layer << " head " << head << " token " << token << " kv " << kv;
  }
}

class RoundTripTest : public ::testing::TestWithParam<DType> {};

// Appends in uneven chunks that straddle page boundaries, then reads every row back, in order,
// reversed with duplicates, and unique with counts.
TEST_P(RoundTripTest, ByteExactAcrossPages) {
  auto store = NewStore();
  const ModelShape s = Shape(GetParam(), 3, 2, 96);
  ASSERT_TRUE(store->CreateSequence("seq", s, {}).ok());
  const uint64_t page_tokens = 8192 / (2 * s.row_bytes());
  uint64_t len = 0;
  for (uint64_t chunk : std::vector<uint64_t>{1, page_tokens - 1, 2, 3 * page_tokens + 5, 7}) {
    ASSERT_TRUE(AppendTokens(*store, "seq", s, 0, 3, len, chunk).ok());
    len += chunk;
  }
  auto info = store->GetSequenceInfo("seq");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->layer_lengths, std::vector<uint64_t>(3, len));
  EXPECT_EQ(info->page_tokens, page_tokens);

  std::vector<uint32_t> all(len), rev_dup;
  for (uint32_t t = 0; t < len; ++t) all[t] = t;
  for (uint32_t t = len; t-- > 0;) {
    rev_dup.push_back(t);
    if (t % 5 == 0) rev_dup.push_back(t);
  }
  for (uint32_t layer = 0; layer < 3; ++layer) {
    auto g = DoGather(*store, "seq", layer, {{0, all}, {1, rev_dup}, {0, rev_dup}});
    ASSERT_TRUE(g.ok()) << g.status();
    ASSERT_EQ(g->result.heads.size(), 3u);
    EXPECT_EQ(g->result.layer_length, len);
    const size_t row = s.row_bytes();
    for (const HeadRows& hr : g->result.heads) {
      const auto& toks = hr.row_offset == 0 ? all : rev_dup;
      ASSERT_EQ(hr.row_count, toks.size());
      for (size_t i = 0; i < toks.size(); ++i) {
        ExpectRow(s, g->k.data() + (hr.row_offset + i) * row, layer, hr.kv_head, toks[i], 0);
        ExpectRow(s, g->v.data() + (hr.row_offset + i) * row, layer, hr.kv_head, toks[i], 1);
      }
    }
    // Unique: ascending distinct tokens with counts; V only.
    auto u = DoGather(*store, "seq", layer, {{1, rev_dup}}, RowKind::kV, /*unique=*/true);
    ASSERT_TRUE(u.ok());
    const HeadRows& hr = u->result.heads[0];
    ASSERT_EQ(hr.token_indices.size(), len);
    EXPECT_TRUE(u->k.empty());
    for (uint32_t t = 0; t < len; ++t) {
      EXPECT_EQ(hr.token_indices[t], t);
      EXPECT_EQ(hr.counts[t], t % 5 == 0 ? 2u : 1u);
      ExpectRow(s, u->v.data() + t * row, layer, 1, t, 1);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, RoundTripTest,
                         ::testing::Values(DType::kFp32, DType::kFp16, DType::kBf16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

TEST(StoreTest, AppendsLayerByLayer) {
  auto store = NewStore();
  const ModelShape s = Shape(DType::kBf16, 4);
  ASSERT_TRUE(store->CreateSequence("a", s, {}).ok());
  // A model server appends each layer's new token as it computes that layer.
  for (uint64_t t = 0; t < 3; ++t) {
    for (uint32_t l = 0; l < 4; ++l) ASSERT_TRUE(AppendTokens(*store, "a", s, l, 1, t, 1).ok());
  }
  // Layers 0..1 now hold 4 tokens, 2..3 hold 3: a multi-layer append over both is refused.
  ASSERT_TRUE(AppendTokens(*store, "a", s, 0, 2, 3, 1).ok());
  EXPECT_EQ(AppendTokens(*store, "a", s, 1, 2, 4, 1).code(), absl::StatusCode::kFailedPrecondition);
  auto g = DoGather(*store, "a", 3, {{1, std::vector<uint32_t>{2}}});
  ASSERT_TRUE(g.ok());
  ExpectRow(s, g->k.data(), 3, 1, 2, 0);
}

// K and V values must be finite and below 2^32 in magnitude (kernels::FirstUnacceptedValue): an
// append holding a NaN, an infinity or a huge finite value is INVALID_ARGUMENT naming the row, in
// every dtype, and the sequence keeps exactly what it held (before: accepted; dense then returned
// NaN outputs with status OK and every S2ANTA call on the sequence failed).
TEST(StoreTest, AppendRefusesNonFiniteAndHugeValues) {
  for (DType dt : {DType::kFp32, DType::kFp16, DType::kBf16}) {
    auto store = NewStore();
    const ModelShape s = Shape(dt, 2);
    ASSERT_TRUE(store->CreateSequence("a", s, {}).ok());
    ASSERT_TRUE(AppendTokens(*store, "a", s, 0, 2, 0, 3).ok());
    const uint64_t used = store->Stats().bytes_used;
    std::vector<float> bads = {std::nanf(""), std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity()};
    if (dt != DType::kFp16) bads.push_back(3e38f);  // fp16 has no finite value that large
    if (dt == DType::kFp32) bads.push_back(-4.3e9f);
    for (float bad : bads) {
      for (int which = 0; which < 2; ++which) {
        std::vector<uint8_t> k, v;
        MakeRows(s, 0, 2, 3, 2, &k, &v);
        // Layer 1, token 1 of the append, kv head 1, element 5.
        const size_t at = ((1 * 2 + 1) * s.num_kv_heads + 1) * s.head_dim + 5;
        kvsparse::kernels::StoreFromFloat(which == 0 ? k.data() : v.data(), at, dt, bad);
        absl::StatusOr<AppendResult> got = store->Append(RequestOf("a", s, 0, 2, 2, k, v));
        EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument)
            << DTypeName(dt) << " " << bad;
        EXPECT_TRUE(absl::StrContains(got.status().message(),
                                      "layer 1, token 1 of the append, kv head 1, element 5"))
            << got.status();
        EXPECT_TRUE(absl::StartsWith(got.status().message(), which == 0 ? "k " : "v "))
            << got.status();
      }
    }
    EXPECT_EQ(store->GetSequenceInfo("a")->layer_lengths, std::vector<uint64_t>(2, 3));
    EXPECT_EQ(store->Stats().bytes_used, used);
    // The largest accepted values still append.
    std::vector<uint8_t> k, v;
    MakeRows(s, 0, 2, 3, 1, &k, &v);
    kvsparse::kernels::StoreFromFloat(k.data(), 0, dt, dt == DType::kFp16 ? 65504.f : 4.2e9f);
    EXPECT_TRUE(store->Append(RequestOf("a", s, 0, 2, 1, k, v)).ok()) << DTypeName(dt);
  }
}

// An append of 1 MiB and more is copied in parts of consecutive tokens by the store's helper
// threads (StoreOptions::append_helpers): every row lands where a single thread puts it, across
// layers, kv heads and pages; a NaN in the last part's rows refuses the whole append (named as
// before), and the sequence keeps exactly what it held, however far the other parts got.
TEST(StoreTest, LargeAppendsCopyInPartsAndRefuseAsOne) {
  const ModelShape s = Shape(DType::kFp32, 3, 4, 128);  // 512-byte rows: 24 KiB a token
  auto store = NewStore(256 << 20);
  ASSERT_TRUE(store->CreateSequence("a", s, {}).ok());
  const uint64_t n = 1000;  // 24 MB of K and V in one append, 16 parts of 64 tokens
  ASSERT_TRUE(AppendTokens(*store, "a", s, 0, 3, 0, n).ok());
  std::vector<uint32_t> all(n);
  for (uint32_t t = 0; t < n; ++t) all[t] = t;
  for (uint32_t layer = 0; layer < 3; ++layer) {
    auto g = DoGather(*store, "a", layer, {{0, all}, {3, all}});
    ASSERT_TRUE(g.ok()) << g.status();
    for (const HeadRows& hr : g->result.heads) {
      for (uint32_t t = 0; t < n; ++t) {
        ExpectRow(s, g->k.data() + (hr.row_offset + t) * s.row_bytes(), layer, hr.kv_head, t, 0);
        ExpectRow(s, g->v.data() + (hr.row_offset + t) * s.row_bytes(), layer, hr.kv_head, t, 1);
      }
    }
  }
  const uint64_t used = store->Stats().bytes_used;
  std::vector<uint8_t> k, v;
  MakeRows(s, 0, 3, n, n, &k, &v);
  // Layer 2, token 990 of the append (the last part), kv head 3, element 7.
  const size_t at = ((2 * n + 990) * s.num_kv_heads + 3) * s.head_dim + 7;
  kvsparse::kernels::StoreFromFloat(v.data(), at, s.dtype, std::nanf(""));
  absl::StatusOr<AppendResult> got = store->Append(RequestOf("a", s, 0, 3, n, k, v));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(got.status().message(),
                                "layer 2, token 990 of the append, kv head 3, element 7"))
      << got.status();
  EXPECT_EQ(store->GetSequenceInfo("a")->layer_lengths, std::vector<uint64_t>(3, n));
  EXPECT_EQ(store->Stats().bytes_used, used);
  // And the same rows without the NaN append after it.
  kvsparse::kernels::StoreFromFloat(v.data(), at, s.dtype, 1.f);
  EXPECT_TRUE(store->Append(RequestOf("a", s, 0, 3, n, k, v)).ok());
}

// Under evict-lru a refused append (a NaN in K) evicts nobody to make room for itself: the idle
// sequence that an accepted append of the same size evicts is still there after the refusal.
TEST(StoreTest, RefusedAppendEvictsNothing) {
  const ModelShape s = Shape(DType::kBf16, 2);  // 32 tokens a page per (layer, kv head)
  size_t bookkeeping = 0;
  {
    auto probe = NewStore();
    ASSERT_TRUE(probe->CreateSequence("idle", s, {}).ok());
    ASSERT_TRUE(probe->CreateSequence("a", s, {}).ok());
    bookkeeping = probe->Stats().bytes_used;
  }
  // Room for exactly 64 tokens of each sequence (8 pages each).
  auto store = NewStore(bookkeeping + 16 * 8192, CapacityPolicy::kEvictLru);
  ASSERT_TRUE(store->CreateSequence("idle", s, {}).ok());
  ASSERT_TRUE(AppendTokens(*store, "idle", s, 0, 2, 0, 64).ok());
  ASSERT_TRUE(store->CreateSequence("a", s, {}).ok());
  ASSERT_TRUE(AppendTokens(*store, "a", s, 0, 2, 0, 64).ok());
  ASSERT_EQ(store->Stats().evictions, 0u);
  std::vector<uint8_t> k, v;
  MakeRows(s, 0, 2, 64, 64, &k, &v);  // needs 8 more pages: room only by evicting "idle"
  kvsparse::kernels::StoreFromFloat(k.data(), 9, s.dtype, std::nanf(""));
  EXPECT_EQ(store->Append(RequestOf("a", s, 0, 2, 64, k, v)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Stats().evictions, 0u);
  EXPECT_TRUE(store->GetSequenceInfo("idle").ok());
  // The same append with accepted values does evict it (the test's premise).
  MakeRows(s, 0, 2, 64, 64, &k, &v);
  EXPECT_TRUE(store->Append(RequestOf("a", s, 0, 2, 64, k, v)).ok());
  EXPECT_EQ(store->Stats().evictions, 1u);
}

TEST(StoreTest, RecreatedSequenceHasNewIncarnation) {
  auto store = NewStore();
  const ModelShape s = Shape(DType::kBf16);
  auto first = store->CreateSequence("a", s, {});
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(store->DropSequence("a").ok());
  auto second = store->CreateSequence("a", s, {});
  ASSERT_TRUE(second.ok());
  EXPECT_NE(first->incarnation, second->incarnation);
  EXPECT_EQ(store->GetSequenceInfo("a")->incarnation, second->incarnation);
}

TEST(StoreTest, MaxSequencesBoundsCreation) {
  StoreOptions o;
  o.capacity_bytes = 8 << 20;
  o.max_sequences = 2;
  auto store = Store::Create(o);
  ASSERT_TRUE(store.ok());
  const ModelShape s = Shape(DType::kBf16);
  ASSERT_TRUE((*store)->CreateSequence("a", s, {}).ok());
  ASSERT_TRUE((*store)->CreateSequence("b", s, {}).ok());
  auto third = (*store)->CreateSequence("c", s, {});
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted) << third.status();
  EXPECT_EQ((*store)->CreateSequence("a", s, {}).status().code(),
            absl::StatusCode::kAlreadyExists);  // an existing id still says so
  ASSERT_TRUE((*store)->DropSequence("a").ok());
  EXPECT_TRUE((*store)->CreateSequence("c", s, {}).ok());
}

// A shard of a sharded fleet holds only the sequences placement gives it.
TEST(StoreTest, ShardHoldsOnlyItsOwnSequences) {
  StoreOptions o;
  o.capacity_bytes = 8 << 20;
  o.shard = {1, 2};  // "s1" is shard 1's, "s0" shard 0's (kvstore/placement_test.cc)
  auto store = Store::Create(o);
  ASSERT_TRUE(store.ok());
  const ModelShape s = Shape(DType::kBf16);
  EXPECT_TRUE((*store)->CreateSequence("s1", s, {}).ok());
  auto other = (*store)->CreateSequence("s0", s, {});
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition) << other.status();
  EXPECT_NE(other.status().message().find("belongs to store shard 0 of 2"), std::string::npos)
      << other.status();
  EXPECT_EQ((*store)->Stats().shard.index, 1u);
  EXPECT_EQ((*store)->Stats().shard.count, 2u);
  for (ShardSpec bad : {ShardSpec{2, 2}, ShardSpec{0, 0}}) {
    o.shard = bad;
    EXPECT_EQ(Store::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

// --arena_file: the pages live in a shared mapping of a file, so another process mapping the
// same file sees the rows appended (here: the file read back through read(2)).
TEST(StoreTest, ArenaInAFile) {
  const std::string path = testing::TempDir() + "/kvsparse-arena-test";
  auto arena = NewFileMemoryResource(path, 8 << 20);
  ASSERT_TRUE(arena.ok()) << arena.status();
  ASSERT_NE((*arena)->shared_arena(), nullptr);
  auto store = NewStore(8 << 20, CapacityPolicy::kReject, arena->get());
  const ModelShape s = Shape(DType::kFp32);
  ASSERT_TRUE(store->CreateSequence("a", s, {}).ok());
  std::vector<uint8_t> k, v;
  MakeRows(s, 0, 1, 0, 7, &k, &v);
  ASSERT_TRUE(AppendTokens(*store, "a", s, 0, 1, 0, 7).ok());
  std::ifstream f(path, std::ios::binary);
  const std::string file((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  // 8 MiB of data, a 4 KiB header and 8 bytes of generation per 4 KiB: 8 MiB + 20 KiB.
  EXPECT_EQ(file.size(), (size_t{8} << 20) + 4096 + 16384);
  const size_t row = s.row_bytes();  // the first K row: kv head 0, token 0
  EXPECT_NE(file.find(std::string(reinterpret_cast<const char*>(k.data()), row)),
            std::string::npos);
  // A file that cannot be made: INVALID_ARGUMENT naming it.
  EXPECT_EQ(NewFileMemoryResource("/nonexistent-dir/arena", 1 << 20).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Pages must start on a granule: a granule that is not a multiple of 4 KiB, or pages that are
  // not a multiple of the granule, are refused.
  EXPECT_EQ(NewFileMemoryResource(path + "-odd", 1 << 20, 6000).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto coarse = NewFileMemoryResource(path + "-coarse", 1 << 20, 16384);
  ASSERT_TRUE(coarse.ok());
  StoreOptions bad;
  bad.page_bytes = 8192;
  bad.capacity_bytes = 1 << 20;
  bad.memory = coarse->get();
  EXPECT_EQ(Store::Create(bad).status().code(), absl::StatusCode::kInvalidArgument);
  std::remove((path + "-coarse").c_str());
  // Neither a missing file nor a file of another kind maps as an arena.
  EXPECT_EQ(ArenaMapping::Open("/nonexistent-dir/arena").status().code(),
            absl::StatusCode::kNotFound);
  const std::string other = testing::TempDir() + "/kvsparse-not-an-arena";
  std::ofstream(other) << std::string(8192, 'x');
  EXPECT_EQ(ArenaMapping::Open(other).status().code(), absl::StatusCode::kFailedPrecondition);
  std::remove(other.c_str());
  std::remove(path.c_str());
}

// Rows copied in place from a mapping of the arena file equal Gather's; once the sequence's
// pages are freed (dropped, evicted) and written by another sequence, the copy reports it.
TEST(StoreTest, PageTableReadsRowsInPlaceAndDetectsReuse) {
  const std::string path = testing::TempDir() + "/kvsparse-arena-inplace";
  auto arena = NewFileMemoryResource(path, 1 << 20, 8192);  // a generation per 8 KiB page
  ASSERT_TRUE(arena.ok()) << arena.status();
  auto store = NewStore(1 << 20, CapacityPolicy::kEvictLru, arena->get());
  auto map = ArenaMapping::Open(path);
  ASSERT_TRUE(map.ok()) << map.status();
  const ModelShape s = Shape(DType::kBf16);  // 128-byte rows: 32 tokens per 8 KiB page
  ASSERT_TRUE(store->CreateSequence("a", s, {}).ok());
  ASSERT_TRUE(AppendTokens(*store, "a", s, 0, 2, 0, 100).ok());
  auto table = store->PageTable("a", 1, 0);
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(table->arena_id, (*map)->arena_id());
  EXPECT_EQ(table->layer_length, 100u);
  EXPECT_EQ(table->page_tokens, 32u);
  ASSERT_EQ(table->lanes.size(), s.num_kv_heads);
  const std::vector<uint32_t> tokens = {99, 0, 31, 32, 64, 5, 5};
  for (uint32_t h = 0; h < s.num_kv_heads; ++h) {
    ASSERT_EQ(table->lanes[h].size(), 4u);
    for (const PageRef& p : table->lanes[h]) EXPECT_TRUE((*map)->HoldsPage(p.offset, 8192));
    std::vector<uint8_t> k(tokens.size() * s.row_bytes()), v(k.size());
    ASSERT_TRUE((*map)->CopyRows(table->lanes[h], table->page_tokens, s.row_bytes(), tokens,
                                 RowKind::kKV, k.data(), v.data()));
    auto g = DoGather(*store, "a", 1, {{h, tokens}});
    ASSERT_TRUE(g.ok());
    EXPECT_EQ(k, g->k);
    EXPECT_EQ(v, g->v);
  }
  // From page 3 on: the last page only; a page index past the end: no pages.
  auto tail = store->PageTable("a", 1, 3);
  ASSERT_TRUE(tail.ok());
  ASSERT_EQ(tail->lanes[0].size(), 1u);
  EXPECT_EQ(tail->lanes[0][0].offset, table->lanes[0][3].offset);
  EXPECT_TRUE(store->PageTable("a", 1, 9)->lanes[0].empty());
  EXPECT_EQ(store->PageTable("a", 2, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->PageTable("zz", 0, 0).status().code(), absl::StatusCode::kNotFound);
  // Drop "a" and fill the arena with "b": "a"'s pages now hold "b"'s rows, and the copy says so.
  ASSERT_TRUE(store->DropSequence("a").ok());
  ASSERT_TRUE(store->CreateSequence("b", s, {}).ok());
  ASSERT_TRUE(AppendTokens(*store, "b", s, 0, 2, 0, 100).ok());
  std::vector<uint8_t> k(tokens.size() * s.row_bytes()), v(k.size());
  EXPECT_FALSE((*map)->CopyRows(table->lanes[0], table->page_tokens, s.row_bytes(), tokens,
                                RowKind::kKV, k.data(), v.data()));
  // Only K asked, only one page touched: still detected.
  EXPECT_FALSE((*map)->CopyRows(table->lanes[0], table->page_tokens, s.row_bytes(), {3},
                                RowKind::kK, k.data(), nullptr));
  // A store whose pages are not in a file has no page tables.
  auto plain = NewStore();
  ASSERT_TRUE(plain->CreateSequence("a", s, {}).ok());
  EXPECT_EQ(plain->PageTable("a", 0, 0).status().code(), absl::StatusCode::kFailedPrecondition);
  // A store started again on the same path makes a new file: the old mapping stays readable and
  // the new one has another arena id.
  store.reset();
  auto again = NewFileMemoryResource(path, 1 << 20, 8192);
  ASSERT_TRUE(again.ok());
  auto remap = ArenaMapping::Open(path);
  ASSERT_TRUE(remap.ok());
  EXPECT_NE((*remap)->arena_id(), (*map)->arena_id());
  EXPECT_FALSE((*map)->IsCurrent());
  EXPECT_TRUE((*remap)->IsCurrent());
  EXPECT_EQ((*again)->shared_arena()->arena_id(), (*remap)->arena_id());
  std::remove(path.c_str());
}

TEST(StoreTest, ExpectedLengthMakesRetriesSafe) {
  auto store = NewStore();
  const ModelShape s = Shape(DType::kFp16);
  ASSERT_TRUE(store->CreateSequence("a", s, {}).ok());
  std::vector<uint8_t> k, v;
  MakeRows(s, 0, 1, 0, 5, &k, &v);
  AppendRequest r;
  r.sequence_id = "a";
  r.num_tokens = 5;
  SetShape(s, &r);
  r.k = k;
  r.v = v;
  r.expected_length = 0;
  auto first = store->Append(r);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->bytes_appended, 2 * k.size());
  // The same append retried is refused and the layer still holds 5 tokens.
  EXPECT_EQ(store->Append(r).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store->GetSequenceInfo("a")->layer_lengths[0], 5u);
}

TEST(StoreTest, BadInputGetsClearCodesAndStoreKeepsServing) {
  auto store = NewStore();
  const ModelShape s = Shape(DType::kBf16);
  ASSERT_TRUE(store->CreateSequence("a", s, {}).ok());
  ASSERT_TRUE(AppendTokens(*store, "a", s, 0, 2, 0, 10).ok());
  using absl::StatusCode;
  // Create.
  EXPECT_EQ(store->CreateSequence("a", s, {}).status().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(store->CreateSequence("", s, {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store->CreateSequence("bad id", s, {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store->CreateSequence(std::string(200, 'x'), s, {}).status().code(),
            StatusCode::kInvalidArgument);
  ModelShape bad = s;
  bad.num_q_heads = 5;
  EXPECT_EQ(store->CreateSequence("b", bad, {}).status().code(), StatusCode::kInvalidArgument);
  bad = s;
  bad.head_dim = 0;
  EXPECT_EQ(store->CreateSequence("b", bad, {}).status().code(), StatusCode::kInvalidArgument);
  Placement dev;
  dev.k_tier = Tier::kDevice;
  EXPECT_TRUE(store->CreateSequence("dev", s, dev).ok());  // a worker placement: accepted
  Placement remote;
  remote.v_tier = Tier::kRemote;
  EXPECT_EQ(store->CreateSequence("b", s, remote).status().code(), StatusCode::kInvalidArgument);
  Placement bits;
  bits.signature_bits = 48;
  EXPECT_EQ(store->CreateSequence("b", s, bits).status().code(), StatusCode::kInvalidArgument);
  // Append.
  EXPECT_EQ(AppendTokens(*store, "nope", s, 0, 1, 0, 1).code(), StatusCode::kNotFound);
  EXPECT_EQ(AppendTokens(*store, "a", s, 1, 2, 10, 1).code(), StatusCode::kInvalidArgument);
  std::vector<uint8_t> k(10), v(10);
  AppendRequest r;
  r.sequence_id = "a";
  r.num_tokens = 1;
  SetShape(s, &r);
  r.k = k;
  r.v = v;  // wrong byte size for the shape
  EXPECT_EQ(store->Append(r).status().code(), StatusCode::kInvalidArgument);
  // Right byte size, wrong dtype (fp16 rows into a bf16 sequence): refused, not reinterpreted.
  std::vector<uint8_t> k1, v1;
  MakeRows(s, 0, 1, 10, 1, &k1, &v1);
  r.k = k1;
  r.v = v1;
  r.dtype = DType::kFp16;
  EXPECT_EQ(store->Append(r).status().code(), StatusCode::kInvalidArgument);
  r.dtype = s.dtype;
  r.num_kv_heads = 1;
  r.head_dim = 2 * s.head_dim;
  EXPECT_EQ(store->Append(r).status().code(), StatusCode::kInvalidArgument);
  SetShape(s, &r);
  r.num_tokens = 0;
  EXPECT_EQ(store->Append(r).status().code(), StatusCode::kInvalidArgument);
  r.num_tokens = 1ull << 40;  // oversized
  EXPECT_EQ(store->Append(r).status().code(), StatusCode::kOutOfRange);
  // Gather.
  const std::vector<uint32_t> ok_tokens = {0, 9};
  const std::vector<uint32_t> past = {0, 10};
  EXPECT_EQ(DoGather(*store, "nope", 0, {{0, ok_tokens}}).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(DoGather(*store, "a", 2, {{0, ok_tokens}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(DoGather(*store, "a", 0, {{2, ok_tokens}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(DoGather(*store, "a", 0, {{0, past}}).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(DoGather(*store, "a", 0, {}).status().code(), StatusCode::kInvalidArgument);
  std::vector<uint32_t> huge(300000, 3);  // 300k x 2 x 128 B > the default limit? use options
  StoreOptions small;
  small.capacity_bytes = 1 << 20;
  small.page_bytes = 8192;
  small.max_gather_bytes = 4096;
  auto tiny = *Store::Create(small);
  ASSERT_TRUE(tiny->CreateSequence("a", s, {}).ok());
  ASSERT_TRUE(AppendTokens(*tiny, "a", s, 0, 1, 0, 4).ok());
  EXPECT_EQ(DoGather(*tiny, "a", 0, {{0, std::vector<uint32_t>(64, 1)}}).status().code(),
            StatusCode::kResourceExhausted);
  // Nothing above changed the data, and the next valid calls succeed.
  auto g = DoGather(*store, "a", 1, {{1, ok_tokens}});
  ASSERT_TRUE(g.ok());
  ExpectRow(s, g->v.data() + s.row_bytes(), 1, 1, 9, 1);
  EXPECT_EQ(store->GetSequenceInfo("a")->layer_lengths, (std::vector<uint64_t>{10, 10}));
  EXPECT_TRUE(AppendTokens(*store, "a", s, 0, 2, 10, 1).ok());
}

TEST(StoreTest, DeadlineInThePastIsRefused) {
  auto store = NewStore();
  const ModelShape s = Shape(DType::kBf16);
  ASSERT_TRUE(store->CreateSequence("a", s, {}).ok());
  std::vector<uint8_t> k, v;
  MakeRows(s, 0, 1, 0, 1, &k, &v);
  AppendRequest r;
  r.sequence_id = "a";
  r.num_tokens = 1;
  SetShape(s, &r);
  r.k = k;
  r.v = v;
  r.deadline = absl::Now() - absl::Seconds(1);
  EXPECT_EQ(store->Append(r).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(store->GetSequenceInfo("a")->layer_lengths[0], 0u);
}

// Capacity in pages: Shape(bf16, 2 layers, 2 heads, d=64) -> 256 B per token slot, 32 tokens
// per 8 KiB page, 4 lanes: 32 tokens cost 4 pages = 32 KiB.
constexpr size_t kPage = 8192;
// Room beside the pages for the sequences' bookkeeping (a few hundred bytes each, charged to the
// capacity from creation), less than a page: the tests below count in whole pages.
constexpr size_t kSlack = 4096;

TEST(StoreTest, RejectPolicyRefusesAppendsButKeepsReadsAndDrops) {
  auto store = NewStore(8 * kPage + kSlack, CapacityPolicy::kReject);
  const ModelShape s = Shape(DType::kBf16);
  ASSERT_TRUE(store->CreateSequence("a", s, {}).ok());
  ASSERT_TRUE(store->CreateSequence("b", s, {}).ok());
  ASSERT_TRUE(AppendTokens(*store, "a", s, 0, 2, 0, 32).ok());  // 4 pages
  ASSERT_TRUE(AppendTokens(*store, "b", s, 0, 2, 0, 32).ok());  // 4 pages: full
  EXPECT_EQ(store->Stats().pages_used, 8u);
  EXPECT_EQ(AppendTokens(*store, "a", s, 0, 2, 32, 1).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store->Stats().rejections, 1u);
  // Nothing half-appended; reads still work.
  EXPECT_EQ(store->GetSequenceInfo("a")->layer_lengths[0], 32u);
  auto g = DoGather(*store, "a", 1, {{1, std::vector<uint32_t>{31}}});
  ASSERT_TRUE(g.ok());
  ExpectRow(s, g->k.data(), 1, 1, 31, 0);
  // Dropping frees room.
  auto freed = store->DropSequence("b");
  ASSERT_TRUE(freed.ok());
  EXPECT_GT(*freed, 4 * kPage);  // its pages and its bookkeeping
  EXPECT_LT(*freed, 4 * kPage + kSlack / 2);
  EXPECT_TRUE(AppendTokens(*store, "a", s, 0, 2, 32, 1).ok());
  EXPECT_EQ(store->Stats().evictions, 0u);
}

TEST(StoreTest, EvictLruEvictsLeastRecentlyUsedIdleSequence) {
  auto store = NewStore(12 * kPage + kSlack, CapacityPolicy::kEvictLru);
  const ModelShape s = Shape(DType::kBf16);
  for (const char* id : {"a", "b", "c"}) {
    ASSERT_TRUE(store->CreateSequence(id, s, {}).ok());
    ASSERT_TRUE(AppendTokens(*store, id, s, 0, 2, 0, 32).ok());
  }
  // Touch a: b is now the least recently used.
  ASSERT_TRUE(DoGather(*store, "a", 0, {{0, std::vector<uint32_t>{0}}}).ok());
  ASSERT_TRUE(store->CreateSequence("d", s, {}).ok());
  ASSERT_TRUE(AppendTokens(*store, "d", s, 0, 2, 0, 32).ok());
  EXPECT_EQ(store->Stats().evictions, 1u);
  EXPECT_EQ(DoGather(*store, "b", 0, {{0, std::vector<uint32_t>{0}}}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(DoGather(*store, "a", 0, {{0, std::vector<uint32_t>{0}}}).ok());
  EXPECT_TRUE(DoGather(*store, "c", 0, {{0, std::vector<uint32_t>{0}}}).ok());
  EXPECT_EQ(store->Stats().pages_used, 12u);
}

// A sequence with a call in flight is never evicted: the gather allocator runs while the
// gather holds its pin, and an append that needs room evicts the other, idle sequence.
// An append that cannot fit even with every idle sequence evicted (larger than the store) is
// refused and evicts nobody. Failed before: it evicted every idle sequence, then was refused.
TEST(StoreTest, EvictLruRefusesWhatCannotFitWithoutEvicting) {
  auto store = NewStore(64 * kPage, CapacityPolicy::kEvictLru);
  const ModelShape s = Shape(DType::kBf16);  // 32 tokens a page per (layer, kv head): 4 lanes
  for (const char* id : {"x", "y", "big"}) ASSERT_TRUE(store->CreateSequence(id, s, {}).ok());
  ASSERT_TRUE(AppendTokens(*store, "x", s, 0, 2, 0, 64).ok());  // 8 pages each
  ASSERT_TRUE(AppendTokens(*store, "y", s, 0, 2, 0, 64).ok());
  const absl::Status too_big = AppendTokens(*store, "big", s, 0, 2, 0, 32 * 80);  // 320 pages
  EXPECT_EQ(too_big.code(), absl::StatusCode::kResourceExhausted) << too_big;
  EXPECT_TRUE(absl::StrContains(too_big.message(), "nothing was evicted")) << too_big;
  EXPECT_EQ(store->Stats().evictions, 0u);
  EXPECT_TRUE(store->GetSequenceInfo("x").ok());
  EXPECT_TRUE(store->GetSequenceInfo("y").ok());
  // One that fits once an idle sequence goes still evicts (40 pages of the 48 left + 8).
  EXPECT_TRUE(AppendTokens(*store, "big", s, 0, 2, 0, 32 * 13).ok());
  EXPECT_EQ(store->Stats().evictions, 1u);
}

TEST(StoreTest, EvictLruNeverEvictsASequenceInFlight) {
  auto store = NewStore(8 * kPage + kSlack, CapacityPolicy::kEvictLru);
  const ModelShape s = Shape(DType::kBf16);
  for (const char* id : {"busy", "idle", "new"}) ASSERT_TRUE(store->CreateSequence(id, s, {}).ok());
  ASSERT_TRUE(AppendTokens(*store, "busy", s, 0, 2, 0, 32).ok());
  ASSERT_TRUE(AppendTokens(*store, "idle", s, 0, 2, 0, 32).ok());
  ASSERT_TRUE(DoGather(*store, "idle", 0, {{0, std::vector<uint32_t>{0}}}).ok());  // busy is LRU
  std::vector<uint8_t> k(32 * s.row_bytes()), v(k.size());
  const std::vector<uint32_t> toks = {0, 31};
  const std::vector<HeadSelection> heads = {{0, toks}};
  GatherRequest r;
  r.sequence_id = "busy";
  r.heads = heads;
  absl::Status inner;
  auto res = store->Gather(r, [&](uint64_t rows, size_t row) -> absl::StatusOr<GatherBuffers> {
    inner = AppendTokens(*store, "new", s, 0, 2, 0, 32);
    return GatherBuffers{k.data(), v.data()};
  });
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_TRUE(inner.ok()) << inner;
  ExpectRow(s, k.data() + s.row_bytes(), 0, 0, 31, 0);
  EXPECT_EQ(store->GetSequenceInfo("idle").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store->GetSequenceInfo("busy").ok());
  // With every other sequence busy, an append that needs room is refused, not served by
  // evicting a sequence in flight.
  auto res2 = store->Gather(r, [&](uint64_t, size_t) -> absl::StatusOr<GatherBuffers> {
    EXPECT_TRUE(store->CreateSequence("x", s, {}).ok());
    inner = AppendTokens(*store, "new", s, 0, 2, 32, 32);
    return GatherBuffers{k.data(), v.data()};
  });
  ASSERT_TRUE(res2.ok());
  EXPECT_EQ(inner.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(store->GetSequenceInfo("busy").ok());
}

// Dropping a sequence while a gather reads it: the gather finishes with intact rows.
TEST(StoreTest, DropDuringGatherKeepsRowsIntact) {
  auto store = NewStore();
  const ModelShape s = Shape(DType::kFp32);
  ASSERT_TRUE(store->CreateSequence("a", s, {}).ok());
  ASSERT_TRUE(AppendTokens(*store, "a", s, 0, 2, 0, 100).ok());
  std::vector<uint8_t> k(s.row_bytes()), v(s.row_bytes());
  const std::vector<uint32_t> toks = {77};
  const std::vector<HeadSelection> heads = {{1, toks}};
  GatherRequest r;
  r.sequence_id = "a";
  r.layer = 1;
  r.heads = heads;
  auto res = store->Gather(r, [&](uint64_t, size_t) -> absl::StatusOr<GatherBuffers> {
    EXPECT_TRUE(store->DropSequence("a").ok());
    return GatherBuffers{k.data(), v.data()};
  });
  ASSERT_TRUE(res.ok());
  ExpectRow(s, k.data(), 1, 1, 77, 0);
  ExpectRow(s, v.data(), 1, 1, 77, 1);
  EXPECT_EQ(store->Stats().pages_used, 0u);  // freed once the gather released its pin
}

// A memory resource that fails after a number of slab allocations.
class FailingMemory final : public MemoryResource {
 public:
  explicit FailingMemory(int allow) : allow_(allow), host_(NewHostMemoryResource()) {}
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (allow_-- <= 0) return absl::ResourceExhaustedError("injected allocation failure");
    return host_->Allocate(bytes);
  }
  void Deallocate(void* p, size_t bytes) override { host_->Deallocate(p, bytes); }
  absl::string_view name() const override { return "failing"; }

 private:
  std::atomic<int> allow_;
  std::unique_ptr<MemoryResource> host_;
};

TEST(StoreTest, AllocationFailureAppendsNothing) {
  FailingMemory memory(1);  // one 1 MiB slab = 128 pages, then failures
  auto store = NewStore(64 << 20, CapacityPolicy::kReject, &memory);
  const ModelShape s = Shape(DType::kBf16);
  ASSERT_TRUE(store->CreateSequence("a", s, {}).ok());
  ASSERT_TRUE(AppendTokens(*store, "a", s, 0, 2, 0, 32 * 30).ok());  // 120 pages
  EXPECT_EQ(AppendTokens(*store, "a", s, 0, 2, 960, 32 * 5).code(),
            absl::StatusCode::kResourceExhausted);  // needs 20 pages: slab allocation fails
  EXPECT_EQ(store->GetSequenceInfo("a")->layer_lengths[0], 960u);
  EXPECT_EQ(store->Stats().pages_used, 120u);
  // Smaller appends still fit in the slab that was mapped.
  EXPECT_TRUE(AppendTokens(*store, "a", s, 0, 2, 960, 32).ok());
  auto g = DoGather(*store, "a", 1, {{1, std::vector<uint32_t>{0, 991}}});
  ASSERT_TRUE(g.ok());
  ExpectRow(s, g->v.data() + s.row_bytes(), 1, 1, 991, 1);
}

// The host resource, counting what the pool gives back.
class CountingMemory final : public MemoryResource {
 public:
  absl::StatusOr<void*> Allocate(size_t bytes) override { return host_->Allocate(bytes); }
  void Deallocate(void* p, size_t bytes) override { host_->Deallocate(p, bytes); }
  void Release(void* p, size_t bytes) override {
    released_bytes += bytes;
    host_->Release(p, bytes);
  }
  absl::string_view name() const override { return "counting"; }
  size_t released_bytes = 0;

 private:
  std::unique_ptr<MemoryResource> host_ = NewHostMemoryResource();
};

// Resident memory of this process (Linux: /proc/self/statm), in bytes.
size_t ResidentBytes() {
  std::ifstream f("/proc/self/statm");
  size_t pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * static_cast<size_t>(sysconf(_SC_PAGESIZE));
}

// A slab none of whose pages is in use goes back to the operating system (RSS drops); a slab
// that still holds a page of a live sequence stays; released pages are reused with their rows
// intact. Failed before: a drop kept every slab resident until the store was destroyed.
TEST(StoreTest, DropsGiveWholeSlabsBackToTheSystem) {
  CountingMemory memory;
  auto store = NewStore(64 << 20, CapacityPolicy::kReject, &memory);  // 1 MiB slabs
  const ModelShape s = Shape(DType::kBf16);  // 1 KiB a token over both layers
  ASSERT_TRUE(store->CreateSequence("a", s, {}).ok());
  ASSERT_TRUE(store->CreateSequence("b", s, {}).ok());
  ASSERT_TRUE(AppendTokens(*store, "b", s, 0, 2, 0, 8).ok());          // b's pages: the first slab
  ASSERT_TRUE(AppendTokens(*store, "a", s, 0, 2, 0, 40 * 1024).ok());  // 40 MiB
  const size_t before = ResidentBytes();
  ASSERT_TRUE(store->DropSequence("a").ok());
  const size_t after = ResidentBytes();
  // a's pages fill about 40 slabs; the first, which also holds b's, stays.
  EXPECT_GE(memory.released_bytes, 39u << 20);
  EXPECT_LE(memory.released_bytes, 40u << 20);
  EXPECT_GE(before, after + (32u << 20)) << before << " -> " << after;
  auto g = DoGather(*store, "b", 1, {{1, std::vector<uint32_t>{0, 7}}});
  ASSERT_TRUE(g.ok()) << g.status();
  ExpectRow(s, g->k.data(), 1, 1, 0, 0);
  ExpectRow(s, g->v.data() + s.row_bytes(), 1, 1, 7, 1);
  // The released pages take new rows.
  ASSERT_TRUE(store->CreateSequence("c", s, {}).ok());
  ASSERT_TRUE(AppendTokens(*store, "c", s, 0, 2, 0, 20 * 1024).ok());
  auto c = DoGather(*store, "c", 0, {{0, std::vector<uint32_t>{0, 12345, 20479}}});
  ASSERT_TRUE(c.ok()) << c.status();
  ExpectRow(s, c->k.data(), 0, 0, 0, 0);
  ExpectRow(s, c->k.data() + s.row_bytes(), 0, 0, 12345, 0);
  ExpectRow(s, c->v.data() + 2 * s.row_bytes(), 0, 0, 20479, 1);
}

// Appenders and gatherers racing with drops and evictions. Each appender owns a series of
// sequences and never reuses an id, so a sequence only grows until it is dropped or evicted:
// a gatherer must get every row it asks for (below a length it observed), intact, or NOT_FOUND.
// Run under ASan/UBSan and TSan in CI (KVSPARSE_SANITIZE / KVSPARSE_TSAN).
TEST(StoreTest, ConcurrentAppendersAndGatherers) {
  // 32 pages: one sequence grows to 40 pages (291 tokens x 4 lanes) before its drop, so
  // evictions and refusals are certain.
  auto store = NewStore(32 * kPage, CapacityPolicy::kEvictLru);
  const ModelShape s = Shape(DType::kBf16);
  constexpr int kAppenders = 3, kGatherers = 3, kIters = 300;
  std::atomic<int> appenders_done{0};
  std::atomic<uint64_t> rows_checked{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < kAppenders; ++w) {
    threads.emplace_back([&, w] {
      int gen = 0;
      std::string id = "a" + std::to_string(w) + "-0";
      ASSERT_TRUE(store->CreateSequence(id, s, {}).ok());
      uint64_t len = 0;
      // Past kIters until a gatherer has checked rows: on a loaded machine the gatherers may
      // not run at all while the appenders do, and what the appenders leave may be empty.
      for (int i = 0; i < kIters || rows_checked.load() == 0; ++i) {
        absl::Status st = AppendTokens(*store, id, s, 0, 2, len, 3);
        if (st.ok()) {
          len += 3;
        } else if (st.code() == absl::StatusCode::kNotFound ||           // evicted
                   st.code() == absl::StatusCode::kResourceExhausted) {  // all others busy
        } else {
          ADD_FAILURE() << st;
        }
        if (st.ok() && len > 0 && i % 41 == 40) {  // go on in a fork of it, the source dropped
          const std::string fork = "f" + std::to_string(w) + "-" + std::to_string(++gen);
          auto forked = store->ForkSequence(id, fork, len);
          if (forked.ok()) {
            (void)store->DropSequence(id);
            id = fork;
            continue;
          }
          EXPECT_TRUE(absl::IsNotFound(forked.status()) ||
                      absl::IsResourceExhausted(forked.status()))
              << forked.status();
        }
        if (!st.ok() || i % 97 == 96) {
          (void)store->DropSequence(id);
          id = "a" + std::to_string(w) + "-" + std::to_string(++gen);
          ASSERT_TRUE(store->CreateSequence(id, s, {}).ok());
          len = 0;
        }
      }
      ++appenders_done;
    });
  }
  for (int w = 0; w < kGatherers; ++w) {
    threads.emplace_back([&, w] {
      std::mt19937 rng(w);
      // Until the appenders finish, then a few more rounds over what they left behind.
      for (int after = 0; after < 20; after += appenders_done.load() == kAppenders) {
        std::vector<SequenceInfo> seqs = store->ListSequences();
        if (seqs.empty()) continue;
        const SequenceInfo& info = seqs[rng() % seqs.size()];
        const uint64_t n = info.layer_lengths[1];
        if (n == 0) continue;
        const std::vector<uint32_t> toks = {0, static_cast<uint32_t>(n - 1),
                                            static_cast<uint32_t>(rng() % n)};
        auto g = DoGather(*store, info.sequence_id, 1, {{1, toks}});
        if (!g.ok()) {
          EXPECT_EQ(g.status().code(), absl::StatusCode::kNotFound) << g.status();
          continue;
        }
        for (size_t j = 0; j < toks.size(); ++j) {
          for (size_t b = 0; b < s.row_bytes(); ++b) {
            ASSERT_EQ(g->k[j * s.row_bytes() + b], RowByte(1, 1, toks[j], 0, b));
            ASSERT_EQ(g->v[j * s.row_bytes() + b], RowByte(1, 1, toks[j], 1, b));
          }
        }
        rows_checked += toks.size();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_GT(rows_checked.load(), 0u);
  const StoreStats st = store->Stats();
  EXPECT_LE(st.bytes_used, st.capacity_bytes);
  EXPECT_GT(st.evictions + st.rejections, 0u);  // the capacity path was exercised
  // Every page and byte comes back, shared ones too.
  for (const SequenceInfo& info : store->ListSequences()) {
    ASSERT_TRUE(store->DropSequence(info.sequence_id).ok());
  }
  EXPECT_EQ(store->Stats().pages_used, 0u);
  EXPECT_EQ(store->Stats().bytes_used, 0u);
}

// A fork holds the source's first tokens: whole pages shared (counted once), the boundary page
// copied; each then appends on its own, and either outlives the other.
TEST(StoreTest, ForkSharesWholePagesAndCopiesTheBoundary) {
  auto store = NewStore();
  const ModelShape s = Shape(DType::kBf16);  // 32 tokens a page, 4 lanes
  ASSERT_TRUE(store->CreateSequence("src", s, {}).ok());
  ASSERT_TRUE(AppendTokens(*store, "src", s, 0, 2, 0, 80).ok());  // 3 pages a lane
  EXPECT_EQ(store->Stats().pages_used, 12u);
  auto fork = store->ForkSequence("src", "f", 70);
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_EQ(fork->layer_lengths, std::vector<uint64_t>(2, 70));
  EXPECT_EQ(fork->bytes_shared, 8 * kPage);  // 2 whole pages a lane
  EXPECT_NE(fork->incarnation, store->GetSequenceInfo("src")->incarnation);
  EXPECT_EQ(store->GetSequenceInfo("src")->bytes_shared, 8 * kPage);
  EXPECT_EQ(store->Stats().pages_used, 16u);  // one copied page a lane
  EXPECT_EQ(store->HeldBy([](absl::string_view) { return true; }).bytes, store->Stats().bytes_used);
  std::vector<uint32_t> prefix(70), past = {70};
  for (uint32_t t = 0; t < 70; ++t) prefix[t] = t;
  auto expect_rows = [&](absl::string_view id, uint32_t layer, uint32_t h,
                         const std::vector<uint32_t>& toks, uint64_t shift_from, uint64_t shift) {
    auto g = DoGather(*store, id, layer, {{h, toks}});
    ASSERT_TRUE(g.ok()) << g.status();
    for (size_t i = 0; i < toks.size(); ++i) {
      const uint64_t t = toks[i] >= shift_from ? toks[i] + shift : toks[i];
      ExpectRow(s, g->k.data() + i * s.row_bytes(), layer, h, t, 0);
      ExpectRow(s, g->v.data() + i * s.row_bytes(), layer, h, t, 1);
    }
  };
  for (uint32_t layer = 0; layer < 2; ++layer) {
    for (uint32_t h = 0; h < 2; ++h) expect_rows("f", layer, h, prefix, 70, 0);
  }
  EXPECT_EQ(DoGather(*store, "f", 0, {{0, past}}).status().code(), absl::StatusCode::kOutOfRange);
  // The fork's tokens 70.. are other rows (those of tokens 1070..); the source's stay its own.
  std::vector<uint8_t> k, v;
  MakeRows(s, 0, 2, 1070, 30, &k, &v);
  ASSERT_TRUE(store->Append(RequestOf("f", s, 0, 2, 30, k, v)).ok());
  ASSERT_TRUE(AppendTokens(*store, "src", s, 0, 2, 80, 20).ok());
  std::vector<uint32_t> all(100);
  for (uint32_t t = 0; t < 100; ++t) all[t] = t;
  expect_rows("f", 1, 1, all, 70, 1000);
  expect_rows("src", 1, 1, all, 100, 0);
  // The source dropped: only its own pages come back; the fork reads on.
  const uint64_t src_bytes = store->GetSequenceInfo("src")->bytes_used;
  auto freed = store->DropSequence("src");
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, src_bytes - 8 * kPage);
  expect_rows("f", 0, 0, all, 70, 1000);
  auto f = store->GetSequenceInfo("f");
  EXPECT_EQ(f->bytes_shared, 0u);
  EXPECT_EQ(store->Stats().bytes_used, f->bytes_used);
  ASSERT_TRUE(store->DropSequence("f").ok());
  EXPECT_EQ(store->Stats().pages_used, 0u);
  EXPECT_EQ(store->Stats().bytes_used, 0u);
}

// A fork that cannot be made says why and holds nothing.
TEST(StoreTest, RefusedForkHoldsNothing) {
  auto store = NewStore();
  const ModelShape s = Shape(DType::kBf16);
  ASSERT_TRUE(store->CreateSequence("src", s, {}).ok());
  ASSERT_TRUE(AppendTokens(*store, "src", s, 0, 2, 0, 40).ok());
  ASSERT_TRUE(AppendTokens(*store, "src", s, 0, 1, 40, 20).ok());  // layer 0: 60, layer 1: 40
  ASSERT_TRUE(store->CreateSequence("taken", s, {}).ok());
  const StoreStats before = store->Stats();
  Placement bad;
  bad.compressed_key_bits = 3;  // not a form of compressed keys
  const struct {
    const char* source;
    const char* id;
    uint64_t n;
    std::optional<Placement> placement;
    absl::StatusCode code;
  } cases[] = {
      {"nope", "f", 10, std::nullopt, absl::StatusCode::kNotFound},
      {"src", "f", 0, std::nullopt, absl::StatusCode::kInvalidArgument},
      {"src", "f", 50, std::nullopt, absl::StatusCode::kFailedPrecondition},  // layer 1 holds 40
      {"src", "taken", 10, std::nullopt, absl::StatusCode::kAlreadyExists},
      {"src", "bad id!", 10, std::nullopt, absl::StatusCode::kInvalidArgument},
      {"src", "f", 10, bad, absl::StatusCode::kInvalidArgument},
  };
  for (const auto& c : cases) {
    auto got = store->ForkSequence(c.source, c.id, c.n, c.placement);
    EXPECT_EQ(got.status().code(), c.code) << c.source << " -> " << c.id << ": " << got.status();
    const StoreStats after = store->Stats();
    EXPECT_EQ(after.bytes_used, before.bytes_used) << c.id;
    EXPECT_EQ(after.pages_used, before.pages_used);
    EXPECT_EQ(after.num_sequences, before.num_sequences);
  }
  EXPECT_EQ(store->GetSequenceInfo("src")->bytes_shared, 0u);
  EXPECT_TRUE(store->ForkSequence("src", "f", 40).ok());  // the store keeps serving
}

// Pages a fork shares cost no page twice, but its page pointers and the sets of shared pages are
// memory a client makes the store hold: charged, and given back with the sequences.
TEST(StoreTest, ForksChargeTheirPagePointers) {
  auto store = NewStore();
  const ModelShape s = Shape(DType::kBf16);
  ASSERT_TRUE(store->CreateSequence("src", s, {}).ok());
  ASSERT_TRUE(AppendTokens(*store, "src", s, 0, 2, 0, 32 * 20).ok());  // 20 whole pages a lane
  const StoreStats one = store->Stats();
  ASSERT_TRUE(store->ForkSequence("src", "f1", 32 * 20).ok());
  const StoreStats two = store->Stats();
  EXPECT_EQ(two.pages_used, one.pages_used);  // nothing copied: a page boundary
  EXPECT_GE(two.bytes_used - one.bytes_used, 80 * 3 * sizeof(uint8_t*));
  ASSERT_TRUE(store->ForkSequence("src", "f2", 32 * 20).ok());
  const uint64_t third = store->Stats().bytes_used - two.bytes_used;
  EXPECT_LT(third, two.bytes_used - one.bytes_used);  // the source's set did not grow again
  EXPECT_EQ(store->HeldBy([](absl::string_view id) { return id != "f2"; }).bytes, two.bytes_used);
  for (const char* id : {"src", "f1", "f2"}) ASSERT_TRUE(store->DropSequence(id).ok());
  EXPECT_EQ(store->Stats().bytes_used, 0u);
}

// Under evict-lru a page shared with a sequence in use is not room: an append that only evicting
// it would make fit is refused with nothing evicted; once every holder is idle it fits.
TEST(StoreTest, EvictLruCountsASharedPageAsRoomOnlyWhenEveryHolderIsIdle) {
  auto store = NewStore(40 * kPage + kPage / 2, CapacityPolicy::kEvictLru);
  const ModelShape s = Shape(DType::kBf16);
  ASSERT_TRUE(store->CreateSequence("a", s, {}).ok());
  ASSERT_TRUE(AppendTokens(*store, "a", s, 0, 2, 0, 64).ok());  // 8 pages
  ASSERT_TRUE(store->ForkSequence("a", "b", 64).ok());          // the same 8 pages
  ASSERT_TRUE(store->CreateSequence("c", s, {}).ok());
  EXPECT_EQ(store->Stats().pages_used, 8u);
  {
    auto view = store->View("b");  // b in use
    ASSERT_TRUE(view.ok());
    const absl::Status st = AppendTokens(*store, "c", s, 0, 2, 0, 32 * 9);  // 36 pages
    EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
    EXPECT_TRUE(absl::StrContains(st.message(), "nothing was evicted")) << st;
    EXPECT_EQ(store->Stats().evictions, 0u);
    EXPECT_TRUE(store->GetSequenceInfo("a").ok());
  }
  ASSERT_TRUE(AppendTokens(*store, "c", s, 0, 2, 0, 32 * 9).ok());
  EXPECT_EQ(store->Stats().evictions, 2u);
  EXPECT_EQ(store->Stats().pages_used, 36u);
}

TEST(StoreTest, PageViewGivesRowAddressesAndHoldsTheSequence) {
  auto store = NewStore(8 * kPage + kSlack, CapacityPolicy::kEvictLru);
  const ModelShape s = Shape(DType::kBf16);
  ASSERT_TRUE(store->CreateSequence("a", s, {}).ok());
  ASSERT_TRUE(store->CreateSequence("b", s, {}).ok());
  ASSERT_TRUE(AppendTokens(*store, "a", s, 0, 2, 0, 40).ok());  // 2 pages per lane: 8 pages
  EXPECT_EQ(store->View("nope").status().code(), absl::StatusCode::kNotFound);
  {
    auto view = store->View("a");
    ASSERT_TRUE(view.ok());
    EXPECT_EQ((*view)->layer_length(1), 40u);
    for (uint64_t t : {0u, 31u, 32u, 39u}) {
      ExpectRow(s, (*view)->KRow(1, 1, t), 1, 1, t, 0);
      ExpectRow(s, (*view)->KRow(1, 1, t) + (*view)->row_bytes(), 1, 1, t, 1);
    }
    // "a" is viewed: an append to "b" that needs room cannot evict it, and fails.
    EXPECT_EQ(AppendTokens(*store, "b", s, 0, 2, 0, 1).code(),
              absl::StatusCode::kResourceExhausted);
    // An append to "a" itself waits for the view to go.
    std::atomic<bool> appended{false};
    std::thread writer([&] {
      EXPECT_TRUE(AppendTokens(*store, "a", s, 0, 2, 40, 1).ok());  // fits in its last page
      appended = true;
    });
    absl::SleepFor(absl::Milliseconds(50));
    EXPECT_FALSE(appended.load());
    view->reset();
    writer.join();
  }
  // Without a view, the LRU policy may evict "a" for "b".
  EXPECT_TRUE(AppendTokens(*store, "b", s, 0, 2, 0, 1).ok());
  EXPECT_EQ(store->GetSequenceInfo("a").status().code(), absl::StatusCode::kNotFound);
}

// A reservation adds pages ahead of the lengths; rows written into its slots become the
// sequence's when committed, later appends fill the reserved pages, and the reservation pins the
// sequence (no eviction; a drop returns the pages only when it is released).
TEST(StoreTest, ReservedPagesTakeRowsWrittenInPlace) {
  auto store = NewStore(24 * kPage, CapacityPolicy::kEvictLru);
  const ModelShape s = Shape(DType::kBf16);  // 32 tokens per page, 4 lanes
  ASSERT_TRUE(store->CreateSequence("a", s, {}).ok());
  ASSERT_TRUE(AppendTokens(*store, "a", s, 0, 2, 0, 40).ok());  // 2 pages per lane
  EXPECT_EQ(store->Reserve("nope", 8).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->Reserve("a", 1ull << 30).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(store->Stats().pages_used, 8u);
  auto r = store->Reserve("a", 70);  // 3 pages per lane
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->tokens(), 96u);
  EXPECT_EQ(store->Stats().pages_used, 12u);
  EXPECT_EQ(store->GetSequenceInfo("a")->layer_lengths, (std::vector<uint64_t>{40, 40}));
  // Tokens 40..44 written in place, as a device would, then committed.
  const size_t row = s.row_bytes();
  for (uint32_t l = 0; l < 2; ++l)
    for (uint32_t h = 0; h < 2; ++h)
      for (uint64_t t = 40; t < 45; ++t) {
        uint8_t* slot = (*r)->Slot(l, h, t);
        for (size_t b = 0; b < row; ++b) {
          slot[b] = RowByte(l, h, t, 0, b);
          slot[row + b] = RowByte(l, h, t, 1, b);
        }
      }
  EXPECT_EQ(store->CommitWritten("a", 0, 2, 41, 5).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store->CommitWritten("a", 0, 2, 40, 57).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(store->CommitWritten("a", 1, 2, 40, 5).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(store->CommitWritten("a", 0, 2, 40, 5).ok());
  EXPECT_EQ(store->GetSequenceInfo("a")->layer_lengths, (std::vector<uint64_t>{45, 45}));
  std::vector<uint32_t> toks = {0, 39, 40, 44};
  auto g = DoGather(*store, "a", 1, {{1, toks}});
  ASSERT_TRUE(g.ok()) << g.status();
  for (size_t i = 0; i < toks.size(); ++i) {
    ExpectRow(s, g->k.data() + i * row, 1, 1, toks[i], 0);
    ExpectRow(s, g->v.data() + i * row, 1, 1, toks[i], 1);
  }
  // An append into the reserved pages takes none more.
  ASSERT_TRUE(AppendTokens(*store, "a", s, 0, 2, 45, 40).ok());
  EXPECT_EQ(store->Stats().pages_used, 12u);
  ASSERT_TRUE(AppendTokens(*store, "a", s, 0, 2, 85, 20).ok());  // past them: a fourth page
  EXPECT_EQ(store->Stats().pages_used, 16u);
  toks = {95, 96, 104};
  g = DoGather(*store, "a", 0, {{0, toks}});
  ASSERT_TRUE(g.ok()) << g.status();
  for (size_t i = 0; i < toks.size(); ++i) ExpectRow(s, g->k.data() + i * row, 0, 0, toks[i], 0);
  // Pinned: another sequence's append cannot evict "a".
  ASSERT_TRUE(store->CreateSequence("b", s, {}).ok());
  EXPECT_EQ(AppendTokens(*store, "b", s, 0, 2, 0, 100).code(),
            absl::StatusCode::kResourceExhausted);
  // Dropped while reserved: the pages go back when the reservation does.
  ASSERT_TRUE(store->DropSequence("a").ok());
  EXPECT_EQ(store->Stats().pages_used, 16u);
  EXPECT_EQ((*r)->Slot(0, 0, 95)[0], RowByte(0, 0, 95, 0, 0));  // still readable
  r->reset();
  EXPECT_EQ(store->Stats().pages_used, 0u);
  EXPECT_EQ(store->CommitWritten("a", 0, 2, 105, 1).status().code(), absl::StatusCode::kNotFound);
}

// A reservation that does not fit allocates nothing.
TEST(StoreTest, ReservationPastCapacityTakesNothing) {
  auto store = NewStore(8 * kPage + kSlack);
  const ModelShape s = Shape(DType::kBf16);
  ASSERT_TRUE(store->CreateSequence("a", s, {}).ok());
  ASSERT_TRUE(AppendTokens(*store, "a", s, 0, 2, 0, 10).ok());
  EXPECT_EQ(store->Reserve("a", 96).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store->Stats().pages_used, 4u);
  auto r = store->Reserve("a", 64);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(store->Stats().pages_used, 8u);
}

// What a sequence costs before its first token is charged to the capacity: a wide shape's page
// lists (1024 layers x 1024 kv heads: 24 MiB of bookkeeping) fill the store, refused with
// RESOURCE_EXHAUSTED beyond it, and dropping gives it back. (bytes_used did not move before.)
TEST(StoreTest, EmptySequencesBookkeepingCountsAgainstTheCapacity) {
  auto store = NewStore(64 << 20, CapacityPolicy::kReject);
  const ModelShape wide{1024, 1024, 1024, 8, DType::kBf16};
  const size_t lanes = sizeof(std::vector<uint8_t*>) * 1024 * 1024;
  ASSERT_TRUE(store->CreateSequence("w0", wide, {}).ok());
  EXPECT_GE(store->Stats().bytes_used, lanes);
  EXPECT_GE(store->GetSequenceInfo("w0")->bytes_used, lanes);
  ASSERT_TRUE(store->CreateSequence("w1", wide, {}).ok());
  auto third = store->CreateSequence("w2", wide, {});
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted) << third.status();
  EXPECT_EQ(store->Stats().num_sequences, 2u);
  auto freed = store->DropSequence("w0");
  ASSERT_TRUE(freed.ok());
  EXPECT_GE(*freed, lanes);
  EXPECT_TRUE(store->CreateSequence("w2", wide, {}).ok());
  ASSERT_TRUE(store->DropSequence("w1").ok());
  ASSERT_TRUE(store->DropSequence("w2").ok());
  EXPECT_EQ(store->Stats().bytes_used, 0u);
  // Under evict-lru an idle sequence makes room for a new one's bookkeeping.
  auto lru = NewStore(64 << 20, CapacityPolicy::kEvictLru);
  for (const char* id : {"a", "b", "c"}) ASSERT_TRUE(lru->CreateSequence(id, wide, {}).ok());
  EXPECT_EQ(lru->Stats().num_sequences, 2u);
  EXPECT_EQ(lru->GetSequenceInfo("a").status().code(), absl::StatusCode::kNotFound);
}

TEST(StoreTest, RejectsBadOptions) {
  StoreOptions o;
  o.page_bytes = 1000;
  EXPECT_EQ(Store::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.page_bytes = 65536;
  o.capacity_bytes = 4096;
  EXPECT_EQ(Store::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvsparse::kvstore
