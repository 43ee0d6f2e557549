// The store's arena in a file that other processes of the host map (the shared-arena deployment:
// a worker container reads a store container's rows in place, no Gather RPC and no copy through
// the store's CPU).
//
// File layout (the host's byte order; only processes of one host share it):
//   [0, 4096)                 ArenaFileHeader
//   [4096, data_offset)       one 64-bit generation per granule (the store's page size) of the
//                             data region, padded to 4 KiB
//   [data_offset, file end)   the slabs the store carves into pages (`bytes` of them)
//
// Reuse detection. A page's generation (the one of the granule it starts) is
// incremented whenever the store frees the page, before the page can be handed to another
// sequence and written again. A reader gets each page's address and generation with the page
// table (Store::PageTable), copies the rows it wants, and then reads the generations of the pages
// it touched: if one changed, the page was freed (its sequence dropped or evicted) and what it
// copied may belong to someone else; it must throw the rows away. This is a seqlock whose writer
// is the page's next owner. Rows of a live page never change: appends write only slots past the
// layer's length, which readers never ask for.
//
// Restarts. The store puts a new file at the path each time it starts (made under another name
// and renamed over the old one), with a new random arena id in the header, so a reader still
// mapping the old file keeps reading the old (unchanged) pages, and sees from the page table's
// arena id, or from the path naming another file (ArenaMapping::IsCurrent), that it must map the
// path again. Until it does, the old file's memory stays allocated: a memory-backed volume must
// have room for two arenas.
#ifndef KVSPARSE_KVSTORE_SHARED_ARENA_H_
#define KVSPARSE_KVSTORE_SHARED_ARENA_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvstore/memory_resource.h"
#include "kvstore/types.h"

namespace kvsparse::kvstore {

// The writer's side, implemented by the file resource (MemoryResource::shared_arena()).
// Thread-safe.
class SharedArena {
 public:
  virtual ~SharedArena() = default;
  // Random per file; a reader compares it with the one of its mapping.
  virtual uint64_t arena_id() const = 0;
  // Bytes per generation; every page must start on one (a page size a multiple of it).
  virtual uint64_t granule() const = 0;
  // Byte offset of p in the file. REQUIRES: p inside a slab of this resource.
  virtual uint64_t Offset(const void* p) const = 0;
  // The generation of the page starting at `page`.
  virtual uint64_t Generation(const void* page) const = 0;
  // Called as the page at `page` is freed, before anyone may write it again.
  virtual void Retire(const void* page) = 0;
  // The whole file as this process maps it (header, generations, data), and where the data
  // starts in it: what a data plane exports (kvstore/ucx_plane.h).
  virtual void* mapping() const = 0;
  virtual uint64_t mapping_bytes() const = 0;
  virtual uint64_t data_offset() const = 0;
};

// Where things are in an arena file (the layout above), for every reader and writer of it.
struct ArenaLayout {
  uint64_t file_bytes = 0;
  uint64_t data_offset = 0;  // where the data region starts
  uint64_t granule = 0;      // bytes per generation
  // The file offset of the generation of the page starting at page_offset (in the data region).
  uint64_t GenerationOffset(uint64_t page_offset) const {
    return kArenaHeaderBytes + (page_offset - data_offset) / granule * sizeof(uint64_t);
  }
  // Whether a page of page_bytes at page_offset lies inside the data region, granule-aligned.
  bool HoldsPage(uint64_t page_offset, uint64_t page_bytes) const {
    return page_offset >= data_offset && (page_offset - data_offset) % granule == 0 &&
           page_bytes <= file_bytes && page_offset <= file_bytes - page_bytes;
  }
  static constexpr uint64_t kArenaHeaderBytes = 4096;
};

// Where one page of a lane sits in the arena file, and its generation when the table was made.
struct PageRef {
  uint64_t offset = 0;
  uint64_t generation = 0;
};

// Rows of one (layer, kv head) lane to read: the lane's pages (page i holds tokens
// [i * page_tokens, (i + 1) * page_tokens); a token's slot is its K row then its V row) and the
// tokens, into k_out / v_out ([tokens, row_bytes] each, null when not asked for).
struct LaneRead {
  absl::Span<const PageRef> pages;
  absl::Span<const uint32_t> tokens;
  uint8_t* k_out = nullptr;
  uint8_t* v_out = nullptr;
};

// A reader of an arena's pages from outside the store: a mapping of its file on the same host
// (ArenaMapping) or one-sided reads across the network (kvstore/ucx_plane.h). Thread-safe.
class ArenaReader {
 public:
  virtual ~ArenaReader() = default;
  virtual uint64_t arena_id() const = 0;
  // Whether a page of page_bytes at `offset` lies inside the data region, granule-aligned.
  virtual bool HoldsPage(uint64_t offset, uint64_t page_bytes) const = 0;
  // Reads the rows of every lane, then checks the generations of the pages it read. true: the
  // rows are the ones asked for; false: a page was freed meanwhile (throw the rows away); an
  // error: the reader failed (UNAVAILABLE: the store went away). REQUIRES: every token <
  // pages.size() * page_tokens and every page passed HoldsPage.
  virtual absl::StatusOr<bool> Read(absl::Span<const LaneRead> lanes, uint32_t page_tokens,
                                    size_t row_bytes, RowKind kind, absl::Time deadline) const = 0;
  // Makes later reads of these pages cheaper (a mapping: prefault them); best effort.
  virtual void Prefault(absl::Span<const PageRef> pages, uint64_t page_bytes) const {}
  // Whether it still reads the store's current arena (false once the store made a new one).
  virtual bool IsCurrent() const { return true; }
  // What it is, for logs ("mapping of PATH", "ucx").
  virtual std::string name() const = 0;
};

// A reader's read-only mapping of an arena file. Thread-safe (immutable after Open).
class ArenaMapping final : public ArenaReader {
 public:
  // NOT_FOUND if the path does not exist (yet); FAILED_PRECONDITION if it is not an arena file of
  // this version; INVALID_ARGUMENT if it cannot be opened or mapped (naming the path and errno).
  static absl::StatusOr<std::unique_ptr<ArenaMapping>> Open(const std::string& path);
  ~ArenaMapping();
  ArenaMapping(const ArenaMapping&) = delete;
  ArenaMapping& operator=(const ArenaMapping&) = delete;

