// kvsparse: command-line client of kvsparse-server.
//
//   kvsparse [--target=HOST:PORT] [--timeout=30s] COMMAND [flags]
//
// Commands: health, create, drop, append, gather, info, list, stats, bench-gather.
// Run `kvsparse --help` for every flag.
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/kvstore_client.h"
#include "client/synthetic.h"
#include "kernels/dtype.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "kvsparse-server address (host:port)");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(30), "Deadline of each call");
ABSL_FLAG(absl::Duration, wait_for_ready, absl::Seconds(5),
          "How long to wait for the server to accept connections before the first call");
// Sequence and shape (create, append, gather, info, drop, bench-gather).
ABSL_FLAG(std::string, seq, "", "Sequence id");
ABSL_FLAG(uint32_t, layers, 32, "create: number of layers");
ABSL_FLAG(uint32_t, q_heads, 32, "create: query heads");
ABSL_FLAG(uint32_t, kv_heads, 8, "create: kv heads");
ABSL_FLAG(uint32_t, head_dim, 128, "create: head dimension");
ABSL_FLAG(std::string, dtype, "bf16", "create: bf16, fp16 or fp32");
// append
ABSL_FLAG(uint64_t, tokens, 1024, "append: tokens to append (to every layer)");
ABSL_FLAG(uint64_t, chunk_bytes, 16 << 20, "append: K+V bytes per Append call");
ABSL_FLAG(uint64_t, seed, 1, "append/gather --verify: seed of the synthetic rows");
// gather / bench-gather
ABSL_FLAG(uint32_t, layer, 0, "gather: layer to read");
ABSL_FLAG(std::string, heads, "", "gather: comma-separated kv heads (default: all)");
ABSL_FLAG(std::string, indices, "", "gather: comma-separated token indices (same for each head)");
ABSL_FLAG(uint64_t, random_rows, 16,
          "gather: random token indices per head, if --indices is empty");
ABSL_FLAG(std::string, kind, "kv", "gather: k, v or kv");
ABSL_FLAG(bool, unique, false, "gather: return each distinct token once, with counts");
ABSL_FLAG(bool, verify, false, "gather/bench-gather: check rows byte-for-byte against --seed");
ABSL_FLAG(uint64_t, rows, 4096, "bench-gather: rows per call (spread over --heads)");
ABSL_FLAG(uint64_t, iters, 200, "bench-gather: timed calls");
ABSL_FLAG(uint64_t, warmup, 10, "bench-gather: untimed calls first");

namespace kvsparse::client {
namespace {

using kernels::DType;

int Fail(const char* cmd, const absl::Status& s) {
  std::fprintf(stderr, "kvsparse %s: %s\n", cmd, s.ToString().c_str());
  return 1;
}

absl::StatusOr<DType> ParseDType(const std::string& s) {
  if (s == "bf16") return DType::kBf16;
  if (s == "fp16") return DType::kFp16;
  if (s == "fp32") return DType::kFp32;
  return absl::InvalidArgumentError(absl::StrCat("--dtype must be bf16, fp16 or fp32, got ", s));
}

v1::DType ToProtoDType(DType d) {
  return d == DType::kBf16 ? v1::DTYPE_BF16 : d == DType::kFp16 ? v1::DTYPE_FP16 : v1::DTYPE_FP32;
}

absl::StatusOr<DType> FromProtoDType(v1::DType d) {
  switch (d) {
    case v1::DTYPE_BF16:
      return DType::kBf16;
    case v1::DTYPE_FP16:
      return DType::kFp16;
    case v1::DTYPE_FP32:
      return DType::kFp32;
    default:
      return absl::InternalError("server returned an unknown dtype");
  }
}

absl::StatusOr<std::vector<uint32_t>> ParseList(const std::string& s, const char* flag) {
  std::vector<uint32_t> out;
  for (absl::string_view part : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    uint32_t v;
    if (!absl::SimpleAtoi(part, &v)) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, ": not a number: ", part));
    }
    out.push_back(v);
  }
  return out;
}

