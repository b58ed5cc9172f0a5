#pragma once
// The prefix kernel `prefix_kernel` of a prefill and of `attend_prefix` (docs/architecture.md,
// "Prefill of any length"): the queries of one item over every stored token of the prefix,
// unmasked. A block of 4 warps takes 128 query rows of one kv head (64 at head_dim 256; row =
// query x GQA group + head, as the tile kernel orders them), each warp 32 rows (16 at 256) as two
// m-tiles that share every K and V fragment it reads, and walks its split of the prefix's
// 64-token tiles: the tile kernel's copy pipeline brings each tile's page bytes (or ring rows)
// into a raw ring, the 4 warps dequantize it once into swizzled fp16 K/V tiles, and every warp
// runs S = Q K^T and O += P V over the whole tile with mma.sync m16n8k16 (fp16 operands, fp32
// accumulation), online softmax in fp32 registers. A tile is read and dequantized once per 128
// rows, where the tile kernel does it once per 16.
// KIVI keys are dequantized to their values here (code x s + z per channel, one fp16 rounding),
// where the tile kernel keeps centered codes and folds the scales into the query: the query
// fragments then serve all four 16-token groups of a tile, and no zero-point term is added.
// Each warp writes its rows' partials (max, sum, unnormalized O, base 2) as the split's partials
// of its m-tiles in the split merge's workspace (attention/merge.cuh).
#include <cmath>

#include "attention/attend_tile.cuh"
#include "attention/mma_tile.cuh"
#include "attention/tile_pages.cuh"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// Raw ring of the copy pipeline: one FP16 tile (K and V rows) at head_dim 128 and 256, two at
// 64. The copies of the next tile land while the warps work on the current one (a tile's bytes
// are released once dequantized); smaller quantized tiles have several in flight. An empty ring
// restarts at offset 0 (`ring_place`, attention/layout.hpp), so a tile as large as the ring fits
// once the tiles before it are released.
template <int D>
constexpr uint32_t prefix_raw_bytes = D == 64 ? 2 * (2 * tile_tokens * D * 2) : 2 * tile_tokens * D * 2;

template <int D>
struct prefix_smem {
  uint8_t raw[prefix_raw_bytes<D>];    // in-flight page bytes, tile after tile
  __half q[prefill_block_rows(D) * D];  // the block's query rows, swizzled
  __half k[tile_tokens * D];           // the tile's keys (values), swizzled
  __half v[tile_tokens * D];           // the tile's values, swizzled
  tile_table tiles;                    // page lookups of this block's tiles
  tile_src slot[pipeline_tiles];       // tiles in flight, written by the producer warp
  uint32_t slot_at[pipeline_tiles];
};
// two blocks an SM on sm_90 (228 KiB of shared memory, 1 KiB of it reserved per block)
static_assert(2 * (sizeof(prefix_smem<128>) + 1024) <= 228 * 1024, "two prefix-kernel blocks fit an SM");
static_assert(3 * (sizeof(prefix_smem<64>) + 1024) <= 228 * 1024, "three prefix-kernel blocks fit an SM");

// Grid (split, kv head x row block, item); `p.mtiles` counts an item's 16-row m-tiles, whose
// partials the warps write (m-tile (block rows / 16) x block + M x warp + m).
template <int D>
__global__ void __launch_bounds__(threads, 2) prefix_kernel(const __grid_constant__ attend_params p) {
  constexpr int M = prefill_warp_mtiles<D>, rows = prefill_block_rows(D);
  pdl_trigger();
  extern __shared__ __align__(16) uint8_t smem_raw[];
  prefix_smem<D>& sm = *reinterpret_cast<prefix_smem<D>*>(smem_raw);
  const int mblocks = ceil_div(p.mtiles, rows / 16);
  const int split = blockIdx.x, h = blockIdx.y / mblocks, mb = blockIdx.y % mblocks;
  const decode_item item = p.items[blockIdx.z];
  const int rows_used = p.group * item.q_len;
  if (mb * rows >= rows_used) return;
  const int page_tiles = ceil_div(item.from_pages, tile_tokens);
  const int T = page_tiles + ceil_div(item.n - item.from_pages, tile_tokens);
  const int t0 = split * p.tiles_per_split, t1 = min(T, t0 + p.tiles_per_split);
  if (t0 >= T) return;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int mt0 = mb * (rows / 16) + warp * M;  // this warp's first m-tile
  const bool active = mt0 * 16 < rows_used;     // (warp-uniform) rows of padding only: no math
  constexpr uint32_t ring_bytes = prefix_raw_bytes<D>;
  const uint32_t raw_base = smem_addr(sm.raw);

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
  __syncthreads();
  // NOTE: the query fragments are read from shared memory at every tile: held in registers beside
  // the output accumulators they spilled at head_dim 128 (docs/decisions.md, "CUDA prefill of any
  // length").

  // The copy pipeline, as in the tile kernel: warp 0 issues tiles in order into the raw ring while
  // space and group slots last; a tile's bytes are freed once it is dequantized.
  uint32_t pipe_end[pipeline_tiles];
  tile_pump<D, ring_bytes> pipe(t0, t1, pipe_end);
  const auto pump = [&](int consumed_upto) {
    pipe.run(p, item, h, t0, sm.tiles, sm.slot, sm.slot_at, raw_base, lane, consumed_upto);
  };
  if (warp == 0) pump(t0);

  float row_max[M][2], row_sum[M][2], acc[M][D / 8][4];
  rows_init<D, M>(row_max, row_sum, acc);

  for (int t = t0; t < t1; ++t) {
    if (warp == 0) cp_wait_dyn(pipe.issued - t - 1);  // this tile's copies have landed
    __syncthreads();                                  // ... visible to all; every warp is done with the previous tile
    const int valid = sm.slot[t % pipeline_tiles].valid;
    tile_to_fp16<D, true>(sm.slot[t % pipeline_tiles], sm.raw + sm.slot_at[t % pipeline_tiles], sm.k, sm.v,
                          p.kv.page_tokens);
    __syncthreads();  // tile ready; its raw bytes are free
    if (warp == 0) {
      pipe.release(t);
      pump(t + 1);  // keep the copies flowing while the tensor cores work
    }
    if (!active) continue;

    // ---- S = Q K^T: M x 16 rows x 64 tokens (8 n-tiles of 8); each K fragment serves the M m-tiles ----
    float s[M][8][4];
    qk_mma_tile<D, M>(sm.q, warp * 16 * M, sm.k, s);
    // ---- columns past the tile's tokens, online softmax, O += P V ----
    uint32_t pf[M][8][2];
    softmax_tile<D, M>(s, p.scale_log2, valid == tile_tokens, [&](int, int, int j) { return j < valid; }, row_max,
                       row_sum, acc, pf);
    pv_mma_tile<D, M>(sm.v, pf, acc);
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
