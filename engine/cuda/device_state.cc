#include "engine/cuda/device_state.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "engine/cuda/compressed_key_sync.h"
#include "engine/resident_cache.h"

namespace kvsparse::engine::gpu {

DeviceState::DeviceState(EngineOptions options, RowSource* source, cudaStream_t stream)
    : options_(std::move(options)),
      source_(source),
      memory_(options_.gpu.capacity_bytes, stream),
      simhash_(options_.signatures.simhash_seed, options_.signatures.norm_margin, &memory_),
      learned_(options_.signatures.learned == nullptr
                   ? nullptr
                   : std::make_unique<LearnedSigning>(options_.signatures.learned, &memory_)),
      saap_(options_.signatures.saap == nullptr
                ? nullptr
                : std::make_unique<SaapSigning>(options_.signatures.saap, &memory_)),
      signing_(saap_ != nullptr      ? static_cast<KeySigning*>(saap_.get())
               : learned_ != nullptr ? static_cast<KeySigning*>(learned_.get())
                                     : &simhash_),
      key_widths_(options_.key_widths, &memory_),
      fetchers_(source->pages_device_visible() ? 0
                                               : std::max(0, options_.gpu.fetch_parallelism - 1)) {}

DeviceState::~DeviceState() {
  memory_.Free(&scratch_);
  memory_.Free(&sync_tmp_);
}

absl::StatusOr<char*> DeviceState::Scratch(size_t bytes) {
  if (scratch_.bytes < bytes) {
    memory_.Free(&scratch_);
    if (absl::Status s = memory_.Alloc(&scratch_, bytes + (bytes >> 2)); !s.ok()) return s;
  }
  return scratch_.as<char>();
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
    DeviceSequence& e = memory_.Use(desc);
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
                                      uint64_t target, BusySequences busy) {
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
                                          hkv, cudaMemcpyDeviceToDevice, memory_.stream());
    };
  };
  if (has_k) {
    if (absl::Status s = memory_.Regrow(e, &l->k, hkv * cap * row, busy, rows_copy(row)); !s.ok())
      return s;
  }
  if (has_v) {
    if (absl::Status s = memory_.Regrow(e, &l->v, hkv * cap * row, busy, rows_copy(row)); !s.ok())
      return s;
  }
  if (words > 0) {
    if (absl::Status s =
            memory_.Regrow(e, &l->sig, hkv * cap * words * 4, busy, rows_copy(words * 4));
        !s.ok()) {
      return s;
    }
  }
  l->capacity = cap;
  return absl::OkStatus();
}

absl::Status DeviceState::SyncRows(DeviceSequence* e, uint32_t layer_index,
                                   const SequenceDesc& desc, uint64_t target, BusySequences busy,
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
                               cnt * unit, hkv, cudaMemcpyHostToDevice, memory_.stream());
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
      absl::StatusOr<DeviceKeyMap> map = key_widths_.Maps(desc, layer_index);
      if (!map.ok()) return map.status();
      if (absl::Status s =
              AppendCompressedKeys(&memory_, &sync_tmp_, e, &l, desc, t0, cnt, k_host, *map, busy);
          !s.ok())
        return s;
    }
    KVS_CUDA_OK(cudaStreamSynchronize(memory_.stream()), "sync upload");  // staging is reused
    l.length += cnt;
    result->sync_bytes += kb + vb;
  }
  return absl::OkStatus();
}

absl::Status DeviceState::SignKeys(DeviceSequence* e, DeviceLayer* l, uint32_t layer_index,
                                   const SequenceDesc& desc, uint64_t t0, uint64_t cnt,
                                   const uint8_t* k_host, BusySequences busy) {
  // A sequence the signing in force cannot serve on the GPU: its calls of that kind run on the
  // CPU engine, which keeps its own signatures; nothing here reads these.
  if (!signing_->OnGpu(desc)) return absl::OkStatus();
  const size_t row = desc.shape.row_bytes();
  KeyChunk keys{nullptr, 0, k_host, t0, cnt};
  if (desc.placement.k_tier == kvstore::Tier::kDevice) {  // resident K, just uploaded
    keys.k = l->k.as<uint8_t>() + t0 * row;
    keys.head_stride = static_cast<int64_t>(l->capacity * row);
  } else {  // the chunk's K, on the device for now
    const size_t kb = desc.shape.num_kv_heads * cnt * row;
    if (sync_tmp_.bytes < kb) {
      memory_.Free(&sync_tmp_);
      if (absl::Status s = memory_.Alloc(&sync_tmp_, kb); !s.ok()) return s;
    }
    KVS_CUDA_OK(cudaMemcpyAsync(sync_tmp_.ptr, k_host, kb, cudaMemcpyHostToDevice, stream()),
                "K upload");
    keys.k = sync_tmp_.as<uint8_t>();
    keys.head_stride = static_cast<int64_t>(cnt * row);
  }
  return signing_->Sign(e, l, layer_index, desc, keys, busy);
}

absl::Status DeviceState::SyncPages(DeviceSequence* e, uint32_t layer_index,
                                    const SequenceDesc& desc, SlotOf slot, uint64_t target,
                                    BusySequences busy) {
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
      return known == 0
                 ? cudaSuccess
                 : cudaMemcpy2DAsync(to.ptr, cap * unit, from.ptr, old_cap * unit, known * unit,
                                     hkv, cudaMemcpyDeviceToDevice, memory_.stream());
    };
    if (absl::Status s = memory_.Regrow(e, &l.pages, hkv * cap * unit, busy, copy); !s.ok())
      return s;
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
  KVS_CUDA_OK(
      cudaMemcpy2DAsync(l.pages.as<uint8_t>() + l.pages_known * unit, l.page_cap * unit, host,
                        add * unit, add * unit, hkv, cudaMemcpyHostToDevice, memory_.stream()),
      "page list upload");
  KVS_CUDA_OK(cudaStreamSynchronize(memory_.stream()), "page list upload");
  l.pages_known = need;
  return absl::OkStatus();
}

absl::Status DeviceState::HoldForSteps(DeviceSequence* e, uint32_t layer, const SequenceDesc& desc,
                                       const kvstore::Reservation& reservation, uint64_t max_tokens,
                                       BusySequences busy) {
  DeviceLayer& l = e->layers[layer];
  if (reservation.tokens() < max_tokens) {
    return absl::InternalError("the store reserved fewer tokens than the plan's bound");
  }
  if (absl::Status s = ReserveRows(e, &l, desc, max_tokens, busy); !s.ok()) return s;
  if (desc.placement.compressed_key_bits > 0) {
    if (absl::Status s = ReserveCompressedKeys(&memory_, e, &l, desc, max_tokens, busy); !s.ok()) {
      return s;
    }
  }
  auto slot = [&](uint32_t j, uint64_t t) -> const uint8_t* {
    return reservation.Slot(layer, j, t);
  };
  return SyncPages(e, layer, desc, slot, max_tokens, busy);
}

}  // namespace kvsparse::engine::gpu
