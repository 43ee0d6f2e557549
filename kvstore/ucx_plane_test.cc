// The UCX data plane against the store's own Gather: a store on an arena file exported with
// UcxExport, a UcxReader connected to it (two UCX workers of this process), over TCP and over
// shared memory, reading by batched gather and by one-sided gets; rows equal Gather's, a freed
// page is detected, a bad address is refused, reads of several readers at once land right.
#include "kvstore/ucx_plane.h"

#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kvstore/store.h"

namespace kvsparse::kvstore {
namespace {

using kernels::DType;

std::vector<uint8_t> RowsOf(Store& store, const std::string& id, uint32_t layer, uint32_t head,
                            const std::vector<uint32_t>& tokens, RowKind kind) {
  std::vector<uint8_t> out;
  std::vector<HeadSelection> heads = {{head, tokens}};
  GatherRequest r;
  r.sequence_id = id;
  r.layer = layer;
  r.kind = kind;
  r.heads = heads;
  auto res = store.Gather(r, [&](uint64_t rows, size_t row) -> absl::StatusOr<GatherBuffers> {
    out.resize(rows * row);
    GatherBuffers b;
    (kind == RowKind::kK ? b.k : b.v) = out.data();
    return b;
  });
  EXPECT_TRUE(res.ok()) << res.status();
  return out;
}

// Six threads reading at once through three readers of `exported`, small (eager) and large
// (rendezvous) reads of layer 1's two lanes mixed: each lands in its own buffers, with the rows
// Gather returns.
void ExpectConcurrentReadsLand(const UcxExport& exported, Store& store, const LayerPageTable& table,
                               const std::vector<uint32_t>& tokens,
                               const std::vector<uint32_t>& many, const char* transports,
                               UcxReadMode mode) {
  std::vector<std::unique_ptr<UcxReader>> readers;
  std::vector<std::shared_ptr<const ArenaReader>> arenas;
  for (int r = 0; r < 3; ++r) {
    auto reader = UcxReader::Create(transports, mode);
    ASSERT_TRUE(reader.ok()) << reader.status();
    auto arena = (*reader)->Connect(exported.address(), absl::Seconds(10));
    ASSERT_TRUE(arena.ok()) << arena.status();
    readers.push_back(std::move(*reader));
    arenas.push_back(std::move(*arena));
  }
  std::vector<std::vector<uint8_t>> want_small, want_big;
  for (uint32_t h = 0; h < 2; ++h) {
    for (RowKind kind : {RowKind::kK, RowKind::kV}) {
      want_small.push_back(RowsOf(store, "a", 1, h, tokens, kind));
      want_big.push_back(RowsOf(store, "a", 1, h, many, kind));
    }
  }
  std::atomic<int> failures{0}, reads{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 12; ++i) {
        const bool large = (i + t) % 3 == 0;
        const std::vector<uint32_t>& rows = large ? many : tokens;
        std::vector<std::vector<uint8_t>> out(4, std::vector<uint8_t>(rows.size() * 128));
        std::vector<LaneRead> read = {{table.lanes[0], rows, out[0].data(), out[1].data()},
                                      {table.lanes[1], rows, out[2].data(), out[3].data()}};
        auto ok = arenas[t % 3]->Read(read, table.page_tokens, 128, RowKind::kKV,
                                      absl::Now() + absl::Seconds(20));
        if (!ok.ok() || !*ok || out != (large ? want_big : want_small)) ++failures;
        ++reads;
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0) << "of " << reads.load() << " concurrent reads";
  arenas.clear();  // before their readers
}

// Reads the store must refuse: a page outside the arena (a corrupt or forged table) is
// DATA_LOSS, and a gather without the export's secret gets no answer (the read times out).
void ExpectForgedReadsRefused(const ArenaReader& remote, UcxReader& reader,
                              const UcxExport& exported, const LayerPageTable& table,
                              uint64_t mapping_bytes, const std::vector<uint32_t>& tokens,
                              const std::vector<LaneRead>& lanes) {
  std::vector<PageRef> forged(table.lanes[0].begin(), table.lanes[0].end());
  forged[0].offset = mapping_bytes + 8192;
  std::vector<uint8_t> k0(tokens.size() * 128), v0(k0.size());
  std::vector<LaneRead> bad = {{forged, tokens, k0.data(), v0.data()}};
  EXPECT_EQ(remote.Read(bad, table.page_tokens, 128, RowKind::kKV, absl::Now() + absl::Seconds(10))
                .status()
                .code(),
            absl::StatusCode::kDataLoss);
  UcxArenaAddress wrong = exported.address();
  wrong.secret ^= 1;
  auto impostor = reader.Connect(wrong, absl::Seconds(10));
  ASSERT_TRUE(impostor.ok()) << impostor.status();
  EXPECT_EQ(
      (*impostor)
          ->Read(lanes, table.page_tokens, 128, RowKind::kKV, absl::Now() + absl::Milliseconds(300))
          .status()
          .code(),
      absl::StatusCode::kDeadlineExceeded);
}

class UcxPlaneTest : public testing::TestWithParam<std::tuple<const char*, UcxReadMode>> {
 protected:
  const char* transports() const { return std::get<0>(GetParam()); }
  UcxReadMode mode() const { return std::get<1>(GetParam()); }
};

TEST_P(UcxPlaneTest, ReadsTheRowsGatherReturnsAndDetectsReuse) {
  if (!UcxAvailable()) GTEST_SKIP() << "built without UCX";
  const std::string path = testing::TempDir() + "/kvsparse-ucx-arena-" + transports() +
                           (mode() == UcxReadMode::kGather ? "-gather" : "-rma");
  auto arena = NewFileMemoryResource(path, 4 << 20, 8192);
  ASSERT_TRUE(arena.ok()) << arena.status();
  StoreOptions o;
  o.capacity_bytes = 4 << 20;
  o.page_bytes = 8192;
  o.slab_bytes = 1 << 20;
  o.memory = arena->get();
  auto store = Store::Create(o);
  ASSERT_TRUE(store.ok());
  const ModelShape s{2, 8, 2, 64, DType::kBf16};  // 128-byte rows, 32 tokens per page
  ASSERT_TRUE((*store)->CreateSequence("a", s, {}).ok());
  const uint64_t n = 300;
  std::vector<uint8_t> k(2 * n * 2 * 128), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = kvsparse::kernels::AcceptedByte(static_cast<uint8_t>(i * 7 + 1), i);
    v[i] = kvsparse::kernels::AcceptedByte(static_cast<uint8_t>(i * 13 + 5), i);
  }
  AppendRequest ar;
  ar.sequence_id = "a";
  ar.num_layers = 2;
  ar.num_tokens = n;
  ar.num_kv_heads = 2;
  ar.head_dim = 64;
  ar.k = k;
  ar.v = v;
  ASSERT_TRUE((*store)->Append(ar).ok());

