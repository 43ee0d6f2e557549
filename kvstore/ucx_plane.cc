#include "kvstore/ucx_plane.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

#ifdef KVSPARSE_WITH_UCX
#include <poll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <thread>

#include "absl/functional/function_ref.h"
#include "kvstore/worker_pool.h"
#endif

namespace kvsparse::kvstore {

#ifndef KVSPARSE_WITH_UCX

bool UcxAvailable() { return false; }

absl::StatusOr<std::unique_ptr<UcxExport>> UcxExport::Create(SharedArena*, const std::string&,
                                                             int) {
  return absl::UnavailableError("this build has no UCX (install libucx-dev and rebuild)");
}

absl::StatusOr<std::unique_ptr<UcxReader>> UcxReader::Create(const std::string&, UcxReadMode) {
  return absl::UnavailableError("this build has no UCX (install libucx-dev and rebuild)");
}

#else  // KVSPARSE_WITH_UCX

bool UcxAvailable() { return true; }

namespace {

absl::Status UcxError(absl::string_view what, ucs_status_t s) {
  return absl::UnavailableError(absl::StrCat("ucx: ", what, ": ", ucs_status_string(s)));
}

// A context with the RMA feature (and wakeup, for a progress thread that sleeps when idle).
absl::StatusOr<ucp_context_h> NewContext(const std::string& transports) {
  ucp_config_t* config = nullptr;
  if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK) {
    return UcxError("config", s);
  }
  if (!transports.empty()) {
    if (ucs_status_t s = ucp_config_modify(config, "TLS", transports.c_str()); s != UCS_OK) {
      ucp_config_release(config);
      return absl::InvalidArgumentError(
          absl::StrCat("ucx transports '", transports, "': ", ucs_status_string(s)));
    }
  }
  // Active messages of any size arrive whole in their handler (no rendezvous to drive).
  if (ucs_status_t s = ucp_config_modify(config, "RNDV_THRESH", "inf"); s != UCS_OK) {
    ucp_config_release(config);
    return UcxError("config RNDV_THRESH", s);
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  ucp_context_h context = nullptr;
  ucs_status_t s = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (s != UCS_OK) return UcxError("init", s);
  return context;
}

absl::StatusOr<ucp_worker_h> NewWorker(ucp_context_h context, ucs_thread_mode_t mode) {
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = mode;
  ucp_worker_h worker = nullptr;
  if (ucs_status_t s = ucp_worker_create(context, &wp, &worker); s != UCS_OK) {
    return UcxError("worker", s);
  }
  return worker;
}

// The batched gather (UcxReadMode::kGather): one active message per read names every row and
// page; the store's progress thread copies the rows and the pages' generations into one reply.
constexpr uint16_t kGatherAm = 11;
constexpr uint16_t kReplyAm = 12;
// Replies from this size on travel by rendezvous (see OnReply), smaller ones eagerly.
constexpr size_t kRendezvousBytes = 256 << 10;
struct GatherHeader {
  uint64_t secret;  // UcxArenaAddress::secret
  uint64_t id;
  uint32_t rows;  // slot offsets (uint64 each) in the payload, then `pages` page offsets
  uint32_t pages;
  uint32_t row_bytes;
  uint32_t kind;  // RowKind
};
struct ReplyHeader {
  uint64_t id;
  uint32_t ok;  // 0: the store refused an offset outside its arena
  uint32_t pad;
};

absl::Status SetAmHandler(ucp_worker_h worker, uint16_t id, ucp_am_recv_callback_t cb, void* arg) {
  ucp_am_handler_param_t hp{};
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  hp.id = id;
  hp.cb = cb;
  hp.arg = arg;
  hp.flags = UCP_AM_FLAG_WHOLE_MSG;
  if (ucs_status_t s = ucp_worker_set_am_recv_handler(worker, &hp); s != UCS_OK) {
    return UcxError("active message handler", s);
  }
  return absl::OkStatus();
}

// The pages a read touches (once per run of one page in a lane) with the generations the reader
// expects of them.
std::vector<PageRef> PagesRead(absl::Span<const LaneRead> lanes, uint32_t page_tokens) {
  std::vector<PageRef> pages;
  for (const LaneRead& l : lanes) {
    size_t last = SIZE_MAX;
    for (const uint32_t t : l.tokens) {
      const size_t page = t / page_tokens;
      if (page == last) continue;
      last = page;
      pages.push_back(l.pages[page]);
    }
  }
  return pages;
}

// A UCX context and one worker on it, released in reverse order. UCS_THREAD_MODE_SINGLE: one
// thread uses the worker; UCS_THREAD_MODE_SERIALIZED: several, one at a time (the owner's lock).
struct UcxWorker {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;

