#pragma once
// Runs one function per rank, each on its own thread, as tensor-parallel ranks run. Catch2's
// assertions are not thread-safe: the rank functions record what they saw and the test checks it
// after `run_ranks` returns; an exception on a rank is returned as that rank's error text.
#include <atomic>
#include <chrono>
#include <exception>
#include <string>
#include <thread>
#include <vector>

namespace kvq_test {

template <class F>
std::vector<std::string> run_ranks(int ranks, F&& f) {
  std::vector<std::string> errors(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        f(r);
      } catch (const std::exception& e) {
        errors[size_t(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

// True if every rank ran without an exception.
inline bool all_ok(const std::vector<std::string>& errors) {
  for (const auto& e : errors)
    if (!e.empty()) return false;
  return true;
}

// A one-way signal between rank threads: a rank that must come after another's failure waits for
// it rather than sleeping for a guessed time.
class signal {
 public:
  void set() { v_.store(true); }
  void wait() const {
    while (!v_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }

 private:
  std::atomic<bool> v_{false};
};

}  // namespace kvq_test
