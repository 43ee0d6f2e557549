#include "engine/cuda/device_state.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/compressed_keys.h"
#include "kernels/cuda/hash_topk.h"
#include "kernels/hash_signatures.h"

namespace kvsparse::engine::gpu {
namespace {

namespace kc = kernels::cuda;

bool Contains(absl::Span<const DeviceSequence* const> busy, const DeviceSequence* e) {
  return std::find(busy.begin(), busy.end(), e) != busy.end();
}

}  // namespace

RowsLayout RowsLayout::Of(int32_t hkv, int32_t cap, size_t row, bool with_slots) {
  RowsLayout l;
  Carver c(nullptr);
  l.tokens = c.used();
  c.Take<int32_t>(static_cast<size_t>(hkv) * cap);
  l.slots = c.used();
  c.Take<int32_t>(with_slots ? static_cast<size_t>(hkv) * cap : 0);
  l.count = c.used();
  c.Take<int32_t>(hkv);
  l.k = c.used();
  c.Take<uint8_t>(row * hkv * cap);
  l.v = c.used();
  c.Take<uint8_t>(row * hkv * cap);
  l.total = c.used();
  return l;
}

DeviceState::DeviceState(DeviceStateOptions options, RowSource* source, cudaStream_t stream)
    : options_(std::move(options)),
      source_(source),
      stream_(stream),
      fetchers_(source->pages_device_visible() ? 0 : std::max(0, options_.fetch_parallelism - 1)) {}

DeviceState::~DeviceState() {
  for (auto& [id, e] : entries_) FreeSequence(&e);
  for (auto& [key, buf] : planes_) Free(&buf);
  for (auto& [key, buf] : learned_) Free(&buf);
  Free(&scratch_);
  Free(&sync_tmp_);
  cudaStreamSynchronize(stream_);
}

// ---- Memory (all on stream_, so frees are ordered after every use). ----

absl::Status DeviceState::Alloc(DevBuf* b, size_t bytes) {
  b->ptr = nullptr;
  b->bytes = 0;
  if (bytes == 0) return absl::OkStatus();
  KVS_CUDA_OK(cudaMallocAsync(&b->ptr, bytes, stream_), "device allocation");
  b->bytes = bytes;
  return absl::OkStatus();
}

void DeviceState::Free(DevBuf* b) {
  if (b->ptr != nullptr) cudaFreeAsync(b->ptr, stream_);
  *b = DevBuf();
}

void DeviceState::FreeSequence(DeviceSequence* e) {
  for (DeviceLayer& l : e->layers) {
    for (DevBuf* b : {&l.k, &l.v, &l.sig, &l.norms, &l.pages, &l.cache, &l.ck, &l.ck_tail}) {
      Free(b);
    }
  }
  e->layers.clear();
  bytes_ -= e->bytes;
  e->bytes = 0;
}

void DeviceState::Forget(const std::string& sequence_id) {
  auto it = entries_.find(sequence_id);
  if (it == entries_.end()) return;
  if (it->second.held > 0) {  // a captured step's plan uses it: freed when released
    it->second.forgotten = true;
    return;
  }
  FreeSequence(&it->second);
  entries_.erase(it);
}

absl::Status DeviceState::Charge(DeviceSequence* self, size_t delta,
                                 absl::Span<const DeviceSequence* const> busy) {
  while (bytes_ + delta > options_.capacity_bytes) {
    DeviceSequence* victim = nullptr;
    std::string victim_id;
    for (auto& [id, e] : entries_) {
      if (&e == self || e.bytes == 0 || e.held > 0 || Contains(busy, &e)) continue;
      if (victim == nullptr || e.last_use < victim->last_use) {
        victim = &e;
        victim_id = id;
      }
    }
    if (victim == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("GPU tier full: ", delta, " more bytes needed, ", bytes_, " of ",
                       options_.capacity_bytes, " held by the sequences of this call"));
    }
    FreeSequence(victim);
    entries_.erase(victim_id);
    ++evictions_;
  }
  bytes_ += delta;
  self->bytes += delta;
  return absl::OkStatus();
}

