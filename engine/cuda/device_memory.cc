#include "engine/cuda/device_memory.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvsparse::engine::gpu {

DeviceMemory::~DeviceMemory() {
  for (auto& [id, e] : entries_) FreeSequence(&e);
  cudaStreamSynchronize(stream_);
}

DeviceSequence& DeviceMemory::Use(const SequenceDesc& desc) {
  DeviceSequence& e = entries_[desc.sequence_id];
  if (e.incarnation != desc.incarnation || e.layers.size() != desc.shape.num_layers) {
    FreeSequence(&e);
    e.incarnation = desc.incarnation;
    e.shape = desc.shape;
    e.placement = desc.placement;
    e.layers.assign(desc.shape.num_layers, DeviceLayer());
  }
  e.last_use = ++tick_;
  return e;
}

absl::Status DeviceMemory::Alloc(DevBuf* b, size_t bytes) {
  b->ptr = nullptr;
  b->bytes = 0;
  if (bytes == 0) return absl::OkStatus();
  KVS_CUDA_OK(cudaMallocAsync(&b->ptr, bytes, stream_), "device allocation");
  b->bytes = bytes;
  return absl::OkStatus();
}

void DeviceMemory::Free(DevBuf* b) {
  if (b->ptr != nullptr) cudaFreeAsync(b->ptr, stream_);
  *b = DevBuf();
}

void DeviceMemory::FreeSequence(DeviceSequence* e) {
  for (DeviceLayer& l : e->layers) {
    for (DevBuf* b : {&l.k, &l.v, &l.sig, &l.norms, &l.pages, &l.cache, &l.ck, &l.ck_tail}) {
      Free(b);
    }
  }
  e->layers.clear();
  bytes_ -= e->bytes;
  e->bytes = 0;
}

void DeviceMemory::Forget(const std::string& sequence_id) {
  auto it = entries_.find(sequence_id);
  if (it == entries_.end()) return;
  if (it->second.held > 0) {  // a captured step's plan uses it: freed when released
    it->second.forgotten = true;
    return;
  }
  FreeSequence(&it->second);
  entries_.erase(it);
}

void DeviceMemory::Release(const std::string& sequence_id) {
  auto it = entries_.find(sequence_id);
  if (it == entries_.end() || it->second.held == 0) return;
  if (--it->second.held == 0 && it->second.forgotten) {
    FreeSequence(&it->second);
    entries_.erase(it);
  }
}

absl::Status DeviceMemory::Charge(DeviceSequence* self, size_t delta, BusySequences busy) {
  while (bytes_ + delta > capacity_) {
    DeviceSequence* victim = nullptr;
    std::string victim_id;
    for (auto& [id, e] : entries_) {
      if (&e == self || e.bytes == 0 || e.held > 0 ||
          std::find(busy.begin(), busy.end(), &e) != busy.end()) {
        continue;
      }
      if (victim == nullptr || e.last_use < victim->last_use) {
        victim = &e;
        victim_id = id;
      }
    }
    if (victim == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("GPU tier full: ", delta, " more bytes needed, ", bytes_, " of ", capacity_,
                       " held by the sequences of this call"));
    }
    FreeSequence(victim);
    entries_.erase(victim_id);
    ++evictions_;
  }
  bytes_ += delta;
  self->bytes += delta;
  return absl::OkStatus();
}

}  // namespace kvsparse::engine::gpu
