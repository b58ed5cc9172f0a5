#pragma once
// The prefix kernel `prefix_kernel` of a prefill and of `attend_prefix` (docs/architecture.md,
// "Prefill of any length"): the queries of one item over every stored token of the prefix,
// unmasked. A block of 4 warps takes 64 query rows of one kv head (row = query x GQA group + head,
// as the tile kernel orders them), each warp 16 rows with its query fragments in registers, and
// walks its split of the prefix's 64-token tiles: the tile kernel's copy pipeline brings each
// tile's page bytes (or ring rows) into a raw ring, the 4 warps dequantize it once into swizzled
// fp16 K/V tiles, and every warp runs S = Q K^T and O += P V over the whole tile with mma.sync
// m16n8k16 (fp16 operands, fp32 accumulation), online softmax in fp32 registers. A tile is read
// and dequantized once per 64 rows, where the tile kernel does it once per 16.
// KIVI keys keep their centered codes, as in the tile kernel; each warp scales its query
// fragments by the tile's channel scales in registers (four half2 products per k-step and token
// group) and adds the zero points' term q . (z + s 2^(b-1)) per row (one more MMA per k-step and
// token group).
// Each warp writes its rows' partial (max, sum, unnormalized O, base 2) as the split's partial of
// its m-tile in the split merge's workspace (attention/merge.cuh).
#include <cmath>

#include "attention/attend_tile.cuh"
#include "attention/row_softmax.cuh"
#include "attention/tile_pages.cuh"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

constexpr int prefix_rows = 64;  // query rows of a prefix-kernel block (4 warps x 16)

// Raw ring of the copy pipeline: 60 KiB at head_dim 128 (one FP16 tile in flight while the warps
// work on the previous one), so that two blocks fit an SM beside the query rows; 64 KiB at 64 and
// at 256 (one FP16 tile; one block an SM).
// Less than two FP16 tiles (32 KiB each at 128): a 32 KiB tile at an offset of 28-32 KiB fits
// neither before the end nor after a wrap, so `tile_pump` restarts an empty ring at offset 0;
// then each tile is issued by the time the tiles before it are released (`ring_place`,
// attention/layout.hpp).
template <int D>
constexpr uint32_t prefix_raw_bytes = D == 128 ? 60 * 1024 : 64 * 1024;

template <int D>
struct prefix_smem {
  uint8_t raw[prefix_raw_bytes<D>];  // in-flight page bytes, tile after tile
  __half q[prefix_rows * D];         // the block's query rows, swizzled
  __half k[tile_tokens * D];         // the tile's keys (values or centered codes), swizzled
  __half v[tile_tokens * D];         // the tile's values, swizzled
  __half kp[2][2][D];                // KIVI keys: [token group][s, z + s 2^(b-1)] of the tile's (up to) two groups
  tile_table tiles;                  // page lookups of this block's tiles
  tile_src slot[pipeline_tiles];     // tiles in flight, written by the producer warp
  uint32_t slot_at[pipeline_tiles];
};
// two blocks an SM on sm_90 (228 KiB of shared memory, 1 KiB of it reserved per block)
static_assert(2 * (sizeof(prefix_smem<128>) + 1024) <= 228 * 1024, "two prefix-kernel blocks fit an SM");

