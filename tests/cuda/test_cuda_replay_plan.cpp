// The launch plan of a replayed decode step's attention (cuda/replay.hpp), checked on the host: no
// CUDA device needed. Each layer runs the decode kernel the eager plan picks for the widest
// format the layer can hold, with the splits the eager plan gives a full batch of max_tokens.
#include <catch2/catch.hpp>

#include "gpu_test.hpp"

#include <kvq/cuda/paged_attention.hpp>

#include "attention/layout.hpp"
#include "replay.hpp"

#include <algorithm>
#include <vector>

using namespace kvq;
using kvq::gpu_test::page_bytes;

namespace {

cuda::attend_args layer(int page_tokens, int max_bits, bool one_format, int q_heads = 32) {
  cuda::attend_args a;
  a.kv.layers = 1;
  a.kv.kv_heads = 8;
  a.kv.head_dim = 128;
  a.kv.page_tokens = page_tokens;
  a.kv.window = 2 * page_tokens;
  a.kv.max_pages = 1024;
  a.kv.k_page_bytes = page_bytes(role::k, page_tokens, 128);
  a.kv.v_page_bytes = page_bytes(role::v, page_tokens, 128);
  a.q_heads = q_heads;
  a.max_page_bits = max_bits;
  a.one_format_per_head = one_format;
  return a;
}

// The eager plan of `batch` sequences of `n` tokens, all in pages but the last.
cuda::attend_plan_info eager(cuda::attend_args a, int batch, int n) {
  std::vector<cuda::decode_item> items;
  for (int i = 0; i < batch; ++i) items.push_back({i, 1, n, n - 1, 0, i});
  a.items = items;
  return cuda::attend_plan(a).value_or_throw();
}

}  // namespace

TEST_CASE("replay plan: the eager plan's decode kernel for the layer's widest format", "[cuda][plan][replay]") {
  const int page_tokens = GENERATE(64, 128);
  const int bits = GENERATE(2, 4, 8, 16);
  const bool one_format = GENERATE(false, true);
  const int batch = GENERATE(1, 8, 32);
  const int64_t max_tokens = GENERATE(1088, 33088);
  CAPTURE(page_tokens, bits, one_format, batch, max_tokens);
  const cuda::attend_args a = layer(page_tokens, bits, one_format);
  size_t ws = 0;
  const auto lp = cuda::detail::replay_plan(a, batch, max_tokens, ws).value_or_throw();
  const cuda::attend_plan_info e = eager(a, batch, int(max_tokens));
  REQUIRE(lp.decode);
  REQUIRE(lp.stage_cap == (bits > 8 ? 16 : bits));
  REQUIRE(e.kernel != cuda::attend_kernel::tile);
  REQUIRE((lp.page_stage > 0) == (e.kernel == cuda::attend_kernel::decode_block_staged));
  REQUIRE(lp.stages == e.stages);
  REQUIRE(lp.smem == e.smem_bytes);
  REQUIRE((lp.decode && lp.page_stage && lp.whole) == e.whole_units);
  REQUIRE(lp.max_splits == e.max_splits);
  REQUIRE(lp.tiles_per_split * lp.unit == e.tokens_per_split);
  // the workspace holds every split's partials of max_batch items
  REQUIRE(ws >= size_t(batch) * 8 * size_t(lp.max_splits) * 16 * (128 + 2) * sizeof(float));
}

TEST_CASE("replay plan: refusals", "[cuda][plan][replay]") {
  size_t ws = 0;
  // a GQA group above 8: the tile kernel, which a replay does not run
  const auto grouped = cuda::detail::replay_plan(layer(64, 4, true, 128), 4, 4096, ws);
  REQUIRE(grouped.error().code() == errc::unsupported);
  REQUIRE(grouped.error().message().find("GQA group") != std::string::npos);
  REQUIRE(cuda::detail::replay_plan(layer(64, 4, true), 0, 4096, ws).error().code() == errc::invalid_argument);
  REQUIRE(cuda::detail::replay_plan(layer(64, 4, true), 4, 1, ws).error().code() == errc::invalid_argument);
  REQUIRE(cuda::detail::replay_plan(layer(64, 4, true), 4, 1024 * 64 + 1, ws).error().code() == errc::invalid_argument);
}

