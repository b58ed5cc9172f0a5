#include <algorithm>
#include <cstdint>
#include <llama/thread_pool.hpp>

namespace kvq::llama {

namespace {

// NOTE: a worker spins this many pause loops (some tens of microseconds) before it sleeps, so
// that the next product of the same forward call, a few microseconds later, finds it awake; a
// condition-variable wake-up per product costs more than the product of a small matrix.
constexpr int spin_iterations = 4096;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

constexpr uint32_t closed = UINT32_MAX;  // task field of a job that takes no more claims

constexpr uint64_t pack(uint32_t job, uint32_t task) { return uint64_t(job) << 32 | task; }

}  // namespace

thread_pool::thread_pool(int threads) {
  if (threads <= 0) threads = int(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { work_loop(); });
}

thread_pool::~thread_pool() {
  {
    std::lock_guard lock(mutex_);
    stop_.store(true);
  }
  wake_.notify_all();
  for (auto& w : workers_) w.join();
}

void thread_pool::drain(uint32_t job) {
  uint64_t word = ticket_.load(std::memory_order_acquire);
  for (;;) {
    // A task is claimed by advancing the ticket of the same job; a ticket of another job means
    // this one has ended (every task done), so fn_ may be gone: stop without touching it.
    if (uint32_t(word >> 32) != job) return;
    const uint32_t task = uint32_t(word);
    if (int64_t(task) >= n_.load(std::memory_order_relaxed)) return;
    if (!ticket_.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel)) continue;
    (*fn_)(task);
    if (done_tasks_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_.load(std::memory_order_relaxed)) {
      std::lock_guard lock(mutex_);
      done_.notify_one();
    }
    word = ticket_.load(std::memory_order_acquire);
  }
}

void thread_pool::work_loop() {
  uint32_t seen = 0;
  for (;;) {
    bool woke = false;
    for (int i = 0; i < spin_iterations && !woke; ++i) {
      woke = uint32_t(ticket_.load(std::memory_order_acquire) >> 32) != seen || stop_.load(std::memory_order_relaxed);
      if (!woke) cpu_relax();
    }
    if (!woke) {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stop_.load() || uint32_t(ticket_.load() >> 32) != seen; });
    }
    if (stop_.load()) return;
    seen = uint32_t(ticket_.load(std::memory_order_acquire) >> 32);
    drain(seen);
  }
}

void thread_pool::run(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  std::unique_lock run_lock(run_mutex_, std::try_to_lock);
  if (workers_.empty() || n == 1 || n > INT32_MAX || !run_lock.owns_lock()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  // The previous job has ended (all its tasks done), so no worker reads these fields until the
  // new ticket below publishes them.
  fn_ = &fn;
  n_.store(n, std::memory_order_relaxed);
  done_tasks_.store(0, std::memory_order_relaxed);
  const uint32_t job = ++job_;
  {
    std::lock_guard lock(mutex_);
    ticket_.store(pack(job, 0), std::memory_order_release);
  }
  wake_.notify_all();
  drain(job);
  // Wait only for tasks that workers have claimed; a worker that never woke holds none.
  for (int i = 0; i < spin_iterations && done_tasks_.load(std::memory_order_acquire) != n; ++i) cpu_relax();
  if (done_tasks_.load(std::memory_order_acquire) != n) {
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return done_tasks_.load(std::memory_order_acquire) == n; });
  }
  // Close the job before the next run rewrites n_: a worker holding a stale ticket of this job
  // could otherwise read the next job's larger n_ and claim a task beyond this job's end.
  ticket_.store(pack(job, closed), std::memory_order_release);
}

}  // namespace kvq::llama
