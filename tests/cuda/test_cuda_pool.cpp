// An engine-owned pool on CUDA (`page_tables::shared`: an int32 block table per sequence shared by
// every layer, a table wider than the pages used, blocks of one size per layer naming their
// formats in a header, one buffer for every layer's pool and another for the windows). The engine
// of tests/pool_engine.hpp drives `append_run`, `prefill_run` (chunks longer than the window and
// over a stored prefix) and `attend_run` (batched decode) on the device while its host mirror runs
// the same calls on the CPU (kvq/attention/cpu_pool.hpp, equal to KVCache on the CPU bit for bit:
// tests/test_pool.cpp). The device pool and windows must equal the mirror's byte for byte after
// every append, and every attention output must match the CPU's within the fp16-MMA bound.
#include "gpu_test.hpp"

#include <kvq/cuda/paged_attention.hpp>

#include <cstring>
#include <vector>

#include "pool_engine.hpp"

using namespace kvq;
using namespace kvq::gpu_test;
using namespace kvq::pool_test;

namespace {

constexpr double nmse_bound = 2e-5;  // as tests/cuda/test_cuda_cache.cpp: fp16 MMA operands

struct device_pool {
  const engine& host;
  dev_mem pool{host.pool.size()}, windows{host.windows.size()}, table{host.table.size() * sizeof(int32_t)};
  dev_mem workspace{64u << 20};

