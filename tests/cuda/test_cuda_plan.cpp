// The attention launch plan (`cuda::attend_plan`), checked on the host: no CUDA device needed, so
// CI runs it. Which kernel each layer gets, and the block-staged ring's shape: at least 3 page
// stages that fit with 3 blocks per SM. (Any stage count: where warp pairs take a stage's pages in
// turn, as with 8-bit pages on 3 stages at page_tokens 64, the kernel gives each stage one full
// barrier per fill parity.)
#include <catch2/catch.hpp>

#include "gpu_test.hpp"

#include <kvq/cuda/canary.hpp>
#include <kvq/cuda/paged_attention.hpp>
#include <kvq/cuda/read_plan.hpp>

#include <tuple>
#include <vector>

using namespace kvq;
using kvq::gpu_test::page_bytes;

namespace {

cuda::paged_view view(int head_dim, int page_tokens) {
  cuda::paged_view kv;
  kv.layers = 1;
  kv.kv_heads = 8;
  kv.head_dim = head_dim;
  kv.page_tokens = page_tokens;
  kv.window = 2 * page_tokens;
  kv.max_pages = 4096;
  kv.k_page_bytes = page_bytes(role::k, page_tokens, head_dim);
  kv.v_page_bytes = page_bytes(role::v, page_tokens, head_dim);
  return kv;
}

// A decode batch: `batch` sequences of `n` tokens, q_len queries each (GQA 4), under a hint
// (`items` holds the batch: the arguments view it).
cuda::attend_args batch_args(std::vector<cuda::decode_item>& items, int head_dim, int page_tokens, int max_bits,
                             int batch, int n, int q_len, bool one_format) {
  cuda::attend_args a;
  const int ring = page_tokens / 2;  // tokens not yet in pages
  for (int i = 0; i < batch; ++i) items.push_back({i, q_len, n, n - ring, 0, i * q_len});
  a.items = items;
  a.kv = view(head_dim, page_tokens);
  a.q_heads = 32;
  a.max_page_bits = max_bits;
  a.one_format_per_head = one_format;
  return a;
}

cuda::attend_plan_info plan(int head_dim, int page_tokens, int max_bits, int batch, int n, int q_len = 1,
                            bool one_format = false, int sink_pages = 0) {
  std::vector<cuda::decode_item> items;
  cuda::attend_args a = batch_args(items, head_dim, page_tokens, max_bits, batch, n, q_len, one_format);
  a.sink_pages = sink_pages;
  return cuda::attend_plan(a).value_or_throw();
}

}  // namespace

TEST_CASE("attention plan: the kernel follows the layer's widest page", "[cuda][plan]") {
  // 16-bit pages: the staged kernels' 16-bit instances (block-staged where 3 page stages fit)
  CHECK(plan(128, 64, 16, 8, 32768).kernel == cuda::attend_kernel::decode_block_staged);
  CHECK(plan(256, 128, 16, 8, 32768).kernel == cuda::attend_kernel::decode_staged);  // 128 KB page-heads
  CHECK(plan(128, 64, 8, 8, 32768).kernel == cuda::attend_kernel::decode_block_staged);
  CHECK(plan(128, 128, 8, 8, 32768).kernel == cuda::attend_kernel::decode_staged);  // 36 KB page-heads
  CHECK(plan(128, 64, 4, 8, 32768).kernel == cuda::attend_kernel::decode_block_staged);
  CHECK(plan(128, 64, 2, 8, 32768).kernel == cuda::attend_kernel::decode_block_staged);
  CHECK(plan(128, 128, 4, 1, 131072).kernel == cuda::attend_kernel::decode_block_staged);
  // more than 8 query rows per kv head: the tile kernel
  CHECK(plan(128, 64, 4, 2, 4096, 4).kernel == cuda::attend_kernel::tile);
}

