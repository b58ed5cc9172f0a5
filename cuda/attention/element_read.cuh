#pragma once
// Pages read element by element: the 3-bit formats (`read_by_element`; the block-staged
// decode kernel's Whole instance reads 3-bit sym and KIVI pages staged in blocks of one 3-bit
// kind pair, kinds kivi3 and sym3, and the 16-bit instances give them kind -1), and in the tile
// kernel also the 4- and 2-bit codebooks and nvfp4 (`tile_reads_by_element`; the decode
// kernels stage those: kinds cb4, cb2, fp4).
// Their pages are not staged:
// the staged decode kernels' 16-bit instances (the kernels of any layer that holds one:
// `kernel_bits`) and the tile kernel read them from global memory where they are used, each element through its format's
// codec (`decode_element`, the CPU reference's own decode), rounded to fp16 for the tensor cores.
// A codebook page's levels, an nvfp4 page's tensor scale and the per-token scales are read from
// the page itself (the loads of one row hit L1 after the first).
// NOTE: one path for every such format, chosen per page, and not in the decode kernels' narrower
// instances (docs/decisions.md, "The CUDA decode kernels read the 3-bit formats by element").
#include <kvq/format/unit_codec.hpp>
#include <kvq/format/codebook.hpp>
#include <kvq/format/kivi.hpp>
#include <kvq/format/nvfp4.hpp>
#include <kvq/format/sym.hpp>

#include "attention/slabs.cuh"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// True for a page read by element: no kernel kind in the page table (`staged_kind`) and fewer than
// 16 bits (the kind is the page table's `kk` / `kv`, so that the test is a compare, not a lookup).
__device__ __forceinline__ bool by_element(format_traits f, int kind) { return kind < 0 && f.bits < 16; }

// Geometry of a page of format f in role r (page_tokens P, head_dim D), for its codec.
template <int D>
__device__ __forceinline__ codec::page_geom element_geom(format_traits f, role r, int P) {
  return codec::page_geom{f, r, P, D, formats::layout_of(f, r, P, D)};
}

// The families whose codecs `with_element_codec` has a case for: every family with a format read
// by element must be one (checked below), so that a new one fails to build until it has its case.
__host__ __device__ constexpr bool element_case(family f) {
  return f == family::sym || f == family::codebook || f == family::nvfp4 || f == family::kivi || f == family::rolealign;
}
template <class... Hs>
constexpr bool element_cases_cover(type_list<Hs...>) {
  return (true && ... && (!family_read_by_element(Hs::fam) || element_case(Hs::fam)));
}
static_assert(element_cases_cover(family_heads<format_list>::type{}),
              "a family read by element without its case in with_element_codec");

// Calls `fn.template operator()<Codec>()` with the codec of a format read by element (outside the
// loops over elements, so that each loop is compiled for one codec).
template <class F>
__device__ __forceinline__ void with_element_codec(family fam, F&& fn) {
  switch (fam) {
    case family::sym: fn.template operator()<sym_codec>(); break;
    case family::codebook: fn.template operator()<codebook_codec>(); break;
    case family::nvfp4: fn.template operator()<nvfp4_codec>(); break;
    case family::kivi:
    case family::rolealign:
    default: fn.template operator()<kivi_codec>(); break;
  }
}

// Channels [c0, c0 + 2 N) of token row `tok` of a page as N half2 words (channel pairs in order).
template <class Codec, int N>
__device__ __forceinline__ void element_pairs(const codec::page_geom& geo, const uint8_t* page, int tok, int c0,
                                              uint32_t (&out)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
    out[i] = h2_bits(__floats2half2_rn(Codec::decode_element(geo, page, tok, c0 + 2 * i),
                                       Codec::decode_element(geo, page, tok, c0 + 2 * i + 1)));
}

