#include "kvstore/shared_arena.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace kvsparse::kvstore {
namespace {

constexpr uint64_t kPageAlign = 4096;  // the header's size and the smallest granule
constexpr uint64_t kHeaderBytes = ArenaLayout::kArenaHeaderBytes;
constexpr char kMagic[8] = {'K', 'V', 'S', 'A', 'R', 'E', 'N', 'A'};
constexpr uint32_t kVersion = 1;

struct ArenaFileHeader {
  char magic[8];
  uint32_t version;
  uint32_t granule_bytes;
  uint64_t arena_id;
  uint64_t data_offset;
  uint64_t data_bytes;
};
static_assert(sizeof(ArenaFileHeader) <= kHeaderBytes);

// Generations are plain 64-bit words in shared memory, read and written with the compiler's
// atomic builtins (address-free, so they work across processes).
uint64_t* GenerationWord(const uint8_t* base, const ArenaLayout& layout, uint64_t page_offset) {
  return reinterpret_cast<uint64_t*>(const_cast<uint8_t*>(base) +
                                     layout.GenerationOffset(page_offset));
}

class FileMemoryResource final : public MemoryResource, public SharedArena {
 public:
  FileMemoryResource(std::string path, uint8_t* base, size_t file_bytes, uint64_t data_offset,
                     uint64_t granule, uint64_t arena_id)
      : path_(std::move(path)),
        base_(base),
        file_bytes_(file_bytes),
        data_offset_(data_offset),
        granule_(granule),
        arena_id_(arena_id) {}
  ~FileMemoryResource() override { munmap(base_, file_bytes_); }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    absl::MutexLock lock(&mu_);
    const size_t aligned = (bytes + granule_ - 1) / granule_ * granule_;
    if (aligned > file_bytes_ - data_offset_ - used_) {
      return absl::ResourceExhaustedError(absl::StrCat("arena file ", path_, " is full (",
                                                       file_bytes_ - data_offset_,
                                                       " bytes; --capacity fits in it)"));
    }
    void* p = base_ + data_offset_ + used_;
    used_ += aligned;
    ++live_;
    return p;
  }

  void Deallocate(void*, size_t) override {
    absl::MutexLock lock(&mu_);
    if (--live_ == 0) used_ = 0;
  }

  absl::string_view name() const override { return "file"; }
  SharedArena* shared_arena() override { return this; }

  uint64_t arena_id() const override { return arena_id_; }
  uint64_t granule() const override { return granule_; }
  void* mapping() const override { return base_; }
  uint64_t mapping_bytes() const override { return file_bytes_; }
  uint64_t data_offset() const override { return data_offset_; }
  uint64_t Offset(const void* p) const override {
    return static_cast<uint64_t>(static_cast<const uint8_t*>(p) - base_);
  }
  uint64_t Generation(const void* page) const override {
    return __atomic_load_n(GenerationWord(base_, Layout(), Offset(page)), __ATOMIC_ACQUIRE);
  }
  void Retire(const void* page) override {
    // Sequentially consistent, and the page's next owner writes it only after taking the pool's
    // lock that Free takes after this: the increment is visible no later than those writes.
    __atomic_fetch_add(GenerationWord(base_, Layout(), Offset(page)), 1, __ATOMIC_SEQ_CST);
  }

 private:
  ArenaLayout Layout() const { return {file_bytes_, data_offset_, granule_}; }

  const std::string path_;
  uint8_t* const base_;
  const size_t file_bytes_;
  const uint64_t data_offset_;
  const uint64_t granule_;
  const uint64_t arena_id_;
  absl::Mutex mu_;
  size_t used_ ABSL_GUARDED_BY(mu_) = 0;
  size_t live_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<MemoryResource>> NewFileMemoryResource(const std::string& path,
                                                                      size_t bytes,
                                                                      size_t granule) {
  if (granule < kPageAlign || granule % kPageAlign != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--arena_file ", path, ": granule ", granule, " is not a multiple of 4096"));
  }
  auto fail = [&](absl::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat("--arena_file ", path, ": ", what, ": ", std::strerror(errno)));
  };
  const uint64_t granules = (bytes + granule - 1) / granule;
  const uint64_t data_offset =
      kHeaderBytes + (granules * sizeof(uint64_t) + kPageAlign - 1) / kPageAlign * kPageAlign;
  const uint64_t file_bytes = data_offset + granules * granule;
  // Made under a temporary name and renamed into place once its header is written, so a reader
  // never maps a half-made file, and one still mapping the previous file keeps its pages.
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  const int fd = open(tmp.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return fail("cannot create it");
  if (ftruncate(fd, static_cast<off_t>(file_bytes)) != 0) {
    absl::Status s = fail("cannot size it");  // before close/unlink change errno
    close(fd);
    unlink(tmp.c_str());
    return s;
  }
  void* p = mmap(nullptr, file_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    absl::Status s = fail("cannot map it");
    close(fd);
    unlink(tmp.c_str());
    return s;
  }
  close(fd);  // the mapping keeps the file's pages
  auto* base = static_cast<uint8_t*>(p);
  ArenaFileHeader header{};
  std::memcpy(header.magic, kMagic, sizeof(kMagic));
  header.version = kVersion;
  header.granule_bytes = static_cast<uint32_t>(granule);
  header.arena_id = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  header.data_offset = data_offset;
  header.data_bytes = granules * granule;
  std::memcpy(base, &header, sizeof(header));
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    absl::Status s = fail("cannot rename it into place");
    munmap(p, file_bytes);
    unlink(tmp.c_str());
    return s;
  }
  return std::unique_ptr<MemoryResource>(
      new FileMemoryResource(path, base, file_bytes, data_offset, granule, header.arena_id));
}