TEST_CASE("attention plan: block-staged rings have at least 3 page stages that fit", "[cuda][plan]") {
  for (int d : {64, 128, 256})
    for (int P : {64, 128, 256})
      for (int bits : {2, 3, 4, 8, 16})
        for (int n : {1000, 32768, 131072}) {
          CAPTURE(d, P, bits, n);
          const auto info = plan(d, P, bits, 8, n);
          if (info.kernel != cuda::attend_kernel::decode_block_staged) continue;
          CHECK(info.stages >= 3);
          CHECK(info.stage_bytes % 128 == 0);
          CHECK(int64_t(info.stages) * info.stage_bytes <= info.smem_bytes);
          CHECK(info.smem_bytes <= 227 * 1024);
          if (bits <= 8) CHECK(info.blocks_per_sm == (d == 256 ? 2 : 3));  // (head_dim 256: 255 registers a thread)
          else CHECK(info.blocks_per_sm <= (d == 256 ? 1 : d == 128 ? 2 : 3));  // (the 16-bit instances' bounds)
          CHECK(info.tokens_per_split % 128 == 0);  // whole 32-token chunks of every warp, whole pages
        }
  // the measured shapes (docs/performance.md): 6 stages of a kivi4 page-head at 64 tokens
  const auto p64 = plan(128, 64, 4, 8, 32768);
  CHECK(p64.stages == 6);
  CHECK(p64.stage_bytes == 10240);
  CHECK(plan(128, 128, 4, 8, 32768).stages == 3);
  // 8-bit pages: 18 KB page-heads (kivi8's), 3 stages; the warp pairs take a stage's pages in turn
  const auto p8 = plan(128, 64, 8, 8, 32768);
  CHECK(p8.stages == 3);
  CHECK(p8.stage_bytes == 18432);
  // 16-bit page-heads at page_tokens 64: 16 KB at head_dim 64 (3 stages, 3 blocks), 32 KB at 128
  // (3 stages, 2 blocks), 64 KB at 256 (3 stages, 1 block)
  const auto w64 = plan(64, 64, 16, 8, 32768), w128 = plan(128, 64, 16, 8, 32768), w256 = plan(256, 64, 16, 8, 32768);
  for (const auto& [w, stages, bytes, blocks] : {std::tuple{w64, 3, 16384u, 3}, {w128, 3, 32768u, 2}, {w256, 3, 65536u, 1}}) {
    CHECK(w.stages == stages);
    CHECK(w.stage_bytes == bytes);
    CHECK(w.blocks_per_sm == blocks);
  }
}

TEST_CASE("attention plan: one format pair per head runs 64-token units on 4- and 2-bit rings", "[cuda][plan]") {
  for (int d : {64, 128}) {
    CAPTURE(d);
    CHECK(plan(d, 64, 4, 8, 32768, 1, true).whole_units);
    CHECK(plan(d, 64, 2, 8, 32768, 1, true).whole_units);
    CHECK(plan(d, 128, 4, 1, 131072, 1, true).whole_units);  // two warps per page
    CHECK_FALSE(plan(d, 64, 4, 8, 32768).whole_units);        // no hint: any mix of formats
  }
  // 8-bit rings: 3 stages of 18 KB, fewer than the block's warps need (they hold 4 pages)
  CHECK_FALSE(plan(128, 64, 8, 8, 32768, 1, true).whole_units);
  CHECK_FALSE(plan(128, 64, 16, 8, 32768, 1, true).whole_units);     // 16-bit stages
  CHECK_FALSE(plan(128, 64, 4, 2, 4096, 4, true).whole_units);       // the tile kernel
}

TEST_CASE("attention plan: head_dim 64, 128 and 256 plan; others are refused", "[cuda][plan]") {
  for (int d : {64, 128, 256}) {
    CAPTURE(d);
    CHECK(plan(d, 64, 4, 8, 32768).kernel == cuda::attend_kernel::decode_block_staged);
    CHECK(plan(d, 64, 16, 8, 32768).kernel == cuda::attend_kernel::decode_block_staged);
    CHECK(plan(d, 64, 4, 2, 4096, 4).kernel == cuda::attend_kernel::tile);
  }
  std::vector<cuda::decode_item> items{{0, 1, 1000, 904, 0, 0}};
  for (int d : {32, 96, 512}) {
    cuda::attend_args a;
    a.kv = view(d, 64);
    a.q_heads = 32;
    a.items = items;
    const auto r = cuda::attend_plan(a);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code() == errc::unsupported);
    CHECK_THAT(std::string(r.error().message()), Catch::Contains("head_dim") && Catch::Contains(std::to_string(d)));
  }
}

TEST_CASE("attention plan: unsupported page sizes are refused with the reason", "[cuda][plan]") {
  std::vector<cuda::decode_item> items{{0, 1, 1000, 904, 0, 0}};
  cuda::attend_args a;
  a.kv = view(128, 192);
  a.q_heads = 32;
  a.items = items;
  const auto r = cuda::attend_plan(a);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code() == errc::unsupported);
  CHECK_THAT(std::string(r.error().message()), Catch::Contains("page_tokens") && Catch::Contains("192"));
}