// S^T = K Q^T of one page slab of K read by element, for lane (g, t): the lane's D/4 channels of
// rows g and g + 8 in the fragment order of `scores_wide`, one MMA k-step at a time; the query's B
// fragments come from the fp16 query pairs in shared memory (`put_query`), not from qb.
// NOTE: a loop that is not unrolled (a runtime k-step, so a query read from shared memory) keeps
// this path's registers low: decoded whole, it made the decode kernel spill (docs/decisions.md).
template <int D>
__device__ __forceinline__ void scores_by_element(const slab_ref& s, int P, int g, int t, const uint4 (&qh)[D / 32][32],
                                                  int lane, float (&sc)[4]) {
  const codec::page_geom geo = element_geom<D>(s.fk, role::k, P);
  with_element_codec(s.fk.fam, [&]<class C>() {
#pragma unroll 1
    for (int k = 0; k < D / 16; ++k) {  // k-step ks of half hs (`scores_wide`'s order)
      const int hs = k / (D / 32), ks = k % (D / 32);
      const int c0 = t * (D / 4) + hs * (D / 8) + 4 * ks;
      uint32_t a0[2], a8[2];
      element_pairs<C, 2>(geo, s.k, s.row0 + g, c0, a0);
      element_pairs<C, 2>(geo, s.k, s.row0 + g + 8, c0, a8);
      const int qi = hs * (D / 16) + 2 * ks;  // qb index of the B fragments
      const uint2 q = reinterpret_cast<const uint2*>(&qh[qi / 4][lane])[(qi % 4) / 2];
      mma16816(sc, a0[0], a8[0], a0[1], a8[1], q.x, q.y);
    }
  });
}

// O^T += V^T P^T for one page slab of V read by element, for lane (g, t): the lane's D/8 channels
// of rows 2t, 2t + 1, 2t + 8, 2t + 9 in the fragment order of `values_wide`, one channel pair (one
// output m-tile, 8 elements) at a time; rows at or beyond `valid` are zeroed.
// NOTE: the m-tile is a runtime loop index (see `scores_by_element`); the accumulators stay in
// registers by a predicated MMA per m-tile (an unrolled loop spilled).
template <int D>
__device__ __forceinline__ void values_by_element(const slab_ref& s, int P, int g, int t, uint32_t pb0, uint32_t pb1,
                                                  float (&acc)[D / 16][4]) {
  const codec::page_geom geo = element_geom<D>(s.fv, role::v, P);
  const int rows[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};
  with_element_codec(s.fv.fam, [&]<class C>() {
#pragma unroll 1
    for (int m = 0; m < D / 16; ++m) {  // acc[m]: half m / (D/32), pair m % (D/32) of `values_wide`
      const int c0 = g * (D / 8) + (m / (D / 32)) * (D / 16) + 2 * (m % (D / 32));
      uint32_t v[4][1];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        element_pairs<C, 1>(geo, s.v, s.row0 + rows[r], c0, v[r]);
        if (rows[r] >= s.valid) v[r][0] = 0u;
      }
      const uint32_t a0 = __byte_perm(v[0][0], v[1][0], 0x5410), a1 = __byte_perm(v[0][0], v[1][0], 0x7632);
      const uint32_t a2 = __byte_perm(v[2][0], v[3][0], 0x5410), a3 = __byte_perm(v[2][0], v[3][0], 0x7632);
#pragma unroll
      for (int mm = 0; mm < D / 16; ++mm)
        if (mm == m) mma16816(acc[mm], a0, a1, a2, a3, pb0, pb1);
    }
  });
}

// The tile kernel's 64-token tile of one role read by element: rows row0 .. row0 + 63 of the page
// -> fp16 values in the swizzled tile `dst` ([64][D]); rows at or beyond `valid` are zero. The
// block's threads take 8 channels of a row each.
template <int D>
__device__ __forceinline__ void tile_by_element(format_id fid, role r, int P, const uint8_t* page, int row0, int valid,
                                                __half* dst) {
  const format_traits f = traits_of(fid);
  const codec::page_geom geo = element_geom<D>(f, r, P);
  uint4* out = reinterpret_cast<uint4*>(dst);
  with_element_codec(f.fam, [&]<class C>() {
    for (int c = threadIdx.x; c < tile_tokens * (D / 8); c += threads) {
      const int row = c / (D / 8), ch = c % (D / 8);
      uint32_t w[4] = {0u, 0u, 0u, 0u};
      if (row < valid) element_pairs<C, 4>(geo, page, row0 + row, ch * 8, w);
      out[swz<D>(row, ch) / 8] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  });
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
