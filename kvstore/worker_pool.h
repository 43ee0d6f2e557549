// A fixed set of helper threads that run the parts of a caller's job beside it: the store's UCX
// export copies a large gather's rows in parts, the GPU engine fetches the rows of a batch's
// sequences from a remote store one sequence per part.
#ifndef KVSPARSE_KVSTORE_WORKER_POOL_H_
#define KVSPARSE_KVSTORE_WORKER_POOL_H_

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"

namespace kvsparse::kvstore {

// Thread-safe: several callers may Run at once (their parts share the helpers; each caller also
// runs parts itself, so a Run never waits on parts no thread is running). std::mutex, not
// absl::Mutex: ThreadSanitizer understands it (Debian's Abseil is not instrumented).
class WorkerPool {
 public:
  // helpers: threads besides the callers (0: every part runs on the caller).
  explicit WorkerPool(int helpers);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int helpers() const { return static_cast<int>(threads_.size()); }

  // Runs part(0) .. part(parts - 1), on the calling thread and the helpers, and returns once
  // every part is done (what the parts wrote happens-before what the caller does next).
  void Run(size_t parts, absl::FunctionRef<void(size_t)> part);

 private:
  struct Job {
    absl::FunctionRef<void(size_t)>* part;
    size_t unfinished;  // parts queued or running on helpers; under mu_
  };
  struct Task {
    size_t index;
    Job* job;
  };
  // Runs a task taken from the queue (mu_ released) and counts it done.
  void RunTask(std::unique_lock<std::mutex>& lock, Task t);
  void Serve();

  std::mutex mu_;
  std::condition_variable queued_, finished_;
  std::deque<Task> tasks_;  // under mu_
  bool stop_ = false;       // under mu_
  std::vector<std::thread> threads_;
};

}  // namespace kvsparse::kvstore

#endif  // KVSPARSE_KVSTORE_WORKER_POOL_H_
