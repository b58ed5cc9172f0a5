#pragma once
// The matrix products of the prefill kernels (the chunk kernel, attention/chunk_causal.cuh; the
// prefix kernel, attention/prefix_tile.cuh) over one 64-token K/V tile in shared memory, for a
// warp of M m-tiles (16 query rows each): every K and V fragment a warp reads serves its M
// m-tiles, so two m-tiles a warp read half the tile's bytes per row that one does. mma.sync
// m16n8k16, fp16 operands, fp32 accumulation; tiles [rows][D] halves, swizzled (`swz<D>`).
#include <cuda_fp16.h>

#include "attention/dequant.cuh"
#include "attention/layout.hpp"
#include "attention/row_softmax.cuh"
#include "ptx.cuh"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// Query rows a warp of the prefill kernels takes: 2 m-tiles, 1 at head_dim 256 (where two
// m-tiles' output accumulators would not fit a thread's registers); a block of 4 warps takes 4x.
KVQ_HOST_DEVICE constexpr int prefill_block_rows(int head_dim) { return head_dim >= 256 ? 64 : 128; }
template <int D>
constexpr int prefill_warp_mtiles = prefill_block_rows(D) / 64;

// The online-softmax state of a warp's M m-tiles, empty: running max -inf, sum 0, output 0.
template <int D, int M>
__device__ __forceinline__ void rows_init(float (&row_max)[M][2], float (&row_sum)[M][2], float (&acc)[M][D / 8][4]) {
#pragma unroll
  for (int m = 0; m < M; ++m) {
    row_max[m][0] = row_max[m][1] = -INFINITY;
    row_sum[m][0] = row_sum[m][1] = 0.f;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.f;
  }
}

// A block's cp.async copy of 64 fp16 rows into a swizzled tile: thread x takes 16-byte chunk
// x % cpr of rows x / cpr + i x step (pass i). At head_dim 64 and 128 `step` is a multiple of 8,
// so every pass of a thread has the same swizzle term and its addresses are constant offsets.
template <int D>
struct tile_rows {
  static constexpr int cpr = D * 2 / 16, step = threads / cpr, passes = tile_tokens / step;
  static_assert(threads % cpr == 0 && tile_tokens % step == 0, "whole passes of rows");
  __half* tile;
  int ch, row0;
  __device__ explicit tile_rows(__half* t) : tile(t), ch(int(threadIdx.x) % cpr), row0(int(threadIdx.x) / cpr) {}
  __device__ int row(int i) const { return row0 + i * step; }
  __device__ __half* dst(int i) const {
    return step % 8 == 0 ? tile + swz<D>(row0, ch) + i * step * D : tile + swz<D>(row(i), ch);
  }
  __device__ void zero(int i) const { *reinterpret_cast<uint4*>(dst(i)) = make_uint4(0, 0, 0, 0); }
};

// Issues the copies of rows [0, valid) of `src` (row j at src + j D) into `tile`, and zeros its
// rows past `valid` (P V must not meet stale bytes). No commit.
template <int D>
__device__ __forceinline__ void copy_tile_rows(__half* tile, const __half* src, int valid) {
  using tr = tile_rows<D>;
  const tr at(tile);
  src += at.row0 * D + at.ch * 8;
  if (valid >= tile_tokens) {
#pragma unroll
    for (int i = 0; i < tr::passes; ++i) cp_async16(smem_addr(at.dst(i)), src + i * tr::step * D);
  } else {
#pragma unroll
    for (int i = 0; i < tr::passes; ++i)
      if (at.row(i) < valid)
        cp_async16(smem_addr(at.dst(i)), src + i * tr::step * D);
      else
        at.zero(i);
  }
}

// S = Q K^T for rows `row0` .. row0 + 16 M - 1 of the query tile `q` over the 64 tokens of the key
// tile `k`: `s` [m-tile][n-tile of 8 tokens][4] in the mma.sync accumulator layout.
template <int D, int M>
__device__ __forceinline__ void qk_mma_tile(const __half* q, int row0, const __half* k, float (&s)[M][8][4]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) s[m][nt][0] = s[m][nt][1] = s[m][nt][2] = s[m][nt][3] = 0.f;
  // ldmatrix addresses: this lane's row, then its 16-byte chunk of k-step ks as a swizzle term
  // ((2 ks) ^ c) x 16 bytes = (ks x 32) ^ (c x 16), one XOR with a constant per load
  const uint32_t qa = smem_addr(q) + uint32_t(row0 + (lane % 8) + ((lane / 8) % 2) * 8) * D * 2;
  const uint32_t ka = smem_addr(k) + uint32_t((lane / 16) * 8 + lane % 8) * D * 2;
  const uint32_t qc = uint32_t((lane / 16) ^ (lane % 8)) * 16, kc = uint32_t(((lane / 8) % 2) ^ (lane % 8)) * 16;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    uint32_t a[M][4];
