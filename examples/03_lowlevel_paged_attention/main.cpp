// Example 03: the low-level CUDA paged attention (kvq/cuda/paged_attention.hpp) over memory,
// page tables and a stream that the engine owns.
//
// What an engine developer learns here:
// - the memory layout kvq reads: one device arena holding page blocks (the pages of every kv head
//   and role of one (sequence, layer, page index), back to back, at 256-byte units) and each
//   sequence's FP16 rings; page tables `blocks` [slots][layers][max_pages] and `fmts`
//   [slots][layers][max_pages][kv_heads][2]. Any format per page and per head;
// - the engine keeps the bookkeeping: per sequence n (tokens held) and e (tokens encoded into
//   pages), and when to cut a page (here: once page_tokens + recent tokens are unencoded, as
//   `KVCache` does); it allocates each new page's block itself;
// - per step and layer: `append_run` (ring write and page encode, one launch pair for the whole
//   batch), then `attend_can_implement` -> `attend_workspace_bytes` -> `attend_run` on the
//   engine's stream, with the engine's workspace; nothing allocates or synchronizes inside.
//   (Prefill attention over the prompt is the engine's own dense kernel; it is left out here.)
//
// Self-checking against a CPU mirror that the engine could keep: the host encodes the same pages
// with the same codec (`kvq::codec`), so the device arena and page tables must equal the mirror
// byte for byte, and every step's attention must match the CPU reference attention over the
// mirror's values (NMSE < 2e-5). Exits 77 (reported as skipped by ctest) without a CUDA device.
#include <kvq/attention/reference.hpp>
#include <kvq/codec/codec.hpp>
#include <kvq/cuda/paged_attention.hpp>
#include <kvq/format/numeric.hpp>

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr int layers = 2, q_heads = 8, kv_heads = 2, d = 128, P = 64, window = 128, recent = 64;
constexpr int slots = 3, max_pages = 8, steps = 100;
constexpr uint64_t arena_bytes = 4 << 20;
// The engine's page formats: page i of kv head h in layer l takes entry (i + h + l) % 4.
const char* const page_specs[] = {"kivi4/g32", "k=int8,v=kivi2/g32", "fp8", "k=kivi8/g64,v=sym4/g32"};
constexpr int widest_bits = 8;  // of the formats above: the `max_page_bits` hint

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(fmt::format("{}: {}", what, cudaGetErrorString(e)));
}

template <class T>
T* device_alloc(size_t count) {
  void* p = nullptr;
  cuda_ok(cudaMalloc(&p, count * sizeof(T)), "cudaMalloc");
  cuda_ok(cudaMemset(p, 0, count * sizeof(T)), "cudaMemset");
  return static_cast<T*>(p);
}

kvq::format_id page_format(int layer, int page, int h, kvq::role r) {
  const auto p = kvq::parse_format_pair(page_specs[(page + h + layer) % 4]).value_or_throw();
  return r == kvq::role::k ? p.k : p.v;
}

// One sequence as the engine tracks it, with its CPU mirror per layer.
struct sequence {
  int slot = 0;
  uint32_t window_unit = 0;  // its ring block, in 256-byte units
  int32_t n = 0, e = 0;      // tokens held, tokens encoded (the same in every layer)
  std::vector<uint16_t> k16[layers], v16[layers];  // [n][kv_heads][d] fp16 as appended
  std::vector<float> k_read[layers], v_read[layers];  // [n][kv_heads][d] as attention reads them
};

struct engine {
  std::vector<uint8_t> mirror = std::vector<uint8_t>(arena_bytes);  // the host copy of the arena
  std::vector<uint32_t> blocks = std::vector<uint32_t>(size_t(slots) * layers * max_pages);
  std::vector<uint8_t> fmts = std::vector<uint8_t>(blocks.size() * kv_heads * 2);
  uint32_t next_unit = 0;  // bump allocator over the arena, in 256-byte units
  uint8_t* arena = nullptr;  // device: the arena and the page tables, as append writes them
  uint32_t* table_blocks = nullptr;
  uint8_t* table_fmts = nullptr;
  kvq::cuda::paged_view view;  // the same memory, as attention reads it

