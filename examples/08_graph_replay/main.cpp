// Example 08: a decode step captured once into a CUDA graph and replayed for every step of a
// continuously batched decode loop (kvq/cache/decode_step.hpp).
//
// What an engine developer learns here:
// - `decode_step::create(cache, max_batch, max_tokens)` once: the step's device tables, pinned
//   buffers and workspace are allocated there, and the launches' shapes fixed;
// - per step, `prepare(seqs)` on the host (the cache's bookkeeping for every layer, then one copy
//   of the step's descriptors on the cache's stream), then one `cudaGraphLaunch`;
// - the graph is captured once, after the first `prepare`, from the step's `append` + `attend`
//   per layer (the model's own kernels would sit between them); the engine's static input and
//   output buffers ([max_batch] rows of K, V, Q, O) keep their addresses, and row i is the i-th
//   sequence given to `prepare`;
// - sequences finish and new ones join between steps (`release_sequence`, `create_sequence`),
//   and the batch shrinks and grows, under the same graph.
//
// Self-checking against a second cache fed the same tokens by the eager `append_batch` +
// `attend`: every step's outputs within summation order (NMSE < 1e-5), and both caches store the
// same bytes at the end. Exits 77 (reported as skipped by ctest) without a CUDA device.
#include <kvq/cache/cache.hpp>
#include <kvq/cache/decode_step.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/static_policy.hpp>

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

namespace {

constexpr int layers = 4, q_heads = 16, kv_heads = 4, d = 128, max_batch = 8, steps = 120;
constexpr int64_t max_tokens = 2048;

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(fmt::format("{}: {}", what, cudaGetErrorString(e)));
}

// A device buffer of fp16 values, [layers][max_batch][heads][d].
struct rows {
  explicit rows(int heads) : heads(heads), count(size_t(layers) * max_batch * heads * d) {
    cuda_ok(cudaMalloc(&p, count * 2), "cudaMalloc");
  }
  ~rows() { cudaFree(p); }
  rows(const rows&) = delete;
  rows& operator=(const rows&) = delete;
  uint16_t* at(int layer) const { return static_cast<uint16_t*>(p) + size_t(layer) * max_batch * heads * d; }
  kvq::tensor_view view(int layer, int64_t n) const { return {at(layer), kvq::dtype::f16, n, heads, d}; }
  kvq::tensor_mut mut(int layer, int64_t n) const { return {at(layer), kvq::dtype::f16, n, heads, d}; }
  int heads;
  size_t count;
  void* p = nullptr;
};

kvq::KVCache make(cudaStream_t stream) {
  kvq::cache_config cfg;
  cfg.shape = {layers, q_heads, kv_heads, d, 64, 128, 32};
  cfg.where = kvq::backend::cuda;
  cfg.budget_bytes = 256ull << 20;
  cfg.max_sequences = 16;
  cfg.max_tokens = max_tokens;
  cfg.stream = stream;
  cfg.check_values = false;  // a replayed step checks no values (docs/architecture.md, "Value checks on the device")
  // 4-bit keys and 2-bit values, the first layer's pages in fp16
  auto pol = kvq::static_policy::parse("k=kivi4/g32,v=kivi2/g32;0=fp16").value_or_throw();
  return kvq::KVCache::create(cfg, std::make_shared<kvq::static_policy>(pol)).value_or_throw();
}

