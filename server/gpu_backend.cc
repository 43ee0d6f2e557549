#include "server/gpu_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "absl/container/node_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/cuda/dense_decode.h"
#include "kernels/cuda/hash_topk.h"
#include "kernels/cuda/santa.h"
#include "kernels/cuda/selected_rows.h"
#include "kernels/cuda/vattention.h"
#include "kernels/hash_signatures.h"
#include "kernels/philox.h"

namespace kvsparse::server {
namespace {

namespace kc = kernels::cuda;
using kernels::DType;
constexpr size_t kDevice = static_cast<size_t>(kvstore::Tier::kDevice);
constexpr size_t kHost = static_cast<size_t>(kvstore::Tier::kHost);

absl::Status CudaStatus(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  if (e == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": GPU memory exhausted"));
  }
  return absl::InternalError(absl::StrCat(what, ": CUDA error ", cudaGetErrorString(e)));
}

#define KVS_CUDA_OK(expr, what)                                          \
  do {                                                                   \
    if (absl::Status s_ = CudaStatus((expr), what); !s_.ok()) return s_; \
  } while (0)

// A stream-ordered device allocation (freed on the backend's stream).
struct DevBuf {
  void* ptr = nullptr;
  size_t bytes = 0;
  template <typename X>
  X* as() const {
    return static_cast<X*>(ptr);
  }
};

// Pinned host memory that grows (contents not kept).
struct PinnedBuf {
  void* ptr = nullptr;
  size_t bytes = 0;
  absl::Status Reserve(size_t n) {
    if (n <= bytes) return absl::OkStatus();
    if (ptr != nullptr) cudaFreeHost(ptr);
    ptr = nullptr;
    bytes = 0;
    const size_t want = std::max<size_t>(n, 1 << 20);
    KVS_CUDA_OK(cudaMallocHost(&ptr, want), "pinned staging");
    bytes = want;
    return absl::OkStatus();
  }
  ~PinnedBuf() {
    if (ptr != nullptr) cudaFreeHost(ptr);
  }
};

// Consecutive 256-byte aligned regions of a buffer (sizes first, with base null; then carve).
class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<char*>(base)) {}
  template <typename X>
  X* Take(size_t count) {
    X* r = base_ == nullptr ? nullptr : reinterpret_cast<X*>(base_ + used_);
    used_ += (count * sizeof(X) + 255) / 256 * 256;
    return r;
  }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

bool IsPow2(uint64_t x) { return x != 0 && (x & (x - 1)) == 0; }
int Log2(uint64_t x) {
  int s = 0;
  while ((uint64_t{1} << s) < x) ++s;
  return s;
}

// One layer of one sequence on the device.
struct Layer {
  uint64_t length = 0, capacity = 0;  // tokens synced; rows allocated per kv head
  DevBuf k, v, sig;                   // [Hkv][capacity][d] rows; [Hkv][capacity][words]
  DevBuf norms;                       // SimHash M per kv head, fixed at the first sync
  DevBuf pages;                       // [Hkv][page_cap] device-visible page addresses
  uint64_t page_cap = 0, pages_known = 0;
  // HashAttention's row cache (GpuBackendOptions::row_cache_fraction): cache_cap slots per kv
  // head, laid out as RowsLayout (with slots) says.
  DevBuf cache;
  int32_t cache_cap = 0;
};

struct Entry {
  uint64_t incarnation = 0;
  kvstore::ModelShape shape;
  kvstore::Placement placement;
  std::vector<Layer> layers;
  uint64_t last_use = 0;
  size_t bytes = 0;
};

