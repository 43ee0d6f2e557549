// kvsparse: command-line client of kvsparse-server.
//
//   kvsparse [--target=HOST:PORT] [--store_target=HOST:PORT[,...]] [--timeout=30s] COMMAND [flags]
//
// --target is the server called (for decode: the worker); --store_target the store when it is
// another server (a split deployment), as the Python client's Client(target, store_target=...).
// Commands: health, create, drop, append, gather, info, list, stats, bench-gather, decode, method.
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
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/attention_client.h"
#include "client/kvstore_client.h"
#include "client/synthetic.h"
#include "google/protobuf/text_format.h"
#include "kernels/dtype.h"
#include "rpc/build_info.h"
#include "rpc/dtype.h"
#include "rpc/flags_help.h"
#include "rpc/method_text.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051",
          "the kvsparse-server to call (host:port): decode goes to it (in a split deployment, the "
          "worker), every other command too unless --store_target names the store");
ABSL_FLAG(std::string, store_target, "",
          "the store in a split deployment (host:port), or a sharded fleet's store shards in shard "
          "order (A:P,B:P or NAME-{0..3}.SERVICE:P, as the worker's --store): every command but "
          "decode goes there, and decode reads its needle rows there; default: --target (as the "
          "Python client's Client(target, store_target=...))");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(30), "Deadline of each call");
ABSL_FLAG(std::string, worker, "",
          "gone: a split deployment is --target=WORKER --store_target=STORE (refused if set)");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA of the server's certificate: TLS (a server with --tls_cert)");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate of this client (a server with --tls_client_ca), with --tls_key");
ABSL_FLAG(std::string, tls_key, "", "PEM key of --tls_cert");
ABSL_FLAG(std::string, token_file, "",
          "File holding the bearer token to send (a server with --auth_tokens; first line)");
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
ABSL_FLAG(uint64_t, tokens, 1024,
          "append: tokens to append (to every layer); fork: the source's first tokens it holds");
ABSL_FLAG(std::string, from, "", "fork: the source sequence");
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
// create: placement
ABSL_FLAG(std::string, k_tier, "host", "create: where the worker keeps K: host or device");
ABSL_FLAG(std::string, v_tier, "host", "create: where the worker keeps V: host or device");
ABSL_FLAG(uint32_t, signature_bits, 0,
          "create: HashAttention signature bits kept per key (0: none)");
ABSL_FLAG(uint32_t, compressed_key_bits, 0,
          "create: bits per channel of the compressed keys kept per key for decode top_k "
          "(0: none; 1, 2, 4 or 8)");
// decode
ABSL_FLAG(std::string, method, "dense",
          "decode, method: the method in its text form, name or name:field=value,... (the "
          "proto's fields and words, every field left out at its default; the Python "
          "package's parse_method reads the same text), e.g. top_k:top_k_fraction=0.05 or "
          "santa:samples=256,scores=compressed. `kvsparse method --method=TEXT` prints every "
          "field");
ABSL_FLAG(bool, compare_dense, true, "decode: also run dense and print the relative L2 error");
ABSL_FLAG(std::string, query, "needle",
          "decode: needle (each query head aimed at one stored key: a peaked, retrieval-like "
          "attention) or random (i.i.d. normal q)");

