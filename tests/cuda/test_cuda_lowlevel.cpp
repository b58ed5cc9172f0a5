// The low-level entry (cuda::attend_run over an arena and page tables the caller built, as an
// engine that owns its memory would) against the CPU reference attention. The widest-format hint
// `max_page_bits` picks the decode kernel and the size of its staging; the header promises that a
// page wider than the hint is still read correctly (only slower), so every hint is run over the
// same pages: 16 (the 16-bit stages), 8 (a stray 16-bit page), 4 and 2 (8- and 4-bit pages wider than
// the stages, read from global memory). Each runs with and without `one_format_per_head`, which
// these mixed pages break: the promise may be wrong, the result may not.
#include "gpu_test.hpp"

#include <kvq/attention/reference.hpp>
#include <kvq/codec/codec.hpp>
#include <kvq/cuda/paged_attention.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <initializer_list>
#include <string>
#include <vector>

using namespace kvq;
using namespace kvq::gpu_test;

namespace {

constexpr int d = 128, kv_heads = 2, q_heads = 8, window = 128, ring_tokens = 40;

// Page formats (K, V) of head 0; head 1 takes them in reverse page order.
const std::vector<std::string> mixed_pages = {"kivi4/g32", "k=kivi8/g64,v=fp8", "fp16", "k=int8,v=kivi2/g32", "ra2/g32",
                                       "k=sym4/g64,v=bf16"};

struct arena_on_host {
  std::vector<uint8_t> bytes;              // page blocks, then the window
  std::vector<uint32_t> blocks;            // [max_pages]
  std::vector<uint8_t> fmts;               // [max_pages][kv_heads][2]
  uint32_t window_unit = 0;                // in 256-byte units
  std::vector<float> k, v;                 // [n_all][kv_heads][d] as the full step reads them
  std::vector<float> ring;                 // [kv_heads][2][window][d] the window's values
  std::array<uint32_t, format_count> k_bytes{}, v_bytes{};
};

format_id page_format(const std::vector<std::string>& specs, int pg, int h, role r) {
  const int pages = int(specs.size());
  const auto pair = parse_format_pair(specs[h == 0 ? pg : pages - 1 - pg]).value_or_throw();
  return r == role::k ? pair.k : pair.v;
}

arena_on_host build(std::mt19937& rng, int P, const std::vector<std::string>& specs) {
  const int pages = int(specs.size());
  const int n_all = pages * P + ring_tokens;
  arena_on_host a;
  a.k_bytes = page_bytes(role::k, P, d);
  a.v_bytes = page_bytes(role::v, P, d);
  a.k.assign(size_t(n_all) * kv_heads * d, 0.f);
  a.v.assign(a.k.size(), 0.f);
  for (int pg = 0; pg < pages; ++pg) {
    a.blocks.push_back(uint32_t(a.bytes.size() / 256));
    for (int h = 0; h < kv_heads; ++h)
      for (role r : {role::k, role::v}) {
        const format_id f = page_format(specs, pg, h, r);
        a.fmts.push_back(f);
        const auto g = codec::make_geom(f, r, P, d);
        const auto src = randn_h(rng, size_t(P) * d);
        const size_t at = a.bytes.size();
        a.bytes.resize(at + g.lay.total(), 0);
        for (int u = 0; u < g.unit_count(); ++u)
          codec::encode_unit(g, src.data(), d, u, a.bytes.data() + at, codec::no_clip);
        auto& dst = r == role::k ? a.k : a.v;
        for (int t = 0; t < P; ++t)
          for (int c = 0; c < d; ++c)
            dst[(size_t(pg * P + t) * kv_heads + h) * d + c] = codec::decode_element(g, a.bytes.data() + at, t, c);
      }
    a.bytes.resize((a.bytes.size() + 255) / 256 * 256, 0);
  }
  // the window: [kv_heads][2][window][d] fp16, token j in slot j % window; it holds the last
  // `window` tokens (some of them also in pages)
  a.window_unit = uint32_t(a.bytes.size() / 256);
  const size_t ring_at = a.bytes.size();
  a.bytes.resize(ring_at + size_t(kv_heads) * 2 * window * d * 2, 0);
  auto* ring = reinterpret_cast<uint16_t*>(a.bytes.data() + ring_at);
  a.ring.assign(size_t(kv_heads) * 2 * window * d, 0.f);
  for (int h = 0; h < kv_heads; ++h)
    for (int r = 0; r < 2; ++r) {
      const auto vals = randn_h(rng, size_t(window) * d);
      for (int j = n_all - window; j < n_all; ++j)
        for (int c = 0; c < d; ++c) {
          const uint16_t x = vals[size_t(j - (n_all - window)) * d + c];
          ring[((size_t(h) * 2 + r) * window + j % window) * d + c] = x;
          a.ring[((size_t(h) * 2 + r) * window + j % window) * d + c] = half_to_float(x);
          if (j >= pages * P) (r == 0 ? a.k : a.v)[(size_t(j) * kv_heads + h) * d + c] = half_to_float(x);
        }
    }
  return a;
}

// Runs two items over the arena of `specs` under each hint and checks them against the CPU
// reference attention. three: `attend_args::three_bit_pages` (3-bit kind pages counted as 3 bits).
void check_hints(int P, const std::vector<std::string>& specs, std::initializer_list<int> hints, bool three = false) {
  const int pages = int(specs.size());
  const int n_all = pages * P + ring_tokens;
  std::mt19937 rng(11);
  const arena_on_host a = build(rng, P, specs);
  dev_mem arena(a.bytes.size()), blocks(a.blocks.size() * 4), fmts(a.fmts.size());
  upload(arena, a.bytes);
  upload(blocks, a.blocks);
  upload(fmts, a.fmts);

  // two items over the same slot: all pages plus 40 ring tokens; and n_b = n_all - 60 reading the
  // last page only up to its row P - 22 and its own token from the ring
  const int n_b = n_all - 60;
  std::vector<cuda::decode_item> items = {{0, 1, n_all, pages * P, a.window_unit, 0}, {0, 1, n_b, n_b - 1, a.window_unit, 1}};
  const auto qh = randn_h(rng, size_t(2) * q_heads * d);
  std::vector<float> qf(qh.size());
  for (size_t i = 0; i < qh.size(); ++i) qf[i] = half_to_float(qh[i]);
  const float scale = 1.f / std::sqrt(float(d));
  std::vector<float> want(qh.size());
  ref::attend(a.k.data(), a.v.data(), n_all, qf.data(), 1, q_heads, kv_heads, d, scale, want.data());
  // item B sees the first n_b tokens, its last one (its own) from the window
  std::vector<float> kb(a.k.begin(), a.k.begin() + size_t(n_b) * kv_heads * d), vb(a.v.begin(), a.v.begin() + kb.size());
  for (int h = 0; h < kv_heads; ++h)
    for (int c = 0; c < d; ++c) {
      kb[(size_t(n_b - 1) * kv_heads + h) * d + c] = a.ring[((size_t(h) * 2 + 0) * window + (n_b - 1) % window) * d + c];
      vb[(size_t(n_b - 1) * kv_heads + h) * d + c] = a.ring[((size_t(h) * 2 + 1) * window + (n_b - 1) % window) * d + c];
    }
  ref::attend(kb.data(), vb.data(), n_b, qf.data() + size_t(q_heads) * d, 1, q_heads, kv_heads, d, scale,
              want.data() + size_t(q_heads) * d);
  dev_mem dq(qh.size() * 2), dout(qh.size() * 4);
  upload(dq, qh);

  cuda::attend_args args;
  args.kv.arena = static_cast<const uint8_t*>(arena.p);
  args.kv.blocks = static_cast<const uint32_t*>(blocks.p);
  args.kv.fmts = static_cast<const uint8_t*>(fmts.p);
  args.kv.layers = 1;
  args.kv.kv_heads = kv_heads;
  args.kv.head_dim = d;
  args.kv.page_tokens = P;
  args.kv.window = window;
  args.kv.max_pages = pages;
  args.kv.k_page_bytes = a.k_bytes;
  args.kv.v_page_bytes = a.v_bytes;
  args.q_heads = q_heads;
  args.items = items;
  args.q = dq.p;
  args.q_type = dtype::f16;
  args.o = dout.p;
  args.o_type = dtype::f32;
  int dev = 0;
  REQUIRE(cudaGetDevice(&dev) == cudaSuccess);
  REQUIRE(cudaDeviceGetAttribute(&args.num_sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess);
  for (int hint : hints)
    for (bool one_format : {false, true}) {  // true: a wrong promise here (mixed pages), still correct
      CAPTURE(hint, one_format, three);
      args.max_page_bits = hint;
      args.one_format_per_head = one_format;
      args.three_bit_pages = three;
      REQUIRE(cuda::attend_can_implement(args).ok());
      const cuda::attend_plan_info plan = cuda::attend_plan(args).value_or_throw();
      // (except for 3-bit pages counted as 3 bits where the promise plans the whole-unit instance,
      // which reads them only in blocks of one 3-bit pair: documented at `one_format_per_head`;
      // the hints 4 and 3, and 8 at page_tokens 128, whose 8-bit page-heads leave room for 2 page
      // stages: 4-bit stages instead)
      if (three && one_format && plan.whole_units) continue;
      if (three && hint < 16) CHECK(plan.three_bit_dispatch);
      dev_mem ws(std::max<size_t>(16, cuda::attend_workspace_bytes(args)));
      std::vector<float> got(qh.size(), std::nanf(""));
      upload(dout, got);  // poisoned: every element must be written
      REQUIRE(cuda::attend_run(args, ws.p, cuda::attend_workspace_bytes(args), nullptr).ok());
      REQUIRE(cudaMemcpy(got.data(), dout.p, got.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
      CHECK(nmse(got, want) < 2e-5);
    }
}

}  // namespace

TEST_CASE("gpu: attend_run over a caller-built arena reads every page under any max_page_bits hint", "[gpu][decode][lowlevel]") {
  const int P = GENERATE(64, 128);  // page_tokens
  CAPTURE(P);
  check_hints(P, mixed_pages, {16, 8, 4, 2});
}

// Pages of the formats read by element (3-bit) among the others: they count as 16 bits
// (`kernel_bits`), so the hint is 16 and a decode kernel's 16-bit instance reads them.
TEST_CASE("gpu: attend_run reads pages of the formats read by element under the hint 16",
          "[gpu][decode][lowlevel][by_element]") {
  const int P = GENERATE(64, 128);
  CAPTURE(P);
  check_hints(P, {"cb3/g32", "k=kivi4/g32,v=sym3/g32", "sym3/g32", "k=cb3/g64,v=fp16", "kivi3/g64", "k=fp8,v=cb3/g32"}, {16});
}

// Pages of the 3-bit kinds among others, counted as 3 bits (`three_bit_pages`): the block-staged
// kernel's Three instances read them staged in 8-, 4- and 3-bit stages (wider pages from global
// memory; at page_tokens 128 the hint 8 plans 4-bit stages), the 16-bit plan by element.
TEST_CASE("gpu: attend_run reads 3-bit pages among others staged under three_bit_pages",
          "[gpu][decode][lowlevel][three]") {
  const int P = GENERATE(64, 128);
  CAPTURE(P);
  check_hints(P, {"kivi3/g32", "k=kivi8/g64,v=sym3/g32", "k=kivi4/g32,v=kivi3/g64", "sym3", "k=fp8,v=kivi2/g32", "sym3/g64"},
              {16, 8, 4, 3}, true);
}

// Codebook and nvfp4 pages (kinds cb4, cb2, fp4) among the others under every hint: staged in 16-,
// 8- and 4-bit stages, and cb4 and nvfp4 pages under the hint 2 read from global memory (pages
// wider than the stages).
TEST_CASE("gpu: attend_run reads codebook and nvfp4 pages under any max_page_bits hint",
          "[gpu][decode][lowlevel][codebook]") {
  const int P = GENERATE(64, 128);
  CAPTURE(P);
  check_hints(P, {"cb4", "k=cb2/g32,v=cb4/g32", "nvfp4", "k=cb4,v=fp8", "k=nvfp4,v=cb2/g64", "k=sym2/g32,v=nvfp4"},
              {16, 8, 4, 2});
}

// A page whose V the stages hold but whose K is wider than them: its V goes to the start of its
// page stage. (At its offset in the page-head, after the wider K, it ran into the next stage,
// which held the next page in flight: memcheck found the last stage's copy running past the
// block's shared memory.) Such pages alternate with fully staged ones, so that every stage's
// neighbour is in use.
TEST_CASE("gpu: a staged V whose K is wider than the stages stays in its page stage", "[gpu][decode][lowlevel]") {
  std::vector<std::string> specs;
  for (int i = 0; i < 16; ++i) specs.push_back(i % 2 ? "k=int8,v=kivi2/g32" : "kivi2/g32");
  check_hints(64, specs, {4, 2});
}