  explicit device_pool(const engine& h) : host(h) {
    REQUIRE(cudaMemset(pool.p, 0, host.pool.size()) == cudaSuccess);
    REQUIRE(cudaMemset(windows.p, 0, host.windows.size()) == cudaSuccess);
  }
  cuda::paged_view view() const {
    cuda::paged_view kv = host.view();
    kv.arena = static_cast<const uint8_t*>(pool.p);
    kv.blocks = static_cast<const uint32_t*>(table.p);
    kv.windows = static_cast<const uint8_t*>(windows.p);
    return kv;
  }
  // The engine's table, as it uploads it before a step.
  void upload_table() { upload(table, host.table); }
  void require_same_bytes() const {
    std::vector<uint8_t> p(host.pool.size()), w(host.windows.size());
    REQUIRE(cudaMemcpy(p.data(), pool.p, p.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
    REQUIRE(cudaMemcpy(w.data(), windows.p, w.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
    REQUIRE(p == host.pool);
    REQUIRE(w == host.windows);
  }
};

// A host tensor's copy on the device.
struct dev_rows {
  dev_mem mem;
  explicit dev_rows(const std::vector<float>& x) : mem(x.size() * sizeof(float)) { upload(mem, x); }
  tensor_view view(int64_t tokens, int heads) const { return {mem.p, dtype::f32, tokens, heads, d}; }
};

std::vector<float> download(const dev_mem& m, size_t count) {
  std::vector<float> x(count);
  REQUIRE(cudaMemcpy(x.data(), m.p, count * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
  return x;
}

// One layer's append on both sides: the device from the mirror's plan, then the mirror.
void append_both(engine& host, device_pool& dev, std::span<const int> ids, std::span<const int32_t> m, int layer,
                 const std::vector<float>& k, const std::vector<float>& v, int64_t tokens) {
  const auto c = host.plan_append(ids, m, layer, rows(k, tokens, kvh), rows(v, tokens, kvh));
  dev.upload_table();
  const dev_rows kd(k), vd(v);
  cuda::append_args a = c->args;
  a.kv = dev.view();
  a.arena = static_cast<uint8_t*>(dev.pool.p), a.windows = static_cast<uint8_t*>(dev.windows.p);
  a.k = kd.view(tokens, kvh), a.v = vd.view(tokens, kvh);
  REQUIRE(cuda::append_run(a, nullptr).ok());
  REQUIRE(cpu::pool_append(c->args).ok());
  host.commit(ids, m, layer);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  dev.require_same_bytes();
}

// Each layer's attention rule (`variant_args`) as the mirror takes it (sink logits in host memory)
// and as the device calls take it (in device memory); plain by default.
struct layer_variants {
  variant_args host[layers]{}, device[layers]{};
};

// Two sequences' prompts (one chunk of 300 tokens, two of 130 and 90) appended and attended by
// `prefill_run` over the stored prefix on both sides, every layer.
void prefill_chunks(engine& host, device_pool& dev, std::mt19937& rng, const layer_variants& var) {
  const int ids[] = {0, 1};
  const std::vector<std::vector<int32_t>> chunks = {{300}, {130, 90}};
  for (int id : ids)
    for (int32_t T : chunks[size_t(id)])
      for (int l = 0; l < layers; ++l) {
        const auto k = randn(rng, size_t(T) * kvh * d), v = randn(rng, size_t(T) * kvh * d),
                   q = randn(rng, size_t(T) * hq * d);
        const engine::sequence before = host.seqs[size_t(id)];
        const int one[] = {id};
        const int32_t m[] = {T};
        append_both(host, dev, one, m, l, k, v, T);
        cuda::prefill_args a = host.prefill_args(before, l, T);
        std::vector<float> o_host(q.size());
        a.q = q.data(), a.q_type = dtype::f32, a.o = o_host.data(), a.o_type = dtype::f32;
        a.k = rows(k, T, kvh), a.v = rows(v, T, kvh);
        a.variant = var.host[l];
        REQUIRE(cpu::pool_prefill(host.workers, a).ok());
        const dev_rows kd(k), vd(v), qd(q);
        dev_mem od(q.size() * sizeof(float));
        a.kv = dev.view();
        a.q = qd.mem.p, a.o = od.p, a.k = kd.view(T, kvh), a.v = vd.view(T, kvh);
        a.variant = var.device[l];
        REQUIRE(cuda::prefill_can_implement(a).ok());
        REQUIRE(cuda::prefill_workspace_bytes(a) <= 64u << 20);
        REQUIRE(cuda::prefill_run(a, dev.workspace.p, 64u << 20, nullptr).ok());
        CAPTURE(id, T, l, before.n);
        CHECK(nmse(download(od, q.size()), o_host) < nmse_bound);
      }
}

// `steps` batched decode steps of both sequences: a token appended to each, every layer, then
// `attend_run` over the batch against the mirror's `pool_attend`.
void decode_steps(engine& host, device_pool& dev, std::mt19937& rng, int steps, const layer_variants& var) {
  const int ids[] = {0, 1};
  for (int step = 0; step < steps; ++step) {
    for (int l = 0; l < layers; ++l) {
      const int32_t m[] = {1, 1};
      append_both(host, dev, ids, m, l, randn(rng, 2 * kvh * d), randn(rng, 2 * kvh * d), 2);
    }
    for (int l = 0; l < layers; ++l) {
      const auto q = randn(rng, 2 * hq * d);
      const auto items = host.decode_items(ids);
      cuda::attend_args a;
      a.kv = host.view();
      a.layer = l, a.q_heads = hq;
      a.items = items;
      std::vector<float> o_host(q.size());
      a.q = q.data(), a.q_type = dtype::f32, a.o = o_host.data(), a.o_type = dtype::f32;
      a.variant = var.host[l];
      REQUIRE(cpu::pool_attend(host.workers, a).ok());
      a.kv = dev.view();
      const dev_rows qd(q);
      dev_mem od(q.size() * sizeof(float));
      a.q = qd.mem.p, a.o = od.p;
      a.variant = var.device[l];
      a.one_format_per_head = true;  // (the engine's policy: one pair per layer)
      REQUIRE(cuda::attend_can_implement(a).ok());
      REQUIRE(cuda::attend_workspace_bytes(a) <= 64u << 20);
      REQUIRE(cuda::attend_run(a, dev.workspace.p, 64u << 20, nullptr).ok());
      CAPTURE(step, l, host.seqs[0].n, host.seqs[1].n);
      CHECK(nmse(download(od, q.size()), o_host) < nmse_bound);
    }
  }
}

}  // namespace

TEST_CASE("engine pool on CUDA: append, long prefill and batched decode over shared block tables", "[gpu][pool]") {
  std::mt19937 rng(21);
  engine host;
  device_pool dev(host);
  prefill_chunks(host, dev, rng, {});
  decode_steps(host, dev, rng, 150, {});
  CHECK(host.seqs[1].n == 370);
}

// The low-level calls with `variant_args`: the engine's layers take a sliding window with
// soft-capping and sink logits (layer 0) and a window shorter than a page (layer 1), the sink
// logits in the memory each side reads (host for the mirror, device for `prefill_run` and
// `attend_run`); a long prefill over a stored prefix and batched decode steps past the windows.
TEST_CASE("engine pool on CUDA: prefill_run and attend_run apply variant_args", "[gpu][pool][variants]") {
  std::mt19937 rng(22);
  engine host;
  device_pool dev(host);
  const std::vector<float> sinks = randn(rng, hq);
  dev_mem sinks_d(sinks.size() * sizeof(float));
  upload(sinks_d, sinks);
  layer_variants var;
  var.host[0] = {100, 3.f, sinks.data()};
  var.host[1] = {37, 0.f, nullptr};
  var.device[0] = {100, 3.f, static_cast<const float*>(sinks_d.p)};
  var.device[1] = var.host[1];
  prefill_chunks(host, dev, rng, var);
  decode_steps(host, dev, rng, 60, var);
}
