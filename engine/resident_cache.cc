#include "engine/resident_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"

namespace kvsparse::engine {

class ResidentCache::Entry {
 public:
  std::mutex mu;
  uint64_t incarnation = 0;           // guarded by mu
  kvstore::ModelShape shape;          // guarded by mu
  std::vector<ResidentLayer> layers;  // guarded by mu
  std::atomic<uint64_t> last_use{0};

  size_t Bytes() const {
    size_t b = 0;
    for (const ResidentLayer& l : layers) b += l.bytes();
    return b;
  }
};

namespace {

void FreeLayer(ResidentLayer* l) { *l = ResidentLayer(); }

}  // namespace

bool ResidentCache::ReserveBytes(Entry* self, size_t need) {
  for (;;) {
    size_t cur = bytes_.load();
    while (cur + need <= capacity_) {
      if (bytes_.compare_exchange_weak(cur, cur + need)) return true;
    }
    if (!EvictOne(self)) return false;
  }
}

bool ResidentCache::EvictOne(Entry* self) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<uint64_t, std::string>> order;
  for (auto& [id, e] : entries_) {
    if (e.get() != self) order.push_back({e->last_use.load(), id});
  }
  std::sort(order.begin(), order.end());
  for (const auto& [use, id] : order) {
    auto it = entries_.find(id);
    std::shared_ptr<Entry> e = it->second;
    std::unique_lock<std::mutex> other(e->mu, std::try_to_lock);
    if (!other.owns_lock()) continue;  // in use: never evicted
    const size_t freed = e->Bytes();
    for (ResidentLayer& l : e->layers) FreeLayer(&l);
    e->incarnation = 0;
    bytes_ -= freed;
    other.unlock();
    if (e.use_count() == 2) entries_.erase(it);  // only the map and `e`: nobody waits on it
    if (freed > 0) {
      evictions_.fetch_add(1);
      return true;
    }
  }
  return false;
}

absl::Status ResidentCache::Reserve(Entry* self, ResidentLayer* l, const kvstore::ModelShape& shape,
                                    uint64_t tokens) {
  if (tokens <= l->capacity_) return absl::OkStatus();
  const uint64_t cap = GrowRows(tokens, l->capacity_, 256);
  const size_t hkv = shape.num_kv_heads;
  const size_t new_bytes = hkv * cap * l->row_bytes_ * (l->has_k_ + l->has_v_) +
                           static_cast<size_t>(l->key_heads_) * cap * l->words_ * 4;
  const size_t delta = new_bytes - l->array_bytes();
  if (!ReserveBytes(self, delta)) {
    return absl::ResourceExhaustedError(absl::StrCat("device tier full: ", delta,
                                                     " more bytes needed, ", bytes_.load(), " of ",
                                                     capacity_, " in use by sequences in flight"));
  }
  auto grow = [&](std::vector<uint8_t>* rows) {
    std::vector<uint8_t> next(hkv * cap * l->row_bytes_);
    for (size_t h = 0; h < hkv && l->length_ > 0; ++h) {
      std::memcpy(next.data() + h * cap * l->row_bytes_,
                  rows->data() + h * l->capacity_ * l->row_bytes_, l->length_ * l->row_bytes_);
    }
    rows->swap(next);
  };
  if (l->has_k_) grow(&l->k_);
  if (l->has_v_) grow(&l->v_);
  if (l->words_ > 0) {
    std::vector<uint32_t> next(static_cast<size_t>(l->key_heads_) * cap * l->words_);
    for (int32_t j = 0; j < l->key_heads_ && l->length_ > 0; ++j) {
      std::memcpy(next.data() + j * cap * l->words_, l->sig_.data() + j * l->capacity_ * l->words_,
                  l->length_ * l->words_ * 4);
    }
    l->sig_.swap(next);
  }
  l->capacity_ = cap;  // delta was added to bytes_ by ReserveBytes
  return absl::OkStatus();
}

