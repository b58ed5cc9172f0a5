// The host and device time of an eager decode step, the way an engine issues it: for every layer
// of a Llama-8B-like stack (32 layers, 32 query heads, 8 kv heads, head_dim 128, kivi4/g32 pages,
// CUDA backend) the new token of every sequence appended (`append_batch`) and the batch attended
// (`attend`), steps issued back to back with no synchronization of the engine's own. Per
// configuration (value checks on, the default, and off) and batch:
// - host: the time the host spends issuing one step (its 64 calls), averaged over the steps;
// - device: the stream's time per step (CUDA events around a block of steps, divided);
// - wall: from the first call of a block to the end of its work on the stream, per step.
// A step whose host time is below its device time lets the host run ahead of the GPU (the engine
// can prepare the next step while this one runs); a call that synchronizes makes host >= device.
//   kvq_bench_step_cuda [--context 4096] [--steps 64] [--batches 1,32]
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <kvq/cache/cache.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/static_policy.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_check.hpp"

namespace {

constexpr int layers = 32, Hq = 32, H = 8, D = 128;

struct device_halves {
  explicit device_halves(size_t n) { CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * 2)); }
  ~device_halves() { cudaFree(p); }
  device_halves(const device_halves&) = delete;
  device_halves& operator=(const device_halves&) = delete;
  void* p = nullptr;
};

void fill_random(device_halves& d, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<uint16_t> h(n);
  for (auto& x : h) x = kvq::float_to_half(g(rng));
  CUDA_CHECK(cudaMemcpy(d.p, h.data(), n * 2, cudaMemcpyHostToDevice));
}

struct timing {
  double host_us, device_us, wall_us;
};

timing run(int batch, int context, int steps, bool check_values, cudaStream_t stream) {
  kvq::cache_config cfg;
  cfg.shape = {.layers = layers, .q_heads = Hq, .kv_heads = H, .head_dim = D, .page_tokens = 64, .window = 128,
               .recent = 64};
  cfg.where = kvq::backend::cuda;
  cfg.max_sequences = batch;
  cfg.max_tokens = context + steps + 64;
  cfg.stream = stream;
  cfg.check_values = check_values;
  // pages + windows of every sequence, with room
  cfg.budget_bytes = uint64_t(batch) * layers * uint64_t(context + steps + 256) * H * D * 2 * 2 * 5 / 16 +
                     uint64_t(batch + 1) * (16ull << 20) + (256ull << 20);
  auto pol = std::make_shared<kvq::static_policy>(kvq::static_policy::parse("kivi4/g32").value_or_throw());
  auto cache = kvq::KVCache::create(cfg, pol).value_or_throw();
  // the prompt: one chunk per (sequence, layer)
  const size_t prompt_elems = size_t(context) * H * D;
  device_halves pk(prompt_elems), pv(prompt_elems);
  fill_random(pk, prompt_elems, 1);
  fill_random(pv, prompt_elems, 2);
  const kvq::tensor_view pkv{pk.p, kvq::dtype::f16, context, H, D, 0}, pvv{pv.p, kvq::dtype::f16, context, H, D, 0};
  for (int s = 0; s < batch; ++s) {
    kvq::check(cache.create_sequence(s));
    for (int l = 0; l < layers; ++l) kvq::check(cache.append(s, l, pkv, pvv));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  // a step's inputs
  device_halves k(size_t(batch) * H * D), v(size_t(batch) * H * D), q(size_t(batch) * Hq * D), o(size_t(batch) * Hq * D);
  fill_random(k, size_t(batch) * H * D, 3);
  fill_random(v, size_t(batch) * H * D, 4);
  fill_random(q, size_t(batch) * Hq * D, 5);
  std::vector<kvq::append_item> adds;
  std::vector<kvq::attend_item> items;
  for (int s = 0; s < batch; ++s) adds.push_back({s, 1}), items.push_back({s, 1});
  const kvq::tensor_view kv{k.p, kvq::dtype::f16, batch, H, D, 0}, vv{v.p, kvq::dtype::f16, batch, H, D, 0};
  const kvq::tensor_view qv{q.p, kvq::dtype::f16, batch, Hq, D, 0};
  const kvq::tensor_mut ov{o.p, kvq::dtype::f16, batch, Hq, D, 0};
  auto step = [&] {
    for (int l = 0; l < layers; ++l) {
      kvq::check(cache.append_batch(adds, l, kv, vv));
      kvq::check(cache.attend(items, l, qv, ov));
    }
  };
  for (int i = 0; i < 4; ++i) step();  // warm-up: workspaces sized, clocks up
  CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  double host = 0;
  const auto wall0 = std::chrono::steady_clock::now();
  CUDA_CHECK(cudaEventRecord(start, stream));
  for (int i = 0; i < steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    host += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  }
  CUDA_CHECK(cudaEventRecord(stop, stream));
  CUDA_CHECK(cudaEventSynchronize(stop));
  const double wall = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - wall0).count();
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  return {host / steps, 1000.0 * ms / steps, wall / steps};
}

}  // namespace

int main(int argc, char** argv) {
  int context = 4096, steps = 64;
  std::vector<int> batches{1, 32};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--context")
      context = std::atoi(argv[i + 1]);
    else if (a == "--steps")
      steps = std::atoi(argv[i + 1]);
    else if (a == "--batches") {
      batches.clear();
      std::stringstream ss(argv[i + 1]);
      for (std::string t; std::getline(ss, t, ',');) batches.push_back(std::atoi(t.c_str()));
    } else {
      std::fprintf(stderr, "unknown option %s\n", argv[i]);
      return 2;
    }
  }
  if (context < 1 || steps < 1 || batches.empty()) {
    std::fprintf(stderr, "need context >= 1, steps >= 1 and at least one batch\n");
    return 2;
  }
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# %s; eager decode step, %d layers (append_batch + attend each), kivi4/g32, context %d, %d steps\n",
              prop.name, layers, context, steps);
  std::printf("check_values,batch,host_us,device_us,wall_us,host/device\n");
  for (int b : batches)
    for (bool checks : {true, false}) {
      const timing t = run(b, context, steps, checks, stream);
      std::printf("%s,%d,%.1f,%.1f,%.1f,%.3f\n", checks ? "on" : "off", b, t.host_us, t.device_us, t.wall_us,
                  t.host_us / t.device_us);
      std::fflush(stdout);
    }
  CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}
