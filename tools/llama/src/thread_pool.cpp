#include <algorithm>
#include <llama/thread_pool.hpp>

namespace kvq::llama {

thread_pool::thread_pool(int threads) {
  if (threads <= 0) threads = int(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { work_loop(); });
}

thread_pool::~thread_pool() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& w : workers_) w.join();
}

void thread_pool::drain() {
  for (int64_t i = next_.fetch_add(1, std::memory_order_relaxed); i < n_; i = next_.fetch_add(1, std::memory_order_relaxed))
    (*fn_)(i);
}

void thread_pool::work_loop() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    drain();
    bool last;
    {
      std::lock_guard lock(mutex_);
      last = --pending_ == 0;
    }
    if (last) done_.notify_one();
  }
}

void thread_pool::run(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  std::unique_lock run_lock(run_mutex_, std::try_to_lock);
  if (workers_.empty() || n == 1 || !run_lock.owns_lock()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    std::lock_guard lock(mutex_);
    fn_ = &fn;
    n_ = n;
    next_.store(0, std::memory_order_relaxed);
    pending_ = int(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  drain();
  // Every worker takes part in every job (if only to find no task left), so no worker can still
  // be on this job when the next one resets the task counter.
  std::unique_lock lock(mutex_);
  done_.wait(lock, [&] { return pending_ == 0; });
}

}  // namespace kvq::llama
