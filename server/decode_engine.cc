#include "server/decode_engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/dense.h"
#include "kernels/philox.h"
#include "kernels/row_selection.h"

namespace kvsparse::server {
namespace {

using kernels::DType;

double Seconds(absl::Time a, absl::Time b) { return absl::ToDoubleSeconds(b - a); }

// n elements of dtype `from` at src -> dtype `to` at dst (through fp32).
void Convert(const uint8_t* src, DType from, uint8_t* dst, DType to, size_t n) {
  if (from == to) {
    std::memcpy(dst, src, n * kernels::DTypeSize(from));
    return;
  }
  for (size_t i = 0; i < n; ++i)
    kernels::StoreFromFloat(dst, i, to, kernels::LoadAsFloat(src, i, from));
}

// d floats of a row of dtype t.
void RowToFloat(const uint8_t* row, int d, DType t, float* out) {
  for (int i = 0; i < d; ++i) out[i] = kernels::LoadAsFloat(row, i, t);
}

// scale * q . row, fp32 in ascending order (the arithmetic of the kernels' references).
float Logit(const float* q, const uint8_t* row, int d, DType t, float scale) {
  float s = 0.f;
  for (int i = 0; i < d; ++i) s += q[i] * kernels::LoadAsFloat(row, i, t);
  return s * scale;
}

// Rows of the kv heads of one sequence, fetched for one stage: per head, tokens (ascending) and
// where their K / V rows sit in k / v ([total, d], the sequence's dtype).
struct Fetched {
  std::vector<std::vector<uint32_t>> tokens;  // [Hkv]
  std::vector<size_t> offset;                 // [Hkv] first row of each head
  std::vector<uint8_t> k, v;
  size_t total = 0;

  const uint8_t* KRow(uint32_t j, size_t i, size_t row) const {
    return k.data() + (offset[j] + i) * row;
  }
  const uint8_t* VRow(uint32_t j, size_t i, size_t row) const {
    return v.data() + (offset[j] + i) * row;
  }
  // Index of token t in head j's list; REQUIRES: present.
  size_t Find(uint32_t j, uint32_t t) const {
    return std::lower_bound(tokens[j].begin(), tokens[j].end(), t) - tokens[j].begin();
  }
};

}  // namespace

const char* MethodName(MethodKind kind) {
  switch (kind) {
    case MethodKind::kDense:
      return "dense";
    case MethodKind::kSanta:
      return "santa";
    case MethodKind::kHashTopK:
      return "hash_top_k";
    case MethodKind::kVAttention:
      return "vattention";
  }
  return "?";
}

DecodeEngine::DecodeEngine(EngineOptions options, RowSource* source,
                           std::unique_ptr<DecodeBackend> backend)
    : options_(std::move(options)),
      source_(source),
      signatures_(options_.signatures),
      cache_(options_.resident_capacity_bytes, options_.max_fetch_bytes, &signatures_),
      backend_(std::move(backend)) {}

namespace {

// Checks what a method needs of a sequence's placement and shape, before anything is appended.
absl::Status CheckMethodFits(const Method& m, const SequenceDesc& desc, bool learned_server,
                             const kernels::LearnedHashWeights* learned) {
  const uint32_t sig_bits = desc.placement.signature_bits;
  auto check_signatures = [&](int32_t bits, const char* method) -> absl::Status {
    if (sig_bits == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          method, " needs key signatures: create the sequence with placement.signature_bits"));
    }
    if (bits != 0 && static_cast<uint32_t>(bits) != sig_bits) {
      return absl::InvalidArgumentError(absl::StrCat(
          method, ": bits ", bits, " but the sequence keeps ", sig_bits, "-bit signatures"));
    }
    if (m.learned_signatures != learned_server) {
      return absl::FailedPreconditionError(
          absl::StrCat(method, ": this server keeps ", learned_server ? "learned" : "SimHash",
                       " signatures (--hash_weights), the request asked for ",
                       m.learned_signatures ? "learned" : "SimHash"));
    }
    if (learned != nullptr) {
      const kvstore::ModelShape& s = desc.shape;
      if (learned->num_layers < static_cast<int32_t>(s.num_layers) ||
          learned->num_q_heads != static_cast<int32_t>(s.num_q_heads) ||
          learned->head_dim() != static_cast<int32_t>(s.head_dim) ||
          learned->bits() != static_cast<int32_t>(sig_bits) ||
          (learned->num_key_mlps != static_cast<int32_t>(s.num_kv_heads) &&
           learned->num_key_mlps != static_cast<int32_t>(s.num_q_heads))) {
        return absl::FailedPreconditionError(
            "the server's learned hash weights do not fit this sequence's shape or bits");
      }
    }
    return absl::OkStatus();
  };
  switch (m.kind) {
    case MethodKind::kDense:
    case MethodKind::kSanta:
      return absl::OkStatus();
    case MethodKind::kHashTopK:
      return check_signatures(m.hash.bits, "hash_top_k");
    case MethodKind::kVAttention:
      if (m.vattention.predictor == kernels::TopKPredictor::kHash) {
        return check_signatures(m.vattention.bits, "vattention (hash predictor)");
      }
      return absl::OkStatus();
  }
  return absl::InvalidArgumentError("unknown method");
}

}  // namespace

