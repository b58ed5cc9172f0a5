#pragma once
// Launch constants and shared-memory layouts of the attention kernels that the host launch plan
// (launch_plan.cpp) sizes as well: host-readable, so that the plan is computed and tested without
// a device.
#include <kvq/config.hpp>
#include <kvq/format/format.hpp>

#include <cuda_runtime.h>  // uint4

#include <cstdint>

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// ---- the tile kernel ---------------------------------------------------------------------------
constexpr int tile_tokens = 64;     // tokens of a tile
constexpr int threads = 128;        // threads of a tile-kernel (and append-kernel) block
constexpr int max_items = 256;      // sequences of one launch (`attend_params::items`)
constexpr int max_kv_heads = 32;
constexpr int pipeline_tiles = 8;   // tiles in flight at most (cp.async groups)
constexpr int max_split_tiles = 256;  // tiles of one block's split (its page lookup table)

KVQ_HOST_DEVICE constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// The units (of `unit` tokens, dividing `page_tokens`) an item's attention leaves out in a layer
// with a sliding window of `window` tokens (0: none): the whole pages before the window of its
// first query, at position `q_pos`, and never past its page part (`from_pages` tokens). Those
// pages may have been released (`layer_state::released`): no kernel reads them. The first pages
// it does read may still start before some query rows' windows: those rows mask them.
KVQ_HOST_DEVICE constexpr int window_skip_units(int window, int64_t q_pos, int from_pages, int page_tokens, int unit) {
  if (window <= 0 || q_pos - window + 1 <= 0) return 0;
  const int64_t first = q_pos - window + 1 < from_pages ? q_pos - window + 1 : from_pages;
  return int(first / page_tokens * page_tokens / unit);
}

// Places a tile of `need` bytes (at most `ring`, a multiple of 16) in the copy pipeline's raw ring
// of `ring` bytes (`tile_pump`, attention/tile_pages.cuh), whose bytes [tail, head) are in flight;
// `head` and `tail` are monotone byte counters, an offset is counter % ring. A tile is contiguous:
// one that does not fit before the ring's end starts at offset 0, the bytes before the end
// skipped. An empty ring restarts at offset 0: so a tile fits once every tile before it is
// released, also where need > ring / 2 (a 60 KiB ring and a 32 KiB FP16 tile at an offset of
// 28-32 KiB fit neither before the end nor after the skip, with nothing left to release). The
// restart moves both counters on to the next multiple of the ring, never back: a tile of no
// bytes (a page read by element) issued before it ends at or below the new tail, so its release
// (`ring_release`) cannot make the ring look empty while a later tile is in flight.
// Returns false where the tile waits for a release; else moves `head` to its start.
KVQ_HOST_DEVICE constexpr bool ring_place(uint32_t& head, uint32_t& tail, uint32_t need, uint32_t ring) {
  if (head == tail) head = tail = (head + ring - 1) / ring * ring;
  const uint32_t off = head % ring, pad = off + need > ring ? ring - off : 0;
  if (head + pad + need - tail > ring) return false;
  head += pad;
  return true;
}

// Frees the ring's bytes of a consumed tile that ended at counter `end` (tiles are released in
// the order they were placed; see `ring_place` for why the tail never moves back).
KVQ_HOST_DEVICE constexpr void ring_release(uint32_t& tail, uint32_t end) { tail = end > tail ? end : tail; }

// ---- the decode kernels (16-token slabs, 4 warps a block) ------------------------------------

constexpr int slab = 16;
constexpr int dec_warps = 4;
constexpr int max_cta_slabs = 1024;

constexpr int max_stages = 8;
// Blocks per SM of the staged kernels: 168 registers at head_dim 64 and 128 (128 registers for 4
// blocks spill ~220 bytes and measured 13-30 % slower); at head_dim 256 a lane's query, key and
// output fragments are twice as many, and 2 blocks give it 255 registers.
template <int D>
constexpr int staged_blocks = D >= 256 ? 2 : 3;
// The same for a 16-bit stage plan (the kernels' Wide instances): fewer blocks, so that 3 stages of
// 16-bit pages fit (and more registers: 210-250 at head_dim 128, no spills).
template <int D>
constexpr int wide_staged_blocks = D >= 256 ? 1 : D >= 128 ? 2 : 3;
template <int D, bool Wide>
constexpr int decode_blocks = Wide ? wide_staged_blocks<D> : staged_blocks<D>;

// A per-warp stage holds one slab (16 rows) of each role. Its room for one role: the code rows of
// `cap` bits plus the largest parameter section (K: KIVI scales and zeros, 4 D bytes; V: scale and
// zero rows, at most 16 D / 8 bytes).
KVQ_HOST_DEVICE constexpr uint32_t stage_k_bytes(int d, int cap) { return uint32_t(slab * d * cap / 8 + 4 * d); }
KVQ_HOST_DEVICE constexpr uint32_t stage_bytes(int d, int cap) {
  return stage_k_bytes(d, cap) + uint32_t(slab * d * cap / 8 + slab * d / 8);
}