absl::StatusOr<v1::RowKind> ParseKind(const std::string& s) {
  if (s == "k") return v1::ROW_KIND_K;
  if (s == "v") return v1::ROW_KIND_V;
  if (s == "kv") return v1::ROW_KIND_KV;
  return absl::InvalidArgumentError("--kind must be k, v or kv");
}

absl::Status RequireSeq() {
  if (absl::GetFlag(FLAGS_seq).empty()) return absl::InvalidArgumentError("--seq is required");
  return absl::OkStatus();
}

void PrintInfo(const v1::SequenceInfo& info) {
  const v1::ModelShape& s = info.shape();
  std::string lens;
  const auto& ll = info.layer_lengths();
  const bool uniform = std::all_of(ll.begin(), ll.end(), [&](uint64_t x) { return x == ll[0]; });
  if (ll.empty()) {
    lens = "-";
  } else if (uniform) {
    lens = absl::StrCat(ll[0], " tokens in every layer");
  } else {
    for (int i = 0; i < ll.size(); ++i) absl::StrAppend(&lens, i ? "," : "", ll[i]);
  }
  std::printf("%s: layers=%u q_heads=%u kv_heads=%u head_dim=%u dtype=%s  %s  bytes=%" PRIu64
              " page_tokens=%u\n",
              info.sequence_id().c_str(), s.num_layers(), s.num_q_heads(), s.num_kv_heads(),
              s.head_dim(), v1::DType_Name(s.dtype()).c_str(), lens.c_str(), info.bytes_used(),
              info.page_tokens());
}

// Which kv heads a gather covers: --heads, or all of the sequence's.
absl::StatusOr<std::vector<uint32_t>> Heads(const v1::SequenceInfo& info) {
  absl::StatusOr<std::vector<uint32_t>> heads = ParseList(absl::GetFlag(FLAGS_heads), "heads");
  if (!heads.ok() || !heads->empty()) return heads;
  std::vector<uint32_t> all(info.shape().num_kv_heads());
  for (uint32_t h = 0; h < all.size(); ++h) all[h] = h;
  return all;
}

// Checks every returned row against the synthetic generator.
absl::Status VerifyRows(const v1::GatherRequest& req, const v1::GatherResponse& resp,
                        const v1::SequenceInfo& info, uint64_t seed) {
  absl::StatusOr<DType> dt = FromProtoDType(info.shape().dtype());
  if (!dt.ok()) return dt.status();
  const uint32_t d = info.shape().head_dim();
  const size_t row = d * kernels::DTypeSize(*dt);
  std::string want(row, '\0');
  for (int hi = 0; hi < resp.heads_size(); ++hi) {
    const v1::HeadRows& hr = resp.heads(hi);
    for (uint64_t i = 0; i < hr.row_count(); ++i) {
      const uint32_t token = req.unique() ? hr.token_indices(i) : req.heads(hi).token_indices(i);
      for (int which = 0; which < 2; ++which) {
        const std::string& data = which == 0 ? resp.k().data() : resp.v().data();
        if (data.empty()) continue;
        SyntheticRow(seed, req.layer(), hr.kv_head(), token, which, d, *dt,
                     reinterpret_cast<uint8_t*>(want.data()));
        if (data.compare((hr.row_offset() + i) * row, row, want) != 0) {
          return absl::DataLossError(absl::StrCat("row mismatch: layer ", req.layer(), " kv head ",
                                                  hr.kv_head(), " token ", token,
                                                  which ? " V" : " K"));
        }
      }
    }
  }
  return absl::OkStatus();
}

int CmdHealth(KvStoreClient& c) {
  absl::Status s = c.CheckHealth();
  if (!s.ok()) return Fail("health", s);
  std::printf("SERVING\n");
  return 0;
}

