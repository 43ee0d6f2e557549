// Cancels DecodeStreams that carry no request for longer than an idle bound
// (--stream_idle_timeout): an abandoned stream would otherwise hold one of
// --max_concurrent_streams until its connection dies (gRPC's keepalive and max_connection_idle
// see a live connection with a call on it and keep it). The client's next read or write on a
// reaped stream fails with CANCELLED; it opens a new stream.
#ifndef KVSPARSE_SERVER_STREAM_REAPER_H_
#define KVSPARSE_SERVER_STREAM_REAPER_H_

#include <grpcpp/server_context.h>

#include <list>
#include <memory>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvsparse::server {

class StreamReaper {
 public:
  // idle <= 0: off (no thread; watches do nothing).
  explicit StreamReaper(absl::Duration idle);
  ~StreamReaper();
  StreamReaper(const StreamReaper&) = delete;
  StreamReaper& operator=(const StreamReaper&) = delete;

  class Watch {
   public:
    ~Watch();
    void Touch();  // the stream is busy: a request arrived, or an answer went out
    bool reaped() const;

   private:
    friend class StreamReaper;
    struct Entry {
      grpc::ServerContextBase* ctx;
      absl::Time last;
      bool reaped;
    };
    Watch(StreamReaper* r, std::list<Entry>::iterator it) : reaper_(r), it_(it) {}
    StreamReaper* reaper_;
    std::list<Entry>::iterator it_;
  };
  // Watches the stream of ctx until the Watch is destroyed (null when off).
  std::unique_ptr<Watch> Add(grpc::ServerContextBase* ctx);

 private:
  void Loop();
  const absl::Duration idle_;
  mutable absl::Mutex mu_;
  std::list<Watch::Entry> entries_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvsparse::server

#endif  // KVSPARSE_SERVER_STREAM_REAPER_H_
