#include "engine/cpu_step.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/time/clock.h"
#include "engine/methods/method_unit.h"
#include "kernels/compressed_keys.h"
#include "kernels/dense.h"
#include "kernels/philox.h"

namespace kvsparse::engine {
namespace {

using kernels::DType;
constexpr size_t kDevice = static_cast<size_t>(kvstore::Tier::kDevice);

double Seconds(absl::Time a, absl::Time b) { return absl::ToDoubleSeconds(b - a); }

}  // namespace

size_t FetchedRows::Find(uint32_t j, uint32_t t) const {
  return std::lower_bound(tokens[j].begin(), tokens[j].end(), t) - tokens[j].begin();
}

void FetchedRows::Layout() {
  offset.assign(tokens.size(), 0);
  total = 0;
  for (size_t j = 0; j < tokens.size(); ++j) {
    offset[j] = total;
    total += tokens[j].size();
  }
}

void RowToFloat(const uint8_t* row, int d, DType t, float* out) {
  for (int i = 0; i < d; ++i) out[i] = kernels::LoadAsFloat(row, i, t);
}

float Logit(const float* q, const uint8_t* row, int d, DType t, float scale) {
  float s = 0.f;
  for (int i = 0; i < d; ++i) s += q[i] * kernels::LoadAsFloat(row, i, t);
  return s * scale;
}

CpuStep::CpuStep(const Env& env, const DecodeCall& call, uint32_t index, const SequenceDesc& desc)
    : env_(env),
      call_(call),
      index_(index),
      desc_(desc),
      shape_(desc.shape),
      H_(static_cast<int32_t>(shape_.num_q_heads)),
      hkv_(static_cast<int32_t>(shape_.num_kv_heads)),
      G_(H_ / hkv_),
      d_(static_cast<int32_t>(shape_.head_dim)),
      row_(shape_.row_bytes()),
      seed_(kernels::SequenceSeed(call.SeedOf(index), index)),
      src_tier_(static_cast<size_t>(env.source->tier())) {}

absl::Status CpuStep::Run(const MethodUnit& unit, DecodeResult* result) {
  if (absl::Status s = Sync(result); !s.ok()) return s;
  if (absl::Status s = call_.CheckLive(); !s.ok()) return s;
  if (res_->length() > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
    return absl::OutOfRangeError("sequence longer than 2^31 tokens");
  }
  n_ = static_cast<int32_t>(res_->length());
  MakeProblem();
  const CpuPlan plan = unit.Plan(method());
  if (plan.all_keys) {
    if (absl::Status s = ProvideKeys(); !s.ok()) return s;
    if (absl::Status s = call_.CheckLive(); !s.ok()) return s;
  }

  absl::Time t0 = absl::Now();
  const double gather_before = gather_seconds_;
  kernels::RowSelection sel;
  if (absl::Status s = unit.Select(*this, &sel); !s.ok()) return s;
  // Rows the selection read itself count as gather time.
  const double selection_s = Seconds(t0, absl::Now()) - (gather_seconds_ - gather_before);

  if (absl::Status s = call_.CheckLive(); !s.ok()) return s;
  if (absl::Status s = GatherSelected(sel); !s.ok()) return s;
  if (absl::Status s = call_.CheckLive(); !s.ok()) return s;

  t0 = absl::Now();
  if (absl::Status s = Estimate(sel, plan.states_standard_error, result); !s.ok()) return s;
  if (!log_left_out_.empty()) StateMissedMass(sel);
  const double compute_s = Seconds(t0, absl::Now());

  for (int32_t j = 0; j < hkv_; ++j) {
    const kernels::KvHeadSelection& ks = sel.at(0, j);
    stats_[j].rows_selected = static_cast<uint64_t>(ks.rows_selected());
    stats_[j].budgets.assign(ks.budgets.begin(), ks.budgets.end());
    if (call_.return_indices) stats_[j].fetched_tokens = rows_.tokens[j];
    result->heads.push_back(std::move(stats_[j]));
  }
  result->timing.selection_seconds += selection_s;
  result->timing.gather_seconds += gather_seconds_;
  result->timing.compute_seconds += compute_s;
  return absl::OkStatus();
}

absl::Status CpuStep::Sync(DecodeResult* result) {
  const absl::Time t0 = absl::Now();
  SyncStats sync;
  absl::StatusOr<ResidentCache::Handle> handle =
      env_.cache->Acquire(desc_, call_.layer, env_.source, call_.deadline, &sync);
  if (!handle.ok()) return handle.status();
  handle_.emplace(std::move(*handle));
  res_ = &handle_->layer();
  if (!call_.new_k.empty()) {
    const size_t token_bytes = static_cast<size_t>(hkv_) * row_;
    if (absl::Status s = handle_->AppendTokens(1, call_.new_k.data() + index_ * token_bytes,
                                               call_.new_v.data() + index_ * token_bytes);
        !s.ok()) {
      return s;
    }
  }
  result->sync_bytes += sync.bytes_fetched;
  result->timing.sync_seconds += Seconds(t0, absl::Now());
  return absl::OkStatus();
}

void CpuStep::MakeProblem() {
  const size_t es = kernels::DTypeSize(shape_.dtype);
  const size_t hd = static_cast<size_t>(H_) * d_;
  q_.resize(hd * es);
  out_.resize(q_.size());
  kernels::ConvertElements(call_.q.data() + index_ * hd * kernels::DTypeSize(call_.q_dtype),
                           call_.q_dtype, q_.data(), shape_.dtype, hd);
  p_.batch = 1;
  p_.num_q_heads = H_;
  p_.num_kv_heads = hkv_;
  p_.head_dim = d_;
  p_.dtype = shape_.dtype;
  p_.q = q_.data();
  p_.seq_lens = &n_;
  p_.scale = call_.scale > 0.f ? call_.scale : 1.f / std::sqrt(static_cast<float>(d_));
  p_.out = out_.data();
  stats_.assign(hkv_, HeadStats());
  for (int32_t j = 0; j < hkv_; ++j) {
    stats_[j].sequence_index = index_;
    stats_[j].kv_head = static_cast<uint32_t>(j);
    stats_[j].dense_equivalent_bytes = 2ull * n_ * row_;
  }
}

absl::Status CpuStep::ProvideKeys() {
  const absl::Time t0 = absl::Now();
  const uint64_t n64 = static_cast<uint64_t>(n_);
  if (res_->has_k()) {
    p_.k = res_->k_base();
    p_.kv_layout = {0, static_cast<int64_t>(res_->capacity()) * d_, d_};
    for (HeadStats& st : stats_) st.bytes[kDevice] += n64 * row_;
  } else {
    // Every K row, [Hkv][n][d], one kv head at a time in chunks that stay well inside the
    // store's message limit.
    k_all_.resize(static_cast<size_t>(hkv_) * n64 * row_);
    const uint64_t chunk = std::max<uint64_t>(1, env_.options->max_fetch_bytes / row_);
    std::vector<uint32_t> tokens;
    for (int32_t j = 0; j < hkv_; ++j) {
      for (uint64_t first = 0; first < n64; first += chunk) {
        const uint64_t cnt = std::min(chunk, n64 - first);
        tokens.resize(cnt);
        for (uint64_t i = 0; i < cnt; ++i) tokens[i] = static_cast<uint32_t>(first + i);
        const RowRequest req{static_cast<uint32_t>(j), tokens};
        absl::StatusOr<uint64_t> got = env_.source->Gather(
            desc_.sequence_id, call_.layer, kvstore::RowKind::kK, absl::MakeConstSpan(&req, 1),
            k_all_.data() + (j * n64 + first) * row_, nullptr, call_.deadline);
        if (!got.ok()) return got.status();
      }
    }
    p_.k = k_all_.data();
    p_.kv_layout = {0, static_cast<int64_t>(n64) * d_, d_};
    for (HeadStats& st : stats_) {
      st.bytes[src_tier_] += n64 * row_;
      st.rows_fetched += n64;
    }
  }
  gather_seconds_ += Seconds(t0, absl::Now());
  return absl::OkStatus();
}

std::vector<float> CpuStep::QueryFloats() const {
  std::vector<float> qf(static_cast<size_t>(H_) * d_);
  const size_t es = kernels::DTypeSize(shape_.dtype);
  for (int32_t h = 0; h < H_; ++h) {
    RowToFloat(q_.data() + static_cast<size_t>(h) * d_ * es, d_, shape_.dtype, qf.data() + h * d_);
  }
  return qf;
}

const kernels::SignatureView& CpuStep::Signatures(int32_t bits) {
  const int32_t words = bits / 32;
  qsig_.assign(static_cast<size_t>(H_) * words, 0);
  std::vector<float> qf = QueryFloats(), scratch;
  for (int32_t h = 0; h < H_; ++h) {
    env_.signatures->Query(static_cast<int32_t>(call_.layer), h, G_, bits, d_,
                           qf.data() + static_cast<size_t>(h) * d_,
                           qsig_.data() + static_cast<size_t>(h) * words, &scratch);
  }
  KeySignatures(bits);
  view_.q = qsig_.data();
  return view_;
}

const kernels::SignatureView& CpuStep::KeySignatures(int32_t bits) {
  const int32_t words = bits / 32;
  view_.bits = bits;
  view_.q = nullptr;
  view_.k = res_->signatures();
  view_.batch_stride = 0;
  view_.head_stride = static_cast<int64_t>(res_->capacity()) * words;
  view_.token_stride = words;
  view_.key_heads = res_->key_heads();
  // The selection reads every key signature of the layer.
  const uint64_t sig_bytes =
      static_cast<uint64_t>(res_->key_heads()) * static_cast<uint64_t>(n_) * words * 4 / hkv_;
  for (HeadStats& st : stats_) st.bytes[kDevice] += sig_bytes;
  return view_;
}

absl::Span<const kernels::CompressedKeysView> CpuStep::CompressedKeys() {
  compressed_.clear();
  for (int32_t j = 0; j < hkv_; ++j) {
    compressed_.push_back(res_->compressed_keys(j));
    stats_[j].bytes[kDevice] += compressed_.back().bytes_read();
  }
  return compressed_;
}

absl::StatusOr<const FetchedRows*> CpuStep::FetchForSelection(
    std::vector<std::vector<uint32_t>> tokens) {
  const absl::Time t0 = absl::Now();
  base_.tokens = std::move(tokens);
  base_.Layout();
  base_.k.resize(base_.total * row_);
  base_.v.resize(base_.total * row_);
  std::vector<RowRequest> req;
  for (int32_t j = 0; j < hkv_; ++j) req.push_back({static_cast<uint32_t>(j), base_.tokens[j]});
  // Every K row read already (ProvideKeys): K from there, the tokens counted then.
  const bool k_read = !k_all_.empty();
  const bool fetch_k = !res_->has_k() && !k_read, fetch_v = !res_->has_v();
  if (fetch_k || fetch_v) {
    const kvstore::RowKind kind = kvstore::RowKindOf(fetch_k, fetch_v);
    absl::StatusOr<uint64_t> got = env_.source->Gather(
        desc_.sequence_id, call_.layer, kind, req, fetch_k ? base_.k.data() : nullptr,
        fetch_v ? base_.v.data() : nullptr, call_.deadline);
    if (!got.ok()) return got.status();
  }
  for (int32_t j = 0; j < hkv_; ++j) {
    const size_t cnt = base_.tokens[j].size();
    for (size_t i = 0; i < cnt; ++i) {
      const uint32_t t = base_.tokens[j][i];
      if (!fetch_k) {
        const uint8_t* k = k_read ? k_all_.data() + (static_cast<size_t>(j) * n_ + t) * row_
                                  : res_->k(j) + t * row_;
        std::memcpy(base_.k.data() + (base_.offset[j] + i) * row_, k, row_);
      }
      if (!fetch_v)
        std::memcpy(base_.v.data() + (base_.offset[j] + i) * row_, res_->v(j) + t * row_, row_);
    }
    if (!k_read) {
      stats_[j].rows_fetched += cnt;
      stats_[j].bytes[fetch_k ? src_tier_ : kDevice] += cnt * row_;
    }
    stats_[j].bytes[fetch_v ? src_tier_ : kDevice] += cnt * row_;
  }
  gather_seconds_ += Seconds(t0, absl::Now());
  return &base_;
}

absl::Status CpuStep::GatherSelected(const kernels::RowSelection& sel) {
  const absl::Time t0 = absl::Now();
  const bool need_k = sel.needs_k_rows();
  FetchedRows extra;  // the rows not in base_, fetched in one call for all heads
  rows_.tokens.assign(hkv_, {});
  extra.tokens.assign(hkv_, {});
  for (int32_t j = 0; j < hkv_; ++j) {
    const auto& toks = sel.at(0, j).tokens;
    rows_.tokens[j].assign(toks.begin(), toks.end());
    for (int32_t t : toks) {
      const uint32_t u = static_cast<uint32_t>(t);
      if (base_.tokens.empty() ||
          !std::binary_search(base_.tokens[j].begin(), base_.tokens[j].end(), u)) {
        extra.tokens[j].push_back(u);
      }
    }
  }
  rows_.Layout();
  extra.Layout();
  rows_.k.resize(need_k ? rows_.total * row_ : 0);
  rows_.v.resize(rows_.total * row_);
  // Every K row was read for the selection (ProvideKeys, K not resident): the selected rows' K
  // comes from there, and those tokens were counted as fetched then.
  const bool k_read = !k_all_.empty();
  const bool fetch_k = need_k && !res_->has_k() && !k_read;
  const bool fetch_v = !res_->has_v();
  if ((fetch_k || fetch_v) && extra.total > 0) {
    extra.k.resize(fetch_k ? extra.total * row_ : 0);
    extra.v.resize(fetch_v ? extra.total * row_ : 0);
    std::vector<RowRequest> req;
    for (int32_t j = 0; j < hkv_; ++j) {
      if (!extra.tokens[j].empty()) req.push_back({static_cast<uint32_t>(j), extra.tokens[j]});
    }
    const kvstore::RowKind kind = kvstore::RowKindOf(fetch_k, fetch_v);
    absl::StatusOr<uint64_t> got = env_.source->Gather(
        desc_.sequence_id, call_.layer, kind, req, fetch_k ? extra.k.data() : nullptr,
        fetch_v ? extra.v.data() : nullptr, call_.deadline);
    if (!got.ok()) return got.status();
  }
  // Each head's rows in selection order from: the rows read for the selection, the extra
  // fetch, or the resident state.
  for (int32_t j = 0; j < hkv_; ++j) {
    const std::vector<uint32_t>& missing = extra.tokens[j];
    size_t xi = 0;
    for (size_t i = 0; i < rows_.tokens[j].size(); ++i) {
      const uint32_t t = rows_.tokens[j][i];
      const bool in_extra = xi < missing.size() && missing[xi] == t;
      uint8_t* dk = need_k ? rows_.k.data() + (rows_.offset[j] + i) * row_ : nullptr;
      uint8_t* dv = rows_.v.data() + (rows_.offset[j] + i) * row_;
      if (in_extra) {
        if (dk) {
          const uint8_t* k = fetch_k  ? extra.KRow(j, xi, row_)
                             : k_read ? k_all_.data() + (static_cast<size_t>(j) * n_ + t) * row_
                                      : res_->k(j) + t * row_;
          std::memcpy(dk, k, row_);
        }
        std::memcpy(dv, fetch_v ? extra.VRow(j, xi, row_) : res_->v(j) + t * row_, row_);
        ++xi;
      } else {  // read for the selection already
        const size_t bi = base_.Find(j, t);
        if (dk) std::memcpy(dk, base_.KRow(j, bi, row_), row_);
        std::memcpy(dv, base_.VRow(j, bi, row_), row_);
      }
    }
    const uint64_t cnt = missing.size();
    if (!k_read) stats_[j].rows_fetched += cnt;  // else counted by ProvideKeys (every token)
    if (need_k && !k_read) stats_[j].bytes[fetch_k ? src_tier_ : kDevice] += cnt * row_;
    stats_[j].bytes[fetch_v ? src_tier_ : kDevice] += cnt * row_;
  }
  gather_seconds_ += Seconds(t0, absl::Now());
  return absl::OkStatus();
}

absl::Status CpuStep::Estimate(const kernels::RowSelection& sel, bool standard_error,
                               DecodeResult* result) {
  const bool need_k = sel.needs_k_rows();
  std::vector<kernels::GatheredRows> gathered(hkv_);
  for (int32_t j = 0; j < hkv_; ++j) {
    gathered[j].k = need_k ? rows_.k.data() + rows_.offset[j] * row_ : nullptr;
    gathered[j].v = rows_.v.data() + rows_.offset[j] * row_;
    gathered[j].row_stride = d_;
  }
  std::vector<float> se;
  if (absl::Status s =
          kernels::EstimateFromGathered(p_, sel, gathered, standard_error ? &se : nullptr);
      !s.ok()) {
    return s;
  }
  if (standard_error) {  // batch 1: [H], query head j * G + g of kv head j
    for (int32_t j = 0; j < hkv_; ++j) {
      stats_[j].standard_error.assign(se.begin() + j * G_, se.begin() + (j + 1) * G_);
    }
  }
  const size_t hd = static_cast<size_t>(H_) * d_;
  kernels::ConvertElements(out_.data(), shape_.dtype,
                           reinterpret_cast<uint8_t*>(result->output.data()) +
                               index_ * hd * kernels::DTypeSize(call_.q_dtype),
                           call_.q_dtype, hd);
  return absl::OkStatus();
}

void CpuStep::StateMissedMass(const kernels::RowSelection& sel) {
  const std::vector<float> q = QueryFloats();
  for (int32_t j = 0; j < hkv_; ++j) {
    const kernels::KvHeadSelection& ks = sel.at(0, j);
    const size_t r_count = ks.tokens.size();
    std::vector<double> logits(r_count);  // exact, in double: the bound's kept side
    for (int32_t g = 0; g < G_; ++g) {
      const int32_t h = j * G_ + g;
      double m = -std::numeric_limits<double>::infinity();
      for (size_t r = 0; r < r_count; ++r) {
        if (ks.head_counts[g * r_count + r] <= 0) continue;
        const uint8_t* row = rows_.KRow(static_cast<uint32_t>(j), r, row_);
        double s = 0;
        for (int32_t c = 0; c < d_; ++c) {
          s += static_cast<double>(q[static_cast<size_t>(h) * d_ + c]) *
               kernels::LoadAsFloat(row, c, shape_.dtype);
        }
        logits[r] = s * p_.scale;
        m = std::max(m, logits[r]);
      }
      double sum = 0;
      for (size_t r = 0; r < r_count; ++r) {
        if (ks.head_counts[g * r_count + r] > 0) sum += std::exp(logits[r] - m);
      }
      const double log_kept = sum > 0 ? m + std::log(sum) : m;
      stats_[j].missed_mass_bound.push_back(kernels::MissedMassBound(log_kept, log_left_out_[h]));
    }
  }
}

}  // namespace kvsparse::engine
