// The mapped-file plane: the store's arena file mapped read-only in this process (the
// shared-arena pod: store and worker share a volume); the rows are copied from its pages.
#include "rpc/data_plane.h"

namespace kvsparse::rpc {
namespace {

class MappedFilePlane final : public DataPlane {
 public:
  explicit MappedFilePlane(std::string path) : path_(std::move(path)) {}
  const char* name() const override { return "--store_arena_file"; }
  absl::StatusOr<std::shared_ptr<const kvstore::ArenaReader>> Open(
      v1::KvStore::StubInterface&, const std::function<void(grpc::ClientContext*)>&,
      absl::Time) override {
    absl::StatusOr<std::unique_ptr<kvstore::ArenaMapping>> m = kvstore::ArenaMapping::Open(path_);
    if (!m.ok()) return m.status();
    return std::shared_ptr<const kvstore::ArenaReader>(std::move(*m));
  }

 private:
  const std::string path_;
};

}  // namespace

std::unique_ptr<DataPlane> NewMappedFilePlane(std::string path) {
  return std::make_unique<MappedFilePlane>(std::move(path));
}

}  // namespace kvsparse::rpc