#pragma unroll
    for (int m = 0; m < M; ++m)
      ldsm_x4(qa + m * 16 * D * 2 + (qc ^ (ks * 32)), a[m][0], a[m][1], a[m][2], a[m][3]);
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) {
      uint32_t b0, b1, b2, b3;
      ldsm_x4(ka + kb * 16 * D * 2 + (kc ^ (ks * 32)), b0, b1, b2, b3);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        mma16816(s[m][2 * kb], a[m][0], a[m][1], a[m][2], a[m][3], b0, b1);
        mma16816(s[m][2 * kb + 1], a[m][0], a[m][1], a[m][2], a[m][3], b2, b3);
      }
    }
  }
}

// Masks (-inf) the scores `s` of `qk_mma_tile` in the columns `visible(m, hr, j)` rejects (m-tile
// m, row half hr: the lane's row 16 m + lane / 4 + 8 hr; j: the token in the tile), unless `all`
// (warp-uniform: every column of every row of the warp visible, the common tile, which then
// skips the per-score tests), and runs `row_softmax_step` on each m-tile (the scale, to base 2,
// inside its exponentials), leaving P in `pf` for `pv_mma_tile`. `softcap_log2` > 0: a
// soft-capped layer's scores are capped first (`score_cap`; 0: off, warp-uniform).
template <int D, int M, class Visible>
__device__ __forceinline__ void softmax_tile(float (&s)[M][8][4], float scale_log2, float softcap_log2, bool all,
                                             Visible visible, float (&row_max)[M][2], float (&row_sum)[M][2],
                                             float (&acc)[M][D / 8][4], uint32_t (&pf)[M][8][2]) {
  const int lane = threadIdx.x % 32;
  if (softcap_log2 > 0.f) {
    const score_cap cap(softcap_log2, scale_log2);
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[m][nt][e] = cap(s[m][nt][e]);
  }
  if (!all)
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (!visible(m, e / 2, nt * 8 + (lane % 4) * 2 + (e % 2))) s[m][nt][e] = -INFINITY;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float tile_max[2], mx[2][8];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) mx[hr][nt] = fmaxf(s[m][nt][2 * hr], s[m][nt][2 * hr + 1]);
      tile_max[hr] = tree_reduce<8, true>(mx[hr]);
    }
    row_softmax_step<8, D>(s[m], scale_log2, tile_max, row_max[m], row_sum[m], acc[m], pf[m]);
  }
}

// O += P V over 16 KB tokens (the 64 of a tile by default) of the value tile `v`, which points at
// the first of them (a row that is a multiple of 8: the swizzle stays the tile's): `pf` P as fp16
// pairs from `row_softmax_step` (attention/row_softmax.cuh), [m-tile][n-tile][row half]; each V
// fragment (ldmatrix, transposed) serves the M m-tiles.
template <int D, int M, int KB = 4>
__device__ __forceinline__ void pv_mma_tile(const __half* v, const uint32_t (&pf)[M][2 * KB][2],
                                            float (&acc)[M][D / 8][4]) {
  const int lane = threadIdx.x % 32;
  // as in `qk_mma_tile`: the lane's row, and its chunk of column pair jp as a swizzle term
  const uint32_t va = smem_addr(v) + uint32_t((lane % 8) + ((lane / 8) % 2) * 8) * D * 2;
  const uint32_t vc = uint32_t((lane / 16) ^ (lane % 8)) * 16;
#pragma unroll
  for (int kb = 0; kb < KB; ++kb)
#pragma unroll
    for (int jp = 0; jp < D / 16; ++jp) {
      uint32_t b0, b1, b2, b3;
      ldsm_x4_t(va + kb * 16 * D * 2 + (vc ^ (jp * 32)), b0, b1, b2, b3);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        mma16816(acc[m][2 * jp], pf[m][2 * kb][0], pf[m][2 * kb][1], pf[m][2 * kb + 1][0], pf[m][2 * kb + 1][1], b0, b1);
        mma16816(acc[m][2 * jp + 1], pf[m][2 * kb][0], pf[m][2 * kb][1], pf[m][2 * kb + 1][0], pf[m][2 * kb + 1][1], b2,
                 b3);
      }
    }
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
