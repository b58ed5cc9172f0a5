#pragma once
// The prefix kernel `prefix_kernel` of a prefill and of `attend_prefix` (docs/architecture.md,
// "Prefill of any length"): the queries of one item over every stored token of the prefix,
// unmasked. A block of 4 warps takes 128 query rows of one kv head (64 at head_dim 256; row =
// query x GQA group + head, as the tile kernel orders them), each warp 32 rows (16 at 256) as two
// m-tiles that share every K and V fragment it reads, and walks its split of the prefix's
// 64-token tiles, FlashAttention-2's order over one K and one V tile in shared memory: each
// iteration is two phases between barriers, (A) V of tile t comes in while S = Q K^T and the
// online softmax run over K of t, (B) K of tile t + 1 comes in while O += P V runs over V of t.
// Every tile is fp16 by then: FP16 rows (the ring, FP16 pages) are copied by `cp.async` straight
// into the swizzled tile, and any other page's role from its fp16 image, which
// `stage_prefix_kernel` dequantized once per call (the tile readers, attention/tile_pages.cuh;
// KIVI keys to their values, code x s + z per channel, where the tile kernel keeps centered codes
// and folds the scales into the query). Every thread issues copies and waits for its own before
// each barrier. mma.sync m16n8k16 (fp16 operands, fp32 accumulation), online softmax in fp32
// registers.
// Each warp writes its rows' partials (max, sum, unnormalized O, base 2) as the split's partials
// of its m-tiles in the split merge's workspace (attention/merge.cuh).
#include <cmath>

#include "attention/attend_tile.cuh"
#include "attention/mma_tile.cuh"
#include "attention/tile_pages.cuh"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// A role's page bytes in the staging kernel's raw slot: at most 64 rows of 16-bit values (every
// quantized role, its scales and zeros included, is smaller).
template <int D>
constexpr uint32_t prefix_slot_bytes = tile_tokens * D * 2;
constexpr int prefix_descs = 4;  // tile descriptions held: tiles t .. t + 2 (and t - 1, last read in its phase A)

template <int D>
struct prefix_smem {
  __half q[prefill_block_rows(D) * D];  // the block's query rows, swizzled
  __half k[tile_tokens * D];           // the tile's keys (values), swizzled
  __half v[tile_tokens * D];           // the tile's values, swizzled
  tile_table tiles;                    // page lookups of this block's tiles
  tile_src desc[prefix_descs];         // tile t's description at t % prefix_descs, written by thread 0
};
// two blocks an SM on sm_90 (228 KiB of shared memory, 1 KiB of it reserved per block)
static_assert(2 * (sizeof(prefix_smem<128>) + 1024) <= 228 * 1024, "two prefix-kernel blocks fit an SM");
static_assert(3 * (sizeof(prefix_smem<64>) + 1024) <= 228 * 1024, "three prefix-kernel blocks fit an SM");

// Role r (0: K, 1: V) of a tile that needs no dequantization: FP16 ring rows and FP16 pages.
__device__ __forceinline__ bool role_direct(const tile_src& s, int r) {
  return s.ring || (r == 0 ? s.fk : s.fv) == fp16_format;
}

// The fp16 image of role r of page tile t of kv head h in the call's staging buffer.
template <int D>
__device__ __forceinline__ __half* staged_image(const attend_params& p, int h, int t, int r) {
  return const_cast<__half*>(p.staged) + ((size_t(h) * p.stage_tiles + (t - p.stage_t0)) * 2 + r) * tile_tokens * D;
}