template <typename Copy>
absl::Status DeviceState::Regrow(DeviceSequence* e, DevBuf* b, size_t bytes,
                                 absl::Span<const DeviceSequence* const> busy, Copy&& copy) {
  if (absl::Status s = Charge(e, bytes, busy); !s.ok()) return s;
  DevBuf next;
  if (absl::Status s = Alloc(&next, bytes); !s.ok()) {
    bytes_ -= bytes;
    e->bytes -= bytes;
    return s;
  }
  if (b->ptr != nullptr) {
    KVS_CUDA_OK(copy(next, *b), "growing device state");
    bytes_ -= b->bytes;
    e->bytes -= b->bytes;
    Free(b);
  }
  *b = next;
  return absl::OkStatus();
}

absl::StatusOr<char*> DeviceState::Scratch(size_t bytes) {
  if (scratch_.bytes < bytes) {
    Free(&scratch_);
    if (absl::Status s = Alloc(&scratch_, bytes + (bytes >> 2)); !s.ok()) return s;
  }
  return scratch_.as<char>();
}

// ---- Row cache and SimHash planes. ----

int32_t DeviceState::CacheSlots(int32_t n, int32_t rows_cap) const {
  if (options_.row_cache_fraction <= 0.0 || n <= 0) return 0;
  const double want = std::ceil(std::min(options_.row_cache_fraction, 1.0) * n);
  const int64_t rounded = (static_cast<int64_t>(want) + 63) / 64 * 64;
  return static_cast<int32_t>(std::min<int64_t>(rounded, rows_cap));
}

absl::Status DeviceState::GrowCache(DeviceSequence* e, DeviceLayer* l, int32_t hkv, int32_t cap,
                                    size_t row, absl::Span<const DeviceSequence* const> busy) {
  const RowsLayout to = RowsLayout::Of(hkv, cap, row, true);
  const RowsLayout from = RowsLayout::Of(hkv, l->cache_cap, row, true);
  const int32_t old_cap = l->cache_cap;
  auto copy = [&](DevBuf& next, const DevBuf& prev) {
    char* dst = next.as<char>();
    const char* src = prev.as<char>();
    const size_t ints = sizeof(int32_t);
    cudaError_t err = cudaSuccess;
    // Per kv head: tokens and slots (old_cap each), the count, K and V rows (old_cap each).
    for (const auto& [t, f, w] :
         {std::tuple{to.tokens, from.tokens, ints}, std::tuple{to.slots, from.slots, ints},
          std::tuple{to.k, from.k, row}, std::tuple{to.v, from.v, row}}) {
      if (err == cudaSuccess) {
        err = cudaMemcpy2DAsync(dst + t, w * cap, src + f, w * old_cap, w * old_cap, hkv,
                                cudaMemcpyDeviceToDevice, stream_);
      }
    }
    if (err == cudaSuccess) {
      err = cudaMemcpyAsync(dst + to.count, src + from.count, ints * hkv, cudaMemcpyDeviceToDevice,
                            stream_);
    }
    return err;
  };
  const bool fresh = l->cache.ptr == nullptr;
  if (absl::Status s = Regrow(e, &l->cache, to.total, busy, copy); !s.ok()) return s;
  if (fresh) {  // empty
    KVS_CUDA_OK(cudaMemsetAsync(l->cache.as<char>() + to.count, 0, sizeof(int32_t) * hkv, stream_),
                "row cache");
  }
  l->cache_cap = cap;
  return absl::OkStatus();
}

bool LearnedSignsOnGpu(const kernels::LearnedHashWeights& w, const SequenceDesc& desc) {
  const kvstore::ModelShape& s = desc.shape;
  return w.num_key_mlps == static_cast<int32_t>(s.num_kv_heads) &&
         w.num_q_heads == static_cast<int32_t>(s.num_q_heads) &&
         w.head_dim() == static_cast<int32_t>(s.head_dim) &&
         w.bits() == static_cast<int32_t>(desc.placement.signature_bits) &&
         w.num_layers >= static_cast<int32_t>(s.num_layers) && kc::LearnedSignSupports(w.dims);
}

absl::Status DeviceState::UploadTable(DevBuf* slot, const std::vector<float>& host,
                                      const char* what) {
  if (absl::Status s = Alloc(slot, host.size() * sizeof(float)); !s.ok()) return s;
  KVS_CUDA_OK(cudaMemcpyAsync(slot->ptr, host.data(), slot->bytes, cudaMemcpyHostToDevice, stream_),
              what);
  KVS_CUDA_OK(cudaStreamSynchronize(stream_), what);  // `host` goes out of scope after
  return absl::OkStatus();
}

