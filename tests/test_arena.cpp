// The byte budget: best-fit allocation, coalescing, and reuse across sizes.
#include <kvq/store/arena.hpp>

#include <catch2/catch.hpp>

#include <random>
#include <vector>

using namespace kvq;

TEST_CASE("arena coalesces freed blocks and reuses them for any size", "[arena]") {
  arena_allocator a(1 << 20);
  std::vector<uint64_t> offs;
  for (int i = 0; i < 16; ++i) offs.push_back(*a.allocate(16384));  // 16 x fp16-sized pages
  REQUIRE(a.used() == 16 * 16384);
  for (int i = 0; i < 16; i += 2) REQUIRE(a.free(offs[i]));
  // freed holes of 16 KiB take four 4 KiB (int4-sized) pages each
  for (int i = 0; i < 32; ++i) REQUIRE(a.allocate(4096).has_value());
  REQUIRE(a.used() == 8 * 16384 + 32 * 4096);
  REQUIRE_FALSE(a.free(12345));  // unknown offset
}

TEST_CASE("arena: allocate-free cycles restore the exact free list", "[arena]") {
  arena_allocator a(4 << 20);
  std::mt19937 rng(5);
  std::vector<uint64_t> live;
  for (int i = 0; i < 20000; ++i) {
    if (live.empty() || rng() % 3) {
      if (auto o = a.allocate(256 + rng() % 20000)) live.push_back(*o);
    } else {
      const size_t k = rng() % live.size();
      REQUIRE(a.free(live[k]));
      live[k] = live.back();
      live.pop_back();
    }
  }
  for (auto o : live) REQUIRE(a.free(o));
  REQUIRE(a.used() == 0);
  REQUIRE(a.largest_free() == a.capacity());
  REQUIRE(a.live_blocks() == 0);
}

TEST_CASE("arena reports exhaustion", "[arena]") {
  arena_allocator a(4096);
  REQUIRE(a.allocate(4096).has_value());
  REQUIRE_FALSE(a.allocate(1).has_value());
}
