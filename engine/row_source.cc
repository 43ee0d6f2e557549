#include "engine/row_source.h"

#include "absl/strings/str_cat.h"
#include "kvstore/placement.h"

namespace kvsparse::engine {
namespace {

class LocalRowSource final : public RowSource {
 public:
  LocalRowSource(kvstore::Store* store, bool mapped) : store_(store), mapped_(mapped) {}

  kvstore::Tier tier() const override { return kvstore::Tier::kHost; }

  absl::StatusOr<SequenceDesc> Describe(absl::string_view id, absl::Time) override {
    absl::StatusOr<kvstore::SequenceInfo> info = store_->GetSequenceInfo(id);
    if (!info.ok()) return info.status();
    return SequenceDesc{info->sequence_id,   info->shape,       info->placement,
                        info->layer_lengths, info->incarnation, info->page_tokens};
  }

  absl::Status Append(absl::string_view id, const kvstore::ModelShape& shape, uint32_t layer,
                      uint64_t expected_length, uint64_t num_tokens, absl::Span<const uint8_t> k,
                      absl::Span<const uint8_t> v, absl::Time deadline) override {
    kvstore::AppendRequest r;
    r.sequence_id = id;
    r.first_layer = layer;
    r.num_layers = 1;
    r.num_tokens = num_tokens;
    r.dtype = shape.dtype;
    r.num_kv_heads = shape.num_kv_heads;
    r.head_dim = shape.head_dim;
    r.k = k;
    r.v = v;
    r.expected_length = expected_length;
    r.deadline = deadline;
    return store_->Append(r).status();
  }

  absl::StatusOr<uint64_t> Gather(absl::string_view id, uint32_t layer, kvstore::RowKind kind,
                                  absl::Span<const RowRequest> heads, uint8_t* k_out,
                                  uint8_t* v_out, absl::Time deadline) override {
    std::vector<kvstore::HeadSelection> sel;
    sel.reserve(heads.size());
    for (const RowRequest& h : heads) sel.push_back({h.kv_head, h.tokens});
    kvstore::GatherRequest r;
    r.sequence_id = id;
    r.layer = layer;
    r.kind = kind;
    r.heads = sel;
    r.deadline = deadline;
    absl::StatusOr<kvstore::GatherResult> res =
        store_->Gather(r, [&](uint64_t, size_t) -> absl::StatusOr<kvstore::GatherBuffers> {
          return kvstore::GatherBuffers{k_out, v_out};
        });
    if (!res.ok()) return res.status();
    return res->layer_length;
  }

  absl::StatusOr<std::unique_ptr<kvstore::PageView>> View(absl::string_view id) override {
    return store_->View(id);
  }
  bool pages_device_visible() const override { return mapped_; }
  absl::StatusOr<std::unique_ptr<kvstore::Reservation>> Reserve(absl::string_view id,
                                                                uint64_t tokens) override {
    return store_->Reserve(id, tokens);
  }
  absl::Status CommitWritten(absl::string_view id, uint32_t num_layers, uint64_t expected_length,
                             uint64_t num_tokens) override {
    return store_->CommitWritten(id, 0, num_layers, expected_length, num_tokens).status();
  }

 private:
  kvstore::Store* const store_;
  const bool mapped_;
};

class ShardedRowSource final : public RowSource {
 public:
  explicit ShardedRowSource(std::vector<std::unique_ptr<RowSource>> shards)
      : shards_(std::move(shards)) {}

  kvstore::Tier tier() const override { return shards_.front()->tier(); }
  absl::StatusOr<SequenceDesc> Describe(absl::string_view id, absl::Time deadline) override {
    return For(id).Describe(id, deadline);
  }
  absl::Status Append(absl::string_view id, const kvstore::ModelShape& shape, uint32_t layer,
                      uint64_t expected_length, uint64_t num_tokens, absl::Span<const uint8_t> k,
                      absl::Span<const uint8_t> v, absl::Time deadline) override {
    return For(id).Append(id, shape, layer, expected_length, num_tokens, k, v, deadline);
  }
  absl::StatusOr<uint64_t> Gather(absl::string_view id, uint32_t layer, kvstore::RowKind kind,
                                  absl::Span<const RowRequest> heads, uint8_t* k_out,
                                  uint8_t* v_out, absl::Time deadline) override {
    return For(id).Gather(id, layer, kind, heads, k_out, v_out, deadline);
  }
  absl::StatusOr<std::unique_ptr<kvstore::PageView>> View(absl::string_view id) override {
    return For(id).View(id);
  }
  bool pages_device_visible() const override { return shards_.front()->pages_device_visible(); }
  absl::StatusOr<std::unique_ptr<kvstore::Reservation>> Reserve(absl::string_view id,
                                                                uint64_t tokens) override {
    return For(id).Reserve(id, tokens);
  }
  absl::Status CommitWritten(absl::string_view id, uint32_t num_layers, uint64_t expected_length,
                             uint64_t num_tokens) override {
    return For(id).CommitWritten(id, num_layers, expected_length, num_tokens);
  }

 private:
  RowSource& For(absl::string_view id) {
    return *shards_[kvstore::ShardOf(id, static_cast<uint32_t>(shards_.size()))];
  }

  const std::vector<std::unique_ptr<RowSource>> shards_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<kvstore::PageView>> RowSource::View(absl::string_view) {
  return absl::UnimplementedError("this row source has no zero-copy view of its pages");
}

absl::StatusOr<std::unique_ptr<kvstore::Reservation>> RowSource::Reserve(absl::string_view,
                                                                         uint64_t) {
  return absl::UnimplementedError("this row source's rows are not in this process");
}
absl::Status RowSource::CommitWritten(absl::string_view, uint32_t, uint64_t, uint64_t) {
  return absl::UnimplementedError("this row source's rows are not in this process");
}

std::unique_ptr<RowSource> NewLocalRowSource(kvstore::Store* store, bool pages_device_visible) {
  return std::make_unique<LocalRowSource>(store, pages_device_visible);
}

std::unique_ptr<RowSource> NewShardedRowSource(std::vector<std::unique_ptr<RowSource>> shards) {
  if (shards.size() == 1) return std::move(shards.front());
  return std::make_unique<ShardedRowSource>(std::move(shards));
}

}  // namespace kvsparse::engine
