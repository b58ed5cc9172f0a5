// Example 02: an engine's decode loop over a batch of sequences, with admission control when the
// byte budget is full.
//
// What an engine developer learns here:
// - one `KVCache` holds every sequence under one byte budget; per decode step and layer the engine
//   makes one `append_batch` (the new token of every running sequence) and one `attend`;
// - what a request will cost is known before it is admitted: `bytes_for(tokens)` answers what a
//   new sequence of its full length takes (its FP16 windows plus its pages in the policy's current
//   formats, in 256-byte blocks). A request that does not fit is queued and admitted when a finished sequence's `release_sequence` returns
//   its bytes, so no append ever fails for lack of budget;
// - `stats()` reports what is held (used bytes, pages per format) at any moment;
// - memory outside the budget is known before creation: `KVCache::overhead(cfg)` (the CUDA page
//   tables), and `stats().overhead` reports it and the workspaces as they grow, so the engine
//   sizes `budget_bytes` as the memory it gives the cache minus that;
// - the same program runs on the CPU backend (host tensors) and on the CUDA backend (device
//   tensors); only where the tensors live changes.
//
// Self-checking: returns non-zero when a request never completes, the budget or a reservation is
// exceeded, nothing had to wait (the scenario would not show admission control), or the attention
// output drifts from an FP16 cache fed the same tokens by more than the format's bound.
// Usage: kvq_example_engine_decode_loop [cpu|cuda|all] (default all: CPU, then CUDA where built
// with CUDA; without a GPU the CUDA part says that it skipped).
#include <kvq/cache/cache.hpp>
#include <kvq/policy/static_policy.hpp>

#if KVQ_WITH_CUDA
#include <cuda_runtime.h>
#endif
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <memory>
#include <random>
#include <span>
#include <stdexcept>
#include <vector>

namespace {

constexpr int layers = 2, q_heads = 8, kv_heads = 2, d = 128;
constexpr const char* spec = "kivi4/g32;0=kivi8/g32";  // the formats the engine ships
constexpr double max_rel_error = 0.05;                 // attention output vs the FP16 cache

struct request {
  int id;
  int prompt;   // prompt tokens
  int max_new;  // tokens to generate
};

// Stand-in for the model: the K, V and Q rows of (request, layer, position), deterministic.
void model_rows(int req, int layer, int64_t pos, float* k, float* v, float* q) {
  std::mt19937 rng(uint32_t(req * 7919 + layer * 104729 + pos * 31));
  std::normal_distribution<float> nd;
  for (int i = 0; i < kv_heads * d; ++i) k[i] = nd(rng) * (i % 16 == 3 ? 6.f : 1.f), v[i] = nd(rng);
  for (int i = 0; i < q_heads * d; ++i) q[i] = nd(rng) * 0.5f;
}

// Where the tensors handed to the cache live: host memory for the CPU backend, device memory
// (copied in and out around each call) for the CUDA backend.
class io_buffers {
#if KVQ_WITH_CUDA
  static void ok(cudaError_t e) {
    if (e != cudaSuccess) throw std::runtime_error(cudaGetErrorString(e));
  }
#endif

 public:
  io_buffers(kvq::backend b, size_t floats) : cuda_(b == kvq::backend::cuda) {
#if KVQ_WITH_CUDA
    for (auto& p : dev_)
      if (cuda_) ok(cudaMalloc(&p, floats * sizeof(float)));
#endif
    (void)floats;
  }
  ~io_buffers() {
#if KVQ_WITH_CUDA
    for (void* p : dev_) cudaFree(p);
#endif
  }
  // Buffer `i` (0 K, 1 V, 2 Q) holding `h`, as a [rows][heads][d] view.
  kvq::tensor_view in(int i, const std::vector<float>& h, int64_t rows, int heads) {
    const void* p = h.data();
#if KVQ_WITH_CUDA
    if (cuda_) {
      ok(cudaMemcpy(dev_[i], h.data(), size_t(rows) * heads * d * sizeof(float), cudaMemcpyHostToDevice));
      p = dev_[i];
    }
#endif
    (void)i;
    return {p, kvq::dtype::f32, rows, heads, d};
  }
  // The output buffer for `rows` query rows; `fetch` brings it into `h` after the call.
  kvq::tensor_mut out(std::vector<float>& h, int64_t rows) {
    void* p = h.data();
#if KVQ_WITH_CUDA
    if (cuda_) p = dev_[3];
#endif
    return {p, kvq::dtype::f32, rows, q_heads, d};
  }
  void fetch(std::vector<float>& h, int64_t rows) {
#if KVQ_WITH_CUDA
    if (cuda_) ok(cudaMemcpy(h.data(), dev_[3], size_t(rows) * q_heads * d * sizeof(float), cudaMemcpyDeviceToHost));
#endif
    (void)h, (void)rows;
  }