// Rows of Hkv heads, cap per head, in one allocation: ascending tokens, (a row cache's) the slot
// of each, the counts, then the K and V rows. A row cache has slots; a plain row set not.
struct RowsLayout {
  size_t tokens = 0, slots = 0, count = 0, k = 0, v = 0, total = 0;
  static RowsLayout Of(int32_t hkv, int32_t cap, size_t row, bool with_slots) {
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
};

class GpuBackend final : public DecodeBackend {
 public:
  GpuBackend(GpuBackendOptions options, RowSource* source, cudaStream_t stream)
      : options_(std::move(options)),
        source_(source),
        maker_(options_.signatures),
        stream_(stream) {
    for (cudaEvent_t& e : events_) cudaEventCreate(&e);
  }
  ~GpuBackend() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, e] : entries_) FreeEntry(&e);
    for (auto& [key, buf] : planes_) Free(&buf);
    Free(&scratch_);
    cudaStreamSynchronize(stream_);
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    cudaStreamDestroy(stream_);
  }

  const char* name() const override { return "cuda"; }

  bool Supports(const DecodeCall& call, absl::Span<const SequenceDesc> descs) const override {
    // The sequences of a call are decoded together: they must share their placement.
    const SequenceDesc& d0 = descs[0];
    for (const SequenceDesc& d : descs) {
      if (d.placement.k_tier != d0.placement.k_tier || d.placement.v_tier != d0.placement.v_tier ||
          d.placement.signature_bits != d0.placement.signature_bits ||
          d.page_tokens != d0.page_tokens || !SupportsOne(call, d)) {
        return false;
      }
    }
    return true;
  }

  absl::Status Decode(const DecodeCall& call, absl::Span<const SequenceDesc> descs,
                      DecodeResult* result) override;

  void Forget(const std::string& sequence_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(sequence_id);
    if (it == entries_.end()) return;
    FreeEntry(&it->second);
    entries_.erase(it);
  }

  size_t resident_bytes() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return bytes_;
  }
  size_t resident_capacity() const override { return options_.capacity_bytes; }

 private:
  // Supports() for one sequence: method, shape, dtype and placement.
  bool SupportsOne(const DecodeCall& call, const SequenceDesc& desc) const {
    const kvstore::ModelShape& s = desc.shape;
    if (call.return_indices) return false;  // the CPU engine lists the rows it read
    if (s.dtype != DType::kBf16 && s.dtype != DType::kFp16) return false;
    if (s.head_dim != 64 && s.head_dim != 128 && s.head_dim != 256) return false;
    const uint32_t g = s.num_q_heads / s.num_kv_heads;
    if (g != 1 && g != 2 && g != 4 && g != 8) return false;
    const kvstore::Placement& pl = desc.placement;
    const bool host_half =
        pl.k_tier != kvstore::Tier::kDevice || pl.v_tier != kvstore::Tier::kDevice;
    if (host_half && (!source_->pages_device_visible() || !IsPow2(desc.page_tokens))) return false;
    const Method& m = call.method;
    switch (m.kind) {
      case MethodKind::kDense:
        return true;
      case MethodKind::kSanta: {
        const kernels::SantaParams& p = m.santa;
        const int32_t tile = p.tile_size == 0 ? options_.default_tile_size : p.tile_size;
        if (pl.k_tier != kvstore::Tier::kDevice || tile != kc::kSantaTile ||
            p.bernoulli_qk_samples != 0) {
          return false;
        }
        return (p.sampler == kernels::SantaSampler::kIid &&
                p.allocation == kernels::SantaAllocation::kGlobal) ||
               (p.sampler == kernels::SantaSampler::kSystematic &&
                (p.allocation == kernels::SantaAllocation::kProp ||
                 p.allocation == kernels::SantaAllocation::kFlash));
      }
      case MethodKind::kHashTopK:
        return pl.signature_bits > 0 && !maker_.learned() && !m.learned_signatures;
      case MethodKind::kVAttention:
        return pl.signature_bits > 0 && !maker_.learned() && !m.learned_signatures &&
               m.vattention.predictor == kernels::TopKPredictor::kHash &&
               !m.vattention.exact_statistics;
    }
    return false;
  }

  // ---- Device memory (all on stream_, so frees are ordered after every use). ----
  absl::Status Alloc(DevBuf* b, size_t bytes) {
    b->ptr = nullptr;
    b->bytes = 0;
    if (bytes == 0) return absl::OkStatus();
    KVS_CUDA_OK(cudaMallocAsync(&b->ptr, bytes, stream_), "device allocation");
    b->bytes = bytes;
    return absl::OkStatus();
  }
  void Free(DevBuf* b) {
    if (b->ptr != nullptr) cudaFreeAsync(b->ptr, stream_);
    *b = DevBuf();
  }
  // Row-cache slots per kv head for a sequence of n tokens: row_cache_fraction of n rounded up
  // to 64, at most the longest union (rows_cap); 0 without a cache.
  int32_t CacheSlots(int32_t n, int32_t rows_cap) const {
    if (options_.row_cache_fraction <= 0.0 || n <= 0) return 0;
    const double want = std::ceil(std::min(options_.row_cache_fraction, 1.0) * n);
    const int64_t rounded = (static_cast<int64_t>(want) + 63) / 64 * 64;
    return static_cast<int32_t>(std::min<int64_t>(rounded, rows_cap));
  }
  // Grows a layer's row cache to `cap` slots per kv head, keeping what it holds.
  absl::Status GrowCache(Entry* e, Layer* l, int32_t hkv, int32_t cap, size_t row,
                         const std::vector<const Entry*>& busy) {
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
        err = cudaMemcpyAsync(dst + to.count, src + from.count, ints * hkv,
                              cudaMemcpyDeviceToDevice, stream_);
      }
      return err;
    };
    const bool fresh = l->cache.ptr == nullptr;
    if (absl::Status s = Regrow(e, &l->cache, to.total, busy, copy); !s.ok()) return s;
    if (fresh) {  // empty
      KVS_CUDA_OK(
          cudaMemsetAsync(l->cache.as<char>() + to.count, 0, sizeof(int32_t) * hkv, stream_),
          "row cache");
    }
    l->cache_cap = cap;
    return absl::OkStatus();
  }
  void FreeEntry(Entry* e) {
    for (Layer& l : e->layers) {
      for (DevBuf* b : {&l.k, &l.v, &l.sig, &l.norms, &l.pages, &l.cache}) Free(b);
    }
    e->layers.clear();
    bytes_ -= e->bytes;
    e->bytes = 0;
  }
  // Accounts `delta` more bytes to `self`, evicting idle entries (least recently used first);
  // RESOURCE_EXHAUSTED when they do not fit. Entries in `busy` (this call's) are never evicted.
  absl::Status Charge(Entry* self, size_t delta, const std::vector<const Entry*>& busy) {
    while (bytes_ + delta > options_.capacity_bytes) {
      Entry* victim = nullptr;
      std::string victim_id;
      for (auto& [id, e] : entries_) {
        if (&e == self || e.bytes == 0 || std::find(busy.begin(), busy.end(), &e) != busy.end()) {
          continue;
        }
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
      FreeEntry(victim);
      entries_.erase(victim_id);
      ++evictions_;
    }
    bytes_ += delta;
    self->bytes += delta;
    return absl::OkStatus();
  }
  // Replaces *b by a buffer of `bytes` (contents copied by `copy`, which may be null).
  template <typename Copy>
  absl::Status Regrow(Entry* e, DevBuf* b, size_t bytes, const std::vector<const Entry*>& busy,
                      Copy&& copy) {
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

  // Brings one layer's rows and signatures up to `target` tokens (rows from the row source).
  absl::Status SyncRows(Entry* e, uint32_t layer_index, const SequenceDesc& desc, uint64_t target,
                        const std::vector<const Entry*>& busy, absl::Time deadline,
                        DecodeResult* result);
  // Brings a host half's page list up to `target` tokens.
  absl::Status SyncPages(Entry* e, uint32_t layer_index, const SequenceDesc& desc,
                         const kvstore::PageView& view, uint64_t target,
                         const std::vector<const Entry*>& busy);
  // The SimHash planes of every kv head of a layer on the device: [Hkv][bits][d + 1].
  absl::StatusOr<const float*> Planes(uint32_t layer, int32_t hkv, int32_t bits, int32_t d);

  const GpuBackendOptions options_;
  RowSource* const source_;
  SignatureMaker maker_;
  cudaStream_t stream_;
  cudaEvent_t events_[4] = {};
  mutable std::mutex mu_;                            // serialises calls; guards everything below
  absl::node_hash_map<std::string, Entry> entries_;  // node map: Entry pointers stay valid
  size_t bytes_ = 0;
  uint64_t tick_ = 0, evictions_ = 0;
  uint64_t calls_ = 0;  // for stage_timing_every
  std::map<std::tuple<uint32_t, int32_t, int32_t>, DevBuf> planes_;
  DevBuf scratch_, sync_tmp_;
  PinnedBuf staging_, call_host_, out_host_;
};

absl::StatusOr<const float*> GpuBackend::Planes(uint32_t layer, int32_t hkv, int32_t bits,
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
    if (absl::Status s = Alloc(&slot, all.size() * sizeof(float)); !s.ok()) return s;
    KVS_CUDA_OK(cudaMemcpyAsync(slot.ptr, all.data(), slot.bytes, cudaMemcpyHostToDevice, stream_),
                "planes upload");
    KVS_CUDA_OK(cudaStreamSynchronize(stream_), "planes upload");
  }
  return slot.as<const float>();
}