// The pages of one thread block's slabs, looked up once: the K block's offset in 16-byte units,
// the V block's offset from it, and both formats' traits (no per-slab table decoding). For the
// block-staged kernel, also the part of the page-head its page stage holds (`issue_page`). There,
// a page whose V the stages hold and whose K they do not has V offset 0: its V sits at the start
// of its page stage, and is never read from the page.
struct page_table_cache {
  int first_page;
  uint32_t page16[max_cta_slabs * slab / 64 + 2];
  uint32_t v_offset[max_cta_slabs * slab / 64 + 2];
  uint32_t copy_from[max_cta_slabs * slab / 64 + 2], copy_bytes[max_cta_slabs * slab / 64 + 2];
  format_traits fk[max_cta_slabs * slab / 64 + 2];
  format_traits fv[max_cta_slabs * slab / 64 + 2];
  format_id kid[max_cta_slabs * slab / 64 + 2];
  int8_t kk[max_cta_slabs * slab / 64 + 2], kv[max_cta_slabs * slab / 64 + 2];  // staged_kind(fk), staged_kind(fv)
  format_id vid[max_cta_slabs * slab / 64 + 2];
};

// The warps' partial outputs and (max, sum) per column, merged after the slab loop.
template <int D>
struct merge_area {
  float wo[dec_warps][8][D];   // [warp][column][channel]
  float wml[dec_warps][8][2];  // [warp][column] running max and sum
};

// One bulk copy of a page section into a per-warp stage, for one slab (16 rows), as the 16 bytes
// a lane reads in one vector load (`issue_chunk`; made by `chunk_section`):
//   x: offset of row 0 (group 0) in the page's role block;
//   y: bytes per row (bits 0-15) | row shift (16-23: rows >> shift per row) | KIVI key group (24)
//      | bit plane (25: a 3-bit page's codes, whose bit plane follows; below);
//   z: bytes to copy (0: nothing); w: offset in the stage's role region.
struct section_copy {
  uint4 w;
  __host__ __device__ static constexpr section_copy make(uint32_t offset, uint32_t row_bytes, uint32_t row_shift,
                                                          bool key_group, uint32_t bytes, uint32_t stage_offset,
                                                          bool bit_plane = false) {
    return {{offset, row_bytes | row_shift << 16 | uint32_t(key_group) << 24 | uint32_t(bit_plane) << 25, bytes, stage_offset}};
  }
  __host__ __device__ constexpr uint32_t offset() const { return w.x; }
  __host__ __device__ constexpr uint32_t row_bytes() const { return w.y & 0xffffu; }
  __host__ __device__ constexpr uint32_t row_shift() const { return (w.y >> 16) & 0xffu; }
  // Scales and zeros of a KIVI key token group: copied once per group (rows >> row_shift per row).
  __host__ __device__ constexpr bool key_group() const { return (w.y >> 24) & 1u; }
  // The codes of a 3-bit page (the kinds kivi3, sym3): this section is the 2-bit plane ([P][D/4]
  // bytes, `row_bytes` D/4); its bit plane ([P][D/8] after it) goes right after it in the stage, so
  // that the stage holds a 16-row 3-bit page (`load_rows3`). Copied by the per-warp kernel's Three
  // instances only (`issue_chunk`).
  __host__ __device__ constexpr bool bit_plane() const { return (w.y >> 25) & 1u; }
  __host__ __device__ constexpr uint32_t bytes() const { return w.z; }
  __host__ __device__ constexpr uint32_t stage_offset() const { return w.w; }
};
static_assert(sizeof(section_copy) == 16, "one vector load");

template <int D>
struct staged_head {
  // The barriers first: compute-sanitizer's racecheck (CUDA 13.0) reported the bulk copies'
  // transaction updates of a barrier at the barrier's address less 0x400 (the reserved shared
  // memory), as a write racing with whatever the block keeps there (it flagged the query rows'
  // stores when the barriers followed them); at offset 0 nothing of the block's lies below them.
  uint64_t bar[dec_warps + 2][max_stages];  // (block-staged kernel: full, empty, odd full, 3 more full rows)
  page_table_cache pages;
  uint4 qh[D / 32][32];  // the fp16 query pairs of each lane (for KIVI re-scaling; `put_query`); all warps alike
  section_copy sect[format_count][2][3];  // chunk_section of every (format, role, section), filled per block
};
template <int D>
constexpr uint32_t staged_head_bytes = (sizeof(staged_head<D>) + 127) / 128 * 128;

}  // namespace cuda::detail
KVQ_NAMESPACE_END