int run() {
  cudaStream_t stream;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  kvq::KVCache cache = make(stream), eager = make(stream);
  kvq::decode_step step = kvq::decode_step::create(cache, max_batch, max_tokens).value_or_throw();
  rows k(kv_heads), v(kv_heads), q(q_heads), o(q_heads), o_eager(q_heads);
  std::mt19937 rng(8);
  std::normal_distribution<float> nd;
  std::vector<uint16_t> host(q.count);
  auto fill = [&](const rows& r) {
    for (size_t i = 0; i < r.count; ++i) host[i] = kvq::float_to_half(nd(rng));
    cuda_ok(cudaMemcpyAsync(r.p, host.data(), r.count * 2, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
    cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  };
  // Running requests: id and tokens left to decode. A request starts from one token (its prompt
  // would be prefilled eagerly with `prefill` before it joins the batch).
  struct request {
    kvq::seq_id id;
    int left;
  };
  std::vector<request> running;
  kvq::seq_id next_id = 0;
  auto admit = [&] {
    while (running.size() < size_t(max_batch) - 1) {
      const kvq::seq_id id = next_id++;
      for (kvq::KVCache* c : {&cache, &eager}) kvq::check(c->create_sequence(id));
      running.push_back({id, 20 + int(rng() % 100)});
    }
  };
  admit();
  cudaGraphExec_t exec = nullptr;
  double worst = 0;
  for (int t = 0; t < steps; ++t) {
    std::vector<kvq::seq_id> seqs;
    for (const request& r : running) seqs.push_back(r.id);
    const int64_t n = int64_t(seqs.size());
    fill(k), fill(v), fill(q);
    kvq::check(step.prepare(seqs));
    if (!exec) {  // capture once
      cudaGraph_t graph;
      cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
      for (int l = 0; l < layers; ++l) {
        kvq::check(step.append(l, k.view(l, max_batch), v.view(l, max_batch)));
        kvq::check(step.attend(l, q.view(l, max_batch), o.mut(l, max_batch)));
      }
      cuda_ok(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
      cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
      cudaGraphDestroy(graph);
    }
    cuda_ok(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    // The same step, eager, on the other cache.
    std::vector<kvq::append_item> adds;
    std::vector<kvq::attend_item> items;
    for (kvq::seq_id s : seqs) adds.push_back({s, 1}), items.push_back({s, 1});
    for (int l = 0; l < layers; ++l) {
      kvq::check(eager.append_batch(adds, l, k.view(l, n), v.view(l, n)));
      kvq::check(eager.attend(items, l, q.view(l, n), o_eager.mut(l, n)));
    }
    cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    std::vector<uint16_t> a(o.count), b(o.count);
    cuda_ok(cudaMemcpy(a.data(), o.p, a.size() * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
    cuda_ok(cudaMemcpy(b.data(), o_eager.p, b.size() * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
    for (int l = 0; l < layers; ++l) {
      double e = 0, s = 0;
      const size_t first = size_t(l) * max_batch * q_heads * d;
      for (size_t i = first; i < first + size_t(n) * q_heads * d; ++i) {
        const double x = kvq::half_to_float(a[i]), y = kvq::half_to_float(b[i]);
        e += (x - y) * (x - y), s += y * y;
      }
      worst = std::max(worst, e / s);
    }
    // Finished requests leave; new ones take their rows from the next step on.
    for (request& r : running) --r.left;
    for (const request& r : running)
      if (r.left == 0)
        for (kvq::KVCache* c : {&cache, &eager}) kvq::check(c->release_sequence(r.id));
    std::erase_if(running, [](const request& r) { return r.left == 0; });
    if (t % 10 == 9) admit();
  }
  bool same = true;
  for (const request& r : running)
    for (int l = 0; l < layers; ++l)
      for (kvq::role role : {kvq::role::k, kvq::role::v}) {
        const size_t m = size_t(cache.length(r.id, l)) * kv_heads * d;
        std::vector<float> x(m), y(m);
        kvq::check(cache.read(r.id, l, role, x));
        kvq::check(eager.read(r.id, l, role, y));
        same = same && cache.length(r.id, l) == eager.length(r.id, l) && std::memcmp(x.data(), y.data(), m * 4) == 0;
      }
  cudaGraphExecDestroy(exec);
  cudaStreamDestroy(stream);
  fmt::print("{} steps replayed from one graph, {} requests served; worst NMSE against the eager calls {:.2e}; "
             "stored bytes {}\n",
             steps, next_id, worst, same ? "equal" : "DIFFERENT");
  return worst < 1e-5 && same ? 0 : 1;
}

}  // namespace

int main() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::fprintf(stderr, "SKIPPED: example 08 needs a CUDA device\n");
    return 77;
  }
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "example 08 failed: %s\n", e.what());
    return 1;
  }
}