  absl::Status Init(const std::string& transports, ucs_thread_mode_t mode) {
    absl::StatusOr<ucp_context_h> c = NewContext(transports);
    if (!c.ok()) return c.status();
    context = *c;
    absl::StatusOr<ucp_worker_h> w = NewWorker(context, mode);
    if (!w.ok()) return w.status();
    worker = *w;
    return absl::OkStatus();
  }
  ~UcxWorker() {
    if (worker != nullptr) ucp_worker_destroy(worker);
    if (context != nullptr) ucp_cleanup(context);
  }
};

// Runs a copy of rows [0, n) in parts on the calling thread and the pool's helpers.
void CopyInParts(WorkerPool& pool, uint64_t n, absl::FunctionRef<void(uint64_t, uint64_t)> copy) {
  constexpr uint64_t kMinPart = 256;  // rows: below this a part costs more than it saves
  const uint64_t parts =
      std::min<uint64_t>(pool.helpers() + 1, std::max<uint64_t>(1, n / kMinPart));
  const uint64_t per = (n + parts - 1) / parts;
  pool.Run(parts, [&](size_t p) { copy(p * per, std::min(n, (p + 1) * per)); });
}

class UcxExportImpl final : public UcxExport {
 public:
  explicit UcxExportImpl(int copy_threads) : copiers_(copy_threads) {}
  ~UcxExportImpl() override {
    if (progress_.joinable()) {
      const uint64_t one = 1;
      (void)!write(stop_fd_, &one, sizeof(one));
      progress_.join();
    }
    if (stop_fd_ >= 0) close(stop_fd_);
    if (memh_ != nullptr) ucp_mem_unmap(ucx_.context, memh_);
  }

  absl::Status Init(SharedArena* arena, const std::string& transports) {
    // Only the progress thread uses the worker after Init.
    if (absl::Status s = ucx_.Init(transports, UCS_THREAD_MODE_SINGLE); !s.ok()) return s;
    ucp_context_h context = ucx_.context;
    ucp_worker_h worker = ucx_.worker;
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = arena->mapping();
    mp.length = arena->mapping_bytes();
    if (ucs_status_t s = ucp_mem_map(context, &mp, &memh_); s != UCS_OK) {
      return UcxError("register the arena", s);
    }
    void* rkey = nullptr;
    size_t rkey_size = 0;
    if (ucs_status_t s = ucp_rkey_pack(context, memh_, &rkey, &rkey_size); s != UCS_OK) {
      return UcxError("pack the remote key", s);
    }
    address_.rkey.assign(static_cast<const char*>(rkey), rkey_size);
    ucp_rkey_buffer_release(rkey);
    ucp_address_t* wa = nullptr;
    size_t wa_size = 0;
    if (ucs_status_t s = ucp_worker_get_address(worker, &wa, &wa_size); s != UCS_OK) {
      return UcxError("worker address", s);
    }
    address_.worker_address.assign(reinterpret_cast<const char*>(wa), wa_size);
    ucp_worker_release_address(worker, wa);
    arena_ = arena;
    if (absl::Status s = SetAmHandler(worker, kGatherAm, &UcxExportImpl::OnGather, this); !s.ok()) {
      return s;
    }
    address_.arena_id = arena->arena_id();
    address_.base_address = reinterpret_cast<uint64_t>(arena->mapping());
    address_.arena_bytes = arena->mapping_bytes();
    address_.data_offset = arena->data_offset();
    address_.granule = arena->granule();
    std::random_device rd;
    address_.secret = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    int efd = -1;
    if (ucs_status_t s = ucp_worker_get_efd(worker, &efd); s != UCS_OK) {
      return UcxError("worker event fd", s);
    }
    stop_fd_ = eventfd(0, EFD_CLOEXEC);
    if (stop_fd_ < 0) return absl::UnavailableError("eventfd failed");
    progress_ = std::thread([this, efd] { Progress(efd); });
    return absl::OkStatus();
  }

