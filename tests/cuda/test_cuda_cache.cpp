// The CUDA backend against the CPU reference backend: append bytes identical (through what both
// decode), decode and extend attention within the NMSE bound of the tolerance table, over every
// format, mixed formats within one sequence, page-edge lengths, unequal batches and GQA 1/4/8.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <kvq/cache/cache.hpp>
#include <kvq/codec/codec.hpp>
#include <kvq/cuda/read_plan.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/policy/static_policy.hpp>
#include <random>
#include <vector>

#include "gpu_test.hpp"

using namespace kvq;
using namespace kvq::gpu_test;

namespace {

bool small() { return std::getenv("KVQ_GPU_TEST_SMALL") != nullptr; }

// NMSE bounds of GPU attention against the CPU reference. The GPU rounds dequantized K/V, the
// query and the probabilities to fp16 for the tensor cores (relative 2^-11 each); the CPU works
// in fp32. One table for every format. The NMSE of one decode query of one sequence at GQA 1 (2
// heads: 128 outputs at head_dim 64) has a long tail where a few keys dominate the softmax and
// their rounded scores move it: over 60 random queries of sequences of 200-1000 tokens on the
// H200 (2026-12-03), sym4/g32 keys at head_dim 64 reached 6.1e-5 (median 3.2e-7).
constexpr double nmse_bound = 2e-5;
constexpr double nmse_bound_one_query = 2e-4;

// Can this spec store pages of `page` tokens of head_dim d (both roles)?
// The spec's formats store pages of this shape and the CUDA kernels read them.
bool supported(const std::string& spec, int d, int page = 64) {
  const auto p = parse_format_pair(spec).value_or_throw();
  return check_shape(p.k, role::k, page, d).ok() && check_shape(p.v, role::v, page, d).ok() && cuda::kernels_read(p.k) &&
         cuda::kernels_read(p.v);
}

struct pair_of_caches {
  KVCache cpu, gpu;
  std::shared_ptr<static_policy> pol;
};

pair_of_caches make(const std::string& spec, int layers, int hq, int h, int d, int page = 64, int sink_pages = 0) {
  cache_config cfg;
  cfg.shape = {layers, hq, h, d, page, 2 * page, 32};
  cfg.budget_bytes = 512ull << 20;
  cfg.max_sequences = 16;
  cfg.max_tokens = 1 << 15;
  cfg.sink_pages = sink_pages;
  auto pol = std::make_shared<static_policy>(static_policy::parse(spec).value_or_throw());
  auto c = KVCache::create(cfg, pol).value_or_throw();
  cfg.where = backend::cuda;
  auto g = KVCache::create(cfg, pol).value_or_throw();
  return {std::move(c), std::move(g), pol};
}

// Appends the same fp16 tokens to both caches (host copy for the CPU, device copy for the GPU).
void append_both(pair_of_caches& c, seq_id s, int layer, const std::vector<uint16_t>& k, const std::vector<uint16_t>& v,
                 int64_t tokens, int h, int d) {
  check(c.cpu.append(s, layer, {k.data(), dtype::f16, tokens, h, d}, {v.data(), dtype::f16, tokens, h, d}));
  dev_mem dk(k.size() * 2), dv(v.size() * 2);
  upload(dk, k);
  upload(dv, v);
  check(c.gpu.append(s, layer, {dk.p, dtype::f16, tokens, h, d}, {dv.p, dtype::f16, tokens, h, d}));
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
}

void require_same_store(pair_of_caches& c, seq_id s, int layer) {
  gpu_test::require_same_store(c.cpu, c.gpu, s, layer);
}

// Sequences 0, 1, ... of the given lengths on both caches (layer 0, 2 kv heads of head_dim d, the
// same random tokens): one decode query each.
std::vector<attend_item> fill_sequences(pair_of_caches& c, const std::vector<int64_t>& lens, int d, std::mt19937& rng) {
  std::vector<attend_item> items;
  for (size_t i = 0; i < lens.size(); ++i) {
    check(c.cpu.create_sequence(int64_t(i)));
    check(c.gpu.create_sequence(int64_t(i)));
    auto k = randn_h(rng, size_t(lens[i]) * 2 * d), v = randn_h(rng, size_t(lens[i]) * 2 * d);
    append_both(c, int64_t(i), 0, k, v, lens[i], 2, d);
    items.push_back({int64_t(i), 1});
  }
  return items;
}

// Runs one attention batch on both backends; returns the NMSE of GPU against CPU.
double attend_both(pair_of_caches& c, const std::vector<attend_item>& items, int layer, std::mt19937& rng) {
  const auto& sh = c.cpu.config().shape;
  int total = 0;
  for (auto& it : items) total += it.q_len;
  const auto qh = randn_h(rng, size_t(total) * sh.q_heads * sh.head_dim);
  std::vector<float> qf(qh.size()), oc(qh.size()), og(qh.size(), std::nanf(""));
  for (size_t i = 0; i < qh.size(); ++i) qf[i] = half_to_float(qh[i]);
  check(c.cpu.attend(items, layer, {qf.data(), dtype::f32, total, sh.q_heads, sh.head_dim},
                     {oc.data(), dtype::f32, total, sh.q_heads, sh.head_dim}));
  dev_mem dq(qh.size() * 2), dout(og.size() * 4);
  upload(dq, qh);
  upload(dout, og);  // poisoned: every element must be written
  check(c.gpu.attend(items, layer, {dq.p, dtype::f16, total, sh.q_heads, sh.head_dim},
                     {dout.p, dtype::f32, total, sh.q_heads, sh.head_dim}));
  REQUIRE(cudaMemcpy(og.data(), dout.p, og.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  return nmse(og, oc);
}

// Sequence 0, layer 1 (8 kv heads of head_dim 128) appended on both caches in `steps` pieces of
// 150 + 37 i tokens, piece i under tiers[i] with kv head i % 8 on `head_even` or `head_odd` (i even
// or odd); requires the two stores to match and returns the number of formats the GPU's pages use.
int append_striped(pair_of_caches& c, const char* const* tiers, int steps, const char* head_even, const char* head_odd,
                   std::mt19937& rng) {
  for (int i = 0; i < steps; ++i) {
    c.pol->set_all(*parse_format_pair(tiers[i]));
    c.pol->set_head(1, i % 8, *parse_format_pair(i % 2 ? head_odd : head_even));
    const int64_t len = 150 + 37 * i;
    auto k = randn_h(rng, size_t(len) * 8 * 128), v = randn_h(rng, size_t(len) * 8 * 128);
    append_both(c, 0, 1, k, v, len, 8, 128);
  }
  require_same_store(c, 0, 1);
  int formats_used = 0;
  for (auto p : c.gpu.stats().pages_by_format) formats_used += p > 0;
  return formats_used;
}

// A cache pair of 2 layers (32 query heads, 8 kv heads of head_dim 128, pages of `page` tokens)
// whose layer 1 is striped (`append_striped`: at least `min_formats` formats used), then sequence
// 0's attention there, q_len queries, against the CPU.
void check_striped(int page, uint32_t seed, const char* const* tiers, int steps, const char* head_even,
                   const char* head_odd, int min_formats, int q_len) {
  auto c = make("kivi4/g32", 2, 32, 8, 128, page);
  std::mt19937 rng(seed);
  check(c.cpu.create_sequence(0));
  check(c.gpu.create_sequence(0));
  REQUIRE(append_striped(c, tiers, steps, head_even, head_odd, rng) >= min_formats);
  REQUIRE(attend_both(c, {{0, q_len}}, 1, rng) < nmse_bound);
}

}  // namespace

TEST_CASE("gpu: append stores what the CPU stores, every format", "[gpu][append]") {
  const int fi = GENERATE(range(0, int(format_count)));
  const int d = GENERATE(64, 128, 256);
  const std::string spec = format_name(format_id(fi));
  if (!supported(spec, d)) return;
  CAPTURE(spec, d);
  auto c = make(spec, 2, 8, 2, d);
  std::vector<float> clip(2 * 2 * 2);
  for (size_t i = 0; i < clip.size(); ++i) clip[i] = 90.f + 2.5f * float(i % 4);  // 90 .. 97.5 percentiles
  check(c.cpu.set_clip_percentiles(clip));
  check(c.gpu.set_clip_percentiles(clip));
  std::mt19937 rng(uint32_t(fi * 100 + d));
  check(c.cpu.create_sequence(3));
  check(c.gpu.create_sequence(3));
  for (int64_t len : {1, 95, 64, 3, 300}) {  // crosses page edges, one long append
    if (len == 3 && codec::is_codebook_format(format_id(fi))) {
      // fitted levels from here on, different per (layer, kv head, role): the device encodes with
      // the cache's table as the CPU does (pages before keep the Lloyd-Max levels)
      const int bits = traits_of(format_id(fi)).bits, n = 1 << bits;
      std::vector<float> lv(size_t(2 * 2 * 2 * n));
      for (size_t i = 0; i < lv.size(); ++i) lv[i] = lloyd_max_level(bits, int(i) % n) * (0.85f + 0.04f * float(i / n));
      check(c.cpu.set_codebook_levels(format_id(fi), lv));
      check(c.gpu.set_codebook_levels(format_id(fi), lv));
    }
    auto k = randn_h(rng, size_t(len) * 2 * d), v = randn_h(rng, size_t(len) * 2 * d);
    append_both(c, 3, 1, k, v, len, 2, d);
  }
  require_same_store(c, 3, 1);
}

// The formats read by element on edge inputs: an all-zero page (nvfp4's tensor scale 1, zero
// codebook scales), a page with one outlier (nvfp4's block-parallel absmax on the device), the
// rest random; both roles, as the CPU stores them byte for byte.
TEST_CASE("gpu: appends of zero pages and single outliers store the CPU's bytes, formats read by element",
          "[gpu][append][by_element]") {
  const std::string spec = GENERATE("nvfp4", "cb4", "cb3/g32", "cb2/g64", "sym3/g32", "kivi3/g32");
  const int d = GENERATE(64, 128, 256);
  CAPTURE(spec, d);
  auto c = make(spec, 1, 4, 2, d);
  std::mt19937 rng(uint32_t(spec.size() * 3 + d));
  check(c.cpu.create_sequence(0));
  check(c.gpu.create_sequence(0));
  const int64_t len = 5 * 64 + 5;  // pages 0-2 leave the 128-token window
  auto k = randn_h(rng, size_t(len) * 2 * d), v = randn_h(rng, k.size());
  for (size_t i = 0; i < size_t(64) * 2 * d; ++i) k[i] = v[i] = 0;  // page 0: zeros
  k[size_t(64 + 17) * 2 * d + 5] = float_to_half(900.f);            // page 1: one outlier per role
  v[size_t(64 + 40) * 2 * d + d + 9] = float_to_half(-700.f);
  append_both(c, 0, 0, k, v, len, 2, d);
  require_same_store(c, 0, 0);
}

// The formats some attention kernel reads by element (cuda/attention/element_read.cuh): the 3-bit
// ones (decode kernels: kinds kivi3 and sym3, cb3 by element; the tile kernel: all by element), the
// codebooks (kinds cb4, cb2; the tile kernel reads every codebook by element) and nvfp4: decode
// (GQA x q_len <= 8) and q_len 16 (the tile kernel), alone and as the K or V of a pair with a
// staged or 16-bit format.
TEST_CASE("gpu: formats read by element: decode and tile attention match the CPU", "[gpu][decode][by_element]") {
  const std::string spec = GENERATE("sym3/g32", "kivi3/g32", "kivi3/g64", "cb4", "cb4/g32", "cb3/g32", "cb2", "cb2/g64",
                                    "nvfp4", "k=kivi4/g32,v=cb3", "k=cb2/g32,v=kivi2/g32", "k=nvfp4,v=fp16",
                                    "k=fp16,v=sym3/g32", "k=kivi3/g32,v=nvfp4");
  const int d = GENERATE(64, 128, 256);
  const int gqa = GENERATE(1, 4);
  const int q_len = GENERATE(1, 16);
  CAPTURE(spec, d, gqa, q_len);
  REQUIRE(supported(spec, d));
  auto c = make(spec, 1, 2 * gqa, 2, d);
  std::mt19937 rng(uint32_t(spec.size() * 13 + d + gqa + q_len));
  const std::vector<int64_t> lens =
      small() ? std::vector<int64_t>{17, 65, 130} : std::vector<int64_t>{17, 63, 64, 65, 127, 129, 200, 700};
  std::vector<attend_item> items = fill_sequences(c, lens, d, rng);
  for (auto& it : items) it.q_len = q_len;  // the last q_len tokens are the queries' own
  REQUIRE(c.gpu.stats().pages > 0);
  REQUIRE(attend_both(c, items, 0, rng) < nmse_bound);
}

// Pages read by element beside staged and 16-bit pages in one layer (temporal striping and one head
// on its own format), at page_tokens 64 and 128, through both kernels that read them: a
// decode kernel (q_len 1: the layer's hint counts them as 16 bits) and the tile kernel (q_len 16).
TEST_CASE("gpu: mixed formats with pages read by element", "[gpu][decode][by_element]") {
  const int which = GENERATE(0, 1, 2);
  const int q_len = GENERATE(1, 16);
  CAPTURE(which, q_len);
  const char* narrow_tiers[] = {"kivi4/g32",           "cb4",     "k=kivi2/g32,v=cb2/g32", "kivi3/g32",
                                "k=nvfp4,v=kivi4/g32", "sym3/g32"};
  const char* eight_tiers[] = {"kivi8/g32", "cb3/g32", "k=int8,v=nvfp4", "kivi4/g32", "k=kivi3/g32,v=fp8", "cb2"};
  const char* wide_tiers[] = {"fp16", "cb4/g32", "k=kivi4/g32,v=kivi3/g32", "k=nvfp4,v=fp16", "kivi2/g32", "cb2/g64"};
  const char* const* tiers = which == 0 ? narrow_tiers : which == 1 ? eight_tiers : wide_tiers;
  check_striped(which == 1 ? 128 : 64, uint32_t(40 + which * 2 + q_len), tiers, small() ? 4 : 6, "kivi4/g32", "cb3",
                small() ? 4 : 6, q_len);
}

// Pages of the 3-bit kinds (kivi3, sym3) beside other formats in one layer (temporal striping and
// heads on their own formats), as EchoKV's tiers leave a layer: decode reads them staged in the
// block-staged kernel's Three instances (`attend_args::three_bit_pages`), in 4-bit stages (page
// tokens 64 and 128), 8-bit stages (3 of them: warp pairs take a stage's pages in turn) and 3-bit
// stages, q_len 1 and 2 (GQA 4: 4 and 8 rows a kv head); at page_tokens 256 (fewer than 3 page
// stages: which 4, 5) in the per-warp kernel's Three instance, in 4- and 8-bit stages. Against the
// CPU.
TEST_CASE("gpu: 3-bit pages among other formats decode staged", "[gpu][decode][three]") {
  const int which = GENERATE(0, 1, 2, 3, 4, 5);
  const int q_len = GENERATE(1, 2);
  CAPTURE(which, q_len);
  const char* four_tiers[] = {"kivi4/g32", "kivi3/g32", "k=kivi2/g32,v=sym3/g32", "cb4", "k=kivi3/g64,v=kivi4/g32",
                              "sym3/g32"};
  const char* eight_tiers[] = {"kivi8/g32", "kivi3/g32", "k=int8,v=sym3/g32", "fp8", "k=kivi3/g32,v=nvfp4", "sym3"};
  const char* three_tiers[] = {"kivi3/g32", "sym3/g32", "k=kivi3/g64,v=sym3/g64", "kivi3/g64", "sym3",
                               "k=sym3/g32,v=kivi3/g32"};
  const bool eight = which == 1 || which == 5;
  const char* const* tiers = eight ? eight_tiers : which == 2 ? three_tiers : four_tiers;
  const char* head_odd = eight ? "fp8" : which == 2 ? "sym3/g32" : "kivi2/g32";
  check_striped(which >= 4 ? 256 : which == 3 ? 128 : 64, uint32_t(70 + which * 2 + q_len), tiers, small() ? 4 : 6,
                "kivi3/g32", head_odd, small() || which >= 4 ? 3 : 5, q_len);  // (256-token pages: fewer sealed)
}

TEST_CASE("gpu: decode attention matches the CPU reference over formats and lengths", "[gpu][decode]") {
  const std::string spec =
      GENERATE("fp16", "bf16", "fp8", "int8", "sym4/g32", "sym2/g64", "kivi8/g32", "kivi4/g32", "kivi2/g32",
               "kivi4/g64", "ra4/g32", "k=kivi4/g32,v=kivi2/g32", "k=int8,v=kivi4/g128", "sym3/g32", "sym3",
               "kivi3/g32", "kivi3/g128", "k=kivi3/g64,v=sym3/g64", "k=sym3/g128,v=kivi2/g32");
  const int d = GENERATE(64, 128, 256);
  const int gqa = GENERATE(1, 4, 8);
  CAPTURE(spec, d, gqa);
  if (!supported(spec, d)) return;
  auto c = make(spec, 1, 2 * gqa, 2, d);
  std::mt19937 rng(uint32_t(spec.size() * 7 + d + gqa));
  const std::vector<int64_t> lens = small() ? std::vector<int64_t>{1, 65, 130}
                                            : std::vector<int64_t>{1, 3, 63, 64, 65, 96, 97, 127, 128, 129, 200, 1000};
  const std::vector<attend_item> items = fill_sequences(c, lens, d, rng);
  // the whole batch of unequal lengths in one launch, then one sequence at a time
  REQUIRE(attend_both(c, items, 0, rng) < nmse_bound);
  for (const auto& it : items) {
    CAPTURE(it.seq);
    REQUIRE(attend_both(c, {it}, 0, rng) < (gqa == 1 ? nmse_bound_one_query : nmse_bound));
  }
}

// Layers whose kv heads each hold one 3-bit pair (kivi3/kivi3, sym3/sym3) decode in the
// block-staged kernel's Whole instance, in chunk loops compiled for that pair, staged (in stages
// of 3 bits; of 4 beside a head of 4-bit pages); where the plan is another kernel or instance
// (page_tokens 256 at head_dim 128 and 256: the per-warp kernel; head_dim 256 beside a 4-bit head
// at page_tokens 64: 4 page stages, too few for the Whole instance), in a Three instance, staged
// too. A 4-bit K beside a 3-bit V (`three_bit_mixed_pairs`) decodes in the Three instances, in a
// chunk loop of its own at page_tokens 64 and 128 (alone, and beside a kivi2 head). Against the
// CPU.
TEST_CASE("gpu: layers of one 3-bit pair per head decode staged", "[gpu][decode][three]") {
  const std::string spec =
      GENERATE("kivi3/g32", "sym3/g32", "sym3", "kivi3/g128", "kivi3/g32;0.1=kivi4/g32", "sym3/g32;0.0=kivi2/g32",
               "k=kivi4/g32,v=kivi3/g32", "k=kivi4/g32,v=kivi3/g32;0.1=kivi2/g32");
  const int d = GENERATE(64, 128, 256);
  const int page = GENERATE(64, 128, 256);
  const int gqa = GENERATE(1, 4);
  CAPTURE(spec, d, page, gqa);
  if (!supported(spec.substr(0, spec.find(';')), d, page)) return;
  auto c = make(spec, 1, 2 * gqa, 2, d, page);
  std::mt19937 rng(uint32_t(spec.size() * 11 + d + page + gqa));
  const std::vector<int64_t> lens = small() ? std::vector<int64_t>{700, 1500} : std::vector<int64_t>{300, 700, 1500, 3000};
  const std::vector<attend_item> items = fill_sequences(c, lens, d, rng);
  REQUIRE(attend_both(c, items, 0, rng) < nmse_bound);
  // one sequence's queries: the one-query tail (kivi3/g32 beside a kivi4/g32 head, head_dim 64,
  // page_tokens 128, GQA 4, the reduced lengths: 2.9e-5 on the H200, 2026-12-03)
  REQUIRE(attend_both(c, {items.back()}, 0, rng) < nmse_bound_one_query);
}

TEST_CASE("gpu: long sequences refill every page stage many times", "[gpu][decode]") {
  // 8 sequences x ~8192 tokens, 8 kv heads: 6 splits of ~22 pages per (sequence, kv head), so each
  // of the block-staged kernel's page stages is filled ~7 times for 8-bit pages (3 stages of 18 KB,
  // whose warp pairs take a stage's pages in turn), 3-4 times for kivi4 (6 of 10 KB) and 2-3 times
  // for kivi2 (8 of 6 KB).
  const std::string spec = GENERATE("kivi8/g32", "kivi4/g32", "int8", "fp8", "kivi2/g32");
  if (small() && spec != "kivi8/g32" && spec != "kivi4/g32") return;
  CAPTURE(spec);
  const int d = 128, h = 8, n = 8192;
  auto c = make(spec, 1, 32, h, d);
  std::mt19937 rng(uint32_t(spec.size() * 13));
  std::vector<attend_item> items;
  for (int i = 0; i < 8; ++i) {
    check(c.cpu.create_sequence(i));
    check(c.gpu.create_sequence(i));
    auto k = randn_h(rng, size_t(n - 37 * i) * h * d), v = randn_h(rng, size_t(n - 37 * i) * h * d);
    append_both(c, i, 0, k, v, n - 37 * i, h, d);
    items.push_back({i, 1});
  }
  REQUIRE(attend_both(c, items, 0, rng) < nmse_bound);
}

TEST_CASE("gpu: pages of 128 tokens (two warps per page in whole-page steps)", "[gpu][decode]") {
  // A block whose pages share one format steps through 64-token units: at page_tokens 128 two warps
  // share each page (and its stage's barriers); lengths end mid-page and mid-unit.
  const std::string spec = GENERATE("kivi4/g32", "kivi2/g32", "int8", "fp8", "kivi8/g32", "sym4/g32");
  const int d = GENERATE(64, 128, 256);
  CAPTURE(spec, d);
  auto c = make(spec, 1, 8, 2, d, 128);
  std::mt19937 rng(uint32_t(spec.size() * 31 + d));
  const std::vector<int64_t> lens =
      small() ? std::vector<int64_t>{100, 1000} : std::vector<int64_t>{1, 100, 129, 1000, 3000};
  const std::vector<attend_item> items = fill_sequences(c, lens, d, rng);
  REQUIRE(attend_both(c, items, 0, rng) < nmse_bound);
}

TEST_CASE("gpu: mixed formats within one sequence (temporal striping)", "[gpu][decode]") {
  // with 16-bit pages (the staged kernels' 16-bit instances) and without
  const bool wide = GENERATE(true, false);
  CAPTURE(wide);
  const char* wide_tiers[] = {"kivi4/g32", "k=kivi2/g32,v=fp8", "fp16", "k=int8,v=kivi2/g64", "ra2/g32", "bf16"};
  const char* narrow_tiers[] = {"kivi4/g32",          "k=kivi2/g32,v=fp8", "kivi8/g64",
                                "k=int8,v=kivi2/g64", "ra2/g32",           "k=fp8,v=sym2/g32"};
  const char* const* tiers = wide ? wide_tiers : narrow_tiers;
  check_striped(64, wide ? 5 : 6, tiers, small() ? 3 : 6, "sym4/g32", "sym4/g32", small() ? 5 : 6, 1);
}

// Sink pages (cache_config::sink_pages: FP16) beside pages of every kind: the backend plans a
// layer for the pages the policy chose (the Whole instance for 4/2-bit pairs, the 3-bit chunk
// loops), and a decode call gives the sink pages a split of their own, read from global memory.
// Decode (one launch for the batch, and one sequence at a time) and extend steps (the tile
// kernel: an FP16 tile filling the 72 KiB copy ring at head_dim 256, then pages read by
// element) against the CPU.
TEST_CASE("gpu: sink pages beside pages of every kind decode as the CPU's", "[gpu][decode][sinks]") {
  const std::string spec = GENERATE("kivi4/g32", "kivi2/g32", "k=kivi4/g32,v=kivi2/g32", "sym4/g32", "cb4", "cb2",
                                    "nvfp4", "int8", "fp8", "kivi3/g32", "sym3/g32", "k=kivi3/g64,v=sym3/g64");
  // (reduced for the sanitizers: head_dim 128, one sink page)
  const int d = GENERATE_COPY(from_range(small() ? std::vector<int>{128} : std::vector<int>{64, 128, 256}));
  const int gqa = GENERATE(1, 4);
  const int sinks = GENERATE_COPY(from_range(small() ? std::vector<int>{1} : std::vector<int>{1, 3}));
  CAPTURE(spec, d, gqa, sinks);
  if (!supported(spec, d)) return;
  auto c = make(spec, 1, 2 * gqa, 2, d, 64, sinks);
  std::mt19937 rng(uint32_t(spec.size() * 17 + d + gqa + sinks));
  const std::vector<int64_t> lens =
      small() ? std::vector<int64_t>{130, 1500} : std::vector<int64_t>{1, 96, 97, 130, 200, 257, 1500, 3000};
  const std::vector<attend_item> items = fill_sequences(c, lens, d, rng);
  CHECK(c.gpu.stats().pages_by_format[fp16_format] > 0);
  require_same_store(c, int64_t(lens.size()) - 1, 0);
  REQUIRE(attend_both(c, items, 0, rng) < nmse_bound);
  for (const auto& it : items) {
    CAPTURE(it.seq);
    REQUIRE(attend_both(c, {it}, 0, rng) < (gqa == 1 ? nmse_bound_one_query : nmse_bound));
  }
  // an extend step of 16 tokens on every sequence
  std::vector<attend_item> ext;
  for (size_t i = 0; i < lens.size(); ++i) {
    auto k = randn_h(rng, size_t(16) * 2 * d), v = randn_h(rng, size_t(16) * 2 * d);
    append_both(c, int64_t(i), 0, k, v, 16, 2, d);
    ext.push_back({int64_t(i), 16});
  }
  REQUIRE(attend_both(c, ext, 0, rng) < nmse_bound);
}

TEST_CASE("gpu: speculative (q_len <= 16) and extend (q_len up to the window) attention", "[gpu][extend]") {
  const int q_len = GENERATE(2, 5, 16, 64, 128);
  const int gqa = GENERATE(1, 4);
  CAPTURE(q_len, gqa);
  auto c = make("k=kivi4/g32,v=kivi2/g32", 1, 2 * gqa, 2, 128);
  std::mt19937 rng(uint32_t(q_len * 3 + gqa));
  std::vector<attend_item> items;
  const std::vector<int64_t> prefix = small() ? std::vector<int64_t>{70} : std::vector<int64_t>{0, 70, 500};
  for (size_t i = 0; i < prefix.size(); ++i) {
    check(c.cpu.create_sequence(int64_t(i)));
    check(c.gpu.create_sequence(int64_t(i)));
    if (prefix[i] > 0) {
      auto k = randn_h(rng, size_t(prefix[i]) * 2 * 128), v = randn_h(rng, size_t(prefix[i]) * 2 * 128);
      append_both(c, int64_t(i), 0, k, v, prefix[i], 2, 128);
    }
    auto k = randn_h(rng, size_t(q_len) * 2 * 128), v = randn_h(rng, size_t(q_len) * 2 * 128);
    append_both(c, int64_t(i), 0, k, v, q_len, 2, 128);
    items.push_back({int64_t(i), q_len});
  }
  REQUIRE(attend_both(c, items, 0, rng) < nmse_bound);
}

// On the device, without a synchronization: the append returns, the sequence is held, and
// `check` reports it and restores it (docs/architecture.md, "Value checks on the device").
TEST_CASE("gpu: bad values are refused on the device and reported by check; nothing is stored", "[gpu][errors]") {
  auto c = make("kivi4/g32", 1, 8, 2, 128);
  std::mt19937 rng(1);
  check(c.gpu.create_sequence(0));
  check(c.cpu.create_sequence(0));
  auto k = randn_h(rng, 200 * 2 * 128), v = randn_h(rng, 200 * 2 * 128);
  append_both(c, 0, 0, k, v, 100, 2, 128);
  const auto before = c.gpu.stats();
  auto kb = k;
  kb[150 * 256 + 17] = 0x7e00;  // fp16 NaN
  dev_mem dk(kb.size() * 2), dv(v.size() * 2);
  upload(dk, kb);
  upload(dv, v);
  check(c.gpu.append(0, 0, {dk.p, dtype::f16, 200, 2, 128}, {dv.p, dtype::f16, 200, 2, 128}));
  const status s = c.gpu.check();
  REQUIRE(s.code() == errc::non_finite);
  CAPTURE(s.message());
  REQUIRE(s.message().find("sequence 0 layer 0 token 250") != std::string::npos);
  REQUIRE(c.gpu.length(0, 0) == 100);
  REQUIRE(c.gpu.check().ok());  // reported once
  REQUIRE(c.gpu.stats().page_bytes == before.page_bytes);
  REQUIRE(c.gpu.stats().used_bytes == before.used_bytes);
  require_same_store(c, 0, 0);
}

TEST_CASE("gpu: a batched append stores what per-sequence CPU appends store", "[gpu][append][batch]") {
  const std::string spec = GENERATE("kivi4/g32", "k=fp8,v=sym8;1=fp16");
  CAPTURE(spec);
  auto c = make(spec, 2, 8, 2, 128);
  std::vector<float> clip(2 * 2 * 2, 95.f);
  check(c.cpu.set_clip_percentiles(clip));
  check(c.gpu.set_clip_percentiles(clip));
  std::mt19937 rng(31);
  const int nseq = 13, H = 2, d = 128;
  for (int s = 0; s < nseq; ++s) check(c.cpu.create_sequence(s)), check(c.gpu.create_sequence(s));
  // a prefill of unequal lengths (one sequence with more new pages than one launch takes), then
  // decode steps of one token each, several of them completing pages in the same call
  std::vector<std::vector<int64_t>> steps = {{1, 30, 64, 95, 96, 97, 128, 129, 200, 300, 2500, 7, 1}};
  for (int t = 0; t < (small() ? 70 : 140); ++t) steps.push_back(std::vector<int64_t>(nseq, 1));
  for (int layer : {0, 1})
    for (const auto& counts : steps) {
      std::vector<append_item> items;
      int64_t rows = 0;
      for (int s = 0; s < nseq; ++s) items.push_back({s, counts[size_t(s)]}), rows += counts[size_t(s)];
      const auto k = randn_h(rng, size_t(rows) * H * d), v = randn_h(rng, size_t(rows) * H * d);
      int64_t row = 0;
      for (const auto& it : items) {
        check(c.cpu.append(it.seq, layer, {k.data() + size_t(row) * H * d, dtype::f16, it.tokens, H, d},
                           {v.data() + size_t(row) * H * d, dtype::f16, it.tokens, H, d}));
        row += it.tokens;
      }
      dev_mem dk(k.size() * 2), dv(v.size() * 2);
      upload(dk, k);
      upload(dv, v);
      check(c.gpu.append_batch(items, layer, {dk.p, dtype::f16, rows, H, d}, {dv.p, dtype::f16, rows, H, d}));
      REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    }
  for (int s = 0; s < nseq; ++s)
    for (int layer : {0, 1}) require_same_store(c, s, layer);
  // and attention over the batch-written caches agrees with the CPU
  std::vector<attend_item> items;
  for (int s = 0; s < nseq; ++s) items.push_back({s, 1});
  REQUIRE(attend_both(c, items, 1, rng) < nmse_bound);
  // a bad value in the last sequence's rows: the others are stored (on the CPU too), the last
  // one is held and restored by check
  std::vector<append_item> all;
  for (int s = 0; s < nseq; ++s) all.push_back({s, 1});
  auto k = randn_h(rng, size_t(nseq) * H * d), v = randn_h(rng, size_t(nseq) * H * d);
  k[size_t(nseq - 1) * H * d + 5] = 0x7e00;  // fp16 NaN
  dev_mem dk(k.size() * 2), dv(v.size() * 2);
  upload(dk, k);
  upload(dv, v);
  check(c.gpu.append_batch(all, 0, {dk.p, dtype::f16, nseq, H, d}, {dv.p, dtype::f16, nseq, H, d}));
  const status st = c.gpu.check();
  REQUIRE(st.code() == errc::non_finite);
  CAPTURE(st.message());
  REQUIRE(st.message().find(fmt::format("sequence {} layer 0", nseq - 1)) != std::string::npos);
  REQUIRE(c.gpu.length(nseq - 1, 0) == c.cpu.length(nseq - 1, 0));
  for (int s = 0; s + 1 < nseq; ++s)
    check(c.cpu.append(s, 0, {k.data() + size_t(s) * H * d, dtype::f16, 1, H, d},
                       {v.data() + size_t(s) * H * d, dtype::f16, 1, H, d}));
  for (int s = 0; s < nseq; ++s) require_same_store(c, s, 0);
}

// Codebook pages whose tokens' scales (their rms) span 0.01 to 2000 in one sequence, keys 0.1 to
// 30: the levels times the scales stay within fp16 and the GPU reads what the CPU reads.
TEST_CASE("gpu: codebook pages of any value scale decode as the CPU's", "[gpu][codebook]") {
  const std::string spec = GENERATE("cb4", "cb2", "cb4/g32");
  const int d = GENERATE(64, 128);
  CAPTURE(spec, d);
  auto c = make(spec, 1, 8, 2, d);
  std::mt19937 rng(static_cast<uint32_t>(d));
  std::vector<attend_item> items;
  for (int s = 0; s < 3; ++s) {
    check(c.cpu.create_sequence(s));
    check(c.gpu.create_sequence(s));
    const int64_t len = 300 + 97 * s;
    auto k = randn_h(rng, size_t(len) * 2 * d), v = randn_h(rng, size_t(len) * 2 * d);
    for (int64_t t = 0; t < len; ++t) {  // each token's V scaled by 0.01 .. 2000 (its rms), K by 0.1 .. 30
      const float sv = std::pow(10.f, -2.f + 5.3f * float((t * 37) % 97) / 96.f), sk = std::pow(10.f, -1.f + 2.5f * float((t * 11) % 13) / 12.f);
      for (int i = 0; i < 2 * d; ++i) {
        uint16_t& x = v[size_t(t) * 2 * d + i];
        x = float_to_half(half_to_float(x) * sv);
        uint16_t& y = k[size_t(t) * 2 * d + i];
        y = float_to_half(half_to_float(y) * sk);
      }
    }
    append_both(c, s, 0, k, v, len, 2, d);
    items.push_back({s, 1});
  }
  require_same_store(c, 1, 0);
  CHECK(attend_both(c, items, 0, rng) < nmse_bound);
}