// rows of token t, kv head h at base + t * token_stride + h * head_stride (bytes).
absl::Status ResidentCache::Append(Entry* self, ResidentLayer* l, uint32_t layer, uint64_t n,
                                   const uint8_t* k, const uint8_t* v) {
  // Internal callers pass rows token-major ([n, Hkv, d]).
  const kvstore::ModelShape& shape = self->shape;
  const size_t hkv = shape.num_kv_heads;
  const size_t row = l->row_bytes_;
  if (absl::Status s = Reserve(self, l, shape, l->length_ + n); !s.ok()) return s;
  if (!l->compressed_.empty()) {
    // Compressed keys grow by closed groups (no headroom): their bytes after these tokens.
    const size_t before = l->compressed_[0].bytes(), after = l->compressed_[0].bytes_after(n);
    if (after > before && !ReserveBytes(self, hkv * (after - before))) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "device tier full: ", hkv * (after - before), " more bytes of compressed keys needed, ",
          bytes_.load(), " of ", capacity_, " in use by sequences in flight"));
    }
    if (after < before) bytes_ -= hkv * (before - after);  // a group closed: its exact rows go
  }
  for (uint64_t t = 0; t < n; ++t) {
    for (size_t h = 0; h < hkv; ++h) {
      const size_t src = (t * hkv + h) * row;
      const size_t dst = (h * l->capacity_ + l->length_ + t) * row;
      if (l->has_k_) std::memcpy(l->k_.data() + dst, k + src, row);
      if (l->has_v_) std::memcpy(l->v_.data() + dst, v + src, row);
      if (!l->compressed_.empty()) l->compressed_[h].Append(k + src);
    }
  }
  if (l->words_ > 0) {
    const uint32_t d = shape.head_dim;
    const int32_t group =
        l->key_heads_ == static_cast<int32_t>(hkv) ? 1 : l->key_heads_ / static_cast<int32_t>(hkv);
    std::vector<float> kf(d), scratch;
    if (l->max_norm_.empty()) {
      if (maker_->learned() || maker_->saap()) {
        l->max_norm_.assign(hkv, 0.f);  // SimHash's M: unused by learned MLPs and SAAP buckets
      } else {
        // SimHash M, fixed now: the largest key norm of this first batch, times the margin.
        l->max_norm_ = MaxKeyNorms(k, shape, n, /*token_major=*/true);
        for (float& m : l->max_norm_) m *= maker_->config().norm_margin;
      }
    }
    for (uint64_t t = 0; t < n; ++t) {
      for (int32_t j = 0; j < l->key_heads_; ++j) {
        const size_t h = static_cast<size_t>(j / group);
        const uint8_t* kr = k + (t * hkv + h) * row;
        for (uint32_t i = 0; i < d; ++i) kf[i] = kernels::LoadAsFloat(kr, i, shape.dtype);
        uint32_t* out = l->sig_.data() + (j * l->capacity_ + l->length_ + t) * l->words_;
        maker_->Key(static_cast<int32_t>(layer), j, l->words_ * 32, static_cast<int32_t>(d),
                    static_cast<int64_t>(l->length_ + t), kf.data(), l->max_norm_[h], out,
                    &scratch);
      }
    }
  }
  l->length_ += n;
  return absl::OkStatus();
}

void ResidentCache::Forget(const std::string& sequence_id) {
  std::shared_ptr<Entry> e;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(sequence_id);
    if (it == entries_.end()) return;
    e = it->second;
    entries_.erase(it);
  }
  std::lock_guard<std::mutex> lock(e->mu);
  bytes_ -= e->Bytes();
  for (ResidentLayer& l : e->layers) FreeLayer(&l);
  e->incarnation = 0;
}

absl::Status ResidentCache::Handle::AppendTokens(uint64_t n, const uint8_t* k, const uint8_t* v) {
  return cache_->Append(entry_.get(), layer_, layer_index_, n, k, v);
}

