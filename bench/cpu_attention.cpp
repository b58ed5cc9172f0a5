// CPU decode attention (q_len 1) of one layer, per format and context, in two ways measured in
// the same run: `KVCache::attend` (pages decoded a page at a time, online softmax; "attend") and
// the plain reference it is tested against, `KVCache::read` of K and V + `kvq::ref::attend`
// ("reference"). Shapes named after real models: SmolLM2-135M (9 query heads, 3 kv heads,
// head_dim 64) and Llama-3-8B (32 / 8 / 128). Bytes processed = the layer's stored bytes (pages
// and window), so GB/s is of what the step reads. One thread (cpu_threads = 1).
//
// Prefill of a T-token prompt into an empty sequence (SmolLM2 shape), append included: one
// `KVCache::prefill` call ("prefill") against the same prompt fed as `append` + `attend` in
// chunks of the window ("chunked"); items per second = prompt tokens per second.
//
//   build/bench/kvq_bench_cpu_attention --benchmark_filter='attend/smollm2'
#include <kvq/attention/reference.hpp>
#include <kvq/cache/cache.hpp>
#include <kvq/policy/static_policy.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

namespace {

struct model_shape {
  const char* name;
  int q_heads, kv_heads, head_dim;
};
constexpr model_shape models[] = {{"smollm2", 9, 3, 64}, {"llama8b", 32, 8, 128}};
const char* const formats[] = {"fp16", "int8", "kivi4/g32", "kivi2/g32", "fp8"};
constexpr int contexts[] = {1024, 8192};

// A one-layer cache holding `n` random tokens of one sequence, and a query.
struct fixture {
  kvq::KVCache cache;
  std::vector<float> q, o;
  fixture(const model_shape& m, const char* spec, int n)
      : cache(make(m, spec)), q(size_t(m.q_heads) * m.head_dim), o(q.size()) {
    kvq::check(cache.create_sequence(0));
    std::mt19937 rng(2);
    std::normal_distribution<float> nd;
    std::vector<float> k(size_t(n) * m.kv_heads * m.head_dim), v(k.size());
    for (auto* x : {&k, &v, &q})
      for (auto& e : *x) e = nd(rng);
    kvq::check(cache.append(0, 0, {k.data(), kvq::dtype::f32, n, m.kv_heads, m.head_dim},
                            {v.data(), kvq::dtype::f32, n, m.kv_heads, m.head_dim}));
  }
  static kvq::KVCache make(const model_shape& m, const char* spec) {
    kvq::cache_config cfg;
    cfg.shape = {1, m.q_heads, m.kv_heads, m.head_dim, 64, 128, 64};
    cfg.budget_bytes = 512ull << 20;
    auto pol = std::make_shared<kvq::static_policy>(kvq::static_policy::parse(spec).value_or_throw());
    return kvq::KVCache::create(cfg, pol).value_or_throw();
  }
  void report(benchmark::State& state) const {
    const auto st = cache.stats();
    state.counters["bits"] = st.page_bits();
    state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(st.page_bytes + st.window_bytes));
  }
};

void bm_attend(benchmark::State& state, model_shape m, const char* spec, int n) {
  fixture f(m, spec, n);
  const kvq::attend_item it{0, 1};
  for (auto _ : state) {
    kvq::check(f.cache.attend({&it, 1}, 0, {f.q.data(), kvq::dtype::f32, 1, m.q_heads, m.head_dim},
                              {f.o.data(), kvq::dtype::f32, 1, m.q_heads, m.head_dim}));
    benchmark::DoNotOptimize(f.o.data());
  }
  f.report(state);
}

// The reference path: every element through the codec, then scalar attention. (`read` takes
// the stored view; the step's own token is in the ring either way.)
void bm_reference(benchmark::State& state, model_shape m, const char* spec, int n) {
  fixture f(m, spec, n);
  std::vector<float> k(size_t(n) * m.kv_heads * m.head_dim), v(k.size());
  for (auto _ : state) {
    kvq::check(f.cache.read(0, 0, kvq::role::k, k));
    kvq::check(f.cache.read(0, 0, kvq::role::v, v));
    kvq::ref::attend(k.data(), v.data(), n, f.q.data(), 1, m.q_heads, m.kv_heads, m.head_dim,
                     1.f / std::sqrt(float(m.head_dim)), f.o.data());
    benchmark::DoNotOptimize(f.o.data());
  }
  f.report(state);
}

// A prompt of `n` tokens, fed in one `prefill` (chunk 0) or in `append` + `attend` chunks.
void bm_prompt(benchmark::State& state, model_shape m, const char* spec, int n, int chunk) {
  kvq::KVCache cache = fixture::make(m, spec);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> k(size_t(n) * m.kv_heads * m.head_dim), v(k.size()), q(size_t(n) * m.q_heads * m.head_dim),
      o(q.size());
  for (auto* x : {&k, &v, &q})
    for (auto& e : *x) e = nd(rng);
  auto rows = [&](const std::vector<float>& x, int64_t from, int64_t count, int heads) {
    return kvq::tensor_view{x.data() + from * heads * m.head_dim, kvq::dtype::f32, count, heads, m.head_dim};
  };
  for (auto _ : state) {
    kvq::check(cache.create_sequence(0));
    for (int64_t i = 0; i < n; i += chunk ? chunk : n) {
      const int64_t c = chunk ? std::min<int64_t>(chunk, n - i) : n;
      const kvq::tensor_mut out{o.data() + i * m.q_heads * m.head_dim, kvq::dtype::f32, c, m.q_heads, m.head_dim};
      if (chunk == 0) {
        kvq::check(cache.prefill(0, 0, rows(k, i, c, m.kv_heads), rows(v, i, c, m.kv_heads), rows(q, i, c, m.q_heads), out));
      } else {
        kvq::check(cache.append(0, 0, rows(k, i, c, m.kv_heads), rows(v, i, c, m.kv_heads)));
        const kvq::attend_item it{0, int(c)};
        kvq::check(cache.attend({&it, 1}, 0, rows(q, i, c, m.q_heads), out));
      }
    }
    benchmark::DoNotOptimize(o.data());
    kvq::check(cache.release_sequence(0));
  }
  state.SetItemsProcessed(int64_t(state.iterations()) * n);
}

const int registered = [] {
  for (const model_shape& m : models)
    for (int n : contexts)
      for (const char* spec : formats) {
        const std::string tag = std::string(m.name) + "/" + std::to_string(n / 1024) + "k/" + spec;
        benchmark::RegisterBenchmark(("attend/" + tag).c_str(), bm_attend, m, spec, n)->Unit(benchmark::kMicrosecond);
        benchmark::RegisterBenchmark(("reference/" + tag).c_str(), bm_reference, m, spec, n)
            ->Unit(benchmark::kMicrosecond);
      }
  for (int n : {1024, 4096})
    for (const char* spec : {"fp16", "kivi4/g32"}) {
      const std::string tag = "smollm2/" + std::to_string(n / 1024) + "k/" + spec;
      benchmark::RegisterBenchmark(("prefill/" + tag).c_str(), bm_prompt, models[0], spec, n, 0)
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark(("chunked/" + tag).c_str(), bm_prompt, models[0], spec, n, 128)
          ->Unit(benchmark::kMillisecond);
    }
  return 0;
}();

}  // namespace

BENCHMARK_MAIN();
