// Example 07: EchoKV on tensor-parallel ranks that agree.
//
// What an engine developer learns here:
// - a tensor-parallel engine shards the KV heads: each rank's `KVCache` holds its slice (here the
//   model has 4 kv heads, each of the 2 ranks holds 2) and runs its own EchoKV on its own heads;
// - `dist::tp_echokv` puts the rank's policy in agreement mode: on every canary step the ranks
//   gather their tier proposals and apply the majority per layer (a tie to the higher tier), so a
//   layer's pages have one format on every rank. The engine calls `end_step` after each decode
//   step with the step's sequences; it exchanges only on canary steps (about 1 in 64 by default;
//   1 in 8 here to show more votes), which every rank knows without talking;
// - the communicator: NCCL with one GPU per rank, each rank a thread (`make_nccl_communicator`,
//   needs `KVQ_NCCL=ON` and two GPUs), or threads of one process on the CPU backend
//   (`make_thread_group`). With fewer than two GPUs, or a build without NCCL, the example says so
//   and runs the CPU version: same code, other communicator and backend.
//
// Self-checking: returns non-zero when the ranks' agreed tiers differ after any step, their page
// formats differ at the end, no vote ran, or the ranks never disagreed (then the example would
// show nothing).
#include <kvq/cache/cache.hpp>
#include <kvq/dist/nccl_communicator.hpp>
#include <kvq/dist/thread_communicator.hpp>
#include <kvq/dist/tp_echokv.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/echokv.hpp>

#ifdef KVQ_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int ranks = 2, layers = 8, kv_heads = 4, group = 4, d = 128;
constexpr int kv_local = kv_heads / ranks, q_local = kv_local * group;
constexpr int prompt = 128, steps = 384;

// Query scale per (layer, global kv head): how sharp a head attends. The two ranks' heads
// disagree on layers 2, 3 and 6: there the vote decides.
constexpr float sharpness[layers][kv_heads] = {
    {0.1f, 0.1f, 0.1f, 0.1f}, {0.2f, 0.2f, 0.3f, 0.3f}, {0.1f, 0.2f, 3.0f, 4.0f}, {4.0f, 3.0f, 0.2f, 0.1f},
    {1.0f, 1.0f, 1.0f, 1.0f}, {4.0f, 4.0f, 4.0f, 4.0f}, {0.5f, 0.5f, 2.5f, 2.5f}, {2.0f, 2.0f, 2.0f, 2.0f}};

// Where a rank's tensors live: host memory on the CPU backend, its GPU's memory on CUDA.
class rank_io {
 public:
  explicit rank_io(bool gpu) : gpu_(gpu) {}
  rank_io(const rank_io&) = delete;
  rank_io& operator=(const rank_io&) = delete;
  ~rank_io() {
#ifdef KVQ_WITH_CUDA
    for (void* p : dev_) cudaFree(p);
#endif
  }
  // The tensor for the cache: `h` itself, or its copy in device buffer `slot`.
  void* put(std::vector<uint16_t>& h, size_t slot) {
    if (!gpu_) return h.data();
#ifdef KVQ_WITH_CUDA
    if (dev_.size() <= slot) dev_.resize(slot + 1, nullptr), bytes_.resize(slot + 1, 0);
    if (bytes_[slot] < h.size() * 2) {
      cudaFree(dev_[slot]);
      if (cudaMalloc(&dev_[slot], h.size() * 2) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
      bytes_[slot] = h.size() * 2;
    }
    if (cudaMemcpy(dev_[slot], h.data(), h.size() * 2, cudaMemcpyHostToDevice) != cudaSuccess)
      throw std::runtime_error("cudaMemcpy failed");
    return dev_[slot];
#else
    return nullptr;
#endif
  }

 private:
  bool gpu_;
  std::vector<void*> dev_;
  std::vector<size_t> bytes_;
};

// Stand-in for the model's layer: rank `rank`'s K, V and Q rows for positions [pos, pos + m).
void model_rows(int rank, int layer, int64_t pos, int m, std::vector<uint16_t>& k, std::vector<uint16_t>& v,
                std::vector<uint16_t>& q) {
  k.resize(size_t(m) * kv_local * d), v.resize(k.size()), q.resize(size_t(m) * q_local * d);
  for (int t = 0; t < m; ++t)
    for (int h = 0; h < kv_local; ++h) {
      const int global = rank * kv_local + h;
      std::mt19937 rng(uint32_t(global * 1000003 + layer * 7919 + (pos + t) * 31));
      std::normal_distribution<float> nd;
      for (int i = 0; i < d; ++i) {
        const size_t at = (size_t(t) * kv_local + size_t(h)) * d + size_t(i);
        k[at] = kvq::float_to_half(nd(rng) * (i % 16 == 5 ? 6.f : 1.f));
        v[at] = kvq::float_to_half(nd(rng));
      }
      for (int g = 0; g < group; ++g)
        for (int i = 0; i < d; ++i)
          q[((size_t(t) * q_local) + size_t(h * group + g)) * d + size_t(i)] =
              kvq::float_to_half(nd(rng) * sharpness[layer][global]);
    }
}

// What one rank reports back.
struct rank_report {
  std::vector<std::vector<uint8_t>> agreed;  // after each step
  kvq::cache_stats stats;
  kvq::dist::tp_vote_counters counters;
  std::string error;
};

void run_rank(int rank, bool gpu, kvq::dist::communicator& comm, rank_report& out) {
  kvq::echokv_options o;
  o.rate = 1.0 / 8;
  o.seed = 2026;  // every rank the same: they draw the same canary steps
  kvq::cache_config cfg;
  cfg.shape = {layers, q_local, kv_local, d, 64, 128, 64};
  cfg.budget_bytes = 64 << 20;
  cfg.where = gpu ? kvq::backend::cuda : kvq::backend::cpu;
  cfg.max_sequences = 4;
  cfg.max_tokens = 4096;
  auto cache = kvq::KVCache::create(cfg, std::make_shared<kvq::echokv_policy>(o)).value_or_throw();
  auto tp = kvq::dist::tp_echokv::create(cache, comm).value_or_throw();
  kvq::check(cache.create_sequence(0));
  rank_io io(gpu);
  std::vector<uint16_t> k, v, q, o_rows;
  const kvq::seq_id seqs[] = {0};
  int64_t pos = 0;
  for (int s = 0; s <= steps; ++s) {
    const int m = s == 0 ? prompt : 1;
    for (int l = 0; l < layers; ++l) {
      model_rows(rank, l, pos, m, k, v, q);
      o_rows.resize(q.size());
      kvq::check(cache.append(0, l, {io.put(k, 0), kvq::dtype::f16, m, kv_local, d},
                              {io.put(v, 1), kvq::dtype::f16, m, kv_local, d}));
      const kvq::attend_item it{0, m};
      kvq::check(cache.attend({&it, 1}, l, {io.put(q, 2), kvq::dtype::f16, m, q_local, d},
                              {io.put(o_rows, 3), kvq::dtype::f16, m, q_local, d}));
    }
    pos += m;
    tp.end_step(seqs).value_or_throw();  // on a canary step: gather, vote, apply
    out.agreed.push_back(tp.policy().agreed());
  }
  out.stats = cache.stats();
  out.counters = tp.counters();
}

int gpus_usable() {
#ifdef KVQ_WITH_CUDA
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
#else
  return 0;
#endif
}

}  // namespace