bool SaapOnGpu(const kernels::SaapWeights& w, const SequenceDesc& desc) {
  const kvstore::ModelShape& s = desc.shape;
  return desc.placement.signature_bits == 32 &&
         w.num_layers >= static_cast<int32_t>(s.num_layers) &&
         w.num_q_heads == static_cast<int32_t>(s.num_q_heads) &&
         w.num_kv_heads == static_cast<int32_t>(s.num_kv_heads) &&
         w.head_dim == static_cast<int32_t>(s.head_dim) && kc::SaapSupports(w);
}

absl::StatusOr<kc::SaapLayerWeights> DeviceState::SaapLayer(uint32_t layer) {
  const kernels::SaapWeights* w = options_.signatures.saap.get();
  if (w == nullptr || static_cast<int32_t>(layer) >= w->num_layers) {
    return absl::FailedPreconditionError("no SAAP partitions for this layer");
  }
  DevBuf& slot = saap_[layer];
  if (slot.ptr == nullptr) {
    std::vector<float> packed;
    kc::PackSaapLayer(*w, static_cast<int32_t>(layer), &packed);
    if (absl::Status s = UploadTable(&slot, packed, "SAAP partitions upload"); !s.ok()) return s;
  }
  return kc::SaapLayerView(*w, slot.as<const float>());
}

absl::StatusOr<const float*> DeviceState::LearnedMlps(uint32_t layer) {
  const kernels::LearnedHashWeights* w = options_.signatures.learned.get();
  if (w == nullptr || static_cast<int32_t>(layer) >= w->num_layers) {
    return absl::FailedPreconditionError("no learned hash weights for this layer");
  }
  DevBuf& slot = learned_[layer];
  if (slot.ptr == nullptr) {
    std::vector<float> all;
    for (int32_t h = 0; h < w->num_q_heads; ++h) {
      kc::AppendPackedMlp(w->query(static_cast<int32_t>(layer), h), &all);
    }
    for (int32_t j = 0; j < w->num_key_mlps; ++j) {
      kc::AppendPackedMlp(w->key(static_cast<int32_t>(layer), j), &all);
    }
    if (absl::Status s = UploadTable(&slot, all, "learned MLPs upload"); !s.ok()) return s;
  }
  return slot.as<const float>();
}

absl::StatusOr<const float*> DeviceState::Planes(uint32_t layer, int32_t hkv, int32_t bits,
                                                 int32_t d) {
  DevBuf& slot = planes_[{layer, bits, d}];
  if (slot.ptr == nullptr) {
    std::vector<float> all;
    for (int32_t j = 0; j < hkv; ++j) {
      kernels::SimHashPlanes pl;
      if (absl::Status s = kernels::MakeSimHashPlanes(options_.signatures.simhash_seed,
                                                      static_cast<int32_t>(layer), j, bits, d, &pl);
          !s.ok()) {
        return s;
      }
      all.insert(all.end(), pl.w.begin(), pl.w.end());
    }
    if (absl::Status s = UploadTable(&slot, all, "planes upload"); !s.ok()) return s;
  }
  return slot.as<const float>();
}

// ---- Sync. ----