absl::Status GpuBackend::SyncRows(Entry* e, uint32_t layer_index, const SequenceDesc& desc,
                                  uint64_t target, const std::vector<const Entry*>& busy,
                                  absl::Time deadline, DecodeResult* result) {
  Layer& l = e->layers[layer_index];
  const kvstore::ModelShape& shape = desc.shape;
  const bool has_k = desc.placement.k_tier == kvstore::Tier::kDevice;
  const bool has_v = desc.placement.v_tier == kvstore::Tier::kDevice;
  const int32_t words = static_cast<int32_t>(desc.placement.signature_bits / 32);
  const size_t hkv = shape.num_kv_heads;
  const size_t row = shape.row_bytes();
  const int32_t d = static_cast<int32_t>(shape.head_dim);
  if (!has_k && !has_v && words == 0) {
    l.length = target;
    return absl::OkStatus();
  }
  if (l.length >= target) return absl::OkStatus();
  if (target > l.capacity) {
    const uint64_t cap = std::max<uint64_t>({target, 2 * l.capacity, 1024});
    const uint64_t old_cap = l.capacity, len = l.length;
    auto rows_copy = [&](size_t unit) {
      return [&, unit](const DevBuf& to, const DevBuf& from) {
        return len == 0 ? cudaSuccess
                        : cudaMemcpy2DAsync(to.ptr, cap * unit, from.ptr, old_cap * unit,
                                            len * unit, hkv, cudaMemcpyDeviceToDevice, stream_);
      };
    };
    if (has_k) {
      if (absl::Status s = Regrow(e, &l.k, hkv * cap * row, busy, rows_copy(row)); !s.ok())
        return s;
    }
    if (has_v) {
      if (absl::Status s = Regrow(e, &l.v, hkv * cap * row, busy, rows_copy(row)); !s.ok())
        return s;
    }
    if (words > 0) {
      if (absl::Status s = Regrow(e, &l.sig, hkv * cap * words * 4, busy, rows_copy(words * 4));
          !s.ok()) {
        return s;
      }
    }
    l.capacity = cap;
  }
  const bool need_k = has_k || words > 0;
  const kvstore::RowKind kind = kvstore::RowKindOf(need_k, has_v);
  const uint64_t per_token = hkv * row * (need_k + has_v) + hkv * words * 4;
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
    uint8_t* k_host = static_cast<uint8_t*>(staging_.ptr);
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
      if (l.norms.ptr == nullptr) {
        // SimHash M, fixed now: the largest key norm of this first batch, times the margin (as
        // ResidentCache does, so both engines sign with the same M). Copied from pageable
        // memory: the copy has read max_norm when it returns.
        std::vector<float> max_norm = MaxKeyNorms(k_host, shape, cnt, /*token_major=*/false);
        for (float& m : max_norm) m *= maker_.config().norm_margin;
        auto no_copy = [](const DevBuf&, const DevBuf&) { return cudaSuccess; };
        if (absl::Status s = Regrow(e, &l.norms, hkv * sizeof(float), busy, no_copy); !s.ok()) {
          return s;
        }
        KVS_CUDA_OK(cudaMemcpyAsync(l.norms.ptr, max_norm.data(), hkv * sizeof(float),
                                    cudaMemcpyHostToDevice, stream_),
                    "norm upload");
      }
      // Key signatures on the GPU (SimHashSign: bit for bit the CPU's SimHashKey), per kv head
      // from the chunk's K rows on the device (resident K, or a temporary copy).
      const uint8_t* kd = l.k.as<uint8_t>();
      int64_t head_stride = static_cast<int64_t>(l.capacity) * row;
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
        sp.max_norm = l.norms.as<float>() + j;
        sp.out = l.sig.as<uint32_t>() + (j * l.capacity + t0) * words;
        sp.out_batch_stride = words;
        KVS_CUDA_OK(kc::SimHashSign(sp, stream_), "SimHashSign (keys)");
      }
    }
    KVS_CUDA_OK(cudaStreamSynchronize(stream_), "sync upload");  // staging is reused
    l.length += cnt;
    result->sync_bytes += kb + vb;
  }
  return absl::OkStatus();
}

absl::Status GpuBackend::SyncPages(Entry* e, uint32_t layer_index, const SequenceDesc& desc,
                                   const kvstore::PageView& view, uint64_t target,
                                   const std::vector<const Entry*>& busy) {
  Layer& l = e->layers[layer_index];
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
  auto* host = static_cast<const void**>(staging_.ptr);
  for (size_t j = 0; j < hkv; ++j) {
    for (uint64_t p = 0; p < add; ++p) {
      host[j * add + p] =
          view.KRow(layer_index, static_cast<uint32_t>(j), (l.pages_known + p) * pt);
    }
  }
  KVS_CUDA_OK(cudaMemcpy2DAsync(l.pages.as<uint8_t>() + l.pages_known * unit, l.page_cap * unit,
                                host, add * unit, add * unit, hkv, cudaMemcpyHostToDevice, stream_),
              "page list upload");
  KVS_CUDA_OK(cudaStreamSynchronize(stream_), "page list upload");
  l.pages_known = need;
  return absl::OkStatus();
}

