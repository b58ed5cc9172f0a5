// GPU prefill benchmark of kvq's CUDA backend: a 32K-token prompt fed as 8 chunks of 4K through
// `KVCache::prefill` (each call appends its chunk and attends its queries to the stored prefix and,
// causally, to the chunk in FP16), Llama-8B shape (32 query heads, 8 kv heads, head_dim 128), one
// layer, one format per run. CUDA-event timing of all chunk calls of a prompt (median over
// iterations; a fresh sequence each iteration, its release outside the timing); value checks off
// (the engine's synchronization-free path). Counters: ms per prompt and the attention TFLOP/s
// (the visible (query, key) pairs x 4 x heads x head_dim). The peer is bench/peer_prefill.py
// (PyTorch SDPA in BF16 over the same chunks); bench/run_gpu.sh's `prefill` step runs both and
// prints the ratios. The `prefix/` rows time the prefix part alone: the whole prompt stored once,
// then per chunk `attend_prefix` of its queries over the tokens before it (what each prefill's
// prefix kernel computes), FLOPs counted over those pairs only.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <kvq/cache/cache.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/static_policy.hpp>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cuda_check.hpp"

namespace {

constexpr int Hq = 32, H = 8, D = 128;

// `count` random fp16 values (normal draws), uploaded; the caller frees them.
void* random_device(std::mt19937& rng, size_t count) {
  std::normal_distribution<float> nd;
  std::vector<uint16_t> host(count);
  for (auto& x : host) x = kvq::float_to_half(nd(rng));
  void* d;
  CUDA_CHECK(cudaMalloc(&d, count * 2));
  CUDA_CHECK(cudaMemcpy(d, host.data(), count * 2, cudaMemcpyHostToDevice));
  return d;
}

double attention_flops(int prompt, int chunk, bool prefix_only) {
  double pairs = 0;
  for (int c0 = 0; c0 < prompt; c0 += chunk) {
    const double t = std::min(chunk, prompt - c0);
    pairs += t * c0 + (prefix_only ? 0.0 : t * (t + 1) / 2);
  }
  return 4.0 * pairs * Hq * D;
}

void bm_prefill(benchmark::State& state, const std::string& spec, int prompt, int chunk, bool prefix_only) {
  const auto fp = kvq::parse_format_pair(spec).value();
  kvq::cache_config cfg;
  cfg.shape = {1, Hq, H, D, 64, 128, 64};
  cfg.where = kvq::backend::cuda;
  cfg.max_sequences = 2;
  cfg.max_tokens = prompt;
  cfg.check_values = false;
  cfg.budget_bytes = uint64_t(prompt) * H * D * 2 * 2 * 2 + (64 << 20);  // (fp16 size: enough for every format)
  auto cr = kvq::KVCache::create(cfg, std::make_shared<kvq::static_policy>(fp));
  if (!cr.ok()) {
    state.SkipWithError(cr.error().to_string().c_str());
    return;
  }
  auto cache = std::move(cr).value();
  std::mt19937 rng(7);
  void* dk = random_device(rng, size_t(prompt) * H * D);
  void* dv = random_device(rng, size_t(prompt) * H * D);
  void* dq = random_device(rng, size_t(prompt) * Hq * D);
  void* dout;
  CUDA_CHECK(cudaMalloc(&dout, size_t(prompt) * Hq * D * 2));
  float* dlse;  // [prompt][Hq] the prefix part's log-sum-exps, as an engine keeps them to merge
  CUDA_CHECK(cudaMalloc(&dlse, size_t(prompt) * Hq * sizeof(float)));
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  const auto chunks = [&](bool prefix_part) {
    for (int c0 = 0; c0 < prompt; c0 += chunk) {
      const int t = std::min(chunk, prompt - c0);
      const auto* k = static_cast<const uint16_t*>(dk) + size_t(c0) * H * D;
      const auto* v = static_cast<const uint16_t*>(dv) + size_t(c0) * H * D;
      const auto* q = static_cast<const uint16_t*>(dq) + size_t(c0) * Hq * D;
      auto* o = static_cast<uint16_t*>(dout) + size_t(c0) * Hq * D;
      if (!prefix_part)
        kvq::check(cache.prefill(0, 0, {k, kvq::dtype::f16, t, H, D}, {v, kvq::dtype::f16, t, H, D},
                                 {q, kvq::dtype::f16, t, Hq, D}, {o, kvq::dtype::f16, t, Hq, D}));
      else if (c0 > 0)
        kvq::check(cache.attend_prefix(0, 0, c0, {q, kvq::dtype::f16, t, Hq, D}, {o, kvq::dtype::f16, t, Hq, D},
                                       dlse + size_t(c0) * Hq));
    }
  };
  if (prefix_only) {  // the prompt stored once
    kvq::check(cache.create_sequence(0));
    chunks(false);
  }
  auto prompt_pass = [&] {
    if (!prefix_only) kvq::check(cache.create_sequence(0));
    cudaEventRecord(e0);
    chunks(prefix_only);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    if (!prefix_only) kvq::check(cache.release_sequence(0));
    return double(ms) * 1e-3;
  };
  for (int w = 0; w < 2; ++w) prompt_pass();
  std::vector<double> times;
  for (auto _ : state) {
    const double s = prompt_pass();
    state.SetIterationTime(s);
    times.push_back(s);
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  std::sort(times.begin(), times.end());
  const double med = times[times.size() / 2];
  state.counters["ms_per_prompt"] = med * 1e3;
  state.counters["TFLOPs"] = attention_flops(prompt, chunk, prefix_only) / med / 1e12;
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(dq);
  cudaFree(dout);
  cudaFree(dlse);
}

}  // namespace

int main(int argc, char** argv) {
  for (const bool prefix_only : {false, true})
    for (const char* spec : {"fp16", "kivi4/g32"})
      benchmark::RegisterBenchmark((std::string(prefix_only ? "prefix/" : "prefill/") + spec + "/32768/4096").c_str(),
                                   bm_prefill, std::string(spec), 32768, 4096, prefix_only)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond)
          ->Iterations(10);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