  const UcxArenaAddress& address() const override { return address_; }

 private:
  // A reader's batched gather: copies the rows, then (after a fence: the seqlock's read side) the
  // generations of the pages, into one reply. Runs on the progress thread. Offsets outside the
  // arena are refused (a reader is not trusted with the store's memory).
  static ucs_status_t OnGather(void* arg, const void* header, size_t header_length, void* data,
                               size_t length, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxExportImpl*>(arg);
    if (header_length != sizeof(GatherHeader) ||
        !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
      return UCS_OK;  // not ours to answer
    }
    GatherHeader h;
    std::memcpy(&h, header, sizeof(h));
    if (h.secret != self->address_.secret) return UCS_OK;  // not from a caller we answered
    ReplyHeader r{h.id, 0, 0};
    const bool want_k = h.kind != static_cast<uint32_t>(RowKind::kV);
    const bool want_v = h.kind != static_cast<uint32_t>(RowKind::kK);
    const uint64_t n = h.rows, row = h.row_bytes;
    const SharedArena& a = *self->arena_;
    const auto* base = static_cast<const uint8_t*>(a.mapping());
    const uint64_t end = a.mapping_bytes();
    const ArenaLayout layout{end, a.data_offset(), a.granule()};
    // The reply's header and its rows in one new[]'d block (not zeroed: every byte is written
    // below), alive until the send completes: UCX 1.13 reads the header of a send it could not
    // start at once (a rendezvous reply queued behind another) later, when it goes out.
    uint8_t* block = nullptr;
    uint8_t* reply = nullptr;
    size_t reply_bytes = 0;
    const auto reserve = [&](size_t bytes) {
      reply_bytes = bytes;
      block = new uint8_t[sizeof(ReplyHeader) + bytes];
      reply = block + sizeof(ReplyHeader);
    };
    if (length == (n + h.pages) * sizeof(uint64_t) && row > 0 && 2 * row <= end) {
      const auto* offsets = static_cast<const uint64_t*>(data);
      bool inside = true;
      for (uint64_t i = 0; i < n && inside; ++i) {
        inside = offsets[i] >= a.data_offset() && offsets[i] <= end - 2 * row;
      }
      for (uint64_t i = n; i < n + h.pages && inside; ++i) {
        inside = layout.HoldsPage(offsets[i], a.granule());
      }
      if (inside) {
        const uint64_t kinds = (want_k ? 1 : 0) + (want_v ? 1 : 0);
        reserve(n * kinds * row + h.pages * sizeof(uint64_t));
        uint8_t* k = reply;
        uint8_t* v = reply + (want_k ? n * row : 0);
        // Rows are scattered over the arena (a sparse method's selection): each is a cache and
        // TLB miss, so the rows a few iterations ahead are fetched while this one is copied,
        // and a large gather is copied in parts on several threads.
        CopyInParts(self->copiers_, n, [&](uint64_t begin, uint64_t end) {
          constexpr uint64_t kAhead = 8;
          for (uint64_t i = begin; i < end; ++i) {
            if (i + kAhead < end) {
              const uint8_t* next = base + offsets[i + kAhead] + (want_k ? 0 : row);
              for (uint64_t b = 0; b < (want_k && want_v ? 2 : 1) * row; b += 64) {
                __builtin_prefetch(next + b);
              }
            }
            const uint8_t* slot = base + offsets[i];
            if (want_k) std::memcpy(k + i * row, slot, row);
            if (want_v) std::memcpy(v + i * row, slot + row, row);
          }
        });
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        auto* gens = reinterpret_cast<uint64_t*>(reply + n * kinds * row);
        for (uint64_t i = 0; i < h.pages; ++i) {
          gens[i] = __atomic_load_n(
              reinterpret_cast<const uint64_t*>(base + layout.GenerationOffset(offsets[n + i])),
              __ATOMIC_RELAXED);
        }
        r.ok = 1;
      }
    }
    if (block == nullptr) reserve(0);
    std::memcpy(block, &r, sizeof(r));
    ucp_request_param_t sp{};
    sp.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    // A large reply by rendezvous: the reader has UCX receive it straight into its buffers.
    sp.flags = reply_bytes >= kRendezvousBytes ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER;
    sp.cb.send = [](void* request, ucs_status_t, void* user) {
      delete[] static_cast<uint8_t*>(user);
      ucp_request_free(request);
    };
    sp.user_data = block;
    ucs_status_ptr_t sent = ucp_am_send_nbx(param->reply_ep, kReplyAm, block, sizeof(ReplyHeader),
                                            reply, reply_bytes, &sp);
    if (!UCS_PTR_IS_PTR(sent)) delete[] block;  // done at once, or failed: the callback won't run
    return UCS_OK;
  }