absl::Status GpuBackend::Decode(const DecodeCall& call, absl::Span<const SequenceDesc> descs,
                                DecodeResult* result) {
  std::lock_guard<std::mutex> lock(mu_);
  const absl::Time start = absl::Now();
  const int32_t B = static_cast<int32_t>(descs.size());
  const kvstore::ModelShape& shape = descs[0].shape;
  const uint32_t layer = call.layer;
  const int32_t H = static_cast<int32_t>(shape.num_q_heads);
  const int32_t hkv = static_cast<int32_t>(shape.num_kv_heads);
  const int32_t G = H / hkv;
  const int32_t d = static_cast<int32_t>(shape.head_dim);
  const DType dt = shape.dtype;
  const size_t es = kernels::DTypeSize(dt);
  const size_t row = shape.row_bytes();
  const bool appended = !call.new_k.empty();
  const Method& m = call.method;
  const int32_t BH = B * H, BK = B * hkv;

  // ---- Sync every sequence's state; views of the pages of host halves. ----
  std::vector<Entry*> entries(B);
  std::vector<const Entry*> busy;
  std::vector<std::unique_ptr<kvstore::PageView>> views(B);
  std::vector<int32_t> lens(B);
  for (int32_t b = 0; b < B; ++b) {
    const SequenceDesc& desc = descs[b];
    Entry& e = entries_[desc.sequence_id];
    if (e.incarnation != desc.incarnation || e.layers.size() != desc.shape.num_layers) {
      FreeEntry(&e);
      e.incarnation = desc.incarnation;
      e.shape = desc.shape;
      e.placement = desc.placement;
      e.layers.assign(desc.shape.num_layers, Layer());
    }
    e.last_use = ++tick_;
    entries[b] = &e;
    busy.push_back(&e);
    const uint64_t n = desc.layer_lengths[layer];
    if (n > static_cast<uint64_t>(std::numeric_limits<int32_t>::max() / 2)) {
      return absl::OutOfRangeError("sequence longer than 2^30 tokens");
    }
    lens[b] = static_cast<int32_t>(n);
  }
  for (int32_t b = 0; b < B; ++b) {
    const SequenceDesc& desc = descs[b];
    const uint64_t n = static_cast<uint64_t>(lens[b]);
    // The token appended by this call is synced on its own after the rest, as the CPU engine
    // appends it (the SimHash M of a first sync is taken over the same tokens).
    if (appended && n > 0) {
      if (absl::Status s = SyncRows(entries[b], layer, desc, n - 1, busy, call.deadline, result);
          !s.ok()) {
        return s;
      }
    }
    if (absl::Status s = SyncRows(entries[b], layer, desc, n, busy, call.deadline, result);
        !s.ok()) {
      return s;
    }
    const kvstore::Placement& pl = desc.placement;
    if (pl.k_tier != kvstore::Tier::kDevice || pl.v_tier != kvstore::Tier::kDevice) {
      absl::StatusOr<std::unique_ptr<kvstore::PageView>> v = source_->View(desc.sequence_id);
      if (!v.ok()) return v.status();
      if ((*v)->layer_length(layer) < n) {
        return absl::AbortedError("the sequence changed during the call; retry");
      }
      views[b] = std::move(*v);
      if (absl::Status s = SyncPages(entries[b], layer, desc, *views[b], n, busy); !s.ok()) {
        return s;
      }
    }
  }
  const int32_t n_max = std::max(1, *std::max_element(lens.begin(), lens.end()));
  const absl::Time synced = absl::Now();
  if (synced > call.deadline) {
    return absl::DeadlineExceededError("deadline passed while syncing the GPU state");
  }
  result->timing.sync_seconds += absl::ToDoubleSeconds(synced - start);

  // ---- Per-method sizes (host-side bounds: grid and workspace sizes). ----
  int32_t max_sel = 0, rows_cap = 0, cache_cap = 0, min_cache = 0;
  kc::HashTopKParams tk;
  if (m.kind == MethodKind::kHashTopK) {
    for (int32_t b = 0; b < B; ++b) {
      absl::StatusOr<int32_t> k =
          kernels::ResolveTopK(m.hash.top_k, m.hash.top_k_fraction, lens[b]);
      if (!k.ok()) return k.status();
    }
    tk.batch = B;
    tk.num_q_heads = H;
    tk.key_heads = hkv;
    tk.bits = static_cast<int32_t>(descs[0].placement.signature_bits);
    tk.max_seq_len = n_max;
    tk.sink_tokens = m.hash.sink_tokens;
    tk.local_tokens = m.hash.local_tokens;
    tk.top_k = m.hash.top_k;
    tk.top_k_fraction = m.hash.top_k_fraction;
    max_sel = std::max(1, tk.MaxSelected());
    rows_cap = std::min(n_max, G * max_sel);  // the longest union of a GQA group
    min_cache = rows_cap;
    for (int32_t b = 0; b < B; ++b) {
      Layer& l = entries[b]->layers[layer];
      const int32_t want = CacheSlots(lens[b], rows_cap);
      if (l.cache_cap < want) {
        if (absl::Status s = GrowCache(entries[b], &l, hkv, want, row, busy); !s.ok()) return s;
      }
      cache_cap = std::max(cache_cap, l.cache_cap);
      min_cache = std::min(min_cache, l.cache_cap);
    }
  }
  if (m.kind == MethodKind::kVAttention) {
    for (int32_t b = 0; b < B; ++b) {
      absl::StatusOr<int32_t> k =
          kernels::ResolveTopK(m.vattention.top_k, m.vattention.top_k_fraction, lens[b]);
      if (!k.ok()) return k.status();
    }
  }
  const bool dense_resident = m.kind == MethodKind::kDense &&
                              std::all_of(descs.begin(), descs.end(), [](const SequenceDesc& s) {
                                return s.placement.k_tier == kvstore::Tier::kDevice &&
                                       s.placement.v_tier == kvstore::Tier::kDevice;
                              });

  // ---- Host tables (one upload) and device scratch. ----
  const int32_t words = static_cast<int32_t>(descs[0].placement.signature_bits / 32);
  Carver hc(nullptr);
  struct Off {
    size_t q, lens, seeds, k_heads, v_heads, tables, sig_heads;
    size_t cache[5], cache_slots;  // row cache tables: tokens, slots, count, k, v; capacities
    size_t call[7];  // per-call row tables: union tokens, count; fetch tokens, count, dest;
                     // overflow k, v
  } off{};
  off.q = hc.used();
  hc.Take<uint8_t>(static_cast<size_t>(BH) * d * es);
  off.lens = hc.used();
  hc.Take<int32_t>(B);
  off.seeds = hc.used();
  hc.Take<uint64_t>(B);
  off.k_heads = hc.used();
  hc.Take<const void*>(BK);
  off.v_heads = hc.used();
  hc.Take<const void*>(BK);
  off.tables = hc.used();
  hc.Take<const void*>(BK);
  off.sig_heads = hc.used();
  hc.Take<const void*>(BK);
  if (m.kind == MethodKind::kHashTopK) {
    for (size_t& o : off.cache) {
      o = hc.used();
      hc.Take<void*>(BK);
    }
    off.cache_slots = hc.used();
    hc.Take<int32_t>(BK);
    for (size_t& o : off.call) {
      o = hc.used();
      hc.Take<void*>(BK);
    }
  }
  // Statistics, last, zeroed by the upload: rows read (SANTA) or union rows (HashAttention) /
  // counts / budgets / hits.
  const size_t stats_off = hc.used();
  hc.Take<int32_t>(4 * static_cast<size_t>(BH));
  const size_t table_bytes = hc.used();
  if (absl::Status s = call_host_.Reserve(table_bytes); !s.ok()) return s;
  char* h = static_cast<char*>(call_host_.ptr);
  std::memset(h, 0, table_bytes);
  {  // q in the sequences' dtype
    uint8_t* q = reinterpret_cast<uint8_t*>(h + off.q);
    const size_t count = static_cast<size_t>(BH) * d;
    if (call.q_dtype == dt) {
      std::memcpy(q, call.q.data(), count * es);
    } else {
      for (size_t i = 0; i < count; ++i)
        kernels::StoreFromFloat(q, i, dt, kernels::LoadAsFloat(call.q.data(), i, call.q_dtype));
    }
  }
  std::memcpy(h + off.lens, lens.data(), sizeof(int32_t) * B);
  for (int32_t b = 0; b < B; ++b) {
    reinterpret_cast<uint64_t*>(h + off.seeds)[b] =
        kernels::SequenceSeed(call.seed, static_cast<uint32_t>(b));
    const Layer& l = entries[b]->layers[layer];
    const RowsLayout cl = RowsLayout::Of(hkv, l.cache_cap, row, true);
    for (int32_t j = 0; j < hkv; ++j) {
      const int32_t i = b * hkv + j;
      if (l.k.ptr != nullptr) {
        reinterpret_cast<const void**>(h + off.k_heads)[i] =
            l.k.as<uint8_t>() + j * l.capacity * row;
      }
      if (l.v.ptr != nullptr) {
        reinterpret_cast<const void**>(h + off.v_heads)[i] =
            l.v.as<uint8_t>() + j * l.capacity * row;
      }
      if (l.pages.ptr != nullptr) {
        reinterpret_cast<const void**>(h + off.tables)[i] =
            l.pages.as<uint8_t>() + j * l.page_cap * sizeof(void*);
      }
      if (l.sig.ptr != nullptr) {
        reinterpret_cast<const void**>(h + off.sig_heads)[i] =
            l.sig.as<uint8_t>() + j * l.capacity * words * 4;
      }
      if (m.kind == MethodKind::kHashTopK) {
        reinterpret_cast<int32_t*>(h + off.cache_slots)[i] = l.cache_cap;
        if (l.cache_cap > 0) {
          char* cb = l.cache.as<char>();
          const size_t ints = sizeof(int32_t) * j * l.cache_cap;
          void** t[5];
          for (int x = 0; x < 5; ++x) t[x] = reinterpret_cast<void**>(h + off.cache[x]);
          t[0][i] = cb + cl.tokens + ints;
          t[1][i] = cb + cl.slots + ints;
          t[2][i] = cb + cl.count + sizeof(int32_t) * j;
          t[3][i] = cb + cl.k + row * j * l.cache_cap;
          t[4][i] = cb + cl.v + row * j * l.cache_cap;
        }
      }
    }
  }

  // Device scratch: the tables and statistics, then the output and the method's buffers.
  Carver dc(nullptr);
  dc.Take<char>(table_bytes);
  const size_t out_off = dc.used();
  dc.Take<uint8_t>(static_cast<size_t>(BH) * d * es);
  const size_t method_off = dc.used();
  // Method buffers are carved twice: sizes first (base null), then pointers.
  kc::DecodeShape shape_d;
  auto fill_shape = [&](char* base) {
    shape_d = kc::DecodeShape();
    shape_d.batch = B;
    shape_d.num_q_heads = H;
    shape_d.num_kv_heads = hkv;
    shape_d.head_dim = d;
    shape_d.dtype = dt;
    shape_d.q = base + off.q;
    shape_d.seq_lens = reinterpret_cast<const int32_t*>(base + off.lens);
    shape_d.max_seq_len = n_max;
    shape_d.scale = call.scale > 0.f ? call.scale : 1.f / std::sqrt(static_cast<float>(d));
    shape_d.out = base + out_off;
    shape_d.kv.token_stride = d;
    const bool k_dev = descs[0].placement.k_tier == kvstore::Tier::kDevice;
    const bool v_dev = descs[0].placement.v_tier == kvstore::Tier::kDevice;
    kc::PagedRows pages;
    pages.tables = reinterpret_cast<const void* const* const*>(base + off.tables);
    pages.page_shift = Log2(descs[0].page_tokens);
    pages.slot_bytes = static_cast<int32_t>(2 * row);
    if (k_dev) {
      shape_d.k_heads = reinterpret_cast<const void* const*>(base + off.k_heads);
    } else {
      shape_d.k_pages = pages;
    }
    if (v_dev) {
      shape_d.v_heads = reinterpret_cast<const void* const*>(base + off.v_heads);
    } else {
      shape_d.v_pages = pages;
      shape_d.v_pages.offset_bytes = static_cast<int32_t>(row);
    }
  };
  // HashAttention's per-call rows (scratch offsets, recorded while sizing; their pointer tables
  // are filled once the scratch is placed): each (b, j)'s union, the rows to fetch and their
  // locations, and overflow rows for misses beyond the row cache.
  struct CallRows {
    size_t union_tokens = 0, fetch_tokens = 0, fetch_count = 0, dest = 0, overflow = 0;
    int32_t overflow_cap = 0;  // rows per (b, j)
  } cr;
  auto table = [&](char* base, size_t o) { return reinterpret_cast<void* const*>(base + o); };
  auto int_table = [&](char* base, size_t o) {
    return reinterpret_cast<int32_t* const*>(base + o);
  };

  // The launch sequence of the method; with run = false it only sizes the workspace. What the
  // statistics need of it afterwards (in the scratch):
  const int64_t* vatt_budget = nullptr;  // vAttention: budgets [B, H]
  const int32_t* iid_indices = nullptr;  // SANTA iid: samples [B, H, S]
  const float* planes = nullptr;
  if (m.kind == MethodKind::kHashTopK || m.kind == MethodKind::kVAttention) {
    absl::StatusOr<const float*> pl = Planes(layer, hkv, words * 32, d);
    if (!pl.ok()) return pl.status();
    planes = *pl;
  }
  // SimHash signatures of the queries ([B, H, words]), as the CPU engine's SignatureMaker::Query.
  auto query_signs = [&](uint32_t* out) {
    kc::SimHashSignParams p;
    p.num_seqs = B;
    p.heads = H;
    p.group = G;
    p.dim = d;
    p.bits = words * 32;
    p.dtype = dt;
    p.x = shape_d.q;
    p.planes = planes;
    p.out = out;
    p.out_batch_stride = static_cast<int64_t>(H) * words;
    p.out_head_stride = words;
    return p;
  };
  auto plan = [&](char* base, bool run, cudaEvent_t* ev, size_t* carved) -> absl::Status {
    fill_shape(base);
    Carver c(base == nullptr ? nullptr : base + method_off);
    int32_t* stats = base == nullptr ? nullptr : reinterpret_cast<int32_t*>(base + stats_off);
    auto mark = [&](int i) -> absl::Status {
      if (run && ev != nullptr) KVS_CUDA_OK(cudaEventRecord(ev[i], stream_), "event");
      return absl::OkStatus();
    };
    if (absl::Status s = mark(0); !s.ok()) return s;
    switch (m.kind) {
      case MethodKind::kDense: {
        kc::DecodeShape ds = shape_d;
        if (absl::Status s = mark(1); !s.ok()) return s;  // no selection
        if (!dense_resident) {  // every row crosses: fetched into a dense staging area first
          const int32_t dense_rows_cap = n_max;  // rows per (b, j)
          const RowsLayout rl = RowsLayout::Of(1, dense_rows_cap, row, false);
          char* sets = c.Take<char>(rl.total * BK);
          void** tab = c.Take<void*>(4 * static_cast<size_t>(BK));
          std::vector<void*> ht(4 * BK);
          for (int32_t i = 0; i < BK && sets != nullptr; ++i) {
            char* sb = sets + rl.total * i;
            ht[i] = sb + rl.tokens;
            ht[BK + i] = sb + rl.count;
            ht[2 * BK + i] = sb + rl.k;
            ht[3 * BK + i] = sb + rl.v;
          }
          kc::RowSetTables t;
          if (tab != nullptr) {
            t.tokens = reinterpret_cast<int32_t* const*>(tab);
            t.count = reinterpret_cast<int32_t* const*>(tab + BK);
            t.k = tab + 2 * BK;
            t.v = tab + 3 * BK;
          }
          t.capacity = dense_rows_cap;
          kc::FetchRowsParams fp;
          fp.shape = shape_d;
          fp.all_tokens = true;
          fp.seq_lens = shape_d.seq_lens;
          fp.max_seq_len = n_max;
          fp.max_rows = n_max;
          fp.out = t;
          if (run) {
            KVS_CUDA_OK(cudaMemcpyAsync(tab, ht.data(), sizeof(void*) * 4 * BK,
                                        cudaMemcpyHostToDevice, stream_),
                        "row tables");
            KVS_CUDA_OK(kc::FetchRows(fp, stream_), "FetchRows");
          }
          ds.k = ds.v = nullptr;
          ds.k_pages = ds.v_pages = kc::PagedRows();
          ds.k_heads = reinterpret_cast<const void* const*>(t.k);
          ds.v_heads = reinterpret_cast<const void* const*>(t.v);
        }
        const size_t wb = kc::DenseDecodeWorkspaceBytes(ds);
        void* ws = c.Take<char>(wb);
        if (absl::Status s = mark(2); !s.ok()) return s;
        if (run) KVS_CUDA_OK(kc::DenseDecode(ds, ws, wb, stream_), "DenseDecode");
        break;
      }
      case MethodKind::kSanta: {
        kc::SantaParams sp;
        sp.shape = shape_d;
        sp.num_samples = m.santa.samples;
        sp.seeds = reinterpret_cast<const uint64_t*>(base + off.seeds);
        const bool iid = m.santa.sampler == kernels::SantaSampler::kIid;
        // Distinct V rows read: counted by prop / flash; for iid from its sampled indices.
        sp.rows_read = iid ? nullptr : stats;
        sp.indices = iid ? c.Take<int32_t>(static_cast<size_t>(BH) * m.santa.samples) : nullptr;
        iid_indices = sp.indices;
        const bool prop = m.santa.allocation == kernels::SantaAllocation::kProp;
        const size_t wb = iid    ? kc::SantaIidWorkspaceBytes(sp)
                          : prop ? kc::S2antaPropWorkspaceBytes(sp)
                                 : kc::S2antaFlashWorkspaceBytes(sp);
        void* ws = c.Take<char>(wb);
        if (absl::Status s = mark(1); !s.ok()) return s;
        if (absl::Status s = mark(2); !s.ok()) return s;
        if (run) {
          KVS_CUDA_OK(iid    ? kc::SantaIid(sp, ws, wb, stream_)
                      : prop ? kc::S2antaProp(sp, ws, wb, stream_)
                             : kc::S2antaFlash(sp, ws, wb, stream_),
                      "SANTA");
        }
        break;
      }
      case MethodKind::kHashTopK: {
        uint32_t* qsig = c.Take<uint32_t>(static_cast<size_t>(BH) * words);
        const kc::SimHashSignParams qsp = query_signs(qsig);
        tk.q_sigs = qsig;
        tk.k_sig_heads = reinterpret_cast<const uint32_t* const*>(base + off.sig_heads);
        tk.k_token_stride = words;
        tk.seq_lens = shape_d.seq_lens;
        tk.indices = c.Take<int32_t>(static_cast<size_t>(BH) * max_sel);
        tk.counts = stats == nullptr ? nullptr : stats + BH;
        tk.budgets = stats == nullptr ? nullptr : stats + 2 * BH;
        const size_t tw = kc::HashTopKWorkspaceBytes(tk);
        void* tws = c.Take<char>(tw);
        kc::UnionSelectedParams up;
        up.batch = B;
        up.num_q_heads = H;
        up.num_kv_heads = hkv;
        up.indices = tk.indices;
        up.counts = tk.counts;
        up.max_selected = max_sel;
        up.seq_lens = shape_d.seq_lens;
        up.max_seq_len = n_max;
        const size_t rows_all = static_cast<size_t>(BK) * rows_cap;
        cr.overflow_cap = std::max(0, rows_cap - min_cache);  // misses beyond a cache's slots
        cr.union_tokens = method_off + c.used();
        c.Take<int32_t>(rows_all);
        cr.fetch_tokens = method_off + c.used();
        c.Take<int32_t>(rows_all);
        cr.fetch_count = method_off + c.used();
        c.Take<int32_t>(BK);
        cr.dest = method_off + c.used();
        c.Take<int32_t>(rows_all);
        cr.overflow = method_off + c.used();
        c.Take<uint8_t>(2 * row * BK * cr.overflow_cap);
        up.out.tokens = int_table(base, off.call[0]);
        up.out.count = int_table(base, off.call[1]);  // the first BK statistics
        up.out.capacity = rows_cap;
        up.positions = c.Take<int32_t>(static_cast<size_t>(BH) * max_sel);
        const size_t uw = kc::UnionSelectedWorkspaceBytes(up);
        void* uws = c.Take<char>(uw);
        kc::PlaceRowsParams pp;
        pp.batch = B;
        pp.num_q_heads = H;
        pp.num_kv_heads = hkv;
        pp.rows = up.out;
        if (cache_cap > 0) {
          pp.cache.tokens = int_table(base, off.cache[0]);
          pp.cache.slots = int_table(base, off.cache[1]);
          pp.cache.count = int_table(base, off.cache[2]);
          pp.cache.k = table(base, off.cache[3]);
          pp.cache.v = table(base, off.cache[4]);
          pp.cache.capacity = cache_cap;
          pp.cache.capacities = reinterpret_cast<const int32_t*>(base + off.cache_slots);
        }
        pp.positions = up.positions;
        pp.counts = tk.counts;
        pp.max_selected = max_sel;
        pp.fetch.tokens = int_table(base, off.call[2]);
        pp.fetch.count = int_table(base, off.call[3]);
        pp.fetch.capacity = rows_cap;
        pp.fetch_dest = int_table(base, off.call[4]);
        pp.hits = stats == nullptr ? nullptr : stats + 3 * BH;
        const size_t pw = kc::PlaceRowsWorkspaceBytes(pp);
        void* pws = c.Take<char>(pw);
        kc::FetchRowsParams fp;
        fp.shape = shape_d;
        fp.max_rows = rows_cap;
        fp.out = pp.fetch;  // the rows to fetch, into cache slots or overflow rows
        fp.out.k = table(base, off.cache[3]);
        fp.out.v = table(base, off.cache[4]);
        fp.dest = pp.fetch_dest;
        if (cr.overflow_cap > 0) {
          fp.second.k = table(base, off.call[5]);
          fp.second.v = table(base, off.call[6]);
        }
        if (cache_cap == 0) {  // no cache: every location is an overflow row
          fp.out.k = fp.second.k;
          fp.out.v = fp.second.v;
        }
        kc::SelectedRowsParams srp;
        srp.shape = shape_d;
        srp.rows.k = fp.out.k;
        srp.rows.v = fp.out.v;
        srp.second = fp.second;
        srp.positions = up.positions;
        srp.counts = tk.counts;
        srp.max_selected = max_sel;
        const size_t sw = kc::SelectedRowsWorkspaceBytes(srp);
        void* sws = c.Take<char>(sw);
        if (run) {
          KVS_CUDA_OK(kc::SimHashSign(qsp, stream_), "SimHashSign");
          KVS_CUDA_OK(kc::HashTopK(tk, tws, tw, stream_), "HashTopK");
          KVS_CUDA_OK(kc::UnionSelected(up, uws, uw, stream_), "UnionSelected");
          KVS_CUDA_OK(kc::PlaceRows(pp, pws, pw, stream_), "PlaceRows");
        }
        if (absl::Status s = mark(1); !s.ok()) return s;
        if (run) KVS_CUDA_OK(kc::FetchRows(fp, stream_), "FetchRows");
        if (absl::Status s = mark(2); !s.ok()) return s;
        if (run) KVS_CUDA_OK(kc::SelectedRowsDecode(srp, sws, sw, stream_), "SelectedRowsDecode");
        break;
      }
      case MethodKind::kVAttention: {
        uint32_t* qsig = c.Take<uint32_t>(static_cast<size_t>(BH) * words);
        const kc::SimHashSignParams qsp = query_signs(qsig);
        const kernels::VAttentionParams& cp = m.vattention;
        kc::VAttentionParams vp;
        vp.shape = shape_d;
        vp.seeds = reinterpret_cast<const uint64_t*>(base + off.seeds);
        vp.epsilon = cp.epsilon;
        vp.delta = cp.delta;
        vp.sink_tokens = cp.sink_tokens;
        vp.local_tokens = cp.local_tokens;
        vp.top_k = cp.top_k;
        vp.top_k_fraction = cp.top_k_fraction;
        vp.base_rate = cp.base_rate;
        vp.bound = static_cast<int32_t>(cp.bound);
        vp.target = static_cast<int32_t>(cp.target);
        vp.bits = words * 32;
        vp.q_sigs = qsig;
        vp.k_sig_heads = reinterpret_cast<const uint32_t* const*>(base + off.sig_heads);
        vp.k_token_stride = words;
        vp.key_heads = hkv;
        const size_t wb = kc::VAttentionWorkspaceBytes(vp);
        void* ws = c.Take<char>(wb);
        if (absl::Status s = mark(1); !s.ok()) return s;
        if (absl::Status s = mark(2); !s.ok()) return s;
        if (run) {
          KVS_CUDA_OK(kc::SimHashSign(qsp, stream_), "SimHashSign");
          KVS_CUDA_OK(kc::VAttentionDecode(vp, ws, wb, stream_), "VAttentionDecode");
          // Per-head counts for the statistics: fixed, base, dyn and budget.
          const kc::VAttentionSelectionView v = kc::VAttentionSelection(vp, ws);
          KVS_CUDA_OK(cudaMemcpyAsync(stats, v.fixed_count, sizeof(int32_t) * BH,
                                      cudaMemcpyDeviceToDevice, stream_),
                      "stats");
          KVS_CUDA_OK(cudaMemcpyAsync(stats + BH, v.base_count, sizeof(int32_t) * BH,
                                      cudaMemcpyDeviceToDevice, stream_),
                      "stats");
          KVS_CUDA_OK(cudaMemcpyAsync(stats + 2 * BH, v.dyn_count, sizeof(int32_t) * BH,
                                      cudaMemcpyDeviceToDevice, stream_),
                      "stats");
          vatt_budget = v.budget;
        }
        break;
      }
    }
    *carved = c.used();
    return mark(3);
  };
  size_t method_bytes = 0;
  if (absl::Status s = plan(nullptr, false, nullptr, &method_bytes); !s.ok()) return s;
  const size_t need = method_off + method_bytes;
  if (scratch_.bytes < need) {
    Free(&scratch_);
    if (absl::Status s = Alloc(&scratch_, need + (need >> 2)); !s.ok()) return s;
  }
  char* base = scratch_.as<char>();
  if (m.kind == MethodKind::kHashTopK) {  // the per-call row tables, now that base is known
    void** t[7];
    for (int x = 0; x < 7; ++x) t[x] = reinterpret_cast<void**>(h + off.call[x]);
    const size_t ints = sizeof(int32_t);
    for (int32_t i = 0; i < BK; ++i) {
      t[0][i] = base + cr.union_tokens + ints * i * rows_cap;
      t[1][i] = base + stats_off + ints * i;
      t[2][i] = base + cr.fetch_tokens + ints * i * rows_cap;
      t[3][i] = base + cr.fetch_count + ints * i;
      t[4][i] = base + cr.dest + ints * i * rows_cap;
      t[5][i] = base + cr.overflow + row * i * cr.overflow_cap;
      t[6][i] = base + cr.overflow + row * (BK + i) * cr.overflow_cap;
    }
  }
  KVS_CUDA_OK(cudaMemcpyAsync(base, h, table_bytes, cudaMemcpyHostToDevice, stream_),
              "call tables upload");
  const int every = options_.stage_timing_every;
  const bool timed = every > 0 && calls_++ % static_cast<uint64_t>(every) == 0;
  if (absl::Status s = plan(base, true, timed ? events_ : nullptr, &method_bytes); !s.ok()) {
    return s;
  }
  // Output and statistics are adjacent in the scratch: one download.
  const size_t down_bytes = out_off + static_cast<size_t>(BH) * d * es - stats_off;
  if (absl::Status s = out_host_.Reserve(down_bytes); !s.ok()) return s;
  char* oh = static_cast<char*>(out_host_.ptr);
  KVS_CUDA_OK(cudaMemcpyAsync(oh, base + stats_off, down_bytes, cudaMemcpyDeviceToHost, stream_),
              "output download");
  const int32_t* st = reinterpret_cast<const int32_t*>(oh);
  const char* out_h = oh + (out_off - stats_off);
  std::vector<int64_t> vbud;
  if (m.kind == MethodKind::kVAttention) {
    vbud.resize(BH);
    KVS_CUDA_OK(cudaMemcpyAsync(vbud.data(), vatt_budget, sizeof(int64_t) * BH,
                                cudaMemcpyDeviceToHost, stream_),
                "budget download");
  }
  std::vector<int32_t> iid_idx;
  if (m.kind == MethodKind::kSanta && m.santa.sampler == kernels::SantaSampler::kIid) {
    iid_idx.resize(static_cast<size_t>(BH) * m.santa.samples);
    KVS_CUDA_OK(cudaMemcpyAsync(iid_idx.data(), iid_indices, sizeof(int32_t) * iid_idx.size(),
                                cudaMemcpyDeviceToHost, stream_),
                "iid indices download");
  }
  const absl::Time enqueued = absl::Now();
  KVS_CUDA_OK(cudaStreamSynchronize(stream_), "decode");
  const absl::Time done = absl::Now();
  result->timing.launch_seconds += absl::ToDoubleSeconds(enqueued - synced);
  result->timing.wait_seconds += absl::ToDoubleSeconds(done - enqueued);
  if (timed) {
    float ms[3] = {0, 0, 0};
    for (int i = 0; i < 3; ++i) cudaEventElapsedTime(&ms[i], events_[i], events_[i + 1]);
    result->timing.selection_seconds += ms[0] * 1e-3;
    result->timing.gather_seconds += ms[1] * 1e-3;
    result->timing.compute_seconds += ms[2] * 1e-3;
    result->timing.stage_weight = every;
  } else {
    result->timing.stage_weight = 0;
  }
  views.clear();  // pages may move again

  // ---- Output in q's dtype and the per-kv-head statistics. ----
  {
    uint8_t* dst = reinterpret_cast<uint8_t*>(result->output.data());
    const size_t count = static_cast<size_t>(BH) * d;
    if (call.q_dtype == dt) {
      std::memcpy(dst, out_h, count * es);
    } else {
      for (size_t i = 0; i < count; ++i) {
        kernels::StoreFromFloat(
            dst, i, call.q_dtype,
            kernels::LoadAsFloat(reinterpret_cast<const uint8_t*>(out_h), i, dt));
      }
    }
  }
  const size_t k_tier = descs[0].placement.k_tier == kvstore::Tier::kDevice ? kDevice : kHost;
  const size_t v_tier = descs[0].placement.v_tier == kvstore::Tier::kDevice ? kDevice : kHost;
  for (int32_t b = 0; b < B; ++b) {
    const uint64_t n = static_cast<uint64_t>(lens[b]);
    for (int32_t j = 0; j < hkv; ++j) {
      HeadStats hs;
      hs.sequence_index = static_cast<uint32_t>(b);
      hs.kv_head = static_cast<uint32_t>(j);
      hs.dense_equivalent_bytes = 2 * n * row;
      const int32_t i = b * hkv + j;
      switch (m.kind) {
        case MethodKind::kDense:
          hs.rows_selected = n * G;
          hs.rows_fetched = n;
          hs.budgets.assign(G, n);
          hs.bytes[k_tier] += n * row;
          hs.bytes[v_tier] += n * row;
          break;
        case MethodKind::kSanta: {
          uint64_t rows = static_cast<uint64_t>(st[i]);
          if (!iid_idx.empty()) {  // distinct tokens over the group's samples
            const size_t S = static_cast<size_t>(m.santa.samples);
            std::vector<int32_t> toks(
                iid_idx.begin() + (static_cast<size_t>(b) * H + j * G) * S,
                iid_idx.begin() + (static_cast<size_t>(b) * H + j * G + G) * S);
            std::sort(toks.begin(), toks.end());
            rows = n > 0 ? std::unique(toks.begin(), toks.end()) - toks.begin() : 0;
          }
          hs.rows_selected = n > 0 ? static_cast<uint64_t>(m.santa.samples) * G : 0;
          hs.rows_fetched = rows;
          hs.budgets.assign(G, n > 0 ? m.santa.samples : 0);
          hs.bytes[kDevice] += n * row;  // every K row is scored
          hs.bytes[v_tier] += rows * row;
          break;
        }
        case MethodKind::kHashTopK: {
          const uint64_t fetched = static_cast<uint64_t>(st[i]);  // the union's rows
          const uint64_t hits = static_cast<uint64_t>(st[3 * BH + i]);
          for (int32_t g = 0; g < G; ++g) {
            hs.rows_selected += static_cast<uint64_t>(st[BH + b * H + j * G + g]);
            hs.budgets.push_back(static_cast<uint64_t>(st[2 * BH + b * H + j * G + g]));
          }
          hs.rows_fetched = fetched;
          hs.rows_cached = hits;
          hs.bytes[kDevice] += n * words * 4 + hits * 2 * row;
          hs.bytes[k_tier] += (fetched - hits) * row;
          hs.bytes[v_tier] += (fetched - hits) * row;
          break;
        }
        case MethodKind::kVAttention: {
          // This kernel reads each query head's rows itself (no union over the group).
          for (int32_t g = 0; g < G; ++g) {
            const int32_t bh = b * H + j * G + g;
            const uint64_t fixed = static_cast<uint64_t>(st[bh]);
            const uint64_t base_rows = static_cast<uint64_t>(st[BH + bh]);
            const uint64_t dyn = static_cast<uint64_t>(std::max(st[2 * BH + bh], 0));
            hs.rows_selected += fixed + dyn;
            hs.rows_fetched += fixed + base_rows + dyn;
            hs.budgets.push_back(static_cast<uint64_t>(std::max<int64_t>(vbud[bh], 0)));
          }
          hs.bytes[kDevice] += n * words * 4;
          hs.bytes[k_tier] += hs.rows_fetched * row;
          hs.bytes[v_tier] += hs.rows_fetched * row;
          break;
        }
      }
      result->heads.push_back(std::move(hs));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<DecodeBackend>> NewGpuBackend(GpuBackendOptions options,
                                                             RowSource* source) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count <= options.device || options.device < 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError("no usable CUDA device");
  }
  if (options.signatures.learned != nullptr) {
    return absl::FailedPreconditionError(
        "the GPU backend signs with SimHash only (learned hash weights run on the CPU engine)");
  }
  KVS_CUDA_OK(cudaSetDevice(options.device), "cudaSetDevice");
  cudaStream_t stream = nullptr;
  KVS_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  return std::unique_ptr<DecodeBackend>(new GpuBackend(std::move(options), source, stream));
}

}  // namespace kvsparse::server
