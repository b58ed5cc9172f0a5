// Cost of EchoKV's tensor-parallel tier vote (NCCL) against the decode step it rides on, on every
// visible GPU (N >= 2; N divides 8), one rank per GPU, each rank a thread. The model is
// Llama-3-8B-shaped (32 layers, 32 query heads, 8 kv heads, head_dim 128) sharded over N ranks:
// each rank's CUDA cache holds 8/N kv heads, kivi4/g32 pages, at `context` tokens per sequence.
//   step  one decode step of the rank's cache (per layer: append_batch of a token per sequence,
//         attend of the batch), policy frozen, timed with CUDA events over `steps` steps: the
//         attention and append share of the time per output token (a real step adds the weights'
//         GEMMs and the other collectives, so it is longer and the ratio below smaller);
//   vote  `tp_echokv::vote`: the proposal (32 bytes) staged to the device, an ncclAllGather, the
//         result back to the host and the majority applied: host wall time per call, `votes`
//         calls back to back (every rank calls, so each call is also the ranks' rendezvous).
// At canary rate r a step of a batch of B sequences holds a canary with P = 1 - (1 - r)^B, so the
// vote adds P x vote / step to the time per output token; printed at r = 1/64 against the 0.05 %
// target (docs/decisions.md, "Tensor parallel").
//   kvq_bench_tp_vote_cuda [--batches 1,8] [--context 8192] [--steps 64] [--votes 2000]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <kvq/cache/cache.hpp>
#include <kvq/dist/nccl_communicator.hpp>
#include <kvq/dist/tp_echokv.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/echokv.hpp>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda_check.hpp"

