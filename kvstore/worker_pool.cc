#include "kvstore/worker_pool.h"

namespace kvsparse::kvstore {

WorkerPool::WorkerPool(int helpers) {
  for (int i = 0; i < helpers; ++i) threads_.emplace_back([this] { Serve(); });
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  queued_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void WorkerPool::RunTask(std::unique_lock<std::mutex>& lock, Task t) {
  lock.unlock();
  (*t.job->part)(t.index);
  lock.lock();
  if (--t.job->unfinished == 0) finished_.notify_all();
}

void WorkerPool::Run(size_t parts, absl::FunctionRef<void(size_t)> part) {
  if (parts == 0) return;
  if (parts == 1 || threads_.empty()) {
    for (size_t i = 0; i < parts; ++i) part(i);
    return;
  }
  Job job{&part, parts - 1};
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 1; i < parts; ++i) tasks_.push_back({i, &job});
  }
  queued_.notify_all();
  part(0);
  // Then whatever parts are still queued (this Run's or another caller's), instead of idling.
  std::unique_lock<std::mutex> lock(mu_);
  while (!tasks_.empty()) {
    const Task t = tasks_.front();
    tasks_.pop_front();
    RunTask(lock, t);
  }
  finished_.wait(lock, [&] { return job.unfinished == 0; });
}

void WorkerPool::Serve() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    queued_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
    if (tasks_.empty()) return;  // stopping
    const Task t = tasks_.front();
    tasks_.pop_front();
    RunTask(lock, t);
  }
}

}  // namespace kvsparse::kvstore
