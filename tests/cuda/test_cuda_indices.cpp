// The index checks of the low-level CUDA API (`paged_view::slots`, `arena_bytes`): a slot, window
// block or new page block out of range is refused on the host before anything is launched, and
// the message names the item or page and the bound. No CUDA device needed.
#include <catch2/catch.hpp>
#include <kvq/cuda/paged_attention.hpp>
#include <string>
#include <vector>

#include "gpu_test.hpp"

using namespace kvq;
using kvq::gpu_test::page_bytes;

namespace {

// 4 slots, 2 layers, 2 kv heads, d 64, P 64, R 128: a window block is 2*2*2*128*64*2 = 128 KiB.
cuda::paged_view view() {
  cuda::paged_view kv;
  kv.layers = 2;
  kv.kv_heads = 2;
  kv.head_dim = 64;
  kv.page_tokens = 64;
  kv.window = 128;
  kv.max_pages = 16;
  kv.slots = 4;
  kv.arena_bytes = 1 << 20;  // 4096 units of 256 bytes
  kv.k_page_bytes = page_bytes(role::k, 64, 64);
  kv.v_page_bytes = page_bytes(role::v, 64, 64);
  return kv;
}

status attend_with(cuda::decode_item it, cuda::paged_view kv = view()) {
  cuda::attend_args a;
  a.kv = kv;
  a.q_heads = 8;
  a.items = {&it, 1};
  return cuda::attend_can_implement(a);
}

bool names(const status& s, const std::string& what) { return s.message().find(what) != std::string::npos; }

}  // namespace

TEST_CASE("low-level attend: slots and window blocks out of range are named", "[cuda][indices]") {
  CHECK(attend_with({3, 1, 100, 0, 0, 0}).ok());
  const status slot = attend_with({4, 1, 100, 0, 0, 0});
  CHECK(slot.code() == errc::invalid_argument);
  CHECK(names(slot, "item 0 has slot 4, outside the page tables' slots [0, 4)"));
  CHECK(attend_with({-1, 1, 100, 0, 0, 0}).code() == errc::invalid_argument);
  // A window of 100 tokens at unit u uses bytes [256 u, 256 u + 7 * 16384 + 100 * 128): it ends
  // at 1048576 for u = 3648 - 50 = 3598 (+ 12800 bytes = 50 units); one unit later it does not.
  CHECK(attend_with({0, 1, 100, 0, 3598, 0}).ok());
  const status win = attend_with({0, 1, 100, 0, 3599, 0});
  CHECK(win.code() == errc::invalid_argument);
  CHECK(names(win, "window at unit 3599"));
  // The full window (128 tokens and more) needs the whole block: 3584 fits, 3585 does not.
  CHECK(attend_with({0, 1, 300, 200, 3584, 0}).ok());
  CHECK(attend_with({0, 1, 300, 200, 3585, 0}).code() == errc::invalid_argument);
  // Pages past the page tables' rows.
  const status pages = attend_with({0, 1, 16 * 64 + 100, 16 * 64 + 1, 0, 0});
  CHECK(pages.code() == errc::invalid_argument);
  // A view without extents (slots, arena_bytes 0) leaves slots and blocks unchecked.
  cuda::paged_view open = view();
  open.slots = 0;
  open.arena_bytes = 0;
  CHECK(attend_with({1000, 1, 100, 0, 1u << 30, 0}, open).ok());
}

TEST_CASE("low-level append: slots, window blocks and page blocks out of range are named", "[cuda][indices]") {
  const format_id f = parse_format("kivi4/g32").value_or_throw();
  const std::vector<uint8_t> fmts(4, f);  // one new page: [kv_heads 2][K, V]
  std::vector<uint32_t> block{0};
  auto run = [&](cuda::append_seq it) {
    cuda::append_args a;
    a.kv = view();
    a.layer = 0;
    a.items = {&it, 1};
    a.k = {nullptr, dtype::f16, it.m, 2, 64};
    a.v = a.k;
    a.page_blocks = block.data();
    a.page_fmts = fmts.data();
    return cuda::append_run(a, nullptr);
  };
  const status slot = run({7, 0, 0, 1, 0, 0, 0});
  CHECK(slot.code() == errc::invalid_argument);
  CHECK(names(slot, "item 0 has slot 7"));
  const status win = run({1, 0, 0, 1, 4000, 0, 0});
  CHECK(win.code() == errc::invalid_argument);
  CHECK(names(win, "window at unit 4000"));
  block[0] = 4095;  // the page block (kv heads x K, V pages) would end past the arena
  const status page = run({1, 95, 0, 1, 0, 0, 1});
  CHECK(page.code() == errc::invalid_argument);
  CHECK(names(page, "new page 0 has its block at unit 4095"));
}