  // Answers the transports that need the target (TCP's emulated gets, connection set-up); sleeps
  // on the worker's event fd when there is nothing to do.
  void Progress(int efd) {
    ucp_worker_h worker = ucx_.worker;
    for (;;) {
      while (ucp_worker_progress(worker) != 0) {
      }
      const ucs_status_t armed = ucp_worker_arm(worker);
      if (armed == UCS_ERR_BUSY) continue;
      pollfd fds[2] = {{efd, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
      poll(fds, 2, 100);
      if (fds[1].revents & POLLIN) return;
    }
  }

  UcxWorker ucx_;
  WorkerPool copiers_;
  SharedArena* arena_ = nullptr;
  ucp_mem_h memh_ = nullptr;
  int stop_fd_ = -1;
  std::thread progress_;
  UcxArenaAddress address_;
};

class UcxReaderImpl;

// One store's arena reached through an endpoint of the reader's worker.
class UcxArena final : public ArenaReader {
 public:
  UcxArena(std::shared_ptr<UcxReaderImpl> reader, ucp_ep_h ep, ucp_rkey_h rkey,
           UcxArenaAddress address, std::shared_ptr<std::atomic<bool>> failed)
      : reader_(std::move(reader)),
        ep_(ep),
        rkey_(rkey),
        a_(std::move(address)),
        failed_(std::move(failed)) {}
  ~UcxArena() override;

  uint64_t arena_id() const override { return a_.arena_id; }
  std::string name() const override { return "ucx"; }
  ArenaLayout layout() const { return {a_.arena_bytes, a_.data_offset, a_.granule}; }
  bool HoldsPage(uint64_t offset, uint64_t page_bytes) const override {
    return layout().HoldsPage(offset, page_bytes);
  }
  bool IsCurrent() const override { return !failed_->load(std::memory_order_relaxed); }
  absl::StatusOr<bool> Read(absl::Span<const LaneRead> lanes, uint32_t page_tokens,
                            size_t row_bytes, RowKind kind, absl::Time deadline) const override;

 private:
  friend class UcxReaderImpl;
  std::shared_ptr<UcxReaderImpl> reader_;
  ucp_ep_h ep_;
  ucp_rkey_h rkey_;
  const UcxArenaAddress a_;
  // Set by the endpoint's error handler (UCX, during progress) or a failed operation.
  const std::shared_ptr<std::atomic<bool>> failed_;
};

class UcxReaderImpl final : public UcxReader, public std::enable_shared_from_this<UcxReaderImpl> {
 public:
  absl::Status Init(const std::string& transports, UcxReadMode mode) {
    // The callers' threads take turns on the worker (mu_).
    if (absl::Status s = ucx_.Init(transports, UCS_THREAD_MODE_SERIALIZED); !s.ok()) return s;
    worker_ = ucx_.worker;
    mode_ = mode;
    return SetAmHandler(worker_, kReplyAm, &UcxReaderImpl::OnReply, this);
  }

  absl::StatusOr<std::shared_ptr<const ArenaReader>> Connect(const UcxArenaAddress& a,
                                                             absl::Duration timeout) override {
    if (a.worker_address.empty() || a.rkey.empty() || a.granule == 0 ||
        a.data_offset > a.arena_bytes) {
      return absl::InvalidArgumentError("ucx: incomplete data plane address");
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto failed = std::make_shared<std::atomic<bool>>(false);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(a.worker_address.data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    // The store went away: the arena's reads fail from now on and the source connects anew.
    ep.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t) {
      static_cast<std::atomic<bool>*>(arg)->store(true);
    };
    ep.err_handler.arg = failed.get();
    ucp_ep_h ep_h = nullptr;
    ucs_status_t created = ucp_ep_create(worker_, &ep, &ep_h);
    if (created == UCS_ERR_UNREACHABLE) {
      // Shared-memory transports of UCX 1.13 have no peer failure detection: connect without it
      // (a store that goes away then shows as a read that times out, not a prompt error).
      ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
      created = ucp_ep_create(worker_, &ep, &ep_h);
    }
    if (created != UCS_OK) return UcxError("connect to the store", created);
    ucp_rkey_h rkey = nullptr;
    if (ucs_status_t s = ucp_ep_rkey_unpack(ep_h, a.rkey.data(), &rkey); s != UCS_OK) {
      CloseLocked(ep_h);
      return UcxError("unpack the store's remote key", s);
    }
    // Wait until the endpoint is wired up (a flush completes once it is).
    if (absl::Status s = FlushLocked(ep_h, absl::Now() + timeout); !s.ok()) {
      ucp_rkey_destroy(rkey);
      CloseLocked(ep_h);
      return s;
    }
    return std::shared_ptr<const ArenaReader>(
        std::make_shared<UcxArena>(shared_from_this(), ep_h, rkey, a, std::move(failed)));
  }

  // Gets every range, waits, then gets the generations and waits again (the second wave is
  // issued only once the rows are in, so a changed generation is seen).
  absl::StatusOr<bool> Read(const UcxArena& arena, absl::Span<const LaneRead> lanes,
                            uint32_t page_tokens, size_t row_bytes, RowKind kind,
                            absl::Time deadline) {
    if (mode_ == UcxReadMode::kGather) {
      return ReadGather(arena, lanes, page_tokens, row_bytes, kind, deadline);
    }
    const bool want_k = kind != RowKind::kV;
    const bool want_v = kind != RowKind::kK;
    const UcxArenaAddress& a = arena.a_;
    std::lock_guard<std::mutex> lock(mu_);
    for (const LaneRead& l : lanes) {
      if ((want_k && l.k_out == nullptr) || (want_v && l.v_out == nullptr)) {
        return absl::InvalidArgumentError("ucx read: no buffer for the rows asked for");
      }
      for (size_t i = 0; i < l.tokens.size(); ++i) {
        const uint32_t t = l.tokens[i];
        const uint64_t slot = a.base_address + l.pages[t / page_tokens].offset +
                              static_cast<uint64_t>(t % page_tokens) * 2 * row_bytes;
        if (want_k) {
          if (absl::Status s = GetLocked(arena, l.k_out + i * row_bytes, row_bytes, slot);
              !s.ok()) {
            return s;
          }
        }
        if (want_v) {
          if (absl::Status s =
                  GetLocked(arena, l.v_out + i * row_bytes, row_bytes, slot + row_bytes);
              !s.ok()) {
            return s;
          }
        }
      }
    }
    if (absl::Status s = FlushLocked(arena.ep_, deadline); !s.ok()) {
      arena.failed_->store(true);
      return s;
    }
    // Then the generations of the pages read.
    const std::vector<PageRef> pages = PagesRead(lanes, page_tokens);
    std::vector<uint64_t> gens(pages.size());
    for (size_t i = 0; i < pages.size(); ++i) {
      const uint64_t word = a.base_address + arena.layout().GenerationOffset(pages[i].offset);
      if (absl::Status s = GetLocked(arena, &gens[i], sizeof(uint64_t), word); !s.ok()) return s;
    }
    if (absl::Status s = FlushLocked(arena.ep_, deadline); !s.ok()) {
      arena.failed_->store(true);
      return s;
    }
    for (size_t i = 0; i < pages.size(); ++i) {
      if (gens[i] != pages[i].generation) return false;
    }
    return true;
  }

  void Close(ucp_ep_h ep, ucp_rkey_h rkey, bool failed) {
    std::lock_guard<std::mutex> lock(mu_);
    ucp_rkey_destroy(rkey);
    CloseLocked(ep, /*force=*/failed);
  }

 private:
  // A gather waiting for its reply: where the rows go, and the generations that came back.
  struct Pending {
    std::vector<uint64_t> gens;  // sized to the pages asked for
    // Where the reply's bytes go, in its order: the K rows of every lane, the V rows of every
    // lane, the generations.
    std::vector<ucp_dt_iov_t> iov;
    size_t reply_bytes = 0;     // the sum of iov's lengths
    void* receiving = nullptr;  // a rendezvous reply's receive, while in flight
    bool done = false;
    bool ok = false;  // the store answered, with exactly the bytes asked for
  };

  // The store's reply to a gather: its rows go straight to the waiting read's buffers (none
  // waiting: the read timed out, the reply is dropped).
  static ucs_status_t OnReply(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxReaderImpl*>(arg);
    if (header_length != sizeof(ReplyHeader)) return UCS_OK;
    ReplyHeader r;
    std::memcpy(&r, header, sizeof(r));
    auto it = self->pending_.find(r.id);
    if (it == self->pending_.end()) return UCS_OK;
    Pending& p = *it->second;
    if (r.ok == 0 || length != p.reply_bytes) {
      p.done = true;
      return UCS_OK;  // (a rendezvous reply not received is dropped by UCX)
    }
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
      // A large reply: UCX moves it straight into the read's buffers, with no copy of the whole
      // message on this side.
      ucp_request_param_t rp{};
      rp.op_attr_mask =
          UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
      rp.datatype = UCP_DATATYPE_IOV;
      rp.user_data = &p;
      rp.cb.recv_am = [](void* request, ucs_status_t status, size_t, void* user) {
        auto* q = static_cast<Pending*>(user);
        q->ok = status == UCS_OK;
        q->done = true;
        q->receiving = nullptr;
        ucp_request_free(request);
      };
      ucs_status_ptr_t got =
          ucp_am_recv_data_nbx(self->worker_, data, p.iov.data(), p.iov.size(), &rp);
      if (UCS_PTR_IS_ERR(got)) {
        p.done = true;
      } else if (got == nullptr) {
        p.ok = p.done = true;
      } else {
        p.receiving = got;
      }
      return UCS_OK;
    }
    p.done = true;
    const auto* from = static_cast<const uint8_t*>(data);
    for (const ucp_dt_iov_t& to : p.iov) {
      std::memcpy(to.buffer, from, to.length);
      from += to.length;
    }
    p.ok = true;
    return UCS_OK;
  }

  // One active message names every row and page; the store answers with the rows and the
  // pages' generations in one reply (UcxReadMode::kGather).
  absl::StatusOr<bool> ReadGather(const UcxArena& arena, absl::Span<const LaneRead> lanes,
                                  uint32_t page_tokens, size_t row_bytes, RowKind kind,
                                  absl::Time deadline) {
    const bool want_k = kind != RowKind::kV;
    const bool want_v = kind != RowKind::kK;
    std::vector<uint64_t> payload;  // slot offsets, then page offsets
    for (const LaneRead& l : lanes) {
      if ((want_k && l.k_out == nullptr) || (want_v && l.v_out == nullptr)) {
        return absl::InvalidArgumentError("ucx read: no buffer for the rows asked for");
      }
      for (const uint32_t t : l.tokens) {
        payload.push_back(l.pages[t / page_tokens].offset +
                          static_cast<uint64_t>(t % page_tokens) * 2 * row_bytes);
      }
    }
    const uint64_t rows = payload.size();
    const std::vector<PageRef> pages = PagesRead(lanes, page_tokens);
    for (const PageRef& p : pages) payload.push_back(p.offset);
    std::lock_guard<std::mutex> lock(mu_);
    GatherHeader h{arena.a_.secret,
                   ++next_id_,
                   static_cast<uint32_t>(rows),
                   static_cast<uint32_t>(pages.size()),
                   static_cast<uint32_t>(row_bytes),
                   static_cast<uint32_t>(kind)};
    Pending pending;
    pending.gens.resize(pages.size());
    for (const bool k : {true, false}) {
      if (!(k ? want_k : want_v)) continue;
      for (const LaneRead& l : lanes) {
        if (l.tokens.empty()) continue;
        pending.iov.push_back({k ? l.k_out : l.v_out, l.tokens.size() * row_bytes});
      }
    }
    if (!pending.gens.empty()) {
      pending.iov.push_back({pending.gens.data(), pending.gens.size() * sizeof(uint64_t)});
    }
    for (const ucp_dt_iov_t& to : pending.iov) pending.reply_bytes += to.length;
    pending_[h.id] = &pending;
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags =
        UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;  // the store's handler wants it whole
    ucs_status_ptr_t sent = ucp_am_send_nbx(arena.ep_, kGatherAm, &h, sizeof(h), payload.data(),
                                            payload.size() * sizeof(uint64_t), &rp);
    if (UCS_PTR_IS_ERR(sent)) {
      pending_.erase(h.id);
      arena.failed_->store(true);
      return UcxError("send a gather", UCS_PTR_STATUS(sent));
    }
    int spins = 0;
    auto sending = [&] {
      return UCS_PTR_IS_PTR(sent) && ucp_request_check_status(sent) == UCS_INPROGRESS;
    };
    // One read in flight per reader: its thread holds the worker until the reply is in. (Reads
    // of several threads interleaved on the one worker and its one connection were slower, not
    // faster: 374.5 against 308.8 ms a step in docs/PERF.md's batch of 4, the connection already
    // moving what TCP moves; a sharded worker reads its shards side by side, a reader each.)
    while (!pending.done || sending()) {
      if (ucp_worker_progress(worker_) == 0 && ++spins % 1024 == 0 &&
          (absl::Now() > deadline || arena.failed_->load())) {
        pending_.erase(h.id);
        if (UCS_PTR_IS_PTR(sent)) {
          ucp_request_cancel(worker_, sent);
          ucp_request_free(sent);
        }
        if (pending.receiving != nullptr) {
          // The reply is landing in the caller's buffers: the buffers go back to the caller only
          // once the receive has ended. (UCX 1.13 may not cancel it; it ends when the rows are in
          // or when the connection fails, which UCX's peer failure detection bounds.)
          ucp_request_cancel(worker_, pending.receiving);
          while (pending.receiving != nullptr) ucp_worker_progress(worker_);
        }
        arena.failed_->store(true);
        return absl::DeadlineExceededError("ucx: the store did not answer the gather in time");
      }
    }
    pending_.erase(h.id);
    if (UCS_PTR_IS_PTR(sent)) ucp_request_free(sent);
    if (!pending.ok) return absl::DataLossError("ucx: the store refused or cut short a gather");
    for (size_t i = 0; i < pages.size(); ++i) {
      if (pending.gens[i] != pages[i].generation) return false;
    }
    return true;
  }

  absl::Status GetLocked(const UcxArena& arena, void* dst, size_t bytes, uint64_t remote) {
    ucp_request_param_t rp{};
    ucs_status_ptr_t r = ucp_get_nbx(arena.ep_, dst, bytes, remote, arena.rkey_, &rp);
    if (UCS_PTR_IS_ERR(r)) {
      arena.failed_->store(true);
      return UcxError("get", UCS_PTR_STATUS(r));
    }
    if (r != nullptr) ucp_request_free(r);  // completion is waited for by the flush
    return absl::OkStatus();
  }

  absl::Status FlushLocked(ucp_ep_h ep, absl::Time deadline) {
    ucp_request_param_t rp{};
    ucs_status_ptr_t r = ucp_ep_flush_nbx(ep, &rp);
    if (UCS_PTR_IS_ERR(r)) return UcxError("flush", UCS_PTR_STATUS(r));
    if (r == nullptr) return absl::OkStatus();
    ucs_status_t s;
    int spins = 0;
    while ((s = ucp_request_check_status(r)) == UCS_INPROGRESS) {
      if (ucp_worker_progress(worker_) == 0 && ++spins % 1024 == 0 && absl::Now() > deadline) {
        ucp_request_cancel(worker_, r);
        ucp_request_free(r);
        return absl::DeadlineExceededError("ucx: the store did not answer in time");
      }
    }
    ucp_request_free(r);
    if (s != UCS_OK) return UcxError("read from the store", s);
    return absl::OkStatus();
  }

  // Closes gracefully (the store's side learns of it and lets its endpoint go), or by force
  // when the store does not answer within a second (it is gone).
  void CloseLocked(ucp_ep_h ep, bool force = false) {
    ucp_request_param_t rp{};
    if (force) {
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
    }
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &rp);
    if (r == nullptr || UCS_PTR_IS_ERR(r)) return;
    const absl::Time deadline = absl::Now() + absl::Seconds(1);
    int spins = 0;
    while (ucp_request_check_status(r) == UCS_INPROGRESS) {
      if (ucp_worker_progress(worker_) == 0 && ++spins % 1024 == 0 && absl::Now() > deadline) {
        // Leave the request to UCX (released when it completes); the endpoint is gone to us.
        ucp_request_free(r);
        return;
      }
    }
    ucp_request_free(r);
  }

  UcxWorker ucx_;
  UcxReadMode mode_ = UcxReadMode::kGather;
  uint64_t next_id_ = 0;                             // under mu_
  absl::flat_hash_map<uint64_t, Pending*> pending_;  // under mu_ (and in OnReply)
  ucp_worker_h worker_ = nullptr;                    // ucx_.worker
  std::mutex mu_;  // held by the thread using the worker (UCS_THREAD_MODE_SERIALIZED)
};

UcxArena::~UcxArena() { reader_->Close(ep_, rkey_, failed_->load()); }

absl::StatusOr<bool> UcxArena::Read(absl::Span<const LaneRead> lanes, uint32_t page_tokens,
                                    size_t row_bytes, RowKind kind, absl::Time deadline) const {
  return reader_->Read(*this, lanes, page_tokens, row_bytes, kind, deadline);
}

}  // namespace

absl::StatusOr<std::unique_ptr<UcxExport>> UcxExport::Create(SharedArena* arena,
                                                             const std::string& transports,
                                                             int copy_threads) {
  if (arena == nullptr) {
    return absl::FailedPreconditionError("the store's pages are not in an arena file");
  }
  if (copy_threads < 0) {
    copy_threads = std::min<int>(3, static_cast<int>(std::thread::hardware_concurrency()) / 4);
  }
  auto e = std::make_unique<UcxExportImpl>(copy_threads);
  if (absl::Status s = e->Init(arena, transports); !s.ok()) return s;
  return std::unique_ptr<UcxExport>(std::move(e));
}

absl::StatusOr<std::unique_ptr<UcxReader>> UcxReader::Create(const std::string& transports,
                                                             UcxReadMode mode) {
  auto r = std::make_shared<UcxReaderImpl>();
  if (absl::Status s = r->Init(transports, mode); !s.ok()) return s;
  // The reader is shared by the arenas it connects (they close their endpoints through it): the
  // caller holds it through this owner, which keeps the shared state alive.
  struct Owner final : UcxReader {
    std::shared_ptr<UcxReaderImpl> impl;
    absl::StatusOr<std::shared_ptr<const ArenaReader>> Connect(const UcxArenaAddress& a,
                                                               absl::Duration t) override {
      return impl->Connect(a, t);
    }
  };
  auto owner = std::make_unique<Owner>();
  owner->impl = std::move(r);
  return std::unique_ptr<UcxReader>(std::move(owner));
}

#endif  // KVSPARSE_WITH_UCX

}  // namespace kvsparse::kvstore
