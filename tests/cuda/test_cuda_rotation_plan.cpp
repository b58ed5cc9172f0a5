// Host-only checks of the CUDA rotation arguments (no device needed): the workspace of a call
// with rotated heads holds the rotated queries after the partial results, and a rotation mask
// naming kv heads the layer does not have is refused before any launch.
#include <kvq/cuda/paged_attention.hpp>

#include <catch2/catch.hpp>

#include "gpu_test.hpp"

#include <vector>

using namespace kvq;

namespace {

cuda::attend_args args(const std::vector<cuda::decode_item>& items, int d) {
  cuda::attend_args a;
  a.kv.layers = 1;
  a.kv.kv_heads = 2;
  a.kv.head_dim = d;
  a.kv.page_tokens = 64;
  a.kv.window = 128;
  a.kv.max_pages = 64;
  a.kv.k_page_bytes = gpu_test::page_bytes(role::k, 64, d);
  a.kv.v_page_bytes = gpu_test::page_bytes(role::v, 64, d);
  a.q_heads = 8;
  a.items = items;
  return a;
}

}  // namespace

TEST_CASE("rotated heads add the rotated queries to the attention workspace", "[cuda][plan][rotation]") {
  const int d = GENERATE(64, 128);
  CAPTURE(d);
  const std::vector<cuda::decode_item> items = {{0, 1, 300, 200, 0, 0}, {1, 3, 900, 832, 4, 1}};
  cuda::attend_args a = args(items, d);
  const size_t plain = cuda::attend_workspace_bytes(a);
  a.rotation = {77, 0b01};
  REQUIRE(cuda::attend_can_implement(a).ok());
  const size_t rotated = cuda::attend_workspace_bytes(a);
  // rows up to the last item's q_row + q_len (4), 8 query heads, fp32, after 256-byte alignment
  const size_t q_bytes = size_t(4) * 8 * d * 4;
  REQUIRE(rotated >= plain + q_bytes);
  REQUIRE(rotated < plain + q_bytes + 256);
  a.rotation.mask = 0b100;  // kv head 2 of a 2-head layer
  const status st = cuda::attend_can_implement(a);
  REQUIRE(st.code() == errc::invalid_argument);
  REQUIRE_THAT(st.message(), Catch::Contains("rotation mask 4") && Catch::Contains("2"));
}