// `attend_run` checks its arguments and the workspace against the call's plan before any device
// work, so these refusals need no device. A batch of more than 256 items (the launch limit) runs
// in parts under one plan: the workspace `attend_workspace_bytes` reports is what it needs.
TEST_CASE("attend_run refuses bad arguments and a short workspace before any launch", "[cuda][plan]") {
  for (const int batch : {8, 300}) {
    CAPTURE(batch);
    std::vector<cuda::decode_item> items;
    for (int i = 0; i < batch; ++i) items.push_back({i, 1, 4096, 4064, 0, i});
    cuda::attend_args a;
    a.kv = view(128, 64);
    a.q_heads = 32;
    a.items = items;
    a.max_page_bits = 4;
    const size_t need = cuda::attend_workspace_bytes(a);
    REQUIRE(need > 0);
    const status short_ws = cuda::attend_run(a, nullptr, need - 1, nullptr);
    CHECK(short_ws.code() == errc::invalid_argument);
    CHECK_THAT(short_ws.message(), Catch::Contains("need " + std::to_string(need)));
    items[1].from_pages = 4096;  // q_len 1 from the ring: none left
    const status bad = cuda::attend_run(a, nullptr, need, nullptr);
    CHECK(bad.code() == errc::invalid_argument);
    CHECK_THAT(bad.message(), Catch::Contains("inconsistent item (slot 1"));
  }
}

// `append_run` checks every index the kernels write through before any device work: a bad slot,
// page range or format id is a status naming the item, and no launch happens (no device needed).
TEST_CASE("append_run refuses inconsistent items and unusable page formats before any launch", "[cuda][plan]") {
  const cuda::paged_view kv = view(128, 64);
  std::vector<uint16_t> rows(size_t(3) * kv.kv_heads * kv.head_dim);  // never read: refused first
  std::vector<uint32_t> blocks = {0};
  std::vector<uint8_t> fmts(size_t(kv.kv_heads) * 2, uint8_t(parse_format("kivi4/g32").value()));
  auto args = [&](std::vector<cuda::append_seq>& items) {
    cuda::append_args a;
    a.kv = kv;
    a.items = items;
    a.k = a.v = {rows.data(), dtype::f16, 3, kv.kv_heads, kv.head_dim};
    a.page_blocks = blocks.data();
    a.page_fmts = fmts.data();
    return a;
  };
  const cuda::append_seq good{.slot = 0, .n = 93, .e = 0, .m = 3, .window_unit = 0, .first_page = 0, .pages = 1};
  const std::vector<std::pair<cuda::append_seq, const char*>> bad = {
      {{.slot = -1, .n = 93, .e = 0, .m = 3, .first_page = 0, .pages = 1}, "slot -1"},
      {{.slot = 0, .n = 93, .e = 64, .m = 3, .first_page = 0, .pages = 1}, "first_page 0"},
      {{.slot = 0, .n = 93, .e = 0, .m = 3, .first_page = 0, .pages = 2}, "pages 2"},
      {{.slot = 0, .n = 93, .e = 0, .m = 0, .first_page = 0, .pages = 1}, "m 0"},
      {{.slot = 0, .n = 4095 * 64, .e = 4095 * 64, .m = 3, .first_page = 4095, .pages = 2}, "first_page 4095"},
  };
  for (const auto& [item, what] : bad) {
    CAPTURE(what);
    std::vector<cuda::append_seq> items = {good, item};
    const status s = cuda::append_run(args(items), nullptr);
    CHECK(s.code() == errc::invalid_argument);
    CHECK_THAT(s.message(), Catch::Contains("item 1") && Catch::Contains(what));
  }
  std::vector<cuda::append_seq> one = {good};
  fmts[3] = uint8_t(format_count);  // V of kv head 1: no such format
  const status f = cuda::append_run(args(one), nullptr);
  CHECK(f.code() == errc::invalid_argument);
  CHECK_THAT(f.message(), Catch::Contains("format id " + std::to_string(format_count)));
  for (int f = 0; f < int(format_count); ++f) {  // every format is read: none is refused as unread
    CAPTURE(format_name(format_id(f)));
    CHECK(cuda::kernels_read(format_id(f)));
  }
  cuda::append_args wrong_layer = args(one);
  wrong_layer.layer = 1;
  CHECK_THAT(cuda::append_run(wrong_layer, nullptr).message(), Catch::Contains("layer 1 outside [0, 1)"));
}

