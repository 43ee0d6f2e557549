#include "server/stream_reaper.h"

#include <algorithm>

#include "absl/time/clock.h"
#include "rpc/logging.h"

namespace kvsparse::server {

StreamReaper::StreamReaper(absl::Duration idle) : idle_(idle) {
  if (idle_ > absl::ZeroDuration()) thread_ = std::thread([this] { Loop(); });
}

StreamReaper::~StreamReaper() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

std::unique_ptr<StreamReaper::Watch> StreamReaper::Add(grpc::ServerContextBase* ctx) {
  if (idle_ <= absl::ZeroDuration()) return nullptr;
  absl::MutexLock lock(&mu_);
  entries_.push_front({ctx, absl::Now(), false});
  return std::unique_ptr<Watch>(new Watch(this, entries_.begin()));
}

StreamReaper::Watch::~Watch() {
  absl::MutexLock lock(&reaper_->mu_);
  reaper_->entries_.erase(it_);
}

void StreamReaper::Watch::Touch() {
  absl::MutexLock lock(&reaper_->mu_);
  it_->last = absl::Now();
}

bool StreamReaper::Watch::reaped() const {
  absl::MutexLock lock(&reaper_->mu_);
  return it_->reaped;
}

void StreamReaper::Loop() {
  // Checks a few times per idle bound (at least once a second): a stream is cancelled between
  // idle and idle + period after its last request.
  const absl::Duration period = std::min(absl::Seconds(1), idle_ / 4);
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    mu_.AwaitWithTimeout(absl::Condition(&stop_), period);
    const absl::Time now = absl::Now();
    for (Watch::Entry& e : entries_) {
      if (e.reaped || now - e.last <= idle_) continue;
      e.reaped = true;
      e.ctx->TryCancel();
      KVSPARSE_LOG(Info) << "DecodeStream from " << e.ctx->peer() << " idle for "
                         << absl::FormatDuration(now - e.last)
                         << ": cancelled (--stream_idle_timeout)";
    }
  }
}

}  // namespace kvsparse::server