absl::StatusOr<DecodeResult> DecodeEngine::Decode(const DecodeCall& call) {
  const absl::Time start = absl::Now();
  if (call.sequence_ids.empty()) return absl::InvalidArgumentError("no sequences");
  if (start > call.deadline) return absl::DeadlineExceededError("deadline passed");
  // Method parameters (per-sequence parts such as k <= n are checked per sequence).
  switch (call.method.kind) {
    case MethodKind::kDense:
      break;
    case MethodKind::kSanta: {
      kernels::SantaParams p = call.method.santa;
      if (p.tile_size == 0) p.tile_size = options_.default_tile_size;
      if (absl::Status s = kernels::ValidateSantaParams(p); !s.ok()) return s;
      break;
    }
    case MethodKind::kHashTopK: {
      kernels::HashTopKParams p = call.method.hash;
      if (p.bits == 0) p.bits = 32;  // the sequence's bits are checked per sequence
      if (absl::Status s = kernels::ValidateHashTopKParams(p); !s.ok()) return s;
      break;
    }
    case MethodKind::kVAttention: {
      kernels::VAttentionParams p = call.method.vattention;
      if (p.bits == 0) p.bits = 32;
      if (p.exact_statistics) return absl::InvalidArgumentError("exact_statistics is test-only");
      if (absl::Status s = kernels::ValidateVAttentionParams(p); !s.ok()) return s;
      break;
    }
  }
  const size_t B = call.sequence_ids.size();
  std::vector<SequenceDesc> descs(B);
  for (size_t b = 0; b < B; ++b) {
    absl::StatusOr<SequenceDesc> d = source_->Describe(call.sequence_ids[b], call.deadline);
    if (absl::IsNotFound(d.status())) {  // gone from the store
      cache_.Forget(call.sequence_ids[b]);
      if (backend_ != nullptr) backend_->Forget(call.sequence_ids[b]);
    }
    if (!d.ok()) return d.status();
    descs[b] = std::move(*d);
  }
  const kvstore::ModelShape& shape = descs[0].shape;
  for (size_t b = 1; b < B; ++b) {
    const kvstore::ModelShape& s = descs[b].shape;
    if (s.num_layers != shape.num_layers || s.num_q_heads != shape.num_q_heads ||
        s.num_kv_heads != shape.num_kv_heads || s.head_dim != shape.head_dim ||
        s.dtype != shape.dtype) {
      return absl::InvalidArgumentError(absl::StrCat("sequences '", descs[0].sequence_id, "' and '",
                                                     descs[b].sequence_id,
                                                     "' have different model shapes"));
    }
  }
  if (call.layer >= shape.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", call.layer, " outside the sequences' ", shape.num_layers));
  }
  if ((call.q_heads != 0 && call.q_heads != shape.num_q_heads) ||
      (call.q_dim != 0 && call.q_dim != shape.head_dim)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "q has ", call.q_heads, " heads of dim ", call.q_dim, " but the sequences' model has ",
        shape.num_q_heads, " query heads of dim ", shape.head_dim));
  }
  const size_t hd = static_cast<size_t>(shape.num_q_heads) * shape.head_dim;
  if (call.q.size() != B * hd * kernels::DTypeSize(call.q_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("q must be [", B, ", ", shape.num_q_heads, ", ", shape.head_dim, "] ",
                     kernels::DTypeName(call.q_dtype), " = ",
                     B * hd * kernels::DTypeSize(call.q_dtype), " bytes; got ", call.q.size()));
  }
  const bool append = !call.new_k.empty() || !call.new_v.empty();
  const size_t token_bytes = static_cast<size_t>(shape.num_kv_heads) * shape.row_bytes();
  if (append) {
    if (call.new_kv_dtype != shape.dtype) {
      return absl::InvalidArgumentError(absl::StrCat("new_k/new_v must be ",
                                                     kernels::DTypeName(shape.dtype), ", got ",
                                                     kernels::DTypeName(call.new_kv_dtype)));
    }
    if (call.new_k.size() != B * token_bytes || call.new_v.size() != B * token_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "new_k and new_v must each be [", B, ", ", shape.num_kv_heads, ", ", shape.head_dim,
          "] = ", B * token_bytes, " bytes; got ", call.new_k.size(), " and ", call.new_v.size()));
    }
  }
  for (const SequenceDesc& d : descs) {
    if (absl::Status s = CheckMethodFits(call.method, d, signatures_.learned(),
                                         signatures_.config().learned.get());
        !s.ok()) {
      return s;
    }
  }
  // Append every sequence's new token before any compute, so a failure leaves nothing half-done
  // within a sequence (each append is all-or-nothing in the store).
  if (append) {
    for (size_t b = 0; b < B; ++b) {
      const uint64_t len = descs[b].layer_lengths[call.layer];
      absl::Status s =
          source_->Append(descs[b].sequence_id, shape, call.layer, len, 1,
                          call.new_k.subspan(b * token_bytes, token_bytes),
                          call.new_v.subspan(b * token_bytes, token_bytes), call.deadline);
      if (!s.ok()) {
        return absl::Status(
            s.code(),
            absl::StrCat("appending the new token of sequence '", descs[b].sequence_id, "'",
                         b > 0 ? " (earlier sequences' were appended)" : "", ": ", s.message()));
      }
    }
  }
  DecodeResult result;
  result.num_q_heads = shape.num_q_heads;
  result.head_dim = shape.head_dim;
  result.output.resize(B * hd * kernels::DTypeSize(call.q_dtype));
  result.heads.reserve(B * shape.num_kv_heads);
  if (backend_ != nullptr) {
    std::vector<SequenceDesc> now = descs;  // as the store holds them now
    if (append) {
      for (SequenceDesc& d : now) ++d.layer_lengths[call.layer];
    }
    if (backend_->Supports(call, now)) {
      if (absl::Status s = backend_->Decode(call, now, &result); !s.ok()) return s;
      result.timing.engine_seconds = Seconds(start, absl::Now());
      return result;
    }
  }
  for (size_t b = 0; b < B; ++b) {
    absl::Status s = DecodeSequence(call, static_cast<uint32_t>(b), descs[b], &result);
    if (!s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("sequence '", descs[b].sequence_id, "': ", s.message()));
    }
  }
  result.timing.engine_seconds = Seconds(start, absl::Now());
  return result;
}

