// In-process sparse gather of the store against a contiguous memcpy of the same bytes.
//
//   store_gather_bench [--pool=2G] [--rows=4096,131072] [--reps=40] [--append_tokens=64]
//
// Then the cost of an Append call and of its value check (finite, below 2^32) within it.
//
// The store holds a sequence of `pool` bytes (16 layers x 8 kv heads, d=128 bf16: K and V rows
// of 256 B). Each rep gathers V rows at random tokens, spread evenly over the 8 kv heads, from
// the next layer in turn, so successive reps touch different memory and the working set is the
// whole pool (far larger than the CPU caches). The baseline copies the same number of bytes
// contiguously from a rotating offset of a separate buffer of the same size into the same
// destination. Both single-threaded; median of `reps`.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kernels/dtype.h"
#include "kvstore/store.h"
#include "tests/bench/bench_fill.h"

ABSL_FLAG(std::string, pool, "2G", "Bytes of K+V held by the store (K, M, G suffixes)");
ABSL_FLAG(std::string, rows, "4096,131072", "Rows per gather call");
ABSL_FLAG(int, reps, 40, "Timed calls per configuration (median reported)");
ABSL_FLAG(uint64_t, append_tokens, 64, "Tokens per timed Append call (every layer and kv head)");

namespace {

using Clock = std::chrono::steady_clock;
using kvsparse::kvstore::DType;
namespace kv = kvsparse::kvstore;

uint64_t ParseBytes(std::string s) {
  uint64_t mult = 1;
  const char last = s.empty() ? 0 : static_cast<char>(toupper(s.back()));
  if (last == 'K' || last == 'M' || last == 'G') {
    mult = last == 'K' ? 1ull << 10 : last == 'M' ? 1ull << 20 : 1ull << 30;
    s.pop_back();
  }
  uint64_t v = 0;
  if (!absl::SimpleAtoi(s, &v)) {
    std::fprintf(stderr, "bad byte size %s\n", s.c_str());
    std::exit(2);
  }
  return v * mult;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Append: what the value check (finite, below 2^32: kernels::FirstUnacceptedValue) costs an
// append. Calls of --append_tokens tokens x every layer and kv head into a fresh sequence
// (pages allocated as it grows), each timed whole; the check alone timed over the same bytes.
// Drops the gather's sequence first. false on error.
bool MeasureAppend(kv::Store& store, const kv::ModelShape& shape, uint64_t token_bytes,
                   uint64_t capacity_bytes, int reps, std::mt19937_64& rng) {
  const size_t row = shape.row_bytes();
  const uint64_t chunk = absl::GetFlag(FLAGS_append_tokens);
  const size_t chunk_bytes = shape.num_layers * chunk * shape.num_kv_heads * row;
  std::vector<uint8_t> k(chunk_bytes), v(chunk_bytes);
  for (size_t i = 0; i < chunk_bytes; ++i) {  // random values the store accepts
    k[i] = kvsparse::kernels::AcceptedByte(static_cast<uint8_t>(rng()), i);
    v[i] = kvsparse::kernels::AcceptedByte(static_cast<uint8_t>(rng()), i);
  }
  if (!store.DropSequence("bench").ok() || !store.CreateSequence("app", shape, {}).ok()) {
    return false;
  }
  std::vector<double> a_us, c_us;
  for (int rep = -2; rep < reps && (rep + 3) * chunk * token_bytes < capacity_bytes / 2; ++rep) {
    kv::AppendRequest r;
    r.sequence_id = "app";
    r.num_layers = shape.num_layers;
    r.num_tokens = chunk;
    r.num_kv_heads = shape.num_kv_heads;
    r.head_dim = shape.head_dim;
    r.dtype = shape.dtype;
    r.k = k;
    r.v = v;
    const auto t0 = Clock::now();
    if (auto a = store.Append(r); !a.ok()) {
      std::fprintf(stderr, "append: %s\n", a.status().ToString().c_str());
      return false;
    }
    const auto t1 = Clock::now();
    const size_t n = chunk_bytes / 2;
    const bool bad = kvsparse::kernels::FirstUnacceptedValue(k.data(), n, shape.dtype) >= 0 ||
                     kvsparse::kernels::FirstUnacceptedValue(v.data(), n, shape.dtype) >= 0;
    const auto t2 = Clock::now();
    if (bad) return false;
    if (rep >= 0) {
      a_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      c_us.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
    }
  }
  if (!a_us.empty()) {
    const double a = Median(a_us), c = Median(c_us);
    std::printf(
        "append of %lu tokens (%.1f MB of K+V): %.1f us (%.2f GB/s), of which the value "
        "check %.1f us (%.1f%%), median of %zu\n",
        static_cast<unsigned long>(chunk), 2 * chunk_bytes / 1e6, a, 2 * chunk_bytes / a / 1e3, c,
        100.0 * c / a, a_us.size());
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const uint64_t pool = ParseBytes(absl::GetFlag(FLAGS_pool));
  const int reps = absl::GetFlag(FLAGS_reps);
  const kv::ModelShape shape{16, 32, 8, 128, DType::kBf16};
  const size_t row = shape.row_bytes();  // 256 B
  const uint64_t token_bytes = 2ull * shape.num_layers * shape.num_kv_heads * row;
  const uint64_t tokens = std::max<uint64_t>(1024, pool / token_bytes);

  kv::StoreOptions o;
  o.capacity_bytes = tokens * token_bytes + (256ull << 20);
  o.max_gather_bytes = 1ull << 30;
  o.max_append_bytes = 1ull << 30;
  auto store = kv::Store::Create(o);
  if (!store.ok()) {
    std::fprintf(stderr, "%s\n", store.status().ToString().c_str());
    return 1;
  }
  if (absl::Status s = kvsparse::bench::FillSequence(store->get(), "bench", shape, tokens);
      !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  // The memcpy baseline's source: as large as the store's pool, touched once.
  std::vector<uint8_t> src(tokens * token_bytes);
  std::memset(src.data(), 1, src.size());

  std::printf("%-8s %-10s %14s %10s %14s %10s %8s\n", "rows", "MB/call", "gather us", "GB/s",
              "memcpy us", "GB/s", "ratio");
  std::mt19937_64 rng(7);
  for (absl::string_view rs : absl::StrSplit(absl::GetFlag(FLAGS_rows), ',')) {
    uint64_t rows = 0;
    if (!absl::SimpleAtoi(rs, &rows) || rows == 0) return 2;
    const uint64_t per_head = rows / shape.num_kv_heads;
    rows = per_head * shape.num_kv_heads;
    const size_t bytes = rows * row;
    std::vector<uint8_t> dst(bytes);
    std::memset(dst.data(), 0, dst.size());
    // Eight index sets, rotated.
    std::vector<std::vector<uint32_t>> sets(8 * shape.num_kv_heads);
    std::uniform_int_distribution<uint32_t> tok(0, static_cast<uint32_t>(tokens - 1));
    for (auto& s : sets) {
      s.resize(per_head);
      for (auto& t : s) t = tok(rng);
    }
    std::vector<double> g_us, m_us;
    for (int rep = -3; rep < reps; ++rep) {
      const int set = (rep + 3) % 8;
      std::vector<kv::HeadSelection> heads;
      for (uint32_t h = 0; h < shape.num_kv_heads; ++h) {
        heads.push_back({h, sets[set * shape.num_kv_heads + h]});
      }
      kv::GatherRequest req;
      req.sequence_id = "bench";
      req.layer = static_cast<uint32_t>((rep + 3) % shape.num_layers);
      req.kind = kv::RowKind::kV;
      req.heads = heads;
      const auto t0 = Clock::now();
      auto res = (*store)->Gather(req, [&](uint64_t, size_t) -> absl::StatusOr<kv::GatherBuffers> {
        return kv::GatherBuffers{nullptr, dst.data()};
      });
      const auto t1 = Clock::now();
      if (!res.ok()) {
        std::fprintf(stderr, "gather: %s\n", res.status().ToString().c_str());
        return 1;
      }
      const size_t off = ((rep + 3) * 7919ull * 4096) % (src.size() - bytes) & ~size_t{4095};
      const auto t2 = Clock::now();
      std::memcpy(dst.data(), src.data() + off, bytes);
      const auto t3 = Clock::now();
      if (rep >= 0) {
        g_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        m_us.push_back(std::chrono::duration<double, std::micro>(t3 - t2).count());
      }
    }
    const double g = Median(g_us), m = Median(m_us);
    std::printf("%-8lu %-10.2f %14.1f %10.2f %14.1f %10.2f %7.0f%%\n",
                static_cast<unsigned long>(rows), bytes / 1e6, g, bytes / g / 1e3, m,
                bytes / m / 1e3, 100.0 * m / g);
  }
  return MeasureAppend(**store, shape, token_bytes, o.capacity_bytes, reps, rng) ? 0 : 1;
}
