// The communicator over threads (see thread_communicator.hpp): a generation-counted rendezvous.
// Each rank deposits its contribution; the last to arrive computes the result for all, moves the
// generation on and wakes the others, who copy the result out. A rank that waits past the timeout,
// aborts, or arrives with a call that differs from the first arrival's breaks the group.
#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <kvq/dist/thread_communicator.hpp>
#include <mutex>

KVQ_NAMESPACE_BEGIN

namespace dist {

namespace {

enum class op_kind : uint8_t { all_gather, all_reduce };

// What one rank asks for; every rank of a generation must ask for the same.
struct call_desc {
  op_kind kind = op_kind::all_gather;
  size_t bytes = 0;  // per rank contribution
  element_type type = element_type::u8;
  reduce_op op = reduce_op::sum;
  bool operator==(const call_desc&) const = default;
  std::string text() const {
    if (kind == op_kind::all_gather) return fmt::format("all_gather of {} bytes", bytes);
    static constexpr const char* types[] = {"u8", "i32", "i64", "f32", "f64"};
    static constexpr const char* ops[] = {"sum", "max", "min"};
    return fmt::format("all_reduce({}, {}) of {} elements", ops[int(op)], types[int(type)],
                       bytes / element_bytes(type));
  }
};

template <class T>
void reduce_into(std::vector<std::byte>& acc, const std::vector<std::byte>& in, reduce_op op) {
  const size_t n = acc.size() / sizeof(T);
  for (size_t i = 0; i < n; ++i) {
    T a, b;
    std::memcpy(&a, acc.data() + i * sizeof(T), sizeof(T));
    std::memcpy(&b, in.data() + i * sizeof(T), sizeof(T));
    const T r = op == reduce_op::sum ? T(a + b) : op == reduce_op::max ? std::max(a, b) : std::min(a, b);
    std::memcpy(acc.data() + i * sizeof(T), &r, sizeof(T));
  }
}

void reduce_into(std::vector<std::byte>& acc, const std::vector<std::byte>& in, element_type t, reduce_op op) {
  switch (t) {
    case element_type::u8:
      return reduce_into<uint8_t>(acc, in, op);
    case element_type::i32:
      return reduce_into<int32_t>(acc, in, op);
    case element_type::i64:
      return reduce_into<int64_t>(acc, in, op);
    case element_type::f32:
      return reduce_into<float>(acc, in, op);
    case element_type::f64:
      return reduce_into<double>(acc, in, op);
  }
}

// The state every rank of one group shares.
struct rendezvous {
  explicit rendezvous(int n, std::chrono::milliseconds t) : size(n), timeout(t), slots(size_t(n)) {}

  const int size;
  const std::chrono::milliseconds timeout;
  std::mutex mu;
  std::condition_variable cv;
  uint64_t generation = 0;                             // collectives completed
  int arrived = 0;                                     // ranks deposited in the current generation
  call_desc current{};                                 // the first arrival's call
  std::vector<std::vector<std::byte>> slots;           // [size] contributions of the current generation
  std::shared_ptr<const std::vector<std::byte>> last;  // result of the last completed generation
  bool is_broken = false;
  std::string why;  // the first failure

  void break_locked(std::string reason) {
    if (is_broken) return;
    is_broken = true;
    why = std::move(reason);
    cv.notify_all();
  }

  status broken_status() const { return {errc::comm_error, fmt::format("communicator group is broken: {}", why)}; }

