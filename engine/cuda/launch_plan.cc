#include "engine/cuda/launch_plan.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "kernels/compressed_keys.h"
#include "kernels/dtype.h"
#include "kernels/philox.h"

namespace kvsparse::engine::gpu {
namespace {

namespace kc = kernels::cuda;

}  // namespace

size_t CompressedKeyBlockBytes(const SequenceDesc& desc) {
  const uint32_t bits = desc.placement.compressed_key_bits;
  if (bits == 0) return 0;
  return kernels::KeyGroupBytes({static_cast<int32_t>(bits), kernels::kKeyGroupTokens},
                                static_cast<int32_t>(desc.shape.head_dim));
}

LaunchPlan::LaunchPlan(const DecodeCall& call, absl::Span<const SequenceDesc> descs,
                       SyncedBatch* batch, DeviceState* state)
    : B(static_cast<int32_t>(descs.size())),
      H(static_cast<int32_t>(descs[0].shape.num_q_heads)),
      hkv(static_cast<int32_t>(descs[0].shape.num_kv_heads)),
      G(H / hkv),
      d(static_cast<int32_t>(descs[0].shape.head_dim)),
      dtype(descs[0].shape.dtype),
      es(kernels::DTypeSize(dtype)),
      row(descs[0].shape.row_bytes()),
      BH(B * H),
      BK(B * hkv),
      words(static_cast<int32_t>(descs[0].placement.signature_bits / 32)),
      n_max(std::max(1, *std::max_element(batch->lens.begin(), batch->lens.end()))),
      call_(call),
      descs_(descs),
      batch_(batch),
      state_(state),
      k_tier_(descs[0].placement.k_tier == kvstore::Tier::kDevice
                  ? kDeviceTier
                  : static_cast<size_t>(state->source()->tier())),
      v_tier_(descs[0].placement.v_tier == kvstore::Tier::kDevice
                  ? kDeviceTier
                  : static_cast<size_t>(state->source()->tier())),
      staged_((k_tier_ != kDeviceTier || v_tier_ != kDeviceTier) &&
              !state->source()->pages_device_visible()) {
  // q travels in the tables unless it is on the device already.
  q_off_ = AddHostTable<uint8_t>(call.on_device() ? 0 : static_cast<size_t>(BH) * d * es);
  lens_off_ = AddHostTable<int32_t>(B);
  seeds_off_ = AddHostTable<uint64_t>(B);
  k_heads_off_ = AddHostTable<const void*>(BK);
  v_heads_off_ = AddHostTable<const void*>(BK);
  pages_off_ = AddHostTable<const void*>(BK);
  sig_heads_off_ = AddHostTable<const void*>(BK);
  ck_heads_off_ = AddHostTable<const void*>(BK);
  ck_tails_off_ = AddHostTable<const void*>(BK);
}

absl::Status LaunchPlan::BuildTables(PinnedBuf* host) {
  absl::StatusOr<DeviceKeyMap> map = state_->key_widths().Maps(descs_[0], call_.layer);
  if (!map.ok()) return map.status();
  key_map_ = *map;
  stats_off_ = AddHostTable<int32_t>(kStatBlocks * static_cast<size_t>(BH));
  table_bytes_ = host_carver_.used();
  if (absl::Status s = host->Reserve(table_bytes_); !s.ok()) return s;
  host_ = static_cast<char*>(host->ptr());
  std::memset(host_, 0, table_bytes_);
  if (!call_.on_device()) {
    kernels::ConvertElements(call_.q.data(), call_.q_dtype, HostTable<uint8_t>(q_off_), dtype,
                             static_cast<size_t>(BH) * d);
  }
  std::memcpy(host_ + lens_off_, batch_->lens.data(), sizeof(int32_t) * B);
  const size_t ck_block = CompressedKeyBlockBytes(descs_[0]);
  for (int32_t b = 0; b < B; ++b) {
    HostTable<uint64_t>(seeds_off_)[b] =
        kernels::SequenceSeed(call_.SeedOf(b), static_cast<uint32_t>(b));
    const DeviceLayer& l = layer(b);
    for (int32_t j = 0; j < hkv; ++j) {
      const int32_t i = b * hkv + j;
      if (l.k.ptr != nullptr)
        HostTable<const void*>(k_heads_off_)[i] = l.k.as<uint8_t>() + j * l.capacity * row;
      if (l.v.ptr != nullptr)
        HostTable<const void*>(v_heads_off_)[i] = l.v.as<uint8_t>() + j * l.capacity * row;
      if (l.pages.ptr != nullptr) {
        HostTable<const void*>(pages_off_)[i] =
            l.pages.as<uint8_t>() + j * l.page_cap * sizeof(void*);
      }
      if (l.sig.ptr != nullptr) {
        HostTable<const void*>(sig_heads_off_)[i] =
            l.sig.as<uint8_t>() + j * l.capacity * words * 4;
      }
      if (l.ck.ptr != nullptr) {
        HostTable<const void*>(ck_heads_off_)[i] = l.ck.as<uint8_t>() + j * l.ck_cap * ck_block;
      }
      if (l.ck_tail.ptr != nullptr) {
        HostTable<const void*>(ck_tails_off_)[i] =
            l.ck_tail.as<uint8_t>() + j * kernels::kKeyGroupTokens * row;
      }
    }
  }
  // The device scratch: the tables and statistics, then the output and the method's buffers.
  Carver dc(nullptr);
  dc.Take<char>(table_bytes_);
  out_off_ = dc.used();
  dc.Take<uint8_t>(call_.on_device() ? 0 : static_cast<size_t>(BH) * d * es);
  method_off_ = dc.used();
  return absl::OkStatus();
}

void LaunchPlan::BeginPass(char* base, cudaEvent_t* events) {
  base_ = base;
  events_ = events;
  shape_ = kc::DecodeShape();
  shape_.batch = B;
  shape_.num_q_heads = H;
  shape_.num_kv_heads = hkv;
  shape_.head_dim = d;
  shape_.dtype = dtype;
  shape_.q = call_.on_device() ? call_.q_device : base_ + q_off_;
  shape_.seq_lens = Dev<const int32_t>(lens_off_);
  shape_.max_seq_len = n_max;
  shape_.scale = call_.scale > 0.f ? call_.scale : 1.f / std::sqrt(static_cast<float>(d));
  shape_.out = call_.on_device() ? call_.out_device : base_ + out_off_;
  shape_.kv.token_stride = d;
  kc::PagedRows pages;  // staged: none until StageListed / StageAll
  if (!staged_) {
    pages.tables = Dev<const void* const* const>(pages_off_);
    pages.page_shift = Log2(descs_[0].page_tokens);
    pages.slot_bytes = static_cast<int32_t>(2 * row);
  }
  if (k_tier_ == kDeviceTier) {
    shape_.k_heads = Dev<const void* const>(k_heads_off_);
  } else {
    shape_.k_pages = pages;
  }
  if (v_tier_ == kDeviceTier) {
    shape_.v_heads = Dev<const void* const>(v_heads_off_);
  } else {
    shape_.v_pages = pages;
    shape_.v_pages.offset_bytes = static_cast<int32_t>(row);
  }
}

absl::Status LaunchPlan::Mark(int i) {
  if (running() && events_ != nullptr) {
    KVS_CUDA_OK(cudaEventRecord(events_[i], stream()), "event");
  }
  return absl::OkStatus();
}

absl::Status LaunchPlan::LoadPlanes() {
  absl::StatusOr<const float*> planes =
      state_->learned() != nullptr ? state_->learned()->Mlps(call_.layer)
                                   : state_->simhash().Planes(call_.layer, hkv, words * 32, d);
  if (!planes.ok()) return planes.status();
  planes_ = *planes;
  return absl::OkStatus();
}

absl::Status LaunchPlan::SignQueries(uint32_t* out) const {
  if (const LearnedSigning* learned = state_->learned(); learned != nullptr) {
    const kernels::LearnedHashWeights* w = &learned->weights();
    kc::LearnedSignParams p;
    p.num_seqs = B;
    p.heads = H;
    p.num_linear = static_cast<int32_t>(w->dims.size()) - 1;
    for (int32_t i = 0; i <= p.num_linear; ++i) p.dims[i] = w->dims[i];
    p.dtype = dtype;
    p.x = shape_.q;
    p.mlps = planes_;
    p.out = out;
    p.out_batch_stride = static_cast<int64_t>(H) * words;
    p.out_head_stride = words;
    KVS_CUDA_OK(kc::LearnedSign(p, stream()), "LearnedSign (queries)");
    return absl::OkStatus();
  }
  kc::SimHashSignParams p;
  p.num_seqs = B;
  p.heads = H;
  p.group = G;
  p.dim = d;
  p.bits = words * 32;
  p.dtype = dtype;
  p.x = shape_.q;
  p.planes = planes_;
  p.out = out;
  p.out_batch_stride = static_cast<int64_t>(H) * words;
  p.out_head_stride = words;
  KVS_CUDA_OK(kc::SimHashSign(p, stream()), "SimHashSign");
  return absl::OkStatus();
}

absl::Status LaunchPlan::StageListed(const int32_t* tokens, int32_t cap, const int32_t* counts,
                                     kc::DecodeShape* shape) {
  KVS_CUDA_OK(cudaStreamSynchronize(stream()), "row lists");
  std::vector<int32_t> n(BK), all(static_cast<size_t>(BK) * cap);
  KVS_CUDA_OK(cudaMemcpy(n.data(), counts, sizeof(int32_t) * BK, cudaMemcpyDeviceToHost),
              "row counts");
  KVS_CUDA_OK(cudaMemcpy(all.data(), tokens, sizeof(int32_t) * all.size(), cudaMemcpyDeviceToHost),
              "row lists");
  std::vector<std::vector<uint32_t>> lists(BK);
  for (int32_t i = 0; i < BK; ++i) {
    if (n[i] < 0 || n[i] > cap) return absl::InternalError("row list count out of range");
    const int32_t* first = all.data() + static_cast<size_t>(i) * cap;
    lists[i].assign(first, first + n[i]);
  }
  return Stage(lists, shape);
}

absl::Status LaunchPlan::StageAll(kc::DecodeShape* shape) {
  std::vector<std::vector<uint32_t>> lists(BK);
  for (int32_t i = 0; i < BK; ++i) {
    lists[i].resize(len(i / hkv));
    std::iota(lists[i].begin(), lists[i].end(), 0u);
  }
  return Stage(lists, shape);
}

absl::Status LaunchPlan::Stage(absl::Span<const std::vector<uint32_t>> lists,
                               kc::DecodeShape* shape) {
  const bool k_host = k_tier_ != kDeviceTier, v_host = v_tier_ != kDeviceTier;
  size_t rows = 0;
  for (const std::vector<uint32_t>& l : lists) rows += l.size();
  const size_t tab = (sizeof(void*) * BK + 255) / 256 * 256;
  const size_t kb = k_host ? rows * row : 0, vb = v_host ? rows * row : 0;
  PinnedBuf* buf = state_->row_staging();
  if (absl::Status s = buf->Reserve(2 * tab + kb + vb); !s.ok()) return s;
  // [K table | V table | K rows | V rows]; the kernels read it in place (pinned memory is mapped).
  char* base = static_cast<char*>(buf->ptr());
  auto* kt = reinterpret_cast<const void**>(base);
  auto* vt = reinterpret_cast<const void**>(base + tab);
  uint8_t* k_rows = reinterpret_cast<uint8_t*>(base + 2 * tab);
  uint8_t* v_rows = k_rows + kb;
  // Where each (b, j)'s rows land: lists in order, so a sequence's rows are contiguous.
  std::vector<size_t> first(BK + 1, 0);
  for (int32_t i = 0; i < BK; ++i) {
    first[i + 1] = first[i] + lists[i].size();
    kt[i] = k_rows + first[i] * row;
    vt[i] = v_rows + first[i] * row;
  }
  // Per sequence, one Gather for as many heads' lists (or parts of one) as fit in
  // max_fetch_bytes; rows land in request order. The batch's sequences are fetched side by side
  // (a remote store's round trips overlap; each sequence's rows go to their own range).
  const size_t per_row = (k_host ? row : 0) + (v_host ? row : 0);
  const size_t batch_rows = std::max<size_t>(1, state_->max_fetch_bytes() / per_row);
  std::vector<absl::Status> fetched(B);
  state_->fetchers()->Run(static_cast<size_t>(B), [&](size_t bi) {
    const int32_t b = static_cast<int32_t>(bi);
    std::vector<RowRequest> heads;
    size_t batch_at = first[b * hkv], in_batch = 0;
    auto flush = [&]() -> absl::Status {
      if (in_batch == 0) return absl::OkStatus();
      absl::StatusOr<uint64_t> got = state_->source()->Gather(
          descs_[b].sequence_id, call_.layer, kvstore::RowKindOf(k_host, v_host), heads,
          k_host ? k_rows + batch_at * row : nullptr, v_host ? v_rows + batch_at * row : nullptr,
          call_.deadline);
      if (!got.ok()) return got.status();
      if (*got < static_cast<uint64_t>(len(b))) {
        return absl::AbortedError("the sequence changed during the call; retry");
      }
      batch_at += in_batch;
      in_batch = 0;
      heads.clear();
      return absl::OkStatus();
    };
    for (int32_t j = 0; j < hkv; ++j) {
      const absl::Span<const uint32_t> list(lists[b * hkv + j]);
      for (size_t r = 0; r < list.size();) {
        const size_t take = std::min(list.size() - r, batch_rows - in_batch);
        heads.push_back({static_cast<uint32_t>(j), list.subspan(r, take)});
        in_batch += take;
        r += take;
        if (in_batch == batch_rows) {
          if (absl::Status s = flush(); !s.ok()) {
            fetched[b] = s;
            return;
          }
        }
      }
    }
    fetched[b] = flush();
  });
  for (const absl::Status& s : fetched) {
    if (!s.ok()) return s;
  }
  if (k_host) {
    shape->k = nullptr;
    shape->k_pages = kc::PagedRows();
    shape->k_heads = kt;
  }
  if (v_host) {
    shape->v = nullptr;
    shape->v_pages = kc::PagedRows();
    shape->v_heads = vt;
  }
  return absl::OkStatus();
}

absl::StatusOr<char*> LaunchPlan::PlaceScratch(size_t method_bytes) {
  return state_->Scratch(method_off_ + method_bytes);
}

absl::Status LaunchPlan::Upload() {
  KVS_CUDA_OK(cudaMemcpyAsync(base_, host_, table_bytes_, cudaMemcpyHostToDevice, stream()),
              "call tables upload");
  return absl::OkStatus();
}

absl::Status LaunchPlan::Download(PinnedBuf* down) {
  // Output and statistics are adjacent in the scratch: one download (the statistics alone when
  // the output is on the device).
  const size_t out_bytes = call_.on_device() ? 0 : static_cast<size_t>(BH) * d * es;
  const size_t bytes = (call_.on_device() ? table_bytes_ : out_off_ + out_bytes) - stats_off_;
  if (absl::Status s = down->Reserve(bytes); !s.ok()) return s;
  KVS_CUDA_OK(
      cudaMemcpyAsync(down->ptr(), base_ + stats_off_, bytes, cudaMemcpyDeviceToHost, stream()),
      "output download");
  down_ = static_cast<const char*>(down->ptr());
  return absl::OkStatus();
}

void LaunchPlan::WriteOutput(DecodeResult* result) const {
  if (call_.on_device()) return;  // written in place
  const auto* out = reinterpret_cast<const uint8_t*>(down_ + (out_off_ - stats_off_));
  kernels::ConvertElements(out, dtype, reinterpret_cast<uint8_t*>(result->output.data()),
                           call_.q_dtype, static_cast<size_t>(BH) * d);
}

}  // namespace kvsparse::engine::gpu