absl::StatusOr<ResidentCache::Handle> ResidentCache::Acquire(const SequenceDesc& desc,
                                                             uint32_t layer, RowSource* source,
                                                             absl::Time deadline,
                                                             SyncStats* stats) {
  std::shared_ptr<Entry> e;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::shared_ptr<Entry>& slot = entries_[desc.sequence_id];
    if (slot == nullptr) slot = std::make_shared<Entry>();
    e = slot;
  }
  e->last_use = ++tick_;
  Handle h;
  h.cache_ = this;
  h.entry_ = e;
  h.lock_ = std::unique_lock<std::mutex>(e->mu);
  const kvstore::ModelShape& shape = desc.shape;
  if (e->incarnation != desc.incarnation) {  // new, evicted, or a re-created sequence
    bytes_ -= e->Bytes();
    e->layers.clear();
    e->layers.resize(shape.num_layers);
    e->shape = shape;
    e->incarnation = desc.incarnation;
  }
  ResidentLayer& l = e->layers[layer];
  h.layer_ = &l;
  h.layer_index_ = layer;
  const uint64_t target = desc.layer_lengths[layer];
  if (l.length_ > target) {  // cannot happen within one incarnation; rebuild to be safe
    bytes_ -= l.bytes();
    FreeLayer(&l);
  }
  if (l.capacity_ == 0 && l.length_ == 0) {
    l.has_k_ = desc.placement.k_tier == kvstore::Tier::kDevice;
    l.has_v_ = desc.placement.v_tier == kvstore::Tier::kDevice;
    l.words_ = static_cast<int32_t>(desc.placement.signature_bits / 32);
    l.key_heads_ = l.words_ > 0 ? maker_->KeyHeads(shape) : 0;
    l.row_bytes_ = shape.row_bytes();
    if (desc.placement.compressed_key_bits > 0) {
      kernels::KeyCompression c{static_cast<int32_t>(desc.placement.compressed_key_bits),
                                kernels::kKeyGroupTokens};
      const int32_t d = static_cast<int32_t>(shape.head_dim);
      const bool widths = KeyWidthsApply(key_widths_.get(), desc);
      for (uint32_t j = 0; j < shape.num_kv_heads; ++j) {
        c.map = widths ? &key_widths_->map(static_cast<int32_t>(layer), static_cast<int32_t>(j))
                       : nullptr;
        if (absl::Status s = kernels::ValidateKeyCompression(c, d); !s.ok()) return s;
        l.compressed_.emplace_back(c, d, shape.dtype);
      }
    }
  }
  if (!l.has_k_ && !l.has_v_ && l.words_ == 0 && l.compressed_.empty()) {
    l.length_ = target;  // nothing to keep: trivially in sync
    return h;
  }
  const bool need_k = l.has_k_ || l.words_ > 0 || !l.compressed_.empty();
  const bool need_v = l.has_v_;
  const kvstore::RowKind kind = kvstore::RowKindOf(need_k, need_v);
  const size_t hkv = shape.num_kv_heads;
  const size_t row = l.row_bytes_;
  const uint64_t chunk = std::max<uint64_t>(1, sync_chunk_bytes_ / (hkv * row * (need_k + need_v)));
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> kb, vb, kt, vt;
  while (l.length_ < target) {
    const uint64_t t0 = l.length_;
    const uint64_t cnt = std::min(chunk, target - t0);
    tokens.resize(cnt);
    for (uint64_t i = 0; i < cnt; ++i) tokens[i] = static_cast<uint32_t>(t0 + i);
    std::vector<RowRequest> heads(hkv);
    for (size_t j = 0; j < hkv; ++j) heads[j] = {static_cast<uint32_t>(j), tokens};
    kb.resize(need_k ? hkv * cnt * row : 0);
    vb.resize(need_v ? hkv * cnt * row : 0);
    absl::StatusOr<uint64_t> got =
        source->Gather(desc.sequence_id, layer, kind, heads, need_k ? kb.data() : nullptr,
                       need_v ? vb.data() : nullptr, deadline);
    if (!got.ok()) return got.status();
    // Head-major [Hkv][cnt][d] from the gather -> token-major [cnt][Hkv][d] for Append.
    auto transpose = [&](const std::vector<uint8_t>& in, std::vector<uint8_t>* out) {
      out->resize(in.size());
      for (size_t j = 0; j < hkv; ++j)
        for (uint64_t t = 0; t < cnt; ++t)
          std::memcpy(out->data() + (t * hkv + j) * row, in.data() + (j * cnt + t) * row, row);
    };
    if (need_k) transpose(kb, &kt);
    if (need_v) transpose(vb, &vt);
    if (absl::Status s = Append(e.get(), &l, layer, cnt, kt.data(), vt.data()); !s.ok()) return s;
    if (stats != nullptr) {
      stats->rows_fetched += cnt * hkv * (need_k + need_v);
      stats->bytes_fetched += cnt * hkv * row * (need_k + need_v);
    }
  }
  return h;
}

}  // namespace kvsparse::engine