  uint32_t allocate(uint64_t bytes) {
    const uint32_t unit = next_unit;
    next_unit += uint32_t((bytes + 255) / 256);
    if (uint64_t(next_unit) * 256 > arena_bytes) throw std::runtime_error("the example's arena is full");
    return unit;
  }
  uint8_t* ring(const sequence& s, int layer, int h, int r) {
    return mirror.data() + size_t(s.window_unit) * 256 + ((size_t(layer) * kv_heads + h) * 2 + r) * window * d * 2;
  }
};

// Pages created by appending m tokens to n held, e encoded: once P + recent are unencoded.
int pages_after(int32_t n, int32_t e, int32_t m) { return n + m - e - recent >= P ? (n + m - e - recent) / P : 0; }

// Appends m tokens to every sequence of the batch in one layer: the CPU mirror first, then one
// `append_run`. `k`/`v` hold the batch's fp16 rows in item order.
void append_layer(engine& eng, std::vector<sequence>& seqs, int layer, int32_t m, const std::vector<uint16_t>& k,
                  const std::vector<uint16_t>& v, uint16_t* dk, uint16_t* dv, cudaStream_t stream) {
  std::vector<kvq::cuda::append_seq> items;
  std::vector<uint32_t> page_blocks;
  std::vector<uint8_t> page_fmts;
  for (size_t i = 0; i < seqs.size(); ++i) {
    sequence& s = seqs[i];
    const size_t row = size_t(m) * kv_heads * d;
    s.k16[layer].insert(s.k16[layer].end(), k.begin() + std::ptrdiff_t(i * row), k.begin() + std::ptrdiff_t((i + 1) * row));
    s.v16[layer].insert(s.v16[layer].end(), v.begin() + std::ptrdiff_t(i * row), v.begin() + std::ptrdiff_t((i + 1) * row));
    for (size_t j = i * row; j < (i + 1) * row; ++j)
      s.k_read[layer].push_back(kvq::half_to_float(k[j])), s.v_read[layer].push_back(kvq::half_to_float(v[j]));
    for (int32_t j = std::max(s.n, s.n + m - window); j < s.n + m; ++j)  // the ring keeps the last `window`
      for (int h = 0; h < kv_heads; ++h)
        for (int r = 0; r < 2; ++r)
          std::copy_n((r ? s.v16 : s.k16)[layer].data() + (size_t(j) * kv_heads + h) * d, d,
                      reinterpret_cast<uint16_t*>(eng.ring(s, layer, h, r)) + size_t(j % window) * d);
    const int pages = pages_after(s.n, s.e, m);
    for (int p = 0; p < pages; ++p) {
      const int page = s.e / P + p, first = s.e + p * P;
      uint64_t bytes = 0;
      for (int h = 0; h < kv_heads; ++h)
        bytes += eng.view.k_page_bytes[page_format(layer, page, h, kvq::role::k)] +
                 eng.view.v_page_bytes[page_format(layer, page, h, kvq::role::v)];
      const uint32_t block = eng.allocate(bytes);
      page_blocks.push_back(block);
      eng.blocks[(size_t(s.slot) * layers + layer) * max_pages + page] = block;
      uint8_t* at = eng.mirror.data() + size_t(block) * 256;
      for (int h = 0; h < kv_heads; ++h)
        for (kvq::role r : {kvq::role::k, kvq::role::v}) {
          const kvq::format_id f = page_format(layer, page, h, r);
          page_fmts.push_back(f);
          eng.fmts[((size_t(s.slot) * layers + layer) * max_pages + page) * kv_heads * 2 + h * 2 + int(r)] = f;
          const auto g = kvq::codec::make_geom(f, r, P, d);
          const auto& src = r == kvq::role::k ? s.k16[layer] : s.v16[layer];
          for (int u = 0; u < g.unit_count(); ++u)
            kvq::codec::encode_unit(g, src.data() + (size_t(first) * kv_heads + h) * d, kv_heads * d, u, at,
                                    kvq::codec::no_clip);
          auto& read = r == kvq::role::k ? s.k_read[layer] : s.v_read[layer];
          for (int t = 0; t < P; ++t)
            for (int c = 0; c < d; ++c) read[(size_t(first + t) * kv_heads + h) * d + c] = kvq::codec::decode_element(g, at, t, c);
          at += g.lay.total();
        }
    }
    items.push_back({s.slot, s.n, s.e, m, s.window_unit, s.e / P, pages});
  }
  const int64_t rows = int64_t(seqs.size()) * m;
  cuda_ok(cudaMemcpyAsync(dk, k.data(), k.size() * 2, cudaMemcpyHostToDevice, stream), "upload K");
  cuda_ok(cudaMemcpyAsync(dv, v.data(), v.size() * 2, cudaMemcpyHostToDevice, stream), "upload V");
  kvq::cuda::append_args a;
  a.kv = eng.view;
  a.arena = eng.arena;
  a.blocks = eng.table_blocks;
  a.fmts = eng.table_fmts;
  a.layer = layer;
  a.items = items;
  a.k = {dk, kvq::dtype::f16, rows, kv_heads, d};
  a.v = {dv, kvq::dtype::f16, rows, kv_heads, d};
  a.page_blocks = page_blocks.data();
  a.page_fmts = page_fmts.data();
  kvq::check(kvq::cuda::append_run(a, stream));
}