  uint64_t arena_id() const override { return arena_id_; }
  const std::string& path() const { return path_; }
  const ArenaLayout& layout() const { return layout_; }
  std::string name() const override;
  // Whether the path still names the file this maps (false once a restarted store has put a new
  // file there: drop this mapping, so the old file's memory is freed, and open the path again).
  bool IsCurrent() const override;
  bool HoldsPage(uint64_t offset, uint64_t page_bytes) const override;

  // Maps these pages into this process now (MADV_POPULATE_READ), so that reads of their rows do
  // not each take a page fault on first touch; best effort (older kernels: nothing happens).
  // REQUIRES: every page passed HoldsPage.
  void Prefault(absl::Span<const PageRef> pages, uint64_t page_bytes) const override;

  // CopyRows of every lane.
  absl::StatusOr<bool> Read(absl::Span<const LaneRead> lanes, uint32_t page_tokens,
                            size_t row_bytes, RowKind kind, absl::Time deadline) const override;

  // Copies the rows of `tokens` of one lane (see LaneRead) into k_out / v_out. Returns false
  // when a page it read was freed since the table was made: the rows written are then not to be
  // used. REQUIRES: every token < pages.size() * page_tokens, every page passed
  // HoldsPage.
  bool CopyRows(absl::Span<const PageRef> pages, uint32_t page_tokens, size_t row_bytes,
                absl::Span<const uint32_t> tokens, RowKind kind, uint8_t* k_out,
                uint8_t* v_out) const;

 private:
  ArenaMapping(std::string path, const uint8_t* base, ArenaLayout layout, uint64_t arena_id,
               uint64_t device, uint64_t inode);
  uint64_t GenerationAt(uint64_t offset) const;

  const std::string path_;
  const uint8_t* const base_;
  const ArenaLayout layout_;
  const uint64_t arena_id_;
  const uint64_t device_;
  const uint64_t inode_;
};

// The store's arena in a file (--arena_file): `bytes` of data (plus a 4 KiB header and 8 bytes of
// generation per granule: 0.2% more at 4 KiB, 0.01% at 64 KiB), the path made anew (see
// Restarts), mapped shared, carved into slabs in order (a slab's space is reused only once every
// slab is back). granule: the store's page size (a multiple of 4096; every slab and page starts
// on one). Put it on a memory-backed filesystem (tmpfs, a Kubernetes emptyDir of medium Memory)
// so another process can map the same pages. INVALID_ARGUMENT when the file cannot be created,
// sized or mapped (naming the path), or for a granule that is not a multiple of 4096.
absl::StatusOr<std::unique_ptr<MemoryResource>> NewFileMemoryResource(const std::string& path,
                                                                      size_t bytes,
                                                                      size_t granule = 4096);

}  // namespace kvsparse::kvstore

#endif  // KVSPARSE_KVSTORE_SHARED_ARENA_H_