  // Three copy threads besides the progress thread: a large gather is copied in parts.
  auto exported = UcxExport::Create((*arena)->shared_arena(), transports(), /*copy_threads=*/3);
  ASSERT_TRUE(exported.ok()) << exported.status();
  auto reader = UcxReader::Create(transports(), mode());
  ASSERT_TRUE(reader.ok()) << reader.status();
  auto remote = (*reader)->Connect((*exported)->address(), absl::Seconds(10));
  ASSERT_TRUE(remote.ok()) << remote.status();
  EXPECT_EQ((*remote)->arena_id(), (*arena)->shared_arena()->arena_id());

  auto table = (*store)->PageTable("a", 1, 0);
  ASSERT_TRUE(table.ok());
  const std::vector<uint32_t> tokens = {299, 0, 31, 32, 100, 100, 7};
  std::vector<uint8_t> k0(tokens.size() * 128), v0(k0.size()), k1(k0.size()), v1(k0.size());
  std::vector<LaneRead> lanes = {{table->lanes[0], tokens, k0.data(), v0.data()},
                                 {table->lanes[1], tokens, k1.data(), v1.data()}};
  for (const LaneRead& l : lanes) {
    for (const PageRef& p : l.pages) EXPECT_TRUE((*remote)->HoldsPage(p.offset, 8192));
  }
  // Reads both lanes (kv heads 0 and 1 of layer 1) and checks the rows against Gather's.
  auto read_matches_gather = [&](const std::vector<LaneRead>& read) {
    auto ok = (*remote)->Read(read, table->page_tokens, 128, RowKind::kKV,
                              absl::Now() + absl::Seconds(10));
    ASSERT_TRUE(ok.ok()) << ok.status();
    EXPECT_TRUE(*ok);
    for (uint32_t h = 0; h < 2; ++h) {
      const std::vector<uint32_t> tokens(read[h].tokens.begin(), read[h].tokens.end());
      const size_t bytes = tokens.size() * 128;
      const std::vector<uint8_t> k(read[h].k_out, read[h].k_out + bytes);
      const std::vector<uint8_t> v(read[h].v_out, read[h].v_out + bytes);
      EXPECT_EQ(k, RowsOf(**store, "a", 1, h, tokens, RowKind::kK)) << "head " << h;
      EXPECT_EQ(v, RowsOf(**store, "a", 1, h, tokens, RowKind::kV)) << "head " << h;
    }
  };
  read_matches_gather(lanes);
  // A large read (2 x 1200 rows, 600 KiB: the reply travels by rendezvous straight into these
  // buffers, and the store copies it in four parts): the same rows as Gather's.
  std::vector<uint32_t> many(1200);
  for (size_t i = 0; i < many.size(); ++i) many[i] = static_cast<uint32_t>((i * 37) % n);
  std::vector<uint8_t> bk0(many.size() * 128), bv0(bk0.size()), bk1(bk0.size()), bv1(bk0.size());
  std::vector<LaneRead> big = {{table->lanes[0], many, bk0.data(), bv0.data()},
                               {table->lanes[1], many, bk1.data(), bv1.data()}};
  read_matches_gather(big);
  // Six threads reading at once through three readers (as the workers of a fleet read one store:
  // several replies in flight at the store, large ones queued behind others).
  if (mode() == UcxReadMode::kGather) {
    ExpectConcurrentReadsLand(**exported, **store, *table, tokens, many, transports(), mode());
  }
  EXPECT_FALSE((*remote)->HoldsPage(0, 8192));                                 // the header
  EXPECT_FALSE((*remote)->HoldsPage(1ull << 40, 8192));                        // past the file
  EXPECT_FALSE((*remote)->HoldsPage(table->lanes[0][0].offset + 4096, 8192));  // misaligned