const char* kernel_name(kvq::cuda::attend_kernel k) {
  using kvq::cuda::attend_kernel;
  return k == attend_kernel::tile ? "tile" : k == attend_kernel::decode_staged ? "decode_staged" : "decode_block_staged";
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    fmt::print(stderr, "SKIPPED: example 03 needs a CUDA device\n");
    return 77;
  }
  // The engine's memory, page tables and stream.
  engine eng;
  uint8_t* arena = eng.arena = device_alloc<uint8_t>(arena_bytes);
  uint32_t* blocks = eng.table_blocks = device_alloc<uint32_t>(eng.blocks.size());
  uint8_t* fmts = eng.table_fmts = device_alloc<uint8_t>(eng.fmts.size());
  uint16_t* dk = device_alloc<uint16_t>(size_t(slots) * 200 * kv_heads * d);  // the largest append: the prefill
  uint16_t* dv = device_alloc<uint16_t>(size_t(slots) * 200 * kv_heads * d);
  uint16_t* dq = device_alloc<uint16_t>(slots * q_heads * d);
  float* dout = device_alloc<float>(slots * q_heads * d);
  cudaStream_t stream;
  cuda_ok(cudaStreamCreate(&stream), "cudaStreamCreate");
  int dev = 0, sms = 0;
  cuda_ok(cudaGetDevice(&dev), "cudaGetDevice");
  cuda_ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");

  eng.view = {arena, blocks, fmts, layers, kv_heads, d, P, window, max_pages, {}, {}};
  for (size_t f = 0; f < kvq::format_count; ++f)  // page bytes of every format that fits the shape
    for (kvq::role r : {kvq::role::k, kvq::role::v})
      if (kvq::check_shape(kvq::format_id(f), r, P, d).ok())
        (r == kvq::role::k ? eng.view.k_page_bytes : eng.view.v_page_bytes)[f] =
            kvq::layout_of(kvq::traits_of(kvq::format_id(f)), r, P, d).total();

  std::vector<sequence> seqs(slots);
  for (int i = 0; i < slots; ++i) seqs[i].slot = i, seqs[i].window_unit = eng.allocate(uint64_t(layers) * kv_heads * 2 * window * d * 2);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  const auto fp16_rows = [&](size_t count, float outlier) {
    std::vector<uint16_t> x(count);
    for (size_t i = 0; i < count; ++i) x[i] = kvq::float_to_half(nd(rng) * (i % 16 == 5 ? outlier : 1.f));
    return x;
  };

  // Prefill: 200 prompt tokens per sequence (one append per layer for the batch), then decode.
  for (int l = 0; l < layers; ++l)
    append_layer(eng, seqs, l, 200, fp16_rows(size_t(slots) * 200 * kv_heads * d, 6.f),
                 fp16_rows(size_t(slots) * 200 * kv_heads * d, 1.f), dk, dv, stream);
  for (auto& s : seqs) s.n += 200, s.e += pages_after(0, 0, 200) * P;

  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  double worst = 0;
  const float scale = 1.f / std::sqrt(float(d));
  for (int step = 0; step < steps; ++step) {
    for (int l = 0; l < layers; ++l) {
      append_layer(eng, seqs, l, 1, fp16_rows(size_t(slots) * kv_heads * d, 6.f), fp16_rows(size_t(slots) * kv_heads * d, 1.f),
                   dk, dv, stream);
      std::vector<kvq::cuda::decode_item> items;
      for (const auto& s : seqs) {
        const int32_t n = s.n + 1, e = s.e + pages_after(s.n, s.e, 1) * P;
        items.push_back({s.slot, 1, n, std::min(e, n - 1), s.window_unit, int32_t(items.size())});
      }
      const std::vector<uint16_t> q = fp16_rows(size_t(slots) * q_heads * d, 1.f);
      cuda_ok(cudaMemcpyAsync(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice, stream), "upload Q");
      kvq::cuda::attend_args a;
      a.kv = eng.view;
      a.layer = l;
      a.q_heads = q_heads;
      a.items = items;
      a.q = dq;
      a.q_type = kvq::dtype::f16;
      a.o = dout;
      a.o_type = kvq::dtype::f32;
      a.scale = scale;
      a.num_sms = sms;
      a.max_page_bits = widest_bits;
      kvq::check(kvq::cuda::attend_can_implement(a));
      if (step == 0 && l == 0) fmt::print("attend plan of a decode step: {}\n", kernel_name(kvq::cuda::attend_plan(a)->kernel));
      if (const size_t need = kvq::cuda::attend_workspace_bytes(a); need > workspace_bytes) {  // grows, then stays
        cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
        cuda_ok(cudaFree(workspace), "cudaFree");
        cuda_ok(cudaMalloc(&workspace, need), "cudaMalloc");
        workspace_bytes = need;
      }
      kvq::check(kvq::cuda::attend_run(a, workspace, workspace_bytes, stream));
      std::vector<float> got(q.size()), want(q.size()), qf(q.size());
      cuda_ok(cudaMemcpyAsync(got.data(), dout, got.size() * 4, cudaMemcpyDeviceToHost, stream), "download O");
      cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      for (size_t i = 0; i < q.size(); ++i) qf[i] = kvq::half_to_float(q[i]);
      double err = 0, norm = 0;
      for (int i = 0; i < slots; ++i) {
        const size_t off = size_t(i) * q_heads * d;
        kvq::ref::attend(seqs[i].k_read[l].data(), seqs[i].v_read[l].data(), items[i].n, qf.data() + off, 1, q_heads,
                         kv_heads, d, scale, want.data() + off);
      }
      for (size_t i = 0; i < got.size(); ++i) err += (got[i] - want[i]) * double(got[i] - want[i]), norm += want[i] * double(want[i]);
      worst = std::max(worst, std::isfinite(err) ? err / norm : 1.0);
    }
    for (auto& s : seqs) s.e += pages_after(s.n, s.e, 1) * P, s.n += 1;
  }

  // The device's arena and page tables against the mirror, byte for byte.
  std::vector<uint8_t> arena_back(size_t(eng.next_unit) * 256);
  std::vector<uint32_t> blocks_back(eng.blocks.size());
  std::vector<uint8_t> fmts_back(eng.fmts.size());
  cuda_ok(cudaMemcpy(arena_back.data(), arena, arena_back.size(), cudaMemcpyDeviceToHost), "download arena");
  cuda_ok(cudaMemcpy(blocks_back.data(), blocks, blocks_back.size() * 4, cudaMemcpyDeviceToHost), "download blocks");
  cuda_ok(cudaMemcpy(fmts_back.data(), fmts, fmts_back.size(), cudaMemcpyDeviceToHost), "download fmts");
  const bool same_bytes = std::equal(arena_back.begin(), arena_back.end(), eng.mirror.begin()) &&
                          blocks_back == eng.blocks && fmts_back == eng.fmts;
  fmt::print("{} sequences x {} layers, {} decode steps: {} pages, {} arena bytes; device bytes {} the CPU codec's; "
             "worst attention NMSE {:.2e} (bound 2e-5)\n",
             slots, layers, steps, seqs[0].e / P * slots * layers, arena_back.size(), same_bytes ? "equal" : "DIFFER FROM",
             worst);
  for (void* p : {static_cast<void*>(arena), static_cast<void*>(blocks), static_cast<void*>(fmts), static_cast<void*>(dk),
                  static_cast<void*>(dv), static_cast<void*>(dq), static_cast<void*>(dout), workspace})
    cudaFree(p);
  cudaStreamDestroy(stream);
  return same_bytes && worst < 2e-5 ? 0 : 1;
}