// The device canary's shared memory: at head_dim 256 a 128-token window's error table does not fit
// an H200 block (232448 bytes) whole; in blocks of 96 keys (then 32) it does, and the keys stay
// staged whole.
TEST_CASE("canary: the error table in blocks of keys fits head_dim 256", "[cuda][plan][canary]") {
  const std::vector<format_id> tiers = {parse_format("kivi2/g32").value_or_throw(),
                                        parse_format("kivi4/g32").value_or_throw(),
                                        parse_format("kivi8/g32").value_or_throw()};
  const size_t whole = cuda::canary_smem_bytes(tiers, 32, 256, 128);
  CHECK(whole == cuda::canary_smem_bytes(tiers, 32, 256, 128, 128));
  CHECK(whole > 232448);
  const size_t blocks = cuda::canary_smem_bytes(tiers, 32, 256, 128, 96);
  CHECK(blocks <= 232448);
  // blocks of 96 keys save 32 error rows (fp32, 260 floats each) and one 32-token page
  CHECK(whole - blocks > size_t(32) * 260 * 4);
  CHECK(cuda::canary_smem_bytes(tiers, 32, 128, 128) <= 232448);  // head_dim 128: the whole table
}

TEST_CASE("attention plan: heads of 3-bit kind pairs take the Whole instance in stages of 3 bits", "[cuda][plan]") {
  // A hint of 3 bits (the CUDA backend's, for a layer whose kv heads each hold kivi3/kivi3 or
  // sym3/sym3): page-heads of at most 3 bits, smaller than 4-bit ones, in a ring the Whole
  // instance runs (no two_full: an even count at page_tokens 64), its chunk loops reading them.
  for (int d : {64, 128, 256}) {
    CAPTURE(d);
    const auto p3 = plan(d, 64, 3, 8, 32768, 1, true), p4 = plan(d, 64, 4, 8, 32768, 1, true);
    CHECK(p3.kernel == cuda::attend_kernel::decode_block_staged);
    CHECK(p3.whole_units);
    CHECK(p3.stages % 2 == 0);
    CHECK(p3.stage_bytes < p4.stage_bytes);
    CHECK(p3.stages >= p4.stages);
    CHECK(plan(d, 128, 3, 8, 32768, 1, true).whole_units);  // (head_dim 256: 3 stages of 32 KB)
  }
  // head_dim 256, 64-token pages: 4-bit page-heads leave room for 4 stages, too few for whole units
  CHECK_FALSE(plan(256, 64, 4, 8, 32768, 1, true).whole_units);
  // page_tokens 256 at head_dim 128 and 256: fewer than 3 page stages, the per-warp kernel's Three
  // instance in 3-bit stages (its stages hold 16-row 3-bit pages)
  for (int d : {128, 256}) {
    const auto p = plan(d, 256, 3, 8, 32768, 1, true);
    CHECK(p.kernel == cuda::attend_kernel::decode_staged);
    CHECK(p.stage_bits == 3);
    CHECK(p.three_bit_dispatch);
    CHECK_FALSE(p.whole_units);
  }
  // without one_format_per_head, no Whole instance: a Three instance
  CHECK_FALSE(plan(128, 64, 3, 8, 32768).whole_units);
  CHECK(plan(128, 64, 3, 8, 32768).three_bit_dispatch);
}

namespace {
// A decode batch of 8 x 32K under a hint with `three_bit_pages`.
cuda::attend_plan_info plan3(int head_dim, int page_tokens, int max_bits, bool three, bool one_format = false,
                             float softcap = 0.f) {
  std::vector<cuda::decode_item> items;
  cuda::attend_args a = batch_args(items, head_dim, page_tokens, max_bits, 8, 32768, 1, one_format);
  a.three_bit_pages = three;
  a.variant.softcap = softcap;
  return cuda::attend_plan(a).value_or_throw();
}
}  // namespace