 private:
  bool cuda_;
  void* dev_[4] = {};
};

struct running {
  request req;
  int64_t pos = 0;     // tokens appended so far
  uint64_t reserved;   // bytes reserved at admission
};

// Runs the whole scenario on one backend; returns the number of failed checks.
int serve(kvq::backend where) {
  const char* name = where == kvq::backend::cpu ? "cpu" : "cuda";
  kvq::cache_config cfg;
  cfg.shape = {layers, q_heads, kv_heads, d, 64, 128, 64};
  cfg.budget_bytes = 1536 << 10;
  cfg.where = where;
  const kvq::cache_overhead extra = kvq::KVCache::overhead(cfg).value_or_throw();
  fmt::print("{}: budget {} bytes; {} bytes outside it at creation (device page tables)\n", name, cfg.budget_bytes,
             extra.device_bytes());
  auto pol = std::make_shared<kvq::static_policy>(kvq::static_policy::parse(spec).value_or_throw());
  auto cache = kvq::KVCache::create(cfg, pol).value_or_throw();
  // The reference: an FP16 cache on the CPU with room for everything, fed the same tokens.
  kvq::cache_config ref_cfg = cfg;
  ref_cfg.budget_bytes = 64ull << 20;
  ref_cfg.where = kvq::backend::cpu;
  auto ref = kvq::KVCache::create(ref_cfg, std::make_shared<kvq::static_policy>()).value_or_throw();

  std::deque<request> queue;
  for (int i = 0; i < 8; ++i) queue.push_back({i, 96 + 37 * (i % 5) * 2, 40 + 23 * (i % 3)});
  const size_t max_rows = 128;  // a prefill chunk (at most the window) or a batch of decode tokens
  io_buffers io(where, max_rows * q_heads * d);
  std::vector<float> k(max_rows * kv_heads * d), v(k.size()), q(max_rows * q_heads * d), o(q.size()), o_ref(q.size());
  std::vector<running> batch;
  uint64_t reserved = 0, peak_used = 0;
  int completed = 0, waited = 0, failures = 0, steps = 0;
  size_t peak_batch = 0;
  double err = 0, norm = 0;

  // For one layer, on both caches: appends `app[i].tokens` tokens of each item's sequence from
  // position `first[i]` on, then attends with the queries of the last `q_len` of them; accumulates
  // the output error.
  auto step_layer = [&](std::span<const kvq::append_item> app, std::span<const kvq::attend_item> att,
                        std::span<const int> req_of, std::span<const int64_t> first, int layer) {
    int64_t rows = 0, qrows = 0;
    for (size_t i = 0; i < app.size(); ++i) {
      for (int64_t t = 0; t < app[i].tokens; ++t, ++rows) {
        float* qr = q.data() + size_t(qrows) * q_heads * d;
        model_rows(req_of[i], layer, first[i] + t, &k[size_t(rows) * kv_heads * d], &v[size_t(rows) * kv_heads * d], qr);
        if (t >= app[i].tokens - att[i].q_len) ++qrows;
      }
    }
    kvq::check(cache.append_batch(app, layer, io.in(0, k, rows, kv_heads), io.in(1, v, rows, kv_heads)));
    kvq::check(cache.attend(att, layer, io.in(2, q, qrows, q_heads), io.out(o, qrows)));
    io.fetch(o, qrows);
    kvq::check(ref.append_batch(app, layer, {k.data(), kvq::dtype::f32, rows, kv_heads, d},
                                {v.data(), kvq::dtype::f32, rows, kv_heads, d}));
    kvq::check(ref.attend(att, layer, {q.data(), kvq::dtype::f32, qrows, q_heads, d},
                          {o_ref.data(), kvq::dtype::f32, qrows, q_heads, d}));
    for (size_t i = 0; i < size_t(qrows) * q_heads * d; ++i)
      err += (o[i] - o_ref[i]) * double(o[i] - o_ref[i]), norm += o_ref[i] * double(o_ref[i]);
  };

  while (!queue.empty() || !batch.empty()) {
    // Admission: first come, first served, while the head of the queue fits the budget.
    while (!queue.empty()) {
      const request r = queue.front();
      const uint64_t need = cache.bytes_for(r.prompt + r.max_new).value_or_throw();
      if (need > cfg.budget_bytes) {
        fmt::print(stderr, "request {} needs {} bytes, more than the whole budget\n", r.id, need);
        return failures + 1;
      }
      if (reserved + need > cfg.budget_bytes) break;
      queue.pop_front();
      waited += steps > 0;  // admitted only after others released their bytes
      reserved += need;
      kvq::check(cache.create_sequence(r.id));
      kvq::check(ref.create_sequence(r.id));
      // Prefill in chunks of at most the window: each chunk attends to itself and what precedes.
      for (int64_t at = 0; at < r.prompt; at += 128)
        for (int l = 0; l < layers; ++l) {
          const int64_t m = std::min<int64_t>(128, r.prompt - at);
          const kvq::append_item a{r.id, m};
          const kvq::attend_item t{r.id, int(m)};
          const int id = r.id;
          step_layer({&a, 1}, {&t, 1}, {&id, 1}, {&at, 1}, l);
        }
      batch.push_back({r, r.prompt, need});
    }
    peak_batch = std::max(peak_batch, batch.size());
    // One decode step: a token for every running sequence, one append_batch and one attend per layer.
    std::vector<kvq::append_item> app;
    std::vector<kvq::attend_item> att;
    std::vector<int> ids;
    std::vector<int64_t> first;
    for (const running& s : batch)
      app.push_back({s.req.id, 1}), att.push_back({s.req.id, 1}), ids.push_back(s.req.id), first.push_back(s.pos);
    for (int l = 0; l < layers; ++l) step_layer(app, att, ids, first, l);
    ++steps;
    const kvq::cache_stats st = cache.stats();
    peak_used = std::max(peak_used, st.used_bytes);
    if (st.used_bytes > reserved || reserved > cfg.budget_bytes) {
      fmt::print(stderr, "step {}: {} bytes used, {} reserved, budget {}\n", steps, st.used_bytes, reserved,
                 cfg.budget_bytes);
      ++failures;
    }
    // Retire finished sequences: their bytes go back to the budget for the queue.
    for (size_t i = 0; i < batch.size();) {
      running& s = batch[i];
      if (++s.pos < s.req.prompt + s.req.max_new) {
        ++i;
        continue;
      }
      kvq::check(cache.release_sequence(s.req.id));
      kvq::check(ref.release_sequence(s.req.id));
      reserved -= s.reserved;
      ++completed;
      batch.erase(batch.begin() + std::ptrdiff_t(i));
    }
  }
  const double rel = std::sqrt(err / norm);
  const kvq::cache_stats st = cache.stats();
  fmt::print("{}: {} requests completed in {} decode steps, at most {} at once, {} waited for memory\n", name,
             completed, steps, peak_batch, waited);
  fmt::print("{}: peak {} of {} budget bytes used; now {} used, {} pages; output error vs FP16 {:.2e} (bound {})\n",
             name, peak_used, cfg.budget_bytes, st.used_bytes, st.pages, rel, max_rel_error);
  const auto expect = [&](bool ok, const char* what) {
    if (!ok) fmt::print(stderr, "{}: check failed: {}\n", name, what), ++failures;
  };
  expect(completed == 8, "every request completes");
  expect(waited > 0, "some request waited for memory (the scenario shows admission control)");
  expect(st.used_bytes == 0, "released sequences return every byte");
  expect(st.overhead.device_tables == extra.device_tables, "the page tables are what overhead(cfg) announced");
  expect((where == kvq::backend::cpu) == (st.overhead.device_bytes() == 0), "only the CUDA backend holds memory "
                                                                             "outside the budget");
  fmt::print("{}: outside the budget now: {} bytes of device tables, {} of workspaces, {} pinned\n", name,
             st.overhead.device_tables, st.overhead.device_workspace, st.overhead.pinned_host);
  expect(rel <= max_rel_error, "the attention output stays within its bound of the FP16 cache");
  return failures;
}

#if KVQ_WITH_CUDA
bool cuda_device_present() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  const char* which = argc > 1 ? argv[1] : "all";
  const bool cpu = !std::strcmp(which, "cpu") || !std::strcmp(which, "all");
  const bool cuda = !std::strcmp(which, "cuda") || !std::strcmp(which, "all");
  if (!cpu && !cuda) {
    fmt::print(stderr, "usage: {} [cpu|cuda|all]\n", argv[0]);
    return 2;
  }
  int failures = cpu ? serve(kvq::backend::cpu) : 0;
  if (cuda) {
#if KVQ_WITH_CUDA
    if (cuda_device_present()) {
      failures += serve(kvq::backend::cuda);
    } else {
      fmt::print("cuda: skipped (no CUDA device)\n");
      if (!cpu) return 77;
    }
#else
    fmt::print("cuda: skipped (kvq was built without CUDA)\n");
    if (!cpu) return 77;
#endif
  }
  if (failures) fmt::print(stderr, "{} check(s) failed\n", failures);
  return failures ? 1 : 0;
}