  if (mode() == UcxReadMode::kGather) {
    ExpectForgedReadsRefused(**remote, **reader, **exported, *table,
                             (*arena)->shared_arena()->mapping_bytes(), tokens, lanes);
  }

  // Freed pages (the sequence dropped): the read says so.
  ASSERT_TRUE((*store)->DropSequence("a").ok());
  auto stale = (*remote)->Read(lanes, table->page_tokens, 128, RowKind::kKV,
                               absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(stale.ok()) << stale.status();
  EXPECT_FALSE(*stale);

  // An address that is not one: refused, nothing crashes.
  UcxArenaAddress bad = (*exported)->address();
  bad.rkey.clear();
  EXPECT_EQ((*reader)->Connect(bad, absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  remote->reset();
  store->reset();
  std::remove(path.c_str());
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxPlaneTest,
                         testing::Combine(testing::Values("tcp", "sm"),
                                          testing::Values(UcxReadMode::kGather,
                                                          UcxReadMode::kOneSided)),
                         [](const testing::TestParamInfo<std::tuple<const char*, UcxReadMode>>& i) {
                           return std::string(std::get<0>(i.param)) +
                                  (std::get<1>(i.param) == UcxReadMode::kGather ? "_gather"
                                                                                : "_one_sided");
                         });

}  // namespace
}  // namespace kvsparse::kvstore