int main() {
  const int gpus = gpus_usable();
  const bool gpu = gpus >= ranks && kvq::dist::nccl_available();
  std::vector<std::unique_ptr<kvq::dist::communicator>> comms(ranks);
  if (gpu) {
    fmt::print("{} GPUs and NCCL: {} ranks, each a thread with its GPU, talking through NCCL\n", gpus, ranks);
    const auto id = kvq::dist::nccl_make_id().value_or_throw();
    std::vector<std::thread> t;
    std::vector<std::string> err(ranks);
    for (int r = 0; r < ranks; ++r)
      t.emplace_back([&, r] {
        auto c = kvq::dist::make_nccl_communicator(ranks, r, id, r);
        if (c)
          comms[size_t(r)] = std::move(c).value_or_throw();
        else
          err[size_t(r)] = c.error().to_string();
      });
    for (auto& th : t) th.join();
    for (const auto& e : err)
      if (!e.empty()) return fmt::print(stderr, "NCCL: {}\n", e), 1;
  } else {
    fmt::print("{} GPU(s){}: running the in-process CPU version ({} ranks, each a thread, a thread communicator)\n",
               gpus, kvq::dist::nccl_available() ? "" : ", kvq built without NCCL", ranks);
    comms = kvq::dist::make_thread_group(ranks).value_or_throw();
  }

  std::vector<rank_report> reports(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
#ifdef KVQ_WITH_CUDA
        if (gpu && cudaSetDevice(r) != cudaSuccess) throw std::runtime_error("cudaSetDevice failed");
#endif
        run_rank(r, gpu, *comms[size_t(r)], reports[size_t(r)]);
      } catch (const std::exception& e) {
        reports[size_t(r)].error = e.what();
        comms[size_t(r)]->abort(e.what());  // the other rank fails too instead of waiting
      }
    });
  for (auto& t : threads) t.join();

  int failures = 0;
  for (int r = 0; r < ranks; ++r)
    if (!reports[size_t(r)].error.empty())
      fmt::print(stderr, "rank {} failed: {}\n", r, reports[size_t(r)].error), ++failures;
  if (failures) return 1;
  const rank_report& a = reports[0];
  for (int r = 1; r < ranks; ++r) {
    const rank_report& b = reports[size_t(r)];
    for (size_t s = 0; s < a.agreed.size(); ++s)
      if (b.agreed[s] != a.agreed[s]) {
        fmt::print(stderr, "FAIL: after step {} rank {} has tiers {}, rank 0 {}\n", s, r, b.agreed[s], a.agreed[s]);
        return 1;
      }
    if (b.stats.pages_by_format != a.stats.pages_by_format) {
      fmt::print(stderr, "FAIL: rank {} stored pages in other formats than rank 0\n", r);
      return 1;
    }
  }
  uint64_t overruled = 0;
  for (const auto& rep : reports) overruled += rep.counters.overruled;
  fmt::print("{} steps, {} votes, {} tier moves agreed; a rank's proposal lost a vote {} times\n", steps,
             a.counters.votes, a.counters.moves, overruled);
  fmt::print("tiers per layer after the last step, the same on every rank: {}\n", a.agreed.back());
  if (a.counters.votes == 0 || overruled == 0) {
    fmt::print(stderr, "FAIL: {}\n", a.counters.votes == 0 ? "no vote ran" : "the ranks never disagreed");
    return 1;
  }
  fmt::print("OK: every rank stores every layer in the format the ranks agreed on\n");
  return 0;
}