namespace {

constexpr int layers = 32, q_heads = 32, kv_heads = 8, D = 128;

struct rank_result {
  double step_ms = 0;           // mean decode step
  std::vector<double> vote_us;  // every timed vote
};

rank_result run_rank(int rank, int ranks, const kvq::dist::nccl_id& id, int batch, int context, int steps, int votes) {
  CUDA_CHECK(cudaSetDevice(rank));
  const int H = kv_heads / ranks, Hq = q_heads / ranks;
  auto comm = kvq::dist::make_nccl_communicator(ranks, rank, id, rank).value_or_throw();
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  kvq::echokv_options o;
  o.initial_tier = 1;  // kivi4/g32 pages
  const int64_t total = context + steps + 64;
  kvq::cache_config cfg;
  cfg.shape = {layers, Hq, H, D, 64, 128, 64};
  cfg.where = kvq::backend::cuda;
  cfg.stream = stream;
  cfg.check_values = false;
  cfg.max_sequences = batch;
  cfg.max_tokens = total;
  cfg.budget_bytes = uint64_t(double(batch) * layers * total * H * D * 2 * 9.0 / 8 * 1.05) +
                     uint64_t(batch) * layers * H * 2 * 128 * D * 2 + (256ull << 20);
  auto cache = kvq::KVCache::create(cfg, std::make_shared<kvq::echokv_policy>(o)).value_or_throw();
  auto tp = kvq::dist::tp_echokv::create(cache, *comm).value_or_throw();

  const int chunk = 4096;
  std::mt19937 rng(uint32_t(7 + rank));
  std::normal_distribution<float> nd;
  std::vector<uint16_t> host(size_t(chunk) * H * D);
  for (auto& x : host) x = kvq::float_to_half(nd(rng));
  void *dk, *dv, *dq, *dout;
  CUDA_CHECK(cudaMalloc(&dk, host.size() * 2));
  CUDA_CHECK(cudaMalloc(&dv, host.size() * 2));
  CUDA_CHECK(cudaMemcpy(dk, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(dv, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
  for (int s = 0; s < batch; ++s) {
    kvq::check(cache.create_sequence(s));
    for (int l = 0; l < layers; ++l)
      for (int done = 0; done < context; done += chunk) {
        const int n = std::min(chunk, context - done);
        kvq::check(cache.append(s, l, {dk, kvq::dtype::f16, n, H, D}, {dv, kvq::dtype::f16, n, H, D}));
      }
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<uint16_t> q(size_t(batch) * Hq * D);
  for (auto& x : q) x = kvq::float_to_half(nd(rng));
  CUDA_CHECK(cudaMalloc(&dq, q.size() * 2));
  CUDA_CHECK(cudaMalloc(&dout, q.size() * 2));
  CUDA_CHECK(cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
  std::vector<kvq::attend_item> items;
  std::vector<kvq::append_item> adds;
  for (int b = 0; b < batch; ++b) items.push_back({b, 1}), adds.push_back({b, 1});

  tp.policy().freeze();  // the step alone: no canary in the timed steps
  auto decode_step = [&] {
    for (int l = 0; l < layers; ++l) {
      kvq::check(cache.append_batch(adds, l, {dk, kvq::dtype::f16, batch, H, D}, {dv, kvq::dtype::f16, batch, H, D}));
      kvq::check(cache.attend(items, l, {dq, kvq::dtype::f16, batch, Hq, D}, {dout, kvq::dtype::f16, batch, Hq, D}));
    }
  };
  for (int s = 0; s < 4; ++s) decode_step();  // warm-up
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  CUDA_CHECK(cudaEventRecord(e0, stream));
  for (int s = 0; s < steps; ++s) decode_step();
  CUDA_CHECK(cudaEventRecord(e1, stream));
  CUDA_CHECK(cudaEventSynchronize(e1));
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  rank_result r;
  r.step_ms = double(ms) / steps;

  for (int i = 0; i < 20; ++i) kvq::check(tp.vote());  // warm-up, and the ranks line up
  r.vote_us.reserve(size_t(votes));
  for (int i = 0; i < votes; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    kvq::check(tp.vote());
    r.vote_us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  cudaFree(dk), cudaFree(dv), cudaFree(dq), cudaFree(dout);
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  return r;
}

std::vector<int> parse_list(const char* s) {
  std::vector<int> out;
  for (const char* p = s; *p;) {
    out.push_back(std::atoi(p));
    while (*p && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return out;
}

double percentile(std::vector<double> x, double p) {
  std::sort(x.begin(), x.end());
  return x[std::min(x.size() - 1, size_t(p * double(x.size() - 1) + 0.5))];
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> batches = {1, 8};
  int context = 8192, steps = 64, votes = 2000;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--batches"))
      batches = parse_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--context"))
      context = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--steps"))
      steps = std::atoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--votes"))
      votes = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown option %s\n", argv[i]);
      return 2;
    }
  }
  int ranks = 0;
  if (cudaGetDeviceCount(&ranks) != cudaSuccess) ranks = 0;
  if (ranks < 2) {
    std::fprintf(stderr, "SKIPPED: the tensor-parallel vote benchmark needs >= 2 CUDA devices, found %d\n", ranks);
    return 77;
  }
  while (kv_heads % ranks) --ranks;  // ranks must divide the kv heads
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf(
      "tensor-parallel EchoKV vote, %d ranks on %s, Llama-3-8B shape (32 layers, 32/8 heads, d 128) "
      "sharded %d kv heads per rank, kivi4/g32 pages, context %d\n",
      ranks, prop.name, kv_heads / ranks, context);
  std::printf("%6s %12s %12s %12s %12s %14s %10s\n", "batch", "step ms", "vote us p50", "vote us mean", "vote us p99",
              "P(canary)", "overhead");
  for (int batch : batches) {
    const kvq::dist::nccl_id id = kvq::dist::nccl_make_id().value_or_throw();
    std::vector<rank_result> res(static_cast<size_t>(ranks));
    std::vector<std::thread> threads;
    std::vector<std::string> errors(static_cast<size_t>(ranks));
    for (int r = 0; r < ranks; ++r)
      threads.emplace_back([&, r] {
        try {
          res[size_t(r)] = run_rank(r, ranks, id, batch, context, steps, votes);
        } catch (const std::exception& e) {
          errors[size_t(r)] = e.what();
        }
      });
    for (auto& t : threads) t.join();
    for (int r = 0; r < ranks; ++r)
      if (!errors[size_t(r)].empty()) {
        std::fprintf(stderr, "rank %d: %s\n", r, errors[size_t(r)].c_str());
        return 1;
      }
    // the slowest rank sets the step; every rank waits for the vote's last arrival
    double step = 0;
    std::vector<double> all;
    for (const auto& r : res) {
      step = std::max(step, r.step_ms);
      all.insert(all.end(), r.vote_us.begin(), r.vote_us.end());
    }
    double mean = 0;
    for (double v : all) mean += v;
    mean /= double(all.size());
    const double p = 1.0 - std::pow(1.0 - 1.0 / 64, batch);
    const double overhead = p * mean * 1e-3 / step;
    std::printf("%6d %12.3f %12.1f %12.1f %12.1f %14.4f %9.4f%% %s\n", batch, step, percentile(all, 0.5), mean,
                percentile(all, 0.99), p, 100 * overhead, overhead <= 5e-4 ? "(<= 0.05 %: met)" : "(> 0.05 %: missed)");
  }
  return 0;
}