int CmdCreate(KvStoreClient& c) {
  if (absl::Status s = RequireSeq(); !s.ok()) return Fail("create", s);
  absl::StatusOr<DType> dt = ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dt.ok()) return Fail("create", dt.status());
  v1::ModelShape shape;
  shape.set_num_layers(absl::GetFlag(FLAGS_layers));
  shape.set_num_q_heads(absl::GetFlag(FLAGS_q_heads));
  shape.set_num_kv_heads(absl::GetFlag(FLAGS_kv_heads));
  shape.set_head_dim(absl::GetFlag(FLAGS_head_dim));
  shape.set_dtype(ToProtoDType(*dt));
  auto info = c.CreateSequence(absl::GetFlag(FLAGS_seq), shape);
  if (!info.ok()) return Fail("create", info.status());
  PrintInfo(*info);
  return 0;
}

int CmdDrop(KvStoreClient& c) {
  if (absl::Status s = RequireSeq(); !s.ok()) return Fail("drop", s);
  auto r = c.DropSequence(absl::GetFlag(FLAGS_seq));
  if (!r.ok()) return Fail("drop", r.status());
  std::printf("dropped %s (%" PRIu64 " bytes freed)\n", absl::GetFlag(FLAGS_seq).c_str(),
              r->bytes_freed());
  return 0;
}

int CmdAppend(KvStoreClient& c) {
  if (absl::Status s = RequireSeq(); !s.ok()) return Fail("append", s);
  const std::string id = absl::GetFlag(FLAGS_seq);
  auto info = c.GetSequenceInfo(id);
  if (!info.ok()) return Fail("append", info.status());
  const v1::ModelShape& shape = info->shape();
  absl::StatusOr<DType> dt = FromProtoDType(shape.dtype());
  if (!dt.ok()) return Fail("append", dt.status());
  const uint64_t start = info->layer_lengths_size() ? info->layer_lengths(0) : 0;
  const uint64_t total = absl::GetFlag(FLAGS_tokens);
  const uint64_t token_bytes =
      2ull * shape.num_layers() * shape.num_kv_heads() * shape.head_dim() * kernels::DTypeSize(*dt);
  const uint64_t chunk = std::max<uint64_t>(1, absl::GetFlag(FLAGS_chunk_bytes) / token_bytes);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  const absl::Time t0 = absl::Now();
  absl::Time last_report = t0;
  v1::AppendRequest req;
  req.set_sequence_id(id);
  req.set_first_layer(0);
  req.set_num_layers(shape.num_layers());
  for (uint64_t done = 0; done < total;) {
    const uint64_t n = std::min(chunk, total - done);
    for (v1::Tensor* t : {req.mutable_k(), req.mutable_v()}) {
      t->set_dtype(shape.dtype());
      t->clear_shape();
      for (int64_t dim :
           {static_cast<int64_t>(shape.num_layers()), static_cast<int64_t>(n),
            static_cast<int64_t>(shape.num_kv_heads()), static_cast<int64_t>(shape.head_dim())}) {
        t->add_shape(dim);
      }
    }
    SyntheticAppend(seed, 0, shape.num_layers(), start + done, n, shape.num_kv_heads(),
                    shape.head_dim(), *dt, req.mutable_k()->mutable_data(),
                    req.mutable_v()->mutable_data());
    req.set_expected_length(start + done);  // a retry after a lost reply cannot double-append
    auto r = c.Append(req);
    if (!r.ok()) return Fail("append", r.status());
    done += n;
    const absl::Time now = absl::Now();
    if (now - last_report > absl::Seconds(1) || done == total) {
      const double secs = absl::ToDoubleSeconds(now - t0);
      std::fprintf(stderr, "\rappend %s: %" PRIu64 "/%" PRIu64 " tokens (%.0f%%), %.1f MB/s   ",
                   id.c_str(), done, total, 100.0 * done / total,
                   done * token_bytes / 1e6 / std::max(secs, 1e-9));
      last_report = now;
    }
  }
  std::fprintf(stderr, "\n");
  std::printf("appended %" PRIu64 " tokens to %s (now %" PRIu64 "), %.1f MB in %.2f s\n", total,
              id.c_str(), start + total, total * token_bytes / 1e6,
              absl::ToDoubleSeconds(absl::Now() - t0));
  return 0;
}

