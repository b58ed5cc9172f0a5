// The launch plan of a replayed decode step's attention (cuda/replay.hpp), checked on the host: no
// CUDA device needed. Each layer runs the decode kernel the eager plan picks for the widest
// format the layer can hold, with the splits the eager plan gives a full batch of max_tokens.
#include <catch2/catch.hpp>

#include "gpu_test.hpp"

#include <kvq/cuda/paged_attention.hpp>

#include "replay.hpp"

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
