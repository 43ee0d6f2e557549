#include "engine/cuda/launch_plan.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/dtype.h"
#include "kernels/philox.h"

namespace kvsparse::engine::gpu {
namespace {

namespace kc = kernels::cuda;

}  // namespace

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
      k_tier_(descs[0].placement.k_tier == kvstore::Tier::kDevice ? kDeviceTier : kHostTier),
      v_tier_(descs[0].placement.v_tier == kvstore::Tier::kDevice ? kDeviceTier : kHostTier) {
  // q travels in the tables unless it is on the device already.
  q_off_ = AddHostTable<uint8_t>(call.on_device() ? 0 : static_cast<size_t>(BH) * d * es);
  lens_off_ = AddHostTable<int32_t>(B);
  seeds_off_ = AddHostTable<uint64_t>(B);
  k_heads_off_ = AddHostTable<const void*>(BK);
  v_heads_off_ = AddHostTable<const void*>(BK);
  pages_off_ = AddHostTable<const void*>(BK);
  sig_heads_off_ = AddHostTable<const void*>(BK);
}

absl::Status LaunchPlan::BuildTables(PinnedBuf* host) {
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
  for (int32_t b = 0; b < B; ++b) {
    HostTable<uint64_t>(seeds_off_)[b] =
        kernels::SequenceSeed(call_.seed, static_cast<uint32_t>(b));
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
  kc::PagedRows pages;
  pages.tables = Dev<const void* const* const>(pages_off_);
  pages.page_shift = Log2(descs_[0].page_tokens);
  pages.slot_bytes = static_cast<int32_t>(2 * row);
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
  absl::StatusOr<const float*> planes = state_->Planes(call_.layer, hkv, words * 32, d);
  if (!planes.ok()) return planes.status();
  planes_ = *planes;
  return absl::OkStatus();
}

kc::SimHashSignParams LaunchPlan::QuerySigns(uint32_t* out) const {
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
  return p;
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
