// The copy pipeline's raw ring (`ring_place`, cuda/attention/layout.hpp), checked on the host: the
// tile and prefix kernels' ring sizes, tile sizes of every kind up to an FP16 tile of 32 KiB, in
// random orders; each tile must be placed by the time the tiles before it are released, inside
// the ring, 16-byte aligned, over no byte still in flight.
#include <catch2/catch.hpp>
#include <cstdint>
#include <deque>
#include <random>
#include <vector>

#include "attention/layout.hpp"

using kvq::cuda::detail::pipeline_tiles;
using kvq::cuda::detail::ring_place;
using kvq::cuda::detail::ring_release;

namespace {

struct span {
  uint32_t from, to;  // ring offsets, [from, to)
};

// Runs tiles of `needs` through a ring of `ring` bytes as `tile_pump` does (at most
// pipeline_tiles in flight, released in order); returns the tile that was not placed in time, or
// -1. Fails a REQUIRE where a placement leaves the ring or overlaps bytes in flight.
int run_pipeline(const std::vector<uint32_t>& needs, uint32_t ring) {
  uint32_t head = 0, tail = 0;
  std::deque<uint32_t> ends;  // in-flight tiles' end counters
  std::deque<span> live;      // their ring offsets
  size_t issued = 0;
  const auto pump = [&](size_t consumed_upto) {
    while (issued < needs.size() && issued - consumed_upto < size_t(pipeline_tiles)) {
      const uint32_t need = needs[issued];
      if (!ring_place(head, tail, need, ring)) break;
      const span s{head % ring, head % ring + need};
      CAPTURE(issued, need, s.from);
      REQUIRE(s.to <= ring);
      REQUIRE(s.from % 16 == 0);
      for (const span& l : live) REQUIRE((s.to <= l.from || l.to <= s.from || l.from == l.to || need == 0));
      head += need;
      ends.push_back(head);
      live.push_back(s);
      ++issued;
    }
  };
  pump(0);
  for (size_t t = 0; t < needs.size(); ++t) {
    if (issued <= t) return int(t);
    ring_release(tail, ends.front());  // tile t dequantized: its bytes are free
    ends.pop_front();
    live.pop_front();
    pump(t + 1);
  }
  return -1;
}

}  // namespace

TEST_CASE("ring_place: every tile placed in time, in the ring, over no byte in flight", "[cuda][ring]") {
  // head_dim 128: FP16 page or ring tile (K and V rows), kivi4/g32, k=kivi2/g32 v=fp8, int8 rows
  // with scales; head_dim 64: the FP16 tile. Rings: the prefix kernel's at head_dim 64 and 128
  // (32 KiB: one FP16 tile at 128), the tile kernel's (64 KiB), and one not a multiple of a tile.
  const std::vector<uint32_t> kinds = {32768, 10240, 11520, 16384 + 512, 16384, 5120};
  const uint32_t ring = GENERATE(32u * 1024, 60u * 1024, 64u * 1024);
  const uint32_t seed = GENERATE(range(1u, 200u));
  CAPTURE(ring, seed);
  std::mt19937 rng(seed);
  std::vector<uint32_t> needs(64);
  for (uint32_t& n : needs) n = kinds[rng() % kinds.size()];
  REQUIRE(run_pipeline(needs, ring) == -1);
}

TEST_CASE("ring_place: tiles of no bytes (pages read by element) beside FP16 tiles that fill the ring", "[cuda][ring]") {
  // head_dim 256: the tile kernel's 72 KiB ring holds one FP16 tile (64 KiB); a page read by
  // element copies nothing. An FP16 sink page, then pages read by element, then the ring's tiles:
  // released in order, a tile of no bytes issued before the ring emptied must not make the ring
  // look empty again while a later tile is in flight.
  REQUIRE(run_pipeline({65536, 0, 0, 0, 65536, 65536, 0, 65536}, 72 * 1024) == -1);
  const std::vector<uint32_t> kinds = {65536, 0, 20480, 36864, 0, 10240};
  const uint32_t seed = GENERATE(range(1u, 200u));
  CAPTURE(seed);
  std::mt19937 rng(seed);
  std::vector<uint32_t> needs(64);
  for (uint32_t& n : needs) n = kinds[rng() % kinds.size()];
  REQUIRE(run_pipeline(needs, 72 * 1024) == -1);
}

TEST_CASE("ring_place: an FP16 tile on an empty 60 KiB ring at an offset of 28-32 KiB", "[cuda][ring]") {
  // two quantized tiles (10,240 + 11,520 + 10,240 bytes) leave the counters at 32,000 bytes: the
  // next 32 KiB tile fits neither before the end nor after the skip, and nothing is in flight
  REQUIRE(run_pipeline({10240, 11520, 10240, 32768, 32768}, 60 * 1024) == -1);
  uint32_t head = 32000, tail = 32000;
  REQUIRE(ring_place(head, tail, 32768, 60 * 1024));
  REQUIRE(head % (60 * 1024) == 0);
  // a tile that must wait: the ring holds a tile there
  head = 32000, tail = 0;
  REQUIRE_FALSE(ring_place(head, tail, 32768, 60 * 1024));
}