absl::Status DecodeEngine::DecodeSequence(const DecodeCall& call, uint32_t index,
                                          const SequenceDesc& desc, DecodeResult* result) {
  const kvstore::ModelShape& shape = desc.shape;
  const uint32_t layer = call.layer;
  const int32_t H = static_cast<int32_t>(shape.num_q_heads);
  const int32_t hkv = static_cast<int32_t>(shape.num_kv_heads);
  const int32_t G = H / hkv;
  const int32_t d = static_cast<int32_t>(shape.head_dim);
  const DType dt = shape.dtype;
  const size_t es = kernels::DTypeSize(dt);
  const size_t row = shape.row_bytes();
  const uint64_t seed = kernels::SequenceSeed(call.seed, index);
  const float scale = call.scale > 0.f ? call.scale : 1.f / std::sqrt(static_cast<float>(d));
  const bool appended = !call.new_k.empty();
  constexpr size_t kDevice = static_cast<size_t>(kvstore::Tier::kDevice);
  const size_t src_tier = static_cast<size_t>(source_->tier());

  // ---- Resident state, synced; the new token goes in directly. ----
  absl::Time t0 = absl::Now();
  SyncStats sync;
  absl::StatusOr<ResidentCache::Handle> handle =
      cache_.Acquire(desc, layer, source_, call.deadline, &sync);
  if (!handle.ok()) return handle.status();
  ResidentLayer& res = handle->layer();
  if (appended) {
    const size_t token_bytes = static_cast<size_t>(hkv) * row;
    if (absl::Status s = handle->AppendTokens(1, call.new_k.data() + index * token_bytes,
                                              call.new_v.data() + index * token_bytes);
        !s.ok()) {
      return s;
    }
  }
  result->sync_bytes += sync.bytes_fetched;
  result->timing.sync_seconds += Seconds(t0, absl::Now());
  const uint64_t n64 = res.length();
  if (n64 > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
    return absl::OutOfRangeError("sequence longer than 2^31 tokens");
  }
  const int32_t n = static_cast<int32_t>(n64);
  double gather_s = 0;

  // ---- The problem: q in the sequence's dtype, K where the selection can read it. ----
  std::vector<uint8_t> q(static_cast<size_t>(H) * d * es), out(q.size());
  Convert(call.q.data() + static_cast<size_t>(index) * H * d * kernels::DTypeSize(call.q_dtype),
          call.q_dtype, q.data(), dt, static_cast<size_t>(H) * d);
  kernels::DecodeProblem p;
  p.batch = 1;
  p.num_q_heads = H;
  p.num_kv_heads = hkv;
  p.head_dim = d;
  p.dtype = dt;
  p.q = q.data();
  p.seq_lens = &n;
  p.scale = scale;
  p.out = out.data();
  std::vector<HeadStats> stats(hkv);
  for (int32_t j = 0; j < hkv; ++j) {
    stats[j].sequence_index = index;
    stats[j].kv_head = static_cast<uint32_t>(j);
    stats[j].dense_equivalent_bytes = 2ull * n64 * row;
  }
  const Method& m = call.method;
  const bool scores_need_k =
      m.kind == MethodKind::kSanta || (m.kind == MethodKind::kVAttention &&
                                       m.vattention.predictor == kernels::TopKPredictor::kExact);
  std::vector<uint8_t>
      k_all;  // every K row, when the selection needs them and they are not resident
  if (scores_need_k) {
    t0 = absl::Now();
    if (res.has_k()) {
      p.k = res.k_base();
      p.kv_layout = {0, static_cast<int64_t>(res.capacity()) * d, d};
      for (auto& st : stats) st.bytes[kDevice] += n64 * row;
    } else {
      // Every K row, [Hkv][n][d], one kv head at a time in chunks that stay well inside the
      // store's message limit.
      k_all.resize(static_cast<size_t>(hkv) * n64 * row);
      const uint64_t chunk = std::max<uint64_t>(1, options_.max_fetch_bytes / row);
      std::vector<uint32_t> tokens;
      for (int32_t j = 0; j < hkv; ++j) {
        for (uint64_t t0 = 0; t0 < n64; t0 += chunk) {
          const uint64_t cnt = std::min(chunk, n64 - t0);
          tokens.resize(cnt);
          for (uint64_t i = 0; i < cnt; ++i) tokens[i] = static_cast<uint32_t>(t0 + i);
          const RowRequest req{static_cast<uint32_t>(j), tokens};
          absl::StatusOr<uint64_t> got = source_->Gather(
              desc.sequence_id, layer, kvstore::RowKind::kK, absl::MakeConstSpan(&req, 1),
              k_all.data() + (j * n64 + t0) * row, nullptr, call.deadline);
          if (!got.ok()) return got.status();
        }
      }
      p.k = k_all.data();
      p.kv_layout = {0, static_cast<int64_t>(n64) * d, d};
      for (auto& st : stats) {
        st.bytes[src_tier] += n64 * row;
        st.rows_fetched += n64;
      }
    }
    gather_s += Seconds(t0, absl::Now());
  }

  // ---- Selection. ----
  t0 = absl::Now();
  double selection_s = 0;
  kernels::RowSelection sel;
  std::vector<uint32_t> qsig;
  kernels::SignatureView view;
  auto make_view = [&](int32_t bits) {
    const int32_t words = bits / 32;
    qsig.assign(static_cast<size_t>(H) * words, 0);
    std::vector<float> qf(d), scratch;
    for (int32_t h = 0; h < H; ++h) {
      RowToFloat(q.data() + static_cast<size_t>(h) * d * es, d, dt, qf.data());
      signatures_.Query(static_cast<int32_t>(layer), h, G, bits, d, qf.data(),
                        qsig.data() + static_cast<size_t>(h) * words, &scratch);
    }
    view.bits = bits;
    view.q = qsig.data();
    view.k = res.signatures();
    view.batch_stride = 0;
    view.head_stride = static_cast<int64_t>(res.capacity()) * words;
    view.token_stride = words;
    view.key_heads = res.key_heads();
    // The selection reads every key signature of the layer.
    const uint64_t sig_bytes = static_cast<uint64_t>(res.key_heads()) * n64 * words * 4 / hkv;
    for (auto& st : stats) st.bytes[kDevice] += sig_bytes;
  };
  const int32_t seq_bits = static_cast<int32_t>(desc.placement.signature_bits);
  Fetched base;  // vAttention: the rows of I_f u B, read before the final sample
  switch (m.kind) {
    case MethodKind::kDense: {
      if (absl::Status s = kernels::SelectAllRows(p, &sel); !s.ok()) return s;
      break;
    }
    case MethodKind::kSanta: {
      kernels::SantaParams params = m.santa;
      if (params.tile_size == 0) params.tile_size = options_.default_tile_size;
      if (absl::Status s = kernels::SantaSelectCpu(p, params, seed, &sel); !s.ok()) return s;
      break;
    }
    case MethodKind::kHashTopK: {
      kernels::HashTopKParams params = m.hash;
      if (params.bits == 0) params.bits = seq_bits;
      make_view(params.bits);
      if (absl::Status s = kernels::HashTopKSelectCpu(p, params, view, &sel); !s.ok()) return s;
      break;
    }
    case MethodKind::kVAttention: {
      kernels::VAttentionParams params = m.vattention;
      const bool hash = params.predictor == kernels::TopKPredictor::kHash;
      if (hash) {
        if (params.bits == 0) params.bits = seq_bits;
        make_view(params.bits);
      }
      absl::StatusOr<int32_t> k = kernels::ResolveTopK(params.top_k, params.top_k_fraction, n);
      if (!k.ok()) return k.status();
      // Steps 1 and 3 per query head: fixed set and base sample, from the predictor alone.
      std::vector<kernels::VAttentionHeadResult> r(H);
      std::vector<std::vector<float>> logits(hash ? 0 : H);
      std::vector<float> qf(static_cast<size_t>(H) * d);
      for (int32_t h = 0; h < H; ++h) {
        RowToFloat(q.data() + static_cast<size_t>(h) * d * es, d, dt, qf.data() + h * d);
      }
      std::vector<int32_t> sim, scratch;
      for (int32_t h = 0; h < H; ++h) {
        const int32_t j = h / G;
        if (hash) {
          const int32_t words = params.bits / 32;
          const int32_t sh = view.key_heads == H ? h : j;
          const uint32_t* qs = view.q + static_cast<size_t>(h) * words;
          const uint32_t* ks = view.k + sh * view.head_stride;
          sim.resize(n);
          for (int32_t t = 0; t < n; ++t) {
            sim[t] = kernels::HammingSimilarity(qs, ks + static_cast<int64_t>(t) * words, words);
          }
          kernels::VAttentionPlanFixed(sim.data(), n, *k, params, &r[h], &scratch);
        } else {
          logits[h].resize(n);
          const uint8_t* kb = static_cast<const uint8_t*>(p.k);
          for (int32_t t = 0; t < n; ++t) {
            logits[h][t] =
                Logit(qf.data() + h * d,
                      kb + (j * p.kv_layout.head_stride + t * p.kv_layout.token_stride) * es, d, dt,
                      scale);
          }
          kernels::VAttentionPlanFixed(logits[h].data(), n, *k, params, &r[h], &scratch);
        }
        kernels::VAttentionSampleBase(n, params, seed, 0, h, &r[h]);
      }
      // Fetch I_f u B of each kv head (K and V), resident halves read in place.
      base.tokens.assign(hkv, {});
      for (int32_t j = 0; j < hkv; ++j) {
        auto& toks = base.tokens[j];
        for (int32_t g = 0; g < G; ++g) {
          const auto& hr = r[j * G + g];
          toks.insert(toks.end(), hr.fixed.begin(), hr.fixed.end());
          toks.insert(toks.end(), hr.base.begin(), hr.base.end());
        }
        std::sort(toks.begin(), toks.end());
        toks.erase(std::unique(toks.begin(), toks.end()), toks.end());
      }
      sel.Reset(kernels::EstimateKind::kSoftmax, 1, hkv, G);
      selection_s += Seconds(t0, absl::Now());
      {
        t0 = absl::Now();
        base.offset.assign(hkv, 0);
        size_t total = 0;
        for (int32_t j = 0; j < hkv; ++j) {
          base.offset[j] = total;
          total += base.tokens[j].size();
        }
        base.total = total;
        base.k.resize(total * row);
        base.v.resize(total * row);
        std::vector<RowRequest> req;
        for (int32_t j = 0; j < hkv; ++j) req.push_back({static_cast<uint32_t>(j), base.tokens[j]});
        const bool fetch_k = !res.has_k(), fetch_v = !res.has_v();
        if (fetch_k || fetch_v) {
          const kvstore::RowKind kind = kvstore::RowKindOf(fetch_k, fetch_v);
          absl::StatusOr<uint64_t> got =
              source_->Gather(desc.sequence_id, layer, kind, req, fetch_k ? base.k.data() : nullptr,
                              fetch_v ? base.v.data() : nullptr, call.deadline);
          if (!got.ok()) return got.status();
        }
        for (int32_t j = 0; j < hkv; ++j) {
          const size_t cnt = base.tokens[j].size();
          for (size_t i = 0; i < cnt; ++i) {
            const uint32_t t = base.tokens[j][i];
            if (!fetch_k)
              std::memcpy(base.k.data() + (base.offset[j] + i) * row, res.k(j) + t * row, row);
            if (!fetch_v)
              std::memcpy(base.v.data() + (base.offset[j] + i) * row, res.v(j) + t * row, row);
          }
          stats[j].rows_fetched += cnt;
          stats[j].bytes[fetch_k ? src_tier : kDevice] += cnt * row;
          stats[j].bytes[fetch_v ? src_tier : kDevice] += cnt * row;
        }
        gather_s += Seconds(t0, absl::Now());
        t0 = absl::Now();  // steps 4-6 below are selection again
      }
      // Steps 4-6 per query head: statistics from the fetched rows, budget, final sample.
      std::vector<kernels::HeadRows> group_rows(G);
      for (int32_t j = 0; j < hkv; ++j) {
        for (int32_t g = 0; g < G; ++g) {
          const int32_t h = j * G + g;
          kernels::VAttentionRowAccess access;
          access.dv = d;
          const float* qh = qf.data() + h * d;
          access.load_v = [&](int32_t t, float* o) {
            RowToFloat(base.VRow(j, base.Find(j, t), row), d, dt, o);
          };
          if (hash) {
            access.logit = [&](int32_t t) {
              return Logit(qh, base.KRow(j, base.Find(j, t), row), d, dt, scale);
            };
          } else {
            const std::vector<float>& lg = logits[h];
            access.logit = [&](int32_t t) { return lg[t]; };
            float rmax = -std::numeric_limits<float>::infinity();
            size_t e = 0;
            for (int32_t t = 0; t < n; ++t) {
              if (e < r[h].fixed.size() && r[h].fixed[e] == t) {
                ++e;
              } else {
                rmax = std::max(rmax, lg[t]);
              }
            }
            if (std::isfinite(rmax)) access.residual_logit_max = rmax;
          }
          kernels::VAttentionBudgetAndSample(n, params, access, seed, 0, h, &r[h]);
          r[h].ToHeadRows(&group_rows[g]);
        }
        kernels::MergeGroup(group_rows, &sel.at(0, j));
      }
      break;
    }
  }
  selection_s += Seconds(t0, absl::Now());

  // ---- Gather exactly the selected rows (those not already read for the selection). ----
  t0 = absl::Now();
  const bool need_k = sel.needs_k_rows();
  Fetched rows;
  rows.tokens.assign(hkv, {});
  rows.offset.assign(hkv, 0);
  std::vector<std::vector<uint32_t>> missing(hkv);  // not in `base`
  for (int32_t j = 0; j < hkv; ++j) {
    const auto& toks = sel.at(0, j).tokens;
    rows.tokens[j].assign(toks.begin(), toks.end());
    rows.offset[j] = rows.total;
    rows.total += toks.size();
    for (int32_t t : toks) {
      const uint32_t u = static_cast<uint32_t>(t);
      if (base.tokens.empty() ||
          !std::binary_search(base.tokens[j].begin(), base.tokens[j].end(), u)) {
        missing[j].push_back(u);
      }
    }
  }
  rows.k.resize(need_k ? rows.total * row : 0);
  rows.v.resize(rows.total * row);
  const bool fetch_k = need_k && !res.has_k();
  const bool fetch_v = !res.has_v();
  Fetched extra;  // the missing rows, fetched in one call for all heads
  extra.tokens = missing;
  extra.offset.assign(hkv, 0);
  for (int32_t j = 0; j < hkv; ++j) {
    extra.offset[j] = extra.total;
    extra.total += missing[j].size();
  }
  if ((fetch_k || fetch_v) && extra.total > 0) {
    extra.k.resize(fetch_k ? extra.total * row : 0);
    extra.v.resize(fetch_v ? extra.total * row : 0);
    std::vector<RowRequest> req;
    for (int32_t j = 0; j < hkv; ++j) {
      if (!missing[j].empty()) req.push_back({static_cast<uint32_t>(j), missing[j]});
    }
    const kvstore::RowKind kind = kvstore::RowKindOf(fetch_k, fetch_v);
    absl::StatusOr<uint64_t> got =
        source_->Gather(desc.sequence_id, layer, kind, req, fetch_k ? extra.k.data() : nullptr,
                        fetch_v ? extra.v.data() : nullptr, call.deadline);
    if (!got.ok()) return got.status();
  }
  // Assemble each head's rows in selection order from: the base fetch, the extra fetch, or the
  // resident state.
  for (int32_t j = 0; j < hkv; ++j) {
    size_t xi = 0;
    for (size_t i = 0; i < rows.tokens[j].size(); ++i) {
      const uint32_t t = rows.tokens[j][i];
      const bool in_extra = xi < missing[j].size() && missing[j][xi] == t;
      uint8_t* dk = need_k ? rows.k.data() + (rows.offset[j] + i) * row : nullptr;
      uint8_t* dv = rows.v.data() + (rows.offset[j] + i) * row;
      if (in_extra) {
        if (dk) std::memcpy(dk, fetch_k ? extra.KRow(j, xi, row) : res.k(j) + t * row, row);
        std::memcpy(dv, fetch_v ? extra.VRow(j, xi, row) : res.v(j) + t * row, row);
        ++xi;
      } else {  // read for the selection already
        const size_t bi = base.Find(j, t);
        if (dk) std::memcpy(dk, base.KRow(j, bi, row), row);
        std::memcpy(dv, base.VRow(j, bi, row), row);
      }
    }
    const uint64_t cnt = missing[j].size();
    stats[j].rows_fetched += cnt;
    if (need_k) stats[j].bytes[fetch_k ? src_tier : kDevice] += cnt * row;
    stats[j].bytes[fetch_v ? src_tier : kDevice] += cnt * row;
  }
  gather_s += Seconds(t0, absl::Now());

  // ---- Estimate. ----
  t0 = absl::Now();
  std::vector<kernels::GatheredRows> gathered(hkv);
  for (int32_t j = 0; j < hkv; ++j) {
    gathered[j].k = need_k ? rows.k.data() + rows.offset[j] * row : nullptr;
    gathered[j].v = rows.v.data() + rows.offset[j] * row;
    gathered[j].row_stride = d;
  }
  if (absl::Status s = kernels::EstimateFromGathered(p, sel, gathered); !s.ok()) return s;
  Convert(out.data(), dt,
          reinterpret_cast<uint8_t*>(result->output.data()) +
              static_cast<size_t>(index) * H * d * kernels::DTypeSize(call.q_dtype),
          call.q_dtype, static_cast<size_t>(H) * d);
  const double compute_s = Seconds(t0, absl::Now());

  for (int32_t j = 0; j < hkv; ++j) {
    const kernels::KvHeadSelection& ks = sel.at(0, j);
    stats[j].rows_selected = static_cast<uint64_t>(ks.rows_selected());
    stats[j].budgets.assign(ks.budgets.begin(), ks.budgets.end());
    if (call.return_indices) stats[j].fetched_tokens = rows.tokens[j];
    result->heads.push_back(std::move(stats[j]));
  }
  result->timing.selection_seconds += selection_s;
  result->timing.gather_seconds += gather_s;
  result->timing.compute_seconds += compute_s;
  return absl::OkStatus();
}

}  // namespace kvsparse::server
