// Example 09: an engine that owns its KV pool, as vLLM's or SGLang's block managers do, with kvq's
// quantized pages inside it: the low-level calls over `page_tables::shared`
// (kvq/cuda/paged_attention.hpp on CUDA, kvq/attention/cpu_pool.hpp on the CPU, the same
// argument structs).
//
// What an engine developer learns here:
// - the pool: one buffer of [layers][pool_blocks] blocks of one size (`pool_block_bytes_per_head`:
//   here kv head 0 keeps kivi4 pages, kv head 1 4-bit keys and 2-bit values), and one of
//   window blocks (`window_block_bytes`: a sequence's FP16 rings, its newest tokens);
// - one int32 block table row per sequence, shared by every layer (block id b of layer l is at
//   pool + l * layer_bytes + b * block_bytes); the engine allocates block ids from its free list
//   when `pages_to_encode` says a page will be cut, and frees them when a request finishes;
//   every block names its formats in a header, so the engine keeps no format table;
// - per layer: `append_run` (the batch's new tokens; their pages encoded), `prefill_run` (a
//   prompt of any length, one chunk) and `attend_run` (a decode step over the batch), with the
//   engine's lengths (n, encoded e) passed per call: plan -> run, nothing allocated inside.
// A continuously batched loop admits requests while blocks are free, decodes, and releases.
//
// Self-checking: the CPU run feeds a `KVCache` (the same formats per head, as a static policy) the
// same tokens beside the pool, and every attention output must equal the cache's bit for bit; where
// a GPU exists, the CUDA run must leave the CPU run's pool byte for byte and match its outputs
// within fp16 MMA rounding. It also prints what the 4- and 2-bit pages cost against FP16 attention
// over the same (random) tokens.
// Usage: kvq_example_engine_pool [cpu|cuda|all] (default all; without a GPU the CUDA part says it skipped).
#include <kvq/attention/cpu_pool.hpp>
#include <kvq/attention/reference.hpp>
#include <kvq/cache/cache.hpp>
#include <kvq/cuda/paged_attention.hpp>
#include <kvq/policy/static_policy.hpp>
#include <kvq/format/numeric.hpp>

#if KVQ_WITH_CUDA
#include <cuda_runtime.h>
#endif
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <deque>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr int layers = 4, q_heads = 8, kv_heads = 2, d = 128, P = 64, R = 128, recent = 64;
constexpr int max_batch = 4, max_blocks = 16, pool_blocks = 12;  // (admission waits for blocks)
// kv head 0 keeps kivi4 pages, kv head 1 4-bit keys and 2-bit values: formats mixed per head.
const char* const head_specs[kv_heads] = {"kivi4/g32", "k=kivi4/g32,v=kivi2/g32"};
// The same as a KVCache static policy: every layer's kv head 1 overridden.
const char* const cache_policy = "kivi4/g32;0.1=k=kivi4/g32,v=kivi2/g32;1.1=k=kivi4/g32,v=kivi2/g32;"
                                 "2.1=k=kivi4/g32,v=kivi2/g32;3.1=k=kivi4/g32,v=kivi2/g32";
constexpr double device_nmse_bound = 2e-5;  // CUDA against the CPU over the same bytes

struct request {
  int prompt, generate;
};
const request requests[] = {{200, 120}, {90, 200}, {300, 80}, {150, 160}, {64, 100}, {250, 60}};

// Where the pool lives: host vectors, or device buffers the engine allocated.
struct memory {
  bool device = false;
  uint8_t* pool = nullptr;
  uint8_t* windows = nullptr;
  int32_t* table = nullptr;
  float *k = nullptr, *v = nullptr, *q = nullptr, *o = nullptr;  // the step's rows
  void* workspace = nullptr;
  size_t workspace_bytes = 64u << 20;
  std::vector<uint8_t> host_pool, host_windows;
  std::vector<float> host_rows[4];
};