  // Deposits `data` for rank `r`, waits for the generation to complete, returns its result.
  result<std::shared_ptr<const std::vector<std::byte>>> exchange(int r, const call_desc& d, const std::byte* data) {
    std::unique_lock lk(mu);
    if (is_broken) return broken_status();
    if (arrived == 0) {
      current = d;
    } else if (!(d == current)) {
      break_locked(fmt::format("rank {} called {} while other ranks called {} (collective #{})", r, d.text(),
                               current.text(), generation));
      return broken_status();
    }
    slots[size_t(r)].assign(data, data + d.bytes);
    const uint64_t mine = generation;
    if (++arrived == size) {
      auto out = std::make_shared<std::vector<std::byte>>();
      if (d.kind == op_kind::all_gather) {
        out->reserve(d.bytes * size_t(size));
        for (auto& s : slots) out->insert(out->end(), s.begin(), s.end());
      } else {
        *out = slots[0];
        for (size_t i = 1; i < slots.size(); ++i) reduce_into(*out, slots[i], d.type, d.op);
      }
      last = std::move(out);
      arrived = 0;
      ++generation;
      cv.notify_all();
      return last;
    }
    const bool done = cv.wait_for(lk, timeout, [&] { return generation != mine || is_broken; });
    if (generation != mine) return last;  // completed, even if the group broke afterwards
    if (!done)
      break_locked(fmt::format("rank {} waited {} ms in {} (collective #{}); {} of {} ranks arrived", r,
                               timeout.count(), d.text(), mine, arrived, size));
    return broken_status();
  }
};

class thread_communicator final : public communicator {
 public:
  thread_communicator(std::shared_ptr<rendezvous> rv, int rank) : rv_(std::move(rv)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return rv_->size; }
  bool device_capable() const override { return false; }
  std::string name() const override { return fmt::format("threads(rank {} of {})", rank_, rv_->size); }

  status all_gather(const void* send, void* recv, size_t bytes, memory_space where, void*) override {
    if (status s = check_args("all_gather", send, recv, bytes, where); !s) return s;
    const call_desc d{op_kind::all_gather, bytes, element_type::u8, reduce_op::sum};
    auto r = rv_->exchange(rank_, d, static_cast<const std::byte*>(send));
    if (!r) return r.error();
    std::memcpy(recv, r.value()->data(), r.value()->size());
    return {};
  }

  status all_reduce(const void* send, void* recv, size_t count, element_type type, reduce_op op, memory_space where,
                    void*) override {
    if (status s = check_args("all_reduce", send, recv, count, where); !s) return s;
    const call_desc d{op_kind::all_reduce, count * element_bytes(type), type, op};
    auto r = rv_->exchange(rank_, d, static_cast<const std::byte*>(send));
    if (!r) return r.error();
    std::memmove(recv, r.value()->data(), r.value()->size());
    return {};
  }

  void abort(const std::string& reason) override {
    std::lock_guard lk(rv_->mu);
    rv_->break_locked(fmt::format("rank {} aborted: {}", rank_, reason));
  }

  bool broken() const override {
    std::lock_guard lk(rv_->mu);
    return rv_->is_broken;
  }

 private:
  // Bad arguments on one rank break the group, so that the others fail now rather than wait.
  status check_args(const char* what, const void* send, const void* recv, size_t n, memory_space where) {
    std::string bad;
    if (!send || !recv)
      bad = fmt::format("{}: null buffer", what);
    else if (n == 0)
      bad = fmt::format("{}: empty buffer", what);
    else if (where != memory_space::host)
      bad = fmt::format("{}: device buffers given to a thread communicator (host buffers only)", what);
    if (bad.empty()) return {};
    abort(bad);
    return {errc::invalid_argument, fmt::format("{} on {}", bad, name())};
  }

  std::shared_ptr<rendezvous> rv_;
  int rank_;
};

}  // namespace

result<std::vector<std::unique_ptr<communicator>>> make_thread_group(int size, std::chrono::milliseconds timeout) {
  if (size < 1) return status{errc::invalid_argument, fmt::format("thread group of {} ranks; needs >= 1", size)};
  if (timeout.count() <= 0)
    return status{errc::invalid_argument, fmt::format("thread group timeout {} ms; needs > 0", timeout.count())};
  auto rv = std::make_shared<rendezvous>(size, timeout);
  std::vector<std::unique_ptr<communicator>> out;
  for (int r = 0; r < size; ++r) out.push_back(std::make_unique<thread_communicator>(rv, r));
  return out;
}

}  // namespace dist

KVQ_NAMESPACE_END