// A sliding layer's replayed plan (planned for the tokens a window reads, not max_tokens) holds
// every item a step can bring: for each length n and each encoded length its ring allows, the
// splits the kernels give the item after its window's skip (`item_splits`, mirrored here) fit the
// plan's, with and without a sink split.
TEST_CASE("replay plan: a sliding layer's splits hold every item after its window's skip", "[cuda][plan][replay][variants]") {
  using cuda::detail::ceil_div;
  const int page_tokens = GENERATE(64, 128);
  const int window = GENERATE(37, 200, 1000, 4096);
  const int sink_pages = GENERATE(0, 1);
  const int batch = GENERATE(1, 32);
  CAPTURE(page_tokens, window, sink_pages, batch);
  const int64_t max_tokens = 33088;
  cuda::attend_args a = layer(page_tokens, 4, true);
  a.variant.window = window;
  a.sink_pages = sink_pages;
  size_t ws = 0;
  const auto lp = cuda::detail::replay_plan(a, batch, max_tokens, ws).value_or_throw();
  REQUIRE(lp.decode);
  const int P = page_tokens, R = a.kv.window, u = lp.unit;
  int worst = 0;
  for (int n = 2; n <= max_tokens; ++n)
    for (int e = std::max(0, (n - R) / P * P); e <= n; e += P) {
      if (n - std::min(e, n - 1) > R) continue;  // (the ring holds the tokens not in pages)
      const int f = std::min(e, n - 1);
      const int units = ceil_div(f, u) + ceil_div(n - f, u);
      const int skip = cuda::detail::window_skip_units(window, n - 1, f, P, u);
      int splits;
      if (lp.sink_units == 0) {
        splits = ceil_div(units - skip, lp.tiles_per_split);
      } else {
        const int rest = std::max(skip, lp.sink_units);
        splits = 1 + (units > rest ? ceil_div(units - rest, lp.tiles_per_split) : 0);
      }
      worst = std::max(worst, splits);
      if (splits > lp.max_splits) {
        CAPTURE(n, e, f, units, skip, splits, lp.max_splits, lp.tiles_per_split);
        REQUIRE(splits <= lp.max_splits);
      }
    }
  CHECK(worst <= lp.max_splits);
}

// The eager plan of a 4096-token window over 8 x 32K is the plan of 8 x 4K: the same splits over
// the same tokens (the decode benchmark's W4096 rows read the 4K rows' bytes).
TEST_CASE("attention plan: a sliding window plans the tokens it reads", "[cuda][plan][variants]") {
  const int bits = GENERATE(2, 4, 8, 16);
  CAPTURE(bits);
  cuda::attend_args a = layer(64, bits, bits <= 4);
  const cuda::attend_plan_info short_ctx = eager(a, 8, 4096);
  a.variant.window = 4096;
  const cuda::attend_plan_info windowed = eager(a, 8, 32768);
  CHECK(windowed.kernel == short_ctx.kernel);
  CHECK(windowed.max_splits == short_ctx.max_splits);
  CHECK(windowed.tokens_per_split == short_ctx.tokens_per_split);
}

// The window's masks and soft-capping run in decode instances of their own: a layer with either
// gets them, eager or replayed (its replayed plan is made for a global item of the window's
// tokens, and still names them); a global layer, the instances without that code.
TEST_CASE("attention plan: the rule instances serve sliding and soft-capped layers only", "[cuda][plan][variants]") {
  const int bits = GENERATE(3, 4, 8, 16);
  CAPTURE(bits);
  cuda::attend_args a = layer(64, bits, bits <= 4);
  CHECK_FALSE(eager(a, 8, 4096).rule_code);
  size_t ws = 0;
  CHECK_FALSE(cuda::detail::replay_plan(a, 8, 32768, ws).value_or_throw().rules);
  cuda::attend_args sliding = a;
  sliding.variant.window = 1024;
  CHECK(eager(sliding, 8, 32768).rule_code);
  CHECK(cuda::detail::replay_plan(sliding, 8, 32768, ws).value_or_throw().rules);
  cuda::attend_args capped = a;
  capped.variant.softcap = 30.f;
  CHECK(eager(capped, 8, 4096).rule_code);
  CHECK_FALSE(eager(capped, 8, 4096).whole_units);  // (the whole-unit instance has no soft-capping)
  CHECK(cuda::detail::replay_plan(capped, 8, 32768, ws).value_or_throw().rules);
}