// Builds a gather request over `heads` with `per_head` random rows each (or --indices).
absl::StatusOr<v1::GatherRequest> MakeGather(const v1::SequenceInfo& info,
                                             const std::vector<uint32_t>& heads, uint64_t per_head,
                                             std::mt19937_64& rng) {
  v1::GatherRequest req;
  req.set_sequence_id(info.sequence_id());
  req.set_layer(absl::GetFlag(FLAGS_layer));
  absl::StatusOr<v1::RowKind> kind = ParseKind(absl::GetFlag(FLAGS_kind));
  if (!kind.ok()) return kind.status();
  req.set_kind(*kind);
  req.set_unique(absl::GetFlag(FLAGS_unique));
  absl::StatusOr<std::vector<uint32_t>> fixed = ParseList(absl::GetFlag(FLAGS_indices), "indices");
  if (!fixed.ok()) return fixed.status();
  const uint32_t layer = req.layer();
  const uint64_t len =
      layer < static_cast<uint32_t>(info.layer_lengths_size()) ? info.layer_lengths(layer) : 0;
  // An out-of-range layer goes to the server, which says why it is wrong.
  if (fixed->empty() && len == 0 && layer < info.shape().num_layers()) {
    return absl::FailedPreconditionError(absl::StrCat("layer ", layer, " holds no tokens"));
  }
  std::uniform_int_distribution<uint32_t> dist(0, len ? static_cast<uint32_t>(len - 1) : 0);
  for (uint32_t h : heads) {
    v1::HeadSelection* sel = req.add_heads();
    sel->set_kv_head(h);
    if (!fixed->empty()) {
      sel->mutable_token_indices()->Add(fixed->begin(), fixed->end());
    } else {
      sel->mutable_token_indices()->Reserve(per_head);
      for (uint64_t i = 0; i < per_head; ++i) sel->add_token_indices(dist(rng));
    }
  }
  return req;
}

int CmdGather(KvStoreClient& c) {
  if (absl::Status s = RequireSeq(); !s.ok()) return Fail("gather", s);
  auto info = c.GetSequenceInfo(absl::GetFlag(FLAGS_seq));
  if (!info.ok()) return Fail("gather", info.status());
  auto heads = Heads(*info);
  if (!heads.ok()) return Fail("gather", heads.status());
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed) * 7 + 3);
  auto req = MakeGather(*info, *heads, absl::GetFlag(FLAGS_random_rows), rng);
  if (!req.ok()) return Fail("gather", req.status());
  const absl::Time t0 = absl::Now();
  auto resp = c.Gather(*req);
  if (!resp.ok()) return Fail("gather", resp.status());
  const double us = absl::ToDoubleMicroseconds(absl::Now() - t0);
  const uint64_t bytes = resp->k().data().size() + resp->v().data().size();
  std::printf("gathered layer %u of %s: %d heads, %" PRIu64
              " bytes in %.0f us (layer length %" PRIu64 ")\n",
              req->layer(), req->sequence_id().c_str(), resp->heads_size(), bytes, us,
              resp->layer_length());
  for (const v1::HeadRows& h : resp->heads()) {
    std::printf("  kv head %u: rows [%" PRIu64 ", %" PRIu64 ")", h.kv_head(), h.row_offset(),
                h.row_offset() + h.row_count());
    if (req->unique()) {
      std::printf(" distinct tokens:");
      for (int i = 0; i < std::min(h.token_indices_size(), 8); ++i) {
        std::printf(" %u(x%u)", h.token_indices(i), h.counts(i));
      }
      if (h.token_indices_size() > 8) std::printf(" ...");
    }
    std::printf("\n");
  }
  if (absl::GetFlag(FLAGS_verify)) {
    absl::Status v = VerifyRows(*req, *resp, *info, absl::GetFlag(FLAGS_seed));
    if (!v.ok()) return Fail("gather --verify", v);
    std::printf("verified: every row matches the synthetic data of seed %" PRIu64 "\n",
                absl::GetFlag(FLAGS_seed));
  }
  return 0;
}