#if KVQ_WITH_CUDA
void cuda_ok(cudaError_t e) {
  if (e != cudaSuccess) throw std::runtime_error(cudaGetErrorString(e));
}
#endif

// Copies `count` elements to (or, `back`, from) where the run's memory is.
template <class T>
void copy(const memory& m, T* dst, const T* src, size_t count, bool back = false) {
#if KVQ_WITH_CUDA
  if (m.device) {
    cuda_ok(cudaMemcpy(dst, src, count * sizeof(T), back ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice));
    return;
  }
#endif
  (void)m, (void)back;
  std::memcpy(dst, src, count * sizeof(T));
}

// The three calls on the run's device: the same arguments, CUDA or the CPU.
void run_append(const kvq::cuda::append_args& a, bool on_gpu) {
#if KVQ_WITH_CUDA
  if (on_gpu) return kvq::check(kvq::cuda::append_run(a, nullptr));
#endif
  (void)on_gpu;
  kvq::check(kvq::cpu::pool_append(a));
}
void run_prefill(const kvq::cuda::prefill_args& a, const memory& m, kvq::cpu::worker_pool& workers) {
#if KVQ_WITH_CUDA
  if (m.device) {
    kvq::check(kvq::cuda::prefill_can_implement(a));
    if (kvq::cuda::prefill_workspace_bytes(a) > m.workspace_bytes) throw std::runtime_error("prefill workspace");
    return kvq::check(kvq::cuda::prefill_run(a, m.workspace, m.workspace_bytes, nullptr));
  }
#endif
  (void)m;
  kvq::check(kvq::cpu::pool_prefill(workers, a));
}
void run_attend(const kvq::cuda::attend_args& a, const memory& m, kvq::cpu::worker_pool& workers) {
#if KVQ_WITH_CUDA
  if (m.device) {
    kvq::check(kvq::cuda::attend_can_implement(a));
    if (kvq::cuda::attend_workspace_bytes(a) > m.workspace_bytes) throw std::runtime_error("attend workspace");
    return kvq::check(kvq::cuda::attend_run(a, m.workspace, m.workspace_bytes, nullptr));
  }
#endif
  (void)m;
  kvq::check(kvq::cpu::pool_attend(workers, a));
}

struct sequence {
  int id = -1, slot = 0;
  int32_t n = 0, e = 0;
  int left = 0;                         // tokens still to generate
  std::vector<float> k[layers], v[layers];  // every token as appended, rounded to fp16 (the FP16 reference)
};

struct run_result {
  std::vector<float> outputs;  // every attention output, in order
  std::vector<uint8_t> pool;   // the pool at the end
  int failures = 0;
};