namespace kvsparse::client {
namespace {

using kernels::DType;

int Fail(const char* cmd, const absl::Status& s) {
  std::fprintf(stderr, "kvsparse %s: %s\n", cmd, s.ToString().c_str());
  return 1;
}

absl::StatusOr<DType> ParseDType(const std::string& s) {
  DType d;
  if (kernels::DTypeFromName(s.c_str(), &d)) return d;
  return absl::InvalidArgumentError(absl::StrCat("--dtype must be bf16, fp16 or fp32, got ", s));
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
  if (info.bytes_shared() > 0) {
    std::printf("  %" PRIu64 " of those bytes shared with another sequence (a fork's prefix)\n",
                info.bytes_shared());
  }
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
  absl::StatusOr<DType> dt = rpc::FromProto(info.shape().dtype(), "shape.dtype");
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
  shape.set_dtype(rpc::ToProto(*dt));
  v1::Placement placement;
  for (auto [flag, set] : {std::pair{absl::GetFlag(FLAGS_k_tier), &v1::Placement::set_k_tier},
                           {absl::GetFlag(FLAGS_v_tier), &v1::Placement::set_v_tier}}) {
    if (flag != "host" && flag != "device") {
      return Fail("create", absl::InvalidArgumentError("--k_tier/--v_tier: host or device"));
    }
    (placement.*set)(flag == "device" ? v1::TIER_DEVICE : v1::TIER_HOST);
  }
  placement.set_signature_bits(absl::GetFlag(FLAGS_signature_bits));
  placement.set_compressed_key_bits(absl::GetFlag(FLAGS_compressed_key_bits));
  auto info = c.CreateSequence(absl::GetFlag(FLAGS_seq), shape, placement);
  if (!info.ok()) return Fail("create", info.status());
  PrintInfo(*info);
  return 0;
}

int CmdFork(KvStoreClient& c) {
  if (absl::Status s = RequireSeq(); !s.ok()) return Fail("fork", s);
  if (absl::GetFlag(FLAGS_from).empty()) {
    return Fail("fork", absl::InvalidArgumentError("--from (the source sequence) is required"));
  }
  auto info = c.ForkSequence(absl::GetFlag(FLAGS_from), absl::GetFlag(FLAGS_seq),
                             absl::GetFlag(FLAGS_tokens));
  if (!info.ok()) return Fail("fork", info.status());
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
  if (absl::GetFlag(FLAGS_tokens) == 0) {
    return Fail("append", absl::InvalidArgumentError("--tokens must be at least 1"));
  }
  const std::string id = absl::GetFlag(FLAGS_seq);
  auto info = c.GetSequenceInfo(id);
  if (!info.ok()) return Fail("append", info.status());
  const v1::ModelShape& shape = info->shape();
  absl::StatusOr<DType> dt = rpc::FromProto(shape.dtype(), "shape.dtype");
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

// The method of --method with every field: its text form (what differs from the defaults), the
// message the server gets and the placement it reads (rpc::PlacementFor, with the default 32
// signature bits and 2-bit keys). No server is asked.
int CmdMethod() {
  absl::StatusOr<v1::Method> m = rpc::MethodFromText(absl::GetFlag(FLAGS_method));
  if (!m.ok()) return Fail("method", m.status());
  std::string text, placement;
  google::protobuf::TextFormat::PrintToString(*m, &text);
  google::protobuf::TextFormat::Printer one_line;
  one_line.SetSingleLineMode(true);
  one_line.PrintToString(rpc::PlacementFor(*m), &placement);
  std::printf("%s\n%splacement: %s\n", rpc::MethodText(*m).c_str(), text.c_str(),
              std::string(absl::StripTrailingAsciiWhitespace(placement)).c_str());
  return 0;
}

// What a response states of its own error, per query head (HeadStats): the median and the
// largest over the heads that state each, a line each; nothing where no head states it.
void PrintStatedErrors(const v1::DecodeResponse& resp) {
  struct Stated {
    const char* what;
    std::vector<float> values;
  };
  Stated stated[] = {
      {"standard error, relative to the output (S2ANTA, from its draws)", {}},
      {"epsilon its sample promises at 1 - delta (vAttention)", {}},
      {"certified bound on the attention mass left out (top-k over compressed keys)", {}}};
  for (const v1::HeadStats& h : resp.heads()) {
    stated[0].values.insert(stated[0].values.end(), h.standard_error().begin(),
                            h.standard_error().end());
    stated[1].values.insert(stated[1].values.end(), h.epsilon().begin(), h.epsilon().end());
    stated[2].values.insert(stated[2].values.end(), h.missed_mass_bound().begin(),
                            h.missed_mass_bound().end());
  }
  for (Stated& s : stated) {
    if (s.values.empty()) continue;
    std::sort(s.values.begin(), s.values.end());
    std::printf("  stated %s: median %.4g, largest %.4g over %zu heads\n", s.what,
                s.values[s.values.size() / 2], s.values.back(), s.values.size());
  }
}

// One decode step of one layer for --seq (comma-separated ids) with a random query: what was
// read from each tier against what dense attention would have read, and the error vs dense.
int CmdDecode(KvStoreClient& c) {
  if (absl::Status s = RequireSeq(); !s.ok()) return Fail("decode", s);
  std::vector<std::string> ids = absl::StrSplit(absl::GetFlag(FLAGS_seq), ',', absl::SkipEmpty());
  auto info = c.GetSequenceInfo(ids[0]);
  if (!info.ok()) return Fail("decode", info.status());
  auto method = rpc::MethodFromText(absl::GetFlag(FLAGS_method));
  if (!method.ok()) return Fail("decode", method.status());
  const v1::ModelShape& shape = info->shape();
  v1::DecodeRequest req;
  req.set_layer(absl::GetFlag(FLAGS_layer));
  for (const std::string& id : ids) req.add_sequence_ids(id);
  v1::Tensor* q = req.mutable_q();
  q->set_dtype(v1::DTYPE_FP32);
  for (int64_t d : {static_cast<int64_t>(ids.size()), static_cast<int64_t>(shape.num_q_heads()),
                    static_cast<int64_t>(shape.head_dim())}) {
    q->add_shape(d);
  }
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  std::normal_distribution<float> normal(0.f, 1.f);
  const uint32_t H = shape.num_q_heads(), G = H / shape.num_kv_heads(), d = shape.head_dim();
  std::vector<float> qv(ids.size() * H * d);
  if (absl::GetFlag(FLAGS_query) == "random") {
    for (float& x : qv) x = 2.f * normal(rng);
  } else {
    // Query head h = 2.5 x the K row of one random token of its kv head, plus noise: that token
    // gets a logit near 2.5 |K|^2 / sqrt(d), the rest spread around 0.
    absl::StatusOr<DType> dt = rpc::FromProto(shape.dtype(), "shape.dtype");
    if (!dt.ok()) return Fail("decode", dt.status());
    for (size_t b = 0; b < ids.size(); ++b) {
      auto sinfo = c.GetSequenceInfo(ids[b]);
      if (!sinfo.ok()) return Fail("decode", sinfo.status());
      const uint32_t layer = absl::GetFlag(FLAGS_layer);
      if (layer >= static_cast<uint32_t>(sinfo->layer_lengths_size()) ||
          sinfo->layer_lengths(layer) == 0) {
        break;  // no needle to aim at: the server's answer to the call says why
      }
      std::uniform_int_distribution<uint32_t> tok(
          0, static_cast<uint32_t>(sinfo->layer_lengths(layer) - 1));
      v1::GatherRequest g;
      g.set_sequence_id(ids[b]);
      g.set_layer(layer);
      g.set_kind(v1::ROW_KIND_K);
      for (uint32_t j = 0; j < shape.num_kv_heads(); ++j) {
        v1::HeadSelection* sel = g.add_heads();
        sel->set_kv_head(j);
        for (uint32_t i = 0; i < G; ++i) sel->add_token_indices(tok(rng));
      }
      auto rows = c.Gather(g);
      if (!rows.ok()) return Fail("decode (needle rows)", rows.status());
      for (uint32_t h = 0; h < H; ++h) {  // row h of the gather is query head h's needle
        for (uint32_t i = 0; i < d; ++i) {
          qv[(b * H + h) * d + i] =
              2.5f * kernels::LoadAsFloat(rows->k().data().data(), h * d + i, *dt) +
              0.5f * normal(rng);
        }
      }
    }
  }
  q->set_data(qv.data(), qv.size() * sizeof(float));
  *req.mutable_method() = *method;
  req.set_seed(absl::GetFlag(FLAGS_seed));
  std::unique_ptr<AttentionClient> attn;
  if (!absl::GetFlag(FLAGS_store_target).empty() &&
      absl::GetFlag(FLAGS_store_target) != absl::GetFlag(FLAGS_target)) {
    ClientOptions o = c.options();
    o.target = absl::GetFlag(FLAGS_target);  // the worker; c is the sequence's store
    auto connected = AttentionClient::Connect(o);
    if (!connected.ok()) return Fail("decode", connected.status());
    attn = std::move(*connected);
  } else {
    attn = AttentionClient::FromChannel(c.channel(), c.options());
  }
  const absl::Time t0 = absl::Now();
  auto resp = attn->Decode(req);
  const double us = absl::ToDoubleMicroseconds(absl::Now() - t0);
  if (!resp.ok()) return Fail("decode", resp.status());
  uint64_t host = 0, device = 0, remote = 0, dense = 0, fetched = 0, selected = 0;
  for (const v1::HeadStats& h : resp->heads()) {
    host += h.bytes_host();
    device += h.bytes_device();
    remote += h.bytes_remote();
    dense += h.dense_equivalent_bytes();
    fetched += h.rows_fetched();
    selected += h.rows_selected();
  }
  std::printf(
      "decode %s layer %u, %zu sequence(s), method %s: %.0f us (engine %.0f us: selection "
      "%.0f, gather %.0f, compute %.0f",
      absl::StrJoin(ids, ",").c_str(), req.layer(), ids.size(), rpc::MethodText(*method).c_str(),
      us, resp->timing().engine_seconds() * 1e6, resp->timing().selection_seconds() * 1e6,
      resp->timing().gather_seconds() * 1e6, resp->timing().compute_seconds() * 1e6);
  if (resp->sync_bytes() > 0) {
    std::printf("; resident sync %.0f us, %" PRIu64 " bytes: one-off after a prefill",
                resp->timing().sync_seconds() * 1e6, resp->sync_bytes());
  }
  std::printf(")\n");
  std::printf("  rows selected %" PRIu64 ", rows fetched %" PRIu64 "\n", selected, fetched);
  std::printf("  bytes read: host %" PRIu64 ", device %" PRIu64 ", remote %" PRIu64
              "; dense reads %" PRIu64 " (%.1f%% of it crossed from host/remote)\n",
              host, device, remote, dense, 100.0 * (host + remote) / std::max<uint64_t>(dense, 1));
  PrintStatedErrors(*resp);
  if (absl::GetFlag(FLAGS_compare_dense) && !method->has_dense() &&
      method->kind_case() != v1::Method::KIND_NOT_SET) {
    v1::DecodeRequest dreq = req;
    dreq.mutable_method()->mutable_dense();
    auto d = attn->Decode(dreq);
    if (!d.ok()) return Fail("decode (dense)", d.status());
    const float* a = reinterpret_cast<const float*>(resp->output().data().data());
    const float* b = reinterpret_cast<const float*>(d->output().data().data());
    double num = 0, den = 0;
    for (size_t i = 0; i < qv.size(); ++i) {
      num += (a[i] - b[i]) * (a[i] - b[i]);
      den += b[i] * b[i];
    }
    std::printf("  relative L2 error against dense: %.4f\n", std::sqrt(num / std::max(den, 1e-30)));
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
      "kvsparse [--target=HOST:PORT] [--store_target=STORE] COMMAND [flags]\n"
      "commands:\n"
      "  health                     grpc.health.v1 check\n"
      "  create --seq=ID [--layers --q_heads --kv_heads --head_dim --dtype --k_tier --v_tier\n"
      "                  --signature_bits --compressed_key_bits]\n"
      "  fork --seq=ID --from=SOURCE --tokens=N   SOURCE's first N tokens, its pages shared\n"
      "  drop --seq=ID\n"
      "  append --seq=ID --tokens=N [--seed]       synthetic K/V rows, with progress\n"
      "  gather --seq=ID [--layer --heads --indices|--random_rows --kind --unique --verify]\n"
      "  info --seq=ID | list | stats\n"
      "  bench-gather --seq=ID [--rows=4096 --iters --kind=v --heads]\n"
      "  decode --seq=ID[,ID...] [--layer --method=NAME[:FIELD=VALUE,...] --query]\n"
      "  method --method=NAME[:FIELD=VALUE,...]   every field and the placement it reads");
  absl::FlagsUsageConfig usage;
  usage.version_string = [] { return kvsparse::BuildInfoLine("kvsparse") + "\n"; };
  absl::SetFlagsUsageConfig(usage);
  kvsparse::rpc::HandleHelp(argc, argv, "client/cli.");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::fprintf(stderr, "%s\n", std::string(absl::ProgramUsageMessage()).c_str());
    return 2;
  }
  const std::string cmd = args[1];
  // An unknown command is answered before any connection is tried.
  static const char* const kCommands[] = {"health", "create", "fork",         "drop",
                                          "append", "gather", "info",         "list",
                                          "stats",  "decode", "bench-gather", "method"};
  if (std::find(std::begin(kCommands), std::end(kCommands), cmd) == std::end(kCommands)) {
    std::fprintf(stderr, "unknown command '%s'\n%s\n", cmd.c_str(),
                 std::string(absl::ProgramUsageMessage()).c_str());
    return 2;
  }
  using namespace kvsparse::client;
  if (cmd == "method") return CmdMethod();
  if (!absl::GetFlag(FLAGS_worker).empty()) {
    std::fprintf(stderr,
                 "--worker is gone: name the worker with --target and the store with "
                 "--store_target (as the Python client's Client(target, store_target=...))\n");
    return 2;
  }
  ClientOptions options;
  // Every command but decode talks to the store: --store_target, or --target when that is both.
  options.target = absl::GetFlag(FLAGS_store_target).empty() ? absl::GetFlag(FLAGS_target)
                                                             : absl::GetFlag(FLAGS_store_target);
  options.timeout = absl::GetFlag(FLAGS_timeout);
  options.tls.ca = absl::GetFlag(FLAGS_tls_ca);
  options.tls.cert = absl::GetFlag(FLAGS_tls_cert);
  options.tls.key = absl::GetFlag(FLAGS_tls_key);
  if (const std::string f = absl::GetFlag(FLAGS_token_file); !f.empty()) {
    absl::StatusOr<std::string> token = kvsparse::rpc::ReadTokenFile(f);
    if (!token.ok()) return Fail("--token_file", token.status());
    options.token = *token;
  }
  // The store may be a sharded fleet: each command goes to its sequence's shard, and list, stats
  // and health to every shard.
  auto shards = StoreShards::Connect(options);
  if (!shards.ok()) return Fail(cmd.c_str(), shards.status());
  for (size_t i = 0; i < (*shards)->size(); ++i) {
    if (absl::Status s = (*shards)->shard(i).WaitForReady(absl::GetFlag(FLAGS_wait_for_ready));
        !s.ok()) {
      return Fail(cmd.c_str(), s);
    }
  }
  if ((*shards)->size() > 1) {
    if (absl::Status s = (*shards)->CheckPlacement(); !s.ok()) return Fail(cmd.c_str(), s);
    if (cmd == "health" || cmd == "list" || cmd == "stats") {
      int rc = 0;
      for (size_t i = 0; i < (*shards)->size(); ++i) {
        KvStoreClient& c = (*shards)->shard(i);
        std::printf("shard %zu (%s)\n", i, c.options().target.c_str());
        rc |= cmd == "health" ? CmdHealth(c) : cmd == "list" ? CmdList(c) : CmdStats(c);
      }
      return rc;
    }
  }
  // A fork goes to its source's shard (which refuses a new id it does not hold).
  const std::string seq = cmd == "fork" ? absl::GetFlag(FLAGS_from) : absl::GetFlag(FLAGS_seq);
  KvStoreClient& c = (*shards)->For(seq.substr(0, seq.find(',')));
  if (cmd == "health") return CmdHealth(c);
  if (cmd == "create") return CmdCreate(c);
  if (cmd == "fork") return CmdFork(c);
  if (cmd == "drop") return CmdDrop(c);
  if (cmd == "append") return CmdAppend(c);
  if (cmd == "gather") return CmdGather(c);
  if (cmd == "info") return CmdInfo(c);
  if (cmd == "list") return CmdList(c);
  if (cmd == "stats") return CmdStats(c);
  if (cmd == "bench-gather") return CmdBenchGather(c);
  if (cmd == "decode") return CmdDecode(c);
  std::fprintf(stderr, "unknown command '%s'\n%s\n", cmd.c_str(),
               std::string(absl::ProgramUsageMessage()).c_str());
  return 2;
}