ArenaMapping::ArenaMapping(std::string path, const uint8_t* base, ArenaLayout layout,
                           uint64_t arena_id, uint64_t device, uint64_t inode)
    : path_(std::move(path)),
      base_(base),
      layout_(layout),
      arena_id_(arena_id),
      device_(device),
      inode_(inode) {}

std::string ArenaMapping::name() const { return absl::StrCat("mapping of ", path_); }

absl::StatusOr<bool> ArenaMapping::Read(absl::Span<const LaneRead> lanes, uint32_t page_tokens,
                                        size_t row_bytes, RowKind kind, absl::Time) const {
  for (const LaneRead& l : lanes) {
    if (!CopyRows(l.pages, page_tokens, row_bytes, l.tokens, kind, l.k_out, l.v_out)) return false;
  }
  return true;
}

bool ArenaMapping::IsCurrent() const {
  struct stat st {};
  return stat(path_.c_str(), &st) == 0 && static_cast<uint64_t>(st.st_dev) == device_ &&
         static_cast<uint64_t>(st.st_ino) == inode_;
}

ArenaMapping::~ArenaMapping() { munmap(const_cast<uint8_t*>(base_), layout_.file_bytes); }

absl::StatusOr<std::unique_ptr<ArenaMapping>> ArenaMapping::Open(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const std::string why = std::strerror(errno);
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat("arena file ", path, ": ", why));
    return absl::InvalidArgumentError(absl::StrCat("arena file ", path, ": ", why));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(kHeaderBytes)) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is not a kvsparse arena file (too short)"));
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  void* p = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    return absl::InvalidArgumentError(
        absl::StrCat("arena file ", path, ": cannot map it: ", std::strerror(errno)));
  }
  ArenaFileHeader h;
  std::memcpy(&h, p, sizeof(h));
  if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0 || h.version != kVersion ||
      h.granule_bytes < kPageAlign || h.granule_bytes % kPageAlign != 0 ||
      h.data_offset < kHeaderBytes || h.data_offset + h.data_bytes != bytes ||
      (h.data_offset - kHeaderBytes) / sizeof(uint64_t) < h.data_bytes / h.granule_bytes) {
    munmap(p, bytes);
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is not a kvsparse arena file of version ", kVersion));
  }
  return std::unique_ptr<ArenaMapping>(new ArenaMapping(
      path, static_cast<const uint8_t*>(p), ArenaLayout{bytes, h.data_offset, h.granule_bytes},
      h.arena_id, static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)));
}

bool ArenaMapping::HoldsPage(uint64_t offset, uint64_t page_bytes) const {
  return layout_.HoldsPage(offset, page_bytes);
}

void ArenaMapping::Prefault(absl::Span<const PageRef> pages, uint64_t page_bytes) const {
#ifdef MADV_POPULATE_READ
  // Runs of consecutive pages in one call (a bulk append's pages are contiguous).
  for (size_t i = 0; i < pages.size();) {
    size_t j = i + 1;
    while (j < pages.size() && pages[j].offset == pages[j - 1].offset + page_bytes) ++j;
    madvise(const_cast<uint8_t*>(base_) + pages[i].offset, (j - i) * page_bytes,
            MADV_POPULATE_READ);
    i = j;
  }
#else
  (void)pages;
  (void)page_bytes;
#endif
}

uint64_t ArenaMapping::GenerationAt(uint64_t offset) const {
  return __atomic_load_n(GenerationWord(base_, layout_, offset), __ATOMIC_RELAXED);
}

bool ArenaMapping::CopyRows(absl::Span<const PageRef> pages, uint32_t page_tokens, size_t row_bytes,
                            absl::Span<const uint32_t> tokens, RowKind kind, uint8_t* k_out,
                            uint8_t* v_out) const {
  const bool want_k = kind != RowKind::kV;
  const bool want_v = kind != RowKind::kK;
  const size_t slot_bytes = 2 * row_bytes;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const uint32_t t = tokens[i];
    const uint8_t* slot = base_ + pages[t / page_tokens].offset + (t % page_tokens) * slot_bytes;
    if (want_k) std::memcpy(k_out + i * row_bytes, slot, row_bytes);
    if (want_v) std::memcpy(v_out + i * row_bytes, slot + row_bytes, row_bytes);
  }
  // Every copy above happens before the generation reads below (the seqlock's read side).
  // ThreadSanitizer does not model fences (GCC refuses them under -fsanitize=thread); its builds
  // run on x86, where loads are not reordered with older loads, so a compiler barrier suffices.
#if defined(__SANITIZE_THREAD__)
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
#else
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
#endif
  size_t last = SIZE_MAX;
  for (const uint32_t t : tokens) {
    const size_t page = t / page_tokens;
    if (page == last) continue;
    last = page;
    if (GenerationAt(pages[page].offset) != pages[page].generation) return false;
  }
  return true;
}

}  // namespace kvsparse::kvstore