run_result serve(bool on_gpu) {
  const char* name = on_gpu ? "cuda" : "cpu";
  kvq::format_pair cands[kv_heads];
  for (int h = 0; h < kv_heads; ++h) cands[h] = kvq::parse_format_pair(head_specs[h]).value_or_throw();
  // (each head keeps its pair: the block holds each head's own pages; a policy that moves formats
  // over time sizes blocks for all its candidates instead, `pool_block_bytes`)
  const uint32_t block_bytes = kvq::cuda::pool_block_bytes_per_head(d, P, cands).value_or_throw();
  const uint64_t layer_bytes = uint64_t(pool_blocks) * block_bytes;
  const uint64_t window_bytes = kvq::cuda::window_block_bytes(layers, kv_heads, d, R);

  memory mem;
  mem.device = on_gpu;
  const size_t pool_size = size_t(layers) * layer_bytes, windows_size = size_t(max_batch) * window_bytes;
  const size_t rows = size_t(1024) * q_heads * d;  // the largest prompt's query rows
  if (on_gpu) {
#if KVQ_WITH_CUDA
    cuda_ok(cudaMalloc(reinterpret_cast<void**>(&mem.pool), pool_size));
    cuda_ok(cudaMalloc(reinterpret_cast<void**>(&mem.windows), windows_size));
    cuda_ok(cudaMalloc(reinterpret_cast<void**>(&mem.table), size_t(max_batch) * max_blocks * 4));
    for (float** p : {&mem.k, &mem.v, &mem.q, &mem.o}) cuda_ok(cudaMalloc(reinterpret_cast<void**>(p), rows * 4));
    cuda_ok(cudaMalloc(&mem.workspace, mem.workspace_bytes));
    cuda_ok(cudaMemset(mem.pool, 0, pool_size));
#endif
  } else {
    mem.host_pool.assign(pool_size, 0);
    mem.host_windows.assign(windows_size, 0);
    mem.pool = mem.host_pool.data(), mem.windows = mem.host_windows.data();
    for (int i = 0; i < 4; ++i) mem.host_rows[i].resize(rows);
    mem.k = mem.host_rows[0].data(), mem.v = mem.host_rows[1].data();
    mem.q = mem.host_rows[2].data(), mem.o = mem.host_rows[3].data();
  }
  std::vector<int32_t> table(size_t(max_batch) * max_blocks, -1);  // the engine's block table (host copy)
  std::vector<int32_t> free_blocks;
  for (int b = pool_blocks - 1; b >= 0; --b) free_blocks.push_back(b);
  std::vector<int> free_slots = {3, 2, 1, 0};
  kvq::cpu::worker_pool workers(2);

  kvq::cuda::paged_view kv;
  kv.arena = mem.pool;
  kv.layers = layers, kv.kv_heads = kv_heads, kv.head_dim = d, kv.page_tokens = P, kv.window = R;
  kv.max_pages = max_blocks, kv.slots = max_batch, kv.arena_bytes = pool_size;
  kv.k_page_bytes = kvq::cuda::page_bytes(kvq::role::k, P, d);
  kv.v_page_bytes = kvq::cuda::page_bytes(kvq::role::v, P, d);
  kv.tables = kvq::cuda::page_tables::shared;
  kv.blocks = reinterpret_cast<const uint32_t*>(on_gpu ? mem.table : table.data());
  kv.windows = mem.windows, kv.windows_bytes = windows_size;
  kv.table_stride = max_blocks, kv.block_bytes = block_bytes, kv.layer_blocks = pool_blocks, kv.layer_bytes = layer_bytes;

  std::mt19937 rng(2026);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto draw = [&](std::vector<float>& x, size_t count) {
    x.resize(count);
    for (float& y : x) y = kvq::half_to_float(kvq::float_to_half(nd(rng)));
  };
  run_result res;
  const float scale = 1.f / std::sqrt(float(d));
  // The CPU run's mirror: a KVCache fed the same tokens, whose outputs the pool's must equal.
  std::optional<kvq::KVCache> cache;
  if (!on_gpu) {
    kvq::cache_config cfg;
    cfg.shape = {layers, q_heads, kv_heads, d, P, R, recent};
    cfg.budget_bytes = 64ull << 20;
    cfg.max_sequences = max_batch;
    cache.emplace(kvq::KVCache::create(cfg, std::make_shared<kvq::static_policy>(
                                                kvq::static_policy::parse(cache_policy).value_or_throw()))
                      .value_or_throw());
  }
  auto same_as_cache = [&](const std::vector<float>& got, const std::vector<float>& want, const char* what) {
    if (std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0) return;
    fmt::print(stderr, "cpu: {} differs from KVCache's\n", what);
    ++res.failures;
  };
  double fp16_err = 0, fp16_norm = 0;
  auto check = [&](const std::vector<float>& got, const sequence& s, int layer, const float* q, int q_len, int64_t n) {
    std::vector<float> want(size_t(q_len) * q_heads * d);
    // FP16 reference: the last q_len tokens are the queries' own; query i sees tokens < n - q_len + i + 1
    for (int i = 0; i < q_len; ++i)
      kvq::ref::attend(s.k[layer].data(), s.v[layer].data(), n - q_len + i + 1, q + size_t(i) * q_heads * d, 1, q_heads,
                       kv_heads, d, scale, want.data() + size_t(i) * q_heads * d);
    (void)layer;
    for (size_t i = 0; i < want.size(); ++i)
      fp16_err += (got[i] - want[i]) * double(got[i] - want[i]), fp16_norm += want[i] * double(want[i]);
    res.outputs.insert(res.outputs.end(), got.begin(), got.end());
  };

  // Appends each sequence's m new rows (k, v: [sum m][kv_heads][d] host) to one layer: new blocks
  // for the pages the append cuts, listed in the table the first time (layer 0).
  auto append = [&](std::vector<sequence*>& batch, const std::vector<int32_t>& m, int layer, const std::vector<float>& k,
                    const std::vector<float>& v) {
    std::vector<kvq::cuda::append_seq> items;
    std::vector<uint32_t> blocks;
    std::vector<uint8_t> fmts;
    for (size_t i = 0; i < batch.size(); ++i) {
      sequence& s = *batch[i];
      const int pages = int(kvq::pages_to_encode(s.n, s.e, m[i], P, recent));
      for (int p = 0; p < pages; ++p) {
        int32_t& entry = table[size_t(s.slot) * max_blocks + size_t(s.e / P + p)];
        if (layer == 0) entry = free_blocks.back(), free_blocks.pop_back();
        blocks.push_back(uint32_t(entry));
        for (int h = 0; h < kv_heads; ++h) fmts.push_back(cands[h].k), fmts.push_back(cands[h].v);
      }
      items.push_back({s.slot, s.n, s.e, m[i], uint32_t(s.slot * window_bytes / 256), s.e / P, pages});
    }
    if (on_gpu) copy(mem, mem.table, table.data(), table.size());  // the engine uploads its table
    copy(mem, mem.k, k.data(), k.size());
    copy(mem, mem.v, v.data(), v.size());
    kvq::cuda::append_args a;
    a.kv = kv;
    a.arena = mem.pool, a.windows = mem.windows;
    a.layer = layer;
    a.items = items;
    a.k = {mem.k, kvq::dtype::f32, int64_t(k.size() / (kv_heads * d)), kv_heads, d};
    a.v = {mem.v, kvq::dtype::f32, a.k.tokens, kv_heads, d};
    a.page_blocks = blocks.data(), a.page_fmts = fmts.data();
    run_append(a, on_gpu);
    size_t row = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
      sequence& s = *batch[i];
      const size_t count = size_t(m[i]) * kv_heads * d;
      s.k[layer].insert(s.k[layer].end(), k.begin() + std::ptrdiff_t(row), k.begin() + std::ptrdiff_t(row + count));
      s.v[layer].insert(s.v[layer].end(), v.begin() + std::ptrdiff_t(row), v.begin() + std::ptrdiff_t(row + count));
      row += count;
      if (layer == layers - 1) {  // the lengths move once every layer holds the tokens
        s.e += int32_t(kvq::pages_to_encode(s.n, s.e, m[i], P, recent)) * P;
        s.n += m[i];
      }
    }
  };

  std::deque<sequence> running;
  size_t next = 0;
  int steps = 0;
  while (next < std::size(requests) || !running.empty()) {
    // Admission: a free slot and blocks for the whole request (its pages and none shared).
    while (next < std::size(requests) && !free_slots.empty()) {
      const request& r = requests[next];
      const int need = int(kvq::pages_to_encode(0, 0, r.prompt + r.generate, P, recent));
      int reserved = 0;
      for (const sequence& s : running) reserved += int(kvq::pages_to_encode(0, 0, s.n + s.left, P, recent)) - s.e / P;
      if (need > int(free_blocks.size()) - reserved) break;
      sequence s;
      s.id = int(next), s.slot = free_slots.back(), s.left = r.generate;
      free_slots.pop_back();
      running.push_back(std::move(s));
      sequence& seq = running.back();
      std::vector<sequence*> one = {&seq};
      if (cache) kvq::check(cache->create_sequence(seq.id));
      for (int l = 0; l < layers; ++l) {  // the prompt: one chunk per layer, of any length
        std::vector<float> k, v, q;
        draw(k, size_t(r.prompt) * kv_heads * d), draw(v, k.size()), draw(q, size_t(r.prompt) * q_heads * d);
        const int32_t n0 = seq.n, e0 = seq.e;
        append(one, {r.prompt}, l, k, v);
        kvq::cuda::prefill_args a;
        a.kv = kv;
        a.layer = l, a.q_heads = q_heads, a.slot = seq.slot, a.window_unit = uint32_t(seq.slot * window_bytes / 256);
        a.prefix = n0, a.from_pages = std::min(e0 + int32_t(kvq::pages_to_encode(n0, e0, r.prompt, P, recent)) * P, n0);
        a.queries = r.prompt;
        copy(mem, mem.q, q.data(), q.size());
        a.q = mem.q, a.q_type = kvq::dtype::f32, a.o = mem.o, a.o_type = kvq::dtype::f32;
        a.k = {mem.k, kvq::dtype::f32, r.prompt, kv_heads, d}, a.v = {mem.v, kvq::dtype::f32, r.prompt, kv_heads, d};
        run_prefill(a, mem, workers);
        std::vector<float> o(q.size());
        copy(mem, o.data(), mem.o, o.size(), true);
        if (cache) {
          std::vector<float> want(o.size());
          kvq::check(cache->prefill(seq.id, l, {k.data(), kvq::dtype::f32, r.prompt, kv_heads, d},
                                    {v.data(), kvq::dtype::f32, r.prompt, kv_heads, d},
                                    {q.data(), kvq::dtype::f32, r.prompt, q_heads, d},
                                    {want.data(), kvq::dtype::f32, r.prompt, q_heads, d}));
          same_as_cache(o, want, "a prompt's attention");
        }
        // (rows past the first 16 queries are checked by the decode steps; prompts are long)
        check(std::vector<float>(o.end() - std::ptrdiff_t(16 * q_heads * d), o.end()), seq, l,
              q.data() + q.size() - size_t(16) * q_heads * d, 16, n0 + r.prompt);
      }
      fmt::print("{}: step {:4d}: request {} admitted ({} prompt tokens), {} blocks free\n", name, steps, seq.id,
                 r.prompt, free_blocks.size());
      ++next;
    }
    // One decode step of the whole batch.
    std::vector<sequence*> batch;
    for (sequence& s : running) batch.push_back(&s);
    const std::vector<int32_t> ones(batch.size(), 1);
    std::vector<kvq::append_item> cache_appends;
    std::vector<kvq::attend_item> cache_attends;
    for (const sequence* s : batch) cache_appends.push_back({s->id, 1}), cache_attends.push_back({s->id, 1});
    const int64_t b = int64_t(batch.size());
    for (int l = 0; l < layers; ++l) {
      std::vector<float> k, v;
      draw(k, batch.size() * kv_heads * d), draw(v, k.size());
      append(batch, ones, l, k, v);
      if (cache)
        kvq::check(cache->append_batch(cache_appends, l, {k.data(), kvq::dtype::f32, b, kv_heads, d},
                                       {v.data(), kvq::dtype::f32, b, kv_heads, d}));
    }
    for (int l = 0; l < layers; ++l) {
      std::vector<float> q;
      draw(q, batch.size() * q_heads * d);
      std::vector<kvq::cuda::decode_item> items;
      for (size_t i = 0; i < batch.size(); ++i) {
        const sequence& s = *batch[i];
        items.push_back({s.slot, 1, s.n, std::min(s.e, s.n - 1), uint32_t(s.slot * window_bytes / 256), int32_t(i)});
      }
      kvq::cuda::attend_args a;
      a.kv = kv;
      a.layer = l, a.q_heads = q_heads;
      a.items = items;
      copy(mem, mem.q, q.data(), q.size());
      a.q = mem.q, a.q_type = kvq::dtype::f32, a.o = mem.o, a.o_type = kvq::dtype::f32;
      a.max_page_bits = 4, a.one_format_per_head = true;  // what the engine knows of its formats
      run_attend(a, mem, workers);
      std::vector<float> o(q.size());
      copy(mem, o.data(), mem.o, o.size(), true);
      if (cache) {
        std::vector<float> want(o.size());
        kvq::check(cache->attend(cache_attends, l, {q.data(), kvq::dtype::f32, b, q_heads, d},
                                 {want.data(), kvq::dtype::f32, b, q_heads, d}));
        same_as_cache(o, want, "a decode step's attention");
      }
      for (size_t i = 0; i < batch.size(); ++i)
        check(std::vector<float>(o.begin() + std::ptrdiff_t(i * q_heads * d), o.begin() + std::ptrdiff_t((i + 1) * q_heads * d)),
              *batch[i], l, q.data() + i * q_heads * d, 1, batch[i]->n);
    }
    ++steps;
    // Finished requests give their blocks and slot back.
    for (auto it = running.begin(); it != running.end();) {
      if (--it->left > 0) {
        ++it;
        continue;
      }
      for (int p = 0; p < it->e / P; ++p) free_blocks.push_back(table[size_t(it->slot) * max_blocks + size_t(p)]);
      std::fill_n(table.begin() + std::ptrdiff_t(it->slot) * max_blocks, max_blocks, -1);
      free_slots.push_back(it->slot);
      if (cache) kvq::check(cache->release_sequence(it->id));
      fmt::print("{}: step {:4d}: request {} done ({} tokens, {} pages)\n", name, steps, it->id, it->n, it->e / P);
      it = running.erase(it);
    }
  }
  res.pool.resize(pool_size);
  copy(mem, res.pool.data(), mem.pool, pool_size, true);
  fmt::print("{}: {} requests in {} steps; blocks of {} bytes ({} per layer); attention NMSE against FP16 over the "
             "same tokens {:.3g}{}\n",
             name, std::size(requests), steps, block_bytes, pool_blocks, fp16_err / fp16_norm,
             cache ? "; every output equal to KVCache's" : "");