int CmdInfo(KvStoreClient& c) {
  if (absl::Status s = RequireSeq(); !s.ok()) return Fail("info", s);
  auto info = c.GetSequenceInfo(absl::GetFlag(FLAGS_seq));
  if (!info.ok()) return Fail("info", info.status());
  PrintInfo(*info);
  return 0;
}

int CmdList(KvStoreClient& c) {
  auto list = c.ListSequences();
  if (!list.ok()) return Fail("list", list.status());
  for (const v1::SequenceInfo& info : *list) PrintInfo(info);
  std::printf("%zu sequences\n", list->size());
  return 0;
}

int CmdStats(KvStoreClient& c) {
  auto s = c.GetStats();
  if (!s.ok()) return Fail("stats", s.status());
  std::printf("sequences       %" PRIu64 "\n", s->num_sequences());
  std::printf("used / capacity %" PRIu64 " / %" PRIu64 " bytes (%.1f%%), policy %s\n",
              s->bytes_used(), s->capacity_bytes(),
              100.0 * s->bytes_used() / std::max<uint64_t>(1, s->capacity_bytes()),
              s->capacity_policy().c_str());
  std::printf("pages           %" PRIu64 " of %" PRIu64 " bytes\n", s->pages_used(),
              s->page_bytes());
  std::printf("rows appended   %" PRIu64 "\n", s->rows_appended());
  std::printf("rows gathered   %" PRIu64 " (%" PRIu64 " bytes)\n", s->rows_gathered(),
              s->bytes_gathered());
  std::printf("evictions       %" PRIu64 "\nrejections      %" PRIu64 "\n", s->evictions(),
              s->rejections());
  return 0;
}