// Issues role r of tile t (description `s`, kv head h) into the swizzled fp16 tile `tile` from
// every thread and commits one copy group: a direct role's rows from the ring or the page (rows
// past `valid` zeroed: P V must not meet stale bytes), any other role's staged image as it is.
template <int D>
__device__ __forceinline__ void issue_role(const attend_params& p, int h, int t, const tile_src& s, int r,
                                           __half* tile) {
  if (s.ring) {  // a row's slot advances `step` a pass and wraps at the window (>= 32 > step)
    using tr = tile_rows<D>;
    const tr rows(tile);
    const int window = p.kv.window;
    const __half* src = reinterpret_cast<const __half*>(s.page[r]) + rows.ch * 8;
    int at = (s.tok0 + rows.row0) % window;  // the source row of this pass
#pragma unroll
    for (int i = 0; i < tr::passes; ++i) {
      if (rows.row(i) < s.valid)
        cp_async16(smem_addr(rows.dst(i)), src + size_t(at) * D);
      else
        rows.zero(i);
      at += tr::step;
      if (at >= window) at -= window;
    }
  } else if (role_direct(s, r)) {
    copy_tile_rows<D>(tile, reinterpret_cast<const __half*>(s.page[r] + s.from[r][0]), s.valid);
  } else {  // the image, swizzled already: 16-byte chunks in order
    const uint4* src = reinterpret_cast<const uint4*>(staged_image<D>(p, h, t, r));
    const uint32_t dst = smem_addr(tile);
#pragma unroll
    for (int i = 0; i < tile_tokens * D / 8 / threads; ++i) {
      const int c = int(threadIdx.x) + i * threads;
      cp_async16(dst + uint32_t(c) * 16, src + c);
    }
  }
  cp_commit();
}

// Grid (page tiles of the segment, kv heads, role): the fp16 image of role r of page tile
// p.stage_t0 + x of kv head h of the call's prefix (item 0's: every item of a call shares it),
// through the tile readers (KIVI keys as values); roles of FP16 pages are skipped (the prefix
// kernel reads them from the page). The role's bytes come by `cp.async` into shared memory, the
// image goes straight to the staging buffer.
template <int D>
__global__ void __launch_bounds__(threads) stage_prefix_kernel(const __grid_constant__ attend_params p) {
  __shared__ __align__(16) uint8_t raw[prefix_slot_bytes<D>];
  __shared__ tile_table tiles;  // (one entry used)
  __shared__ tile_src desc;
  const int t = p.stage_t0 + int(blockIdx.x), h = blockIdx.y, r = blockIdx.z;
  const decode_item item = p.items[0];
  if (t >= ceil_div(item.from_pages, tile_tokens)) return;
  load_tile_table<D>(p, item, h, t, t + 1, tiles);
  __syncthreads();
  if (threadIdx.x == 0) desc = describe_tile<D>(p, item, h, t, t, tiles);
  __syncthreads();
  const tile_src s = desc;
  if (role_direct(s, r)) return;
  issue_role_bytes(s, r, smem_addr(raw), int(threadIdx.x), threads);
  cp_commit();
  cp_wait<0>();
  __syncthreads();
  role_to_fp16<D, true>(s, r, raw, staged_image<D>(p, h, t, r), p.kv.page_tokens);
}