// Grid (split, kv head x 64-row block, item); `p.mtiles` counts an item's 16-row m-tiles, whose
// partials the warps write (m-tile 4 x block + warp).
template <int D>
__global__ void __launch_bounds__(threads, 2) prefix_kernel(const __grid_constant__ attend_params p) {
  pdl_trigger();
  extern __shared__ __align__(16) uint8_t smem_raw[];
  prefix_smem<D>& sm = *reinterpret_cast<prefix_smem<D>*>(smem_raw);
  const int mblocks = ceil_div(p.mtiles, prefix_rows / 16);
  const int split = blockIdx.x, h = blockIdx.y / mblocks, mb = blockIdx.y % mblocks;
  const decode_item item = p.items[blockIdx.z];
  const int rows_used = p.group * item.q_len;
  if (mb * prefix_rows >= rows_used) return;
  const int page_tiles = ceil_div(item.from_pages, tile_tokens);
  const int T = page_tiles + ceil_div(item.n - item.from_pages, tile_tokens);
  const int t0 = split * p.tiles_per_split, t1 = min(T, t0 + p.tiles_per_split);
  if (t0 >= T) return;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int mt = mb * (prefix_rows / 16) + warp;  // this warp's m-tile
  const bool active = mt * 16 < rows_used;        // (warp-uniform) rows of padding only: no math
  constexpr uint32_t ring_bytes = prefix_raw_bytes<D>;
  const uint32_t raw_base = smem_addr(sm.raw);

  load_tile_table<D>(p, item, h, t0, t1, sm.tiles);
  // the block's query rows: row r -> m = 64 mb + r, query m / group,
  // head h group + m % group
  for (int idx = tid; idx < prefix_rows * D; idx += threads) {
    const int r = idx / D, c = idx % D, m = mb * prefix_rows + r;
    float x = 0.f;
    if (m < rows_used) {
      const int i = m / p.group, qh = h * p.group + m % p.group;
      x = load_any(p.q, p.q_type, int64_t(item.q_row + i) * p.q_stride + int64_t(qh) * D + c);
    }
    sm.q[swz<D>(r, c / 8) + c % 8] = __float2half_rn(x);
  }
  __syncthreads();
  // NOTE: the query fragments are read from shared memory at every tile (a quarter more ldmatrix
  // than K's): held in registers beside the output accumulators they spilled at head_dim 128
  // (docs/decisions.md, "CUDA prefill of any length").
  const int q_row = warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8;  // this lane's ldmatrix row

  // The copy pipeline, as in the tile kernel: warp 0 issues tiles in order into the raw ring while
  // space and group slots last; a tile's bytes are freed once it is dequantized.
  uint32_t pipe_end[pipeline_tiles];
  tile_pump<D, ring_bytes> pipe(t0, t1, pipe_end);
  const auto pump = [&](int consumed_upto) {
    pipe.run(p, item, h, t0, sm.tiles, sm.slot, sm.slot_at, raw_base, lane, consumed_upto);
  };
  if (warp == 0) pump(t0);

  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  for (int t = t0; t < t1; ++t) {
    if (warp == 0) cp_wait_dyn(pipe.issued - t - 1);  // this tile's copies have landed
    __syncthreads();                                  // ... visible to all; every warp is done with the previous tile
    const tile_src s = sm.slot[t % pipeline_tiles];
    const uint8_t* raw = sm.raw + sm.slot_at[t % pipeline_tiles];
    tile_to_fp16<D>(s, raw, sm.k, sm.v, p.kv.page_tokens);
    const format_traits fk = traits_of(s.fk);
    const bool k_codes = !s.ring && fk.k_along_tokens() && !tile_reads_by_element(fk);  // (by element: values)
    if (k_codes) {
      // the channel scales s and the zero points' weights z + s 2^(b-1) of the tile's token groups
      // (one group: both slots alike)
      const int ngroups = fk.group >= tile_tokens ? 1 : tile_tokens >> log2i(fk.group);
      const float mid = float(1 << (fk.bits - 1));
      const __half2* sc = reinterpret_cast<const __half2*>(raw + s.size[0][0]);
      const __half2* zr = reinterpret_cast<const __half2*>(raw + s.size[0][0] + s.size[0][1]);
      for (int c = tid; c < D; c += threads) {  // c: (group, channel pair)
        const int gi = c / (D / 2), at = min(gi, ngroups - 1) * (D / 2) + c % (D / 2);
        const float2 s2 = __half22float2(sc[at]), z2 = __half22float2(zr[at]);
        reinterpret_cast<__half2*>(sm.kp[gi][0])[c % (D / 2)] = sc[at];
        reinterpret_cast<__half2*>(sm.kp[gi][1])[c % (D / 2)] =
            __floats2half2_rn(fmaf(s2.x, mid, z2.x), fmaf(s2.y, mid, z2.y));
      }
    }
    __syncthreads();  // tile ready; its raw bytes are free
    if (warp == 0) {
      pipe.release(t);
      pump(t + 1);  // keep the copies flowing while the tensor cores work
    }
    if (!active) continue;

    // ---- S = Q K^T: 16 rows x 64 tokens (8 n-tiles of 8); KIVI: q scaled per token group ----
    float sc4[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) sc4[nt][0] = sc4[nt][1] = sc4[nt][2] = sc4[nt][3] = 0.f;
    // q . (z + s 2^(b-1)) of the token groups, by one MMA per k-step whose B has that vector in
    // every column: [token group][row g: 0, row g + 8: 2]
    float cz[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int gi = 0; gi < 2; ++gi)  // tokens 0-31, then 32-63 (a KIVI token group is 32 tokens or more)
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t a[4];
        ldsm_x4(smem_addr(sm.q + swz<D>(q_row, ks * 2 + lane / 16)), a[0], a[1], a[2], a[3]);
        if (k_codes) {
          const int c = ks * 16 + (lane % 4) * 2;
          const uint32_t w_lo = *reinterpret_cast<const uint32_t*>(&sm.kp[gi][1][c]);
          const uint32_t w_hi = *reinterpret_cast<const uint32_t*>(&sm.kp[gi][1][c + 8]);
          mma16816(cz[gi], a[0], a[1], a[2], a[3], w_lo, w_hi);
          const __half2 s_lo = *reinterpret_cast<const __half2*>(&sm.kp[gi][0][c]);
          const __half2 s_hi = *reinterpret_cast<const __half2*>(&sm.kp[gi][0][c + 8]);
#pragma unroll
          for (int e = 0; e < 4; ++e) a[e] = h2_bits(__hmul2(bits_h2(a[e]), e < 2 ? s_lo : s_hi));
        }
#pragma unroll
        for (int kb = 2 * gi; kb < 2 * gi + 2; ++kb) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4(smem_addr(sm.k + swz<D>(kb * 16 + (lane / 16) * 8 + lane % 8, ks * 2 + (lane / 8) % 2)), b0, b1, b2,
                  b3);
          mma16816(sc4[2 * kb], a[0], a[1], a[2], a[3], b0, b1);
          mma16816(sc4[2 * kb + 1], a[0], a[1], a[2], a[3], b2, b3);
        }
      }
    // ---- scale, zero-point term, rows past the tile's tokens, online softmax ----
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = nt * 8 + (lane % 4) * 2 + (e % 2);
        const float x = (sc4[nt][e] + cz[nt / 4][e & 2]) * p.scale_log2;
        sc4[nt][e] = j < s.valid ? x : -INFINITY;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], sc4[nt][e]);
      }
    uint32_t pf[8][2];
    row_softmax_step<8, D>(sc4, tile_max, row_max, row_sum, acc, pf);
    pv_mma<D, 4>(sm.v, 0, pf, acc);  // O += P V
  }
  if (!active) return;

  // ---- this warp's 16 rows: the partial of (item, kv head, m-tile, split) ----
  const size_t part = ((size_t(blockIdx.z) * p.kv.kv_heads + h) * p.mtiles + mt) * p.max_splits + split;
  store_warp_partial<D>(p.ws_o + part * 16 * D, p.ws_ml + part * 16 * 2, acc, row_max, row_sum);
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