absl::Status DeviceState::Sync(const DecodeCall& call, absl::Span<const SequenceDesc> descs,
                               SyncedBatch* batch, DecodeResult* result) {
  const size_t B = descs.size();
  const uint32_t layer = call.layer;
  batch->seqs.assign(B, nullptr);
  batch->busy.clear();
  batch->views.clear();
  batch->views.resize(B);
  batch->lens.assign(B, 0);
  for (size_t b = 0; b < B; ++b) {
    const SequenceDesc& desc = descs[b];
    DeviceSequence& e = entries_[desc.sequence_id];
    if (e.incarnation != desc.incarnation || e.layers.size() != desc.shape.num_layers) {
      FreeSequence(&e);
      e.incarnation = desc.incarnation;
      e.shape = desc.shape;
      e.placement = desc.placement;
      e.layers.assign(desc.shape.num_layers, DeviceLayer());
    }
    e.last_use = ++tick_;
    batch->seqs[b] = &e;
    batch->busy.push_back(&e);
    const uint64_t n = desc.layer_lengths[layer];
    if (n > static_cast<uint64_t>(std::numeric_limits<int32_t>::max() / 2)) {
      return absl::OutOfRangeError("sequence longer than 2^30 tokens");
    }
    batch->lens[b] = static_cast<int32_t>(n);
  }
  const bool appended = !call.new_k.empty();
  for (size_t b = 0; b < B; ++b) {
    // A caller gone or out of time stops the sync between sequences (each is whole).
    if (absl::Status s = call.CheckLive(); !s.ok()) return s;
    const SequenceDesc& desc = descs[b];
    const uint64_t n = static_cast<uint64_t>(batch->lens[b]);
    // The token appended by this call is synced on its own after the rest, as the CPU engine
    // appends it (the SimHash M of a first sync is taken over the same tokens).
    if (appended && n > 0) {
      if (absl::Status s =
              SyncRows(batch->seqs[b], layer, desc, n - 1, batch->busy, call.deadline, result);
          !s.ok()) {
        return s;
      }
    }
    if (absl::Status s =
            SyncRows(batch->seqs[b], layer, desc, n, batch->busy, call.deadline, result);
        !s.ok()) {
      return s;
    }
    const kvstore::Placement& pl = desc.placement;
    if ((pl.k_tier != kvstore::Tier::kDevice || pl.v_tier != kvstore::Tier::kDevice) &&
        source_->pages_device_visible()) {
      absl::StatusOr<std::unique_ptr<kvstore::PageView>> v = source_->View(desc.sequence_id);
      if (!v.ok()) return v.status();
      if ((*v)->layer_length(layer) < n) {
        return absl::AbortedError("the sequence changed during the call; retry");
      }
      batch->views[b] = std::move(*v);
      const kvstore::PageView& view = *batch->views[b];
      auto slot = [&](uint32_t j, uint64_t t) { return view.KRow(layer, j, t); };
      if (absl::Status s = SyncPages(batch->seqs[b], layer, desc, slot, n, batch->busy); !s.ok()) {
        return s;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status DeviceState::ReserveRows(DeviceSequence* e, DeviceLayer* l, const SequenceDesc& desc,
                                      uint64_t target,
                                      absl::Span<const DeviceSequence* const> busy) {
  if (target <= l->capacity) return absl::OkStatus();
  const bool has_k = desc.placement.k_tier == kvstore::Tier::kDevice;
  const bool has_v = desc.placement.v_tier == kvstore::Tier::kDevice;
  const size_t words = desc.placement.signature_bits / 32;
  const size_t hkv = desc.shape.num_kv_heads;
  const size_t row = desc.shape.row_bytes();
  const uint64_t cap = GrowRows(target, l->capacity, 1024);
  const uint64_t old_cap = l->capacity, len = l->length;
  auto rows_copy = [&](size_t unit) {
    return [&, unit](const DevBuf& to, const DevBuf& from) {
      return len == 0 ? cudaSuccess
                      : cudaMemcpy2DAsync(to.ptr, cap * unit, from.ptr, old_cap * unit, len * unit,
                                          hkv, cudaMemcpyDeviceToDevice, stream_);
    };
  };
  if (has_k) {
    if (absl::Status s = Regrow(e, &l->k, hkv * cap * row, busy, rows_copy(row)); !s.ok()) return s;
  }
  if (has_v) {
    if (absl::Status s = Regrow(e, &l->v, hkv * cap * row, busy, rows_copy(row)); !s.ok()) return s;
  }
  if (words > 0) {
    if (absl::Status s = Regrow(e, &l->sig, hkv * cap * words * 4, busy, rows_copy(words * 4));
        !s.ok()) {
      return s;
    }
  }
  l->capacity = cap;
  return absl::OkStatus();
}

absl::Status DeviceState::SyncRows(DeviceSequence* e, uint32_t layer_index,
                                   const SequenceDesc& desc, uint64_t target,
                                   absl::Span<const DeviceSequence* const> busy,
                                   absl::Time deadline, DecodeResult* result) {
  DeviceLayer& l = e->layers[layer_index];
  const bool has_k = desc.placement.k_tier == kvstore::Tier::kDevice;
  const bool has_v = desc.placement.v_tier == kvstore::Tier::kDevice;
  const int32_t words = static_cast<int32_t>(desc.placement.signature_bits / 32);
  const bool compressed = desc.placement.compressed_key_bits > 0;
  const size_t hkv = desc.shape.num_kv_heads;
  const size_t row = desc.shape.row_bytes();
  if (!has_k && !has_v && words == 0 && !compressed) {
    l.length = target;
    return absl::OkStatus();
  }
  if (l.length >= target) return absl::OkStatus();
  if (absl::Status s = ReserveRows(e, &l, desc, target, busy); !s.ok()) return s;
  const bool need_k = has_k || words > 0 || compressed;
  const kvstore::RowKind kind = kvstore::RowKindOf(need_k, has_v);
  // Chunks of the rows read, as the CPU engine's ResidentCache takes them: the SimHash M is the
  // first chunk's, so both engines sign with the same M only if their chunks agree.
  const uint64_t per_token = hkv * row * (need_k + has_v);
  const uint64_t chunk = std::max<uint64_t>(1, options_.max_fetch_bytes / per_token);
  std::vector<uint32_t> tokens;
  while (l.length < target) {
    const uint64_t t0 = l.length;
    const uint64_t cnt = std::min(chunk, target - t0);
    tokens.resize(cnt);
    for (uint64_t i = 0; i < cnt; ++i) tokens[i] = static_cast<uint32_t>(t0 + i);
    std::vector<RowRequest> heads(hkv);
    for (size_t j = 0; j < hkv; ++j) heads[j] = {static_cast<uint32_t>(j), tokens};
    const size_t kb = need_k ? hkv * cnt * row : 0, vb = has_v ? hkv * cnt * row : 0;
    if (absl::Status s = staging_.Reserve(kb + vb); !s.ok()) return s;
    uint8_t* k_host = static_cast<uint8_t*>(staging_.ptr());
    uint8_t* v_host = k_host + kb;
    auto put = [&](const DevBuf& dst, const void* src, size_t unit) {
      return cudaMemcpy2DAsync(dst.as<uint8_t>() + t0 * unit, l.capacity * unit, src, cnt * unit,
                               cnt * unit, hkv, cudaMemcpyHostToDevice, stream_);
    };
    absl::StatusOr<uint64_t> got =
        source_->Gather(desc.sequence_id, layer_index, kind, heads, need_k ? k_host : nullptr,
                        has_v ? v_host : nullptr, deadline);
    if (!got.ok()) return got.status();
    if (has_k) KVS_CUDA_OK(put(l.k, k_host, row), "K upload");
    if (has_v) KVS_CUDA_OK(put(l.v, v_host, row), "V upload");
    if (words > 0) {
      if (absl::Status s = SignKeys(e, &l, layer_index, desc, t0, cnt, k_host, busy); !s.ok()) {
        return s;
      }
    }
    if (compressed) {
      if (absl::Status s = CompressKeys(e, &l, desc, t0, cnt, k_host, busy); !s.ok()) return s;
    }
    KVS_CUDA_OK(cudaStreamSynchronize(stream_), "sync upload");  // staging is reused
    l.length += cnt;
    result->sync_bytes += kb + vb;
  }
  return absl::OkStatus();
}

absl::Status DeviceState::CompressKeys(DeviceSequence* e, DeviceLayer* l, const SequenceDesc& desc,
                                       uint64_t t0, uint64_t cnt, const uint8_t* k_host,
                                       absl::Span<const DeviceSequence* const> busy) {
  const kernels::KeyCompression c{static_cast<int32_t>(desc.placement.compressed_key_bits),
                                  kernels::kKeyGroupTokens};
  const int32_t d = static_cast<int32_t>(desc.shape.head_dim);
  const uint64_t G = static_cast<uint64_t>(c.group_tokens);
  const size_t hkv = desc.shape.num_kv_heads, row = desc.shape.row_bytes();
  const size_t block = kernels::KeyGroupBytes(c, d);
  const uint64_t end = t0 + cnt;
  const uint64_t g0 = t0 / G, g1 = end / G;  // groups [g0, g1) close with this chunk
  auto no_copy = [](const DevBuf&, const DevBuf&) { return cudaSuccess; };
  if (l->ck_tail.ptr == nullptr) {
    if (absl::Status s = Regrow(e, &l->ck_tail, hkv * G * row, busy, no_copy); !s.ok()) return s;
  }
  if (g1 > l->ck_cap) {
    const uint64_t cap = GrowRows(g1, l->ck_cap, 8), old_cap = l->ck_cap;
    auto keep = [&](const DevBuf& to, const DevBuf& from) {
      return g0 == 0 ? cudaSuccess
                     : cudaMemcpy2DAsync(to.ptr, cap * block, from.ptr, old_cap * block, g0 * block,
                                         hkv, cudaMemcpyDeviceToDevice, stream_);
    };
    if (absl::Status s = Regrow(e, &l->ck, hkv * cap * block, busy, keep); !s.ok()) return s;
    l->ck_cap = cap;
  }
  if (g1 > g0) {
    // The open group's rows before this chunk are on the device only: read them back.
    const uint64_t before = t0 - g0 * G;
    std::vector<uint8_t> head(hkv * before * row);
    if (before > 0) {
      KVS_CUDA_OK(cudaMemcpy2DAsync(head.data(), before * row, l->ck_tail.ptr, G * row,
                                    before * row, hkv, cudaMemcpyDeviceToHost, stream_),
                  "open group read-back");
      KVS_CUDA_OK(cudaStreamSynchronize(stream_), "open group read-back");
    }
    // Each closing group quantized as the CPU engine's CompressedKeys does, heads and groups
    // side by side on the fetch helpers.
    const uint64_t groups = g1 - g0;
    std::vector<uint8_t> blocks(hkv * groups * block);
    fetchers_.Run(hkv * groups, [&](size_t i) {
      const size_t j = i / groups;
      const uint64_t g = g0 + i % groups;
      std::vector<uint8_t> rows(G * row);
      for (uint64_t t = g * G; t < (g + 1) * G; ++t) {
        const uint8_t* src = t < t0 ? head.data() + (j * before + (t - g0 * G)) * row
                                    : k_host + (j * cnt + (t - t0)) * row;
        std::memcpy(rows.data() + (t - g * G) * row, src, row);
      }
      kernels::CompressKeyGroup(c, d, desc.shape.dtype, rows.data(), blocks.data() + i * block);
    });
    // From pageable memory: the copy has read `blocks` when it returns.
    KVS_CUDA_OK(
        cudaMemcpy2DAsync(l->ck.as<uint8_t>() + g0 * block, l->ck_cap * block, blocks.data(),
                          groups * block, groups * block, hkv, cudaMemcpyHostToDevice, stream_),
        "compressed keys upload");
  }
  // The chunk's tokens of the (new) open group, exact.
  const uint64_t open = g1 * G, from = std::max(t0, open);
  if (end > from) {
    KVS_CUDA_OK(cudaMemcpy2DAsync(l->ck_tail.as<uint8_t>() + (from - open) * row, G * row,
                                  k_host + (from - t0) * row, cnt * row, (end - from) * row, hkv,
                                  cudaMemcpyHostToDevice, stream_),
                "open group upload");
  }
  return absl::OkStatus();
}

absl::Status DeviceState::SignKeys(DeviceSequence* e, DeviceLayer* l, uint32_t layer_index,
                                   const SequenceDesc& desc, uint64_t t0, uint64_t cnt,
                                   const uint8_t* k_host,
                                   absl::Span<const DeviceSequence* const> busy) {
  const kvstore::ModelShape& shape = desc.shape;
  const bool has_k = desc.placement.k_tier == kvstore::Tier::kDevice;
  const int32_t words = static_cast<int32_t>(desc.placement.signature_bits / 32);
  const size_t hkv = shape.num_kv_heads;
  const size_t row = shape.row_bytes();
  const int32_t d = static_cast<int32_t>(shape.head_dim);
  const size_t kb = hkv * cnt * row;
  const kernels::LearnedHashWeights* learned = options_.signatures.learned.get();
  // Learned MLPs the GPU cannot apply to this sequence: its hash calls run on the CPU engine,
  // which keeps its own signatures; nothing here reads these.
  if (learned != nullptr && !LearnedSignsOnGpu(*learned, desc)) return absl::OkStatus();
  const kernels::SaapWeights* saap = options_.signatures.saap.get();
  // SAAP partitions the GPU cannot apply to this sequence: its saap calls run on the CPU engine,
  // which keeps its own buckets.
  if (saap != nullptr && !SaapOnGpu(*saap, desc)) return absl::OkStatus();
  if (saap == nullptr && learned == nullptr && l->norms.ptr == nullptr) {
    // SimHash M, fixed now: the largest key norm of this first batch, times the margin (as
    // ResidentCache does, so both engines sign with the same M). Copied from pageable memory:
    // the copy has read max_norm when it returns.
    std::vector<float> max_norm = MaxKeyNorms(k_host, shape, cnt, /*token_major=*/false);
    for (float& m : max_norm) m *= options_.signatures.norm_margin;
    auto no_copy = [](const DevBuf&, const DevBuf&) { return cudaSuccess; };
    if (absl::Status s = Regrow(e, &l->norms, hkv * sizeof(float), busy, no_copy); !s.ok()) {
      return s;
    }
    KVS_CUDA_OK(cudaMemcpyAsync(l->norms.ptr, max_norm.data(), hkv * sizeof(float),
                                cudaMemcpyHostToDevice, stream_),
                "norm upload");
  }
  // Key signatures on the GPU (SimHashSign: bit for bit the CPU's SimHashKey), per kv head from
  // the chunk's K rows on the device (resident K, or a temporary copy).
  const uint8_t* kd = l->k.as<uint8_t>();
  int64_t head_stride = static_cast<int64_t>(l->capacity) * row;
  if (!has_k) {
    if (sync_tmp_.bytes < kb) {
      Free(&sync_tmp_);
      if (absl::Status s = Alloc(&sync_tmp_, kb); !s.ok()) return s;
    }
    KVS_CUDA_OK(cudaMemcpyAsync(sync_tmp_.ptr, k_host, kb, cudaMemcpyHostToDevice, stream_),
                "K upload");
    kd = sync_tmp_.as<uint8_t>();
    head_stride = static_cast<int64_t>(cnt) * row;
  } else {
    kd += t0 * row;
  }
  if (saap != nullptr) {  // each key's bucket, as the CPU engine's SaapAssignKey
    absl::StatusOr<kc::SaapLayerWeights> sw = SaapLayer(layer_index);
    if (!sw.ok()) return sw.status();
    for (size_t j = 0; j < hkv; ++j) {
      kc::SaapAssignParams ap;
      ap.w = *sw;
      ap.kv_head = static_cast<int32_t>(j);
      ap.num_keys = static_cast<int32_t>(cnt);
      ap.first_position = static_cast<int64_t>(t0);
      ap.dtype = shape.dtype;
      ap.x = kd + j * head_stride;
      ap.out = l->sig.as<uint32_t>() + j * l->capacity + t0;
      KVS_CUDA_OK(kc::SaapAssignKeys(ap, stream_), "SaapAssignKeys");
    }
    return absl::OkStatus();
  }
  if (learned != nullptr) {
    absl::StatusOr<const float*> mlps = LearnedMlps(layer_index);
    if (!mlps.ok()) return mlps.status();
    const int32_t n_lin = static_cast<int32_t>(learned->dims.size()) - 1;
    const int64_t per_mlp = kc::LearnedMlpFloats(learned->dims.data(), n_lin);
    for (size_t j = 0; j < hkv; ++j) {
      kc::LearnedSignParams lp;
      lp.num_seqs = static_cast<int32_t>(cnt);
      lp.heads = 1;
      lp.num_linear = n_lin;
      for (int32_t i = 0; i <= n_lin; ++i) lp.dims[i] = learned->dims[i];
      lp.dtype = shape.dtype;
      lp.x = kd + j * head_stride;
      lp.mlps = *mlps + (learned->num_q_heads + static_cast<int64_t>(j)) * per_mlp;
      lp.out = l->sig.as<uint32_t>() + (j * l->capacity + t0) * words;
      lp.out_batch_stride = words;
      KVS_CUDA_OK(kc::LearnedSign(lp, stream_), "LearnedSign (keys)");
    }
    return absl::OkStatus();
  }
  absl::StatusOr<const float*> planes =
      Planes(layer_index, static_cast<int32_t>(hkv), words * 32, d);
  if (!planes.ok()) return planes.status();
  for (size_t j = 0; j < hkv; ++j) {
    kc::SimHashSignParams sp;
    sp.num_seqs = static_cast<int32_t>(cnt);
    sp.heads = 1;
    sp.group = 1;
    sp.dim = d;
    sp.bits = words * 32;
    sp.dtype = shape.dtype;
    sp.x = kd + j * head_stride;
    sp.planes = *planes + j * static_cast<size_t>(words) * 32 * (d + 1);
    sp.max_norm = l->norms.as<float>() + j;
    sp.out = l->sig.as<uint32_t>() + (j * l->capacity + t0) * words;
    sp.out_batch_stride = words;
    KVS_CUDA_OK(kc::SimHashSign(sp, stream_), "SimHashSign (keys)");
  }
  return absl::OkStatus();
}

absl::Status DeviceState::SyncPages(DeviceSequence* e, uint32_t layer_index,
                                    const SequenceDesc& desc, SlotOf slot, uint64_t target,
                                    absl::Span<const DeviceSequence* const> busy) {
  DeviceLayer& l = e->layers[layer_index];
  const uint64_t pt = desc.page_tokens;
  const uint64_t need = (target + pt - 1) / pt;
  if (need <= l.pages_known) return absl::OkStatus();
  const size_t hkv = desc.shape.num_kv_heads;
  const size_t unit = sizeof(void*);
  if (need > l.page_cap) {
    const uint64_t cap = std::max<uint64_t>({need, 2 * l.page_cap, 64});
    const uint64_t old_cap = l.page_cap, known = l.pages_known;
    auto copy = [&](const DevBuf& to, const DevBuf& from) {
      return known == 0 ? cudaSuccess
                        : cudaMemcpy2DAsync(to.ptr, cap * unit, from.ptr, old_cap * unit,
                                            known * unit, hkv, cudaMemcpyDeviceToDevice, stream_);
    };
    if (absl::Status s = Regrow(e, &l.pages, hkv * cap * unit, busy, copy); !s.ok()) return s;
    l.page_cap = cap;
  }
  const uint64_t add = need - l.pages_known;
  if (absl::Status s = staging_.Reserve(hkv * add * unit); !s.ok()) return s;
  auto* host = static_cast<const void**>(staging_.ptr());
  for (size_t j = 0; j < hkv; ++j) {
    for (uint64_t p = 0; p < add; ++p) {
      host[j * add + p] = slot(static_cast<uint32_t>(j), (l.pages_known + p) * pt);
    }
  }
  KVS_CUDA_OK(cudaMemcpy2DAsync(l.pages.as<uint8_t>() + l.pages_known * unit, l.page_cap * unit,
                                host, add * unit, add * unit, hkv, cudaMemcpyHostToDevice, stream_),
              "page list upload");
  KVS_CUDA_OK(cudaStreamSynchronize(stream_), "page list upload");
  l.pages_known = need;
  return absl::OkStatus();
}

absl::Status DeviceState::HoldForSteps(DeviceSequence* e, uint32_t layer, const SequenceDesc& desc,
                                       const kvstore::Reservation& reservation, uint64_t max_tokens,
                                       absl::Span<const DeviceSequence* const> busy) {
  DeviceLayer& l = e->layers[layer];
  if (reservation.tokens() < max_tokens) {
    return absl::InternalError("the store reserved fewer tokens than the plan's bound");
  }
  if (absl::Status s = ReserveRows(e, &l, desc, max_tokens, busy); !s.ok()) return s;
  auto slot = [&](uint32_t j, uint64_t t) -> const uint8_t* {
    return reservation.Slot(layer, j, t);
  };
  return SyncPages(e, layer, desc, slot, max_tokens, busy);
}

void DeviceState::Release(const std::string& sequence_id) {
  auto it = entries_.find(sequence_id);
  if (it == entries_.end() || it->second.held == 0) return;
  if (--it->second.held == 0 && it->second.forgotten) {
    FreeSequence(&it->second);
    entries_.erase(it);
  }
}

}  // namespace kvsparse::engine::gpu