int CmdBenchGather(KvStoreClient& c) {
  if (absl::Status s = RequireSeq(); !s.ok()) return Fail("bench-gather", s);
  auto info = c.GetSequenceInfo(absl::GetFlag(FLAGS_seq));
  if (!info.ok()) return Fail("bench-gather", info.status());
  auto heads = Heads(*info);
  if (!heads.ok()) return Fail("bench-gather", heads.status());
  const uint64_t rows = absl::GetFlag(FLAGS_rows);
  const uint64_t per_head = std::max<uint64_t>(1, rows / heads->size());
  const uint64_t iters = absl::GetFlag(FLAGS_iters);
  const uint64_t warmup = absl::GetFlag(FLAGS_warmup);
  const bool verify = absl::GetFlag(FLAGS_verify);
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed) * 7 + 3);
  // A few different index sets, rotated, so no call repeats the previous one's rows.
  std::vector<v1::GatherRequest> reqs;
  for (int i = 0; i < 8; ++i) {
    auto r = MakeGather(*info, *heads, per_head, rng);
    if (!r.ok()) return Fail("bench-gather", r.status());
    reqs.push_back(std::move(*r));
  }
  std::vector<double> lat;
  lat.reserve(iters);
  uint64_t bytes = 0;
  v1::GatherResponse resp;
  const absl::Time t0 = absl::Now();
  absl::Time last_report = t0, timed_start = t0;
  for (uint64_t i = 0; i < warmup + iters; ++i) {
    if (i == warmup) timed_start = absl::Now();
    const v1::GatherRequest& req = reqs[i % reqs.size()];
    resp.Clear();
    const absl::Time a = absl::Now();
    absl::Status s = c.Gather(req, &resp);
    const absl::Time b = absl::Now();
    if (!s.ok()) return Fail("bench-gather", s);
    if (verify) {
      absl::Status v = VerifyRows(req, resp, *info, absl::GetFlag(FLAGS_seed));
      if (!v.ok()) return Fail("bench-gather --verify", v);
    }
    if (i >= warmup) {
      lat.push_back(absl::ToDoubleMicroseconds(b - a));
      bytes += resp.k().data().size() + resp.v().data().size();
    }
    if (b - last_report > absl::Seconds(1)) {
      std::fprintf(stderr, "\rbench-gather: %" PRIu64 "/%" PRIu64 " calls   ", i + 1,
                   warmup + iters);
      last_report = b;
    }
  }
  const double secs = absl::ToDoubleSeconds(absl::Now() - timed_start);
  std::fprintf(stderr, "\r%60s\r", "");
  std::sort(lat.begin(), lat.end());
  auto pct = [&](double p) {
    return lat.empty() ? 0.0 : lat[static_cast<size_t>(p * (lat.size() - 1))];
  };
  std::printf("bench-gather %s layer %u: %" PRIu64 " rows/call (%zu heads), kind %s%s\n",
              info->sequence_id().c_str(), absl::GetFlag(FLAGS_layer), per_head * heads->size(),
              heads->size(), absl::GetFlag(FLAGS_kind).c_str(), verify ? ", verified" : "");
  std::printf("  %" PRIu64 " calls in %.3f s: %.1f calls/s, %.1f MB/s (payload)\n", iters, secs,
              iters / secs, bytes / 1e6 / secs);
  std::printf("  latency us: p50 %.0f  p90 %.0f  p99 %.0f  max %.0f\n", pct(0.5), pct(0.9),
              pct(0.99), lat.empty() ? 0.0 : lat.back());
  return 0;
}

}  // namespace
}  // namespace kvsparse::client

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "kvsparse [--target=HOST:PORT] COMMAND [flags]\n"
      "commands:\n"
      "  health                     grpc.health.v1 check\n"
      "  create --seq=ID [--layers --q_heads --kv_heads --head_dim --dtype]\n"
      "  drop --seq=ID\n"
      "  append --seq=ID --tokens=N [--seed]       synthetic K/V rows, with progress\n"
      "  gather --seq=ID [--layer --heads --indices|--random_rows --kind --unique --verify]\n"
      "  info --seq=ID | list | stats\n"
      "  bench-gather --seq=ID [--rows=4096 --iters --kind=v --heads]");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::fprintf(stderr, "%s\n", std::string(absl::ProgramUsageMessage()).c_str());
    return 2;
  }
  const std::string cmd = args[1];
  using namespace kvsparse::client;
  ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.timeout = absl::GetFlag(FLAGS_timeout);
  auto client = KvStoreClient::Connect(options);
  if (!client.ok()) return Fail(cmd.c_str(), client.status());
  if (absl::Status s = (*client)->WaitForReady(absl::GetFlag(FLAGS_wait_for_ready)); !s.ok()) {
    return Fail(cmd.c_str(), s);
  }
  KvStoreClient& c = **client;
  if (cmd == "health") return CmdHealth(c);
  if (cmd == "create") return CmdCreate(c);
  if (cmd == "drop") return CmdDrop(c);
  if (cmd == "append") return CmdAppend(c);
  if (cmd == "gather") return CmdGather(c);
  if (cmd == "info") return CmdInfo(c);
  if (cmd == "list") return CmdList(c);
  if (cmd == "stats") return CmdStats(c);
  if (cmd == "bench-gather") return CmdBenchGather(c);
  std::fprintf(stderr, "unknown command '%s'\n%s\n", cmd.c_str(),
               std::string(absl::ProgramUsageMessage()).c_str());
  return 2;
}