#if KVQ_WITH_CUDA
  if (on_gpu)
    for (void* p : {(void*)mem.pool, (void*)mem.windows, (void*)mem.table, (void*)mem.k, (void*)mem.v, (void*)mem.q,
                    (void*)mem.o, mem.workspace})
      cudaFree(p);
#endif
  return res;
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
  int failures = 0;
  run_result on_cpu;
  if (cpu) on_cpu = serve(false), failures += on_cpu.failures;
  if (cuda) {
#if KVQ_WITH_CUDA
    if (cuda_device_present()) {
      const run_result on_gpu = serve(true);
      failures += on_gpu.failures;
      if (cpu) {  // the same loop on both devices: the same bytes, outputs within fp16 MMA rounding
        const bool same_pool = on_gpu.pool == on_cpu.pool;
        double err = 0, norm = 0;
        for (size_t i = 0; i < on_cpu.outputs.size(); ++i) {
          const double x = on_gpu.outputs[i] - on_cpu.outputs[i];
          err += x * x, norm += double(on_cpu.outputs[i]) * on_cpu.outputs[i];
        }
        fmt::print("cuda against cpu: pools {} byte for byte; outputs NMSE {:.3g} (bound {})\n",
                   same_pool ? "equal" : "DIFFER", err / norm, device_nmse_bound);
        failures += !same_pool + !(err / norm < device_nmse_bound);
      }
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