// Grid (split, kv head x row block, item); `p.mtiles` counts an item's 16-row m-tiles, whose
// partials the warps write (m-tile (block rows / 16) x block + M x warp + m).
template <int D>
__global__ void __launch_bounds__(threads, 2) prefix_kernel(const __grid_constant__ attend_params p) {
  constexpr int M = prefill_warp_mtiles<D>, rows = prefill_block_rows(D), nd = prefix_descs;
  pdl_trigger();
  extern __shared__ __align__(16) uint8_t smem_raw[];
  prefix_smem<D>& sm = *reinterpret_cast<prefix_smem<D>*>(smem_raw);
  const int mblocks = ceil_div(p.mtiles, rows / 16);
  const int split = p.split0 + int(blockIdx.x), h = blockIdx.y / mblocks, mb = blockIdx.y % mblocks;
  const decode_item item = p.items[blockIdx.z];
  const int rows_used = p.group * item.q_len;
  if (mb * rows >= rows_used) return;
  const int page_tiles = ceil_div(item.from_pages, tile_tokens);
  const int T = page_tiles + ceil_div(item.n - item.from_pages, tile_tokens);
  const int t0 = item_skip(p, item) + split * p.tiles_per_split, t1 = min(T, t0 + p.tiles_per_split);
  if (t0 >= T) return;
  const int tid = threadIdx.x, warp = tid / 32;
  const int mt0 = mb * (rows / 16) + warp * M;  // this warp's first m-tile
  const bool active = mt0 * 16 < rows_used;     // (warp-uniform) rows of padding only: no math
  // A sliding layer: the first prefix token from which every row of the warp sees (its last used
  // row's; the query of row r stands at the prefix's end + the item's first query + r / group);
  // 0 in a global layer. Each row's own first token is computed where a tile needs masking.
  // A sliding layer: the first token of row r is item.n + item.q_row + r / group - window + 1,
  // computed where a tile is tested (no register held across the loop for it).
  load_tile_table<D>(p, item, h, t0, t1, sm.tiles);
  // the block's query rows: row r -> m = rows mb + r, query m / group, head h group + m % group
  for (int idx = tid; idx < rows * D; idx += threads) {
    const int r = idx / D, c = idx % D, m = mb * rows + r;
    float x = 0.f;
    if (m < rows_used) {
      const int i = m / p.group, qh = h * p.group + m % p.group;
      x = load_any(p.q, p.q_type, int64_t(item.q_row + i) * p.q_stride + int64_t(qh) * D + c);
    }
    sm.q[swz<D>(r, c / 8) + c % 8] = __float2half_rn(x);
  }
  __syncthreads();  // the page lookups
  if (tid == 0)
    for (int t = t0; t < min(t1, t0 + 2); ++t) sm.desc[t % nd] = describe_tile<D>(p, item, h, t, t0, sm.tiles);
  __syncthreads();
  // NOTE: the query fragments are read from shared memory at every tile: held in registers beside
  // the output accumulators they spilled at head_dim 128 (docs/decisions.md, "CUDA prefill of any
  // length").

  issue_role<D>(p, h, t0, sm.desc[t0 % nd], 0, sm.k);  // K of the first tile

  float row_max[M][2], row_sum[M][2], acc[M][D / 8][4];
  rows_init<D, M>(row_max, row_sum, acc);

  for (int t = t0; t < t1; ++t) {
    const tile_src& cur = sm.desc[t % nd];
    cp_wait<0>();
    // A: K of tile t is in sm.k; every warp is done with sm.v
    __syncthreads();
    issue_role<D>(p, h, t, cur, 1, sm.v);  // V of t
    if (tid == 0 && t + 2 < t1) sm.desc[(t + 2) % nd] = describe_tile<D>(p, item, h, t + 2, t0, sm.tiles);
    uint32_t pf[M][8][2];
    if (active) {
      // ---- S = Q K^T: M x 16 rows x 64 tokens (8 n-tiles of 8); each K fragment serves the M m-tiles ----
      float s[M][8][4];
      qk_mma_tile<D, M>(sm.q, warp * 16 * M, sm.k, s);
      // ---- columns past the tile's tokens, online softmax ----
      const int valid = cur.valid, tok0 = cur.tok0;
      softmax_tile<D, M>(
          s, p.scale_log2, p.softcap_log2,
          valid == tile_tokens &&
              (p.window == 0 ||  // (every row of the warp: its last used row's window holds the tile)
               tok0 >= item.n + item.q_row + (min((mt0 + M) * 16, rows_used) - 1) / p.group - p.window + 1),
          [&](int m, int hr, int j) {
            return j < valid && (p.window == 0 || tok0 + j >= item.n + item.q_row +
                                                              ((mt0 + m) * 16 + (tid % 32) / 4 + 8 * hr) / p.group -
                                                              p.window + 1);
          },
          row_max, row_sum, acc, pf);
    }
    cp_wait<0>();
    // B: V of tile t is in sm.v; every warp is done with sm.k
    __syncthreads();
    if (t + 1 < t1) issue_role<D>(p, h, t + 1, sm.desc[(t + 1) % nd], 0, sm.k);  // K of t + 1
    if (active) pv_mma_tile<D, M>(sm.v, pf, acc);  // ---- O += P V ----
  }
  if (!active) return;

  // ---- this warp's m-tiles: the partials of (item, kv head, m-tile, split) ----
#pragma unroll
  for (int m = 0; m < M; ++m) {
    if ((mt0 + m) * 16 >= rows_used) break;
    const size_t part = ((size_t(blockIdx.z) * p.kv.kv_heads + h) * p.mtiles + mt0 + m) * p.max_splits + split;
    store_warp_partial<D>(p.ws_o + part * 16 * D, p.ws_ml + part * 16 * 2, acc[m], row_max[m], row_sum[m]);
  }
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
