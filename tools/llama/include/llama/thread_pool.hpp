#pragma once
/// \file
/// A small fixed pool of worker threads for the model runner's matrix products: `run(n, fn)`
/// calls fn(i) for every i in [0, n), spread over the workers and the calling thread, and
/// returns when all are done.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvq::llama {

/// Worker threads that share the tasks of one `run` at a time. A `run` called while another
/// is in flight (from a second thread) executes its tasks on the calling thread alone, so
/// concurrent forward calls on one model stay correct without waiting for each other.
class thread_pool {
 public:
  /// `threads` in total, the caller included (so threads - 1 workers); 0 means
  /// std::thread::hardware_concurrency().
  explicit thread_pool(int threads = 0);
  ~thread_pool();
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  /// Threads a `run` uses, the caller included.
  int threads() const { return int(workers_.size()) + 1; }

  /// Calls fn(i) for i in [0, n) and returns when every call has returned. fn must not throw.
  void run(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  void work_loop();
  void drain(uint32_t job);

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;  // held by the run in flight
  std::mutex mutex_;      // guards the sleeps on wake_ and done_
  std::condition_variable wake_, done_;
  // The job in flight: fn_ and n_ are written by run() before it publishes the job's ticket
  // (release) and read by a worker only between a successful claim and that task's end.
  const std::function<void(int64_t)>* fn_ = nullptr;
  std::atomic<int64_t> n_{0};
  std::atomic<uint64_t> ticket_{UINT32_MAX};  // (job number << 32) | next task to claim (job 0: closed)
  std::atomic<int64_t> done_tasks_{0};
  uint32_t job_ = 0;  // last job number, written by run() only
  std::atomic<bool> stop_{false};
};

}  // namespace kvq::llama