TEST_CASE("attention plan: 3-bit pages among other formats take a Three instance of their stage width", "[cuda][plan]") {
  // A mixed layer (EchoKV's tiers over time, striped pages) whose 3-bit kind pages count 3 bits:
  // the block-staged kernel in the stages of the layer's widest page, its Three instance (3-bit
  // cases in the per-page dispatch); the same layer without 3-bit pages keeps the plain instance.
  for (int d : {64, 128, 256}) {
    CAPTURE(d);
    for (int bits : {3, 4, 8}) {
      CAPTURE(bits);
      // (8-bit page-heads at head_dim 256 leave room for 2 page stages: 4-bit stages instead,
      // the 8-bit pages read from global memory)
      const auto p = plan3(d, 64, bits, true);
      CHECK(p.kernel == cuda::attend_kernel::decode_block_staged);
      CHECK(p.three_bit_dispatch);
      CHECK_FALSE(p.whole_units);
      CHECK(p.stage_bits == (d == 256 && bits == 8 ? 4 : bits));
      if (bits > 3) CHECK_FALSE(plan3(d, 64, bits, false).three_bit_dispatch);
    }
  }
  // heads of 3-bit pairs beside heads of 8-bit pairs: an 8-bit ring (no whole units), a Three
  // instance whose chunk loops read the 3-bit blocks
  const auto p8 = plan3(128, 64, 8, true, true);
  CHECK(p8.three_bit_dispatch);
  CHECK_FALSE(p8.whole_units);
  // heads of 3-bit pairs beside 4-bit ones: the Whole instance reads both
  CHECK(plan3(128, 64, 4, true, true).whole_units);
  CHECK_FALSE(plan3(128, 64, 4, true, true).three_bit_dispatch);
  // a soft-capped layer never runs whole units: its Three instance with the rule code
  const auto pc = plan3(128, 64, 3, false, true, 30.f);
  CHECK(pc.three_bit_dispatch);
  CHECK(pc.rule_code);
  CHECK_FALSE(pc.whole_units);
  // 8-bit page-heads at page_tokens 128 take the per-warp kernel: a block-staged Three instance of
  // 4-bit stages instead (the 8-bit pages from global memory); where those leave room for fewer
  // than 3 page stages too (head_dim 256, page_tokens 256), the per-warp kernel's Three instance in
  // 8-bit stages (every page staged)
  CHECK(plan3(128, 128, 8, false).kernel == cuda::attend_kernel::decode_staged);
  const auto p4 = plan3(128, 128, 8, true);
  CHECK(p4.kernel == cuda::attend_kernel::decode_block_staged);
  CHECK(p4.stage_bits == 4);
  CHECK(p4.three_bit_dispatch);
  const auto pw = plan3(256, 256, 8, true);
  CHECK(pw.kernel == cuda::attend_kernel::decode_staged);
  CHECK(pw.stage_bits == 8);
  CHECK(pw.three_bit_dispatch);
  // without 3-bit pages the same layer keeps the plain per-warp instance
  CHECK_FALSE(plan3(256, 256, 8, false).three_bit_dispatch);
  CHECK(plan3(256, 256, 4, true).kernel == cuda::attend_kernel::decode_staged);
  CHECK(plan3(256, 256, 4, true).three_bit_dispatch);
  // a hint of 16 (a 16-bit or by-element page in the layer) stays the 16-bit plan
  CHECK_FALSE(plan3(128, 64, 16, true).three_bit_dispatch);
  CHECK(plan3(128, 64, 16, true).stage_bits == 16);
}

TEST_CASE("attention plan: sink pages get a split of their own, the rest keeps the layer's instance", "[cuda][plan]") {
  for (const int n : {100, 4096, 32768, 131072})
    for (const int sinks : {1, 2}) {
      CAPTURE(n, sinks);
      const cuda::attend_plan_info without = plan(128, 64, 4, 8, n, 1, true);
      const cuda::attend_plan_info with = plan(128, 64, 4, 8, n, 1, true, sinks);
      CHECK(with.kernel == without.kernel);
      CHECK(with.whole_units == without.whole_units);
      CHECK(with.stages == without.stages);
      // split 0: the sink pages; the others: tokens_per_split each over what follows them
      const int slabs = (n - 32 + 15) / 16 + 2, rest = std::max(1, slabs - sinks * 4);  // (32 ring tokens)
      CHECK(with.max_splits == 1 + (rest + with.tokens_per_split / 16 - 1) / (with.tokens_per_split / 16));
      CHECK(with.tokens_per_split % 128 == 0);  // whole 32-token chunks per warp of the block
    }
  // a tile call (extend) has no sink split
  CHECK(plan(128, 64, 4, 8, 4096, 16, true, 1).max_splits == plan(128, 64, 4, 8, 4096, 16, true, 0).max_splits);
}
