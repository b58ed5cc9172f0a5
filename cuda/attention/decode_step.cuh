#pragma once
// The decode inner loop of every page format: one step of the staged decode kernels (query fold,
// scores, online softmax, P V) compiled per kind of K and V format (`scores_kind`, `values_kind`;
// kinds in kinds.cuh), and the staged kernels' common start and per-warp bulk copies.
#include "attention/decode_mma.cuh"
#include "attention/element_read.cuh"
#include "attention/query.cuh"
#include "attention/softmax.cuh"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// The staged kernels' common start: the block's page lookups, this lane's query fragments, and
// the fp16 query pairs in shared memory (for KIVI re-scaling). A rotated head's query columns are
// rotated by the block's warps together (`rotate_query_columns`) and read back after a barrier;
// otherwise each warp loads its fragments and warp w stores rows w, w + 4, ... of qh. Either way
// the caller syncs the block (its barrier before the first copies) before other warps read qh.
template <int D>
__device__ __forceinline__ void staged_start(const attend_params& p, const decode_item& item, int h, const slab_range& rg,
                                             int warp, int g, int t, int lane, staged_head<D>& sm, uint32_t (&qb)[D / 8]) {
  fill_page_table<D>(p, item, h, rg.c0, rg.c1, rg.page_slabs, sm.pages);
  if (!p.q_rotated && head_rotated(p.rot, h)) {  // (block-uniform)
    rotate_query_columns<D>(p, item, h, warp, dec_warps, lane, sm.qh);
    __syncthreads();
    get_query<D>(sm.qh, lane, qb);
    return;
  }
  load_query<D>(p, item, h, g, t, qb);
  // Every warp holds the same fragments: warp w stores rows w, w + 4, ... of the D / 32 rows
  // (warps past them store nothing). No warp-0-only stores: in the build with per-kind chunk
  // loops, ptxas predicated those in every warp, and racecheck reported them as a hazard
  // (unexplained).
#pragma unroll
  for (int r0 = 0; r0 < D / 32; r0 += dec_warps) {
    const int r = r0 + warp;
    if (r < D / 32) {
      uint4 v = make_uint4(qb[4 * r0], qb[4 * r0 + 1], qb[4 * r0 + 2], qb[4 * r0 + 3]);
#pragma unroll
      for (int i = r0 + 1; i < D / 32 && i < r0 + dec_warps; ++i)
        if (r == i) v = make_uint4(qb[4 * i], qb[4 * i + 1], qb[4 * i + 2], qb[4 * i + 3]);
      sm.qh[r][lane] = v;
    }
  }
}

// Issues the bulk copies of page slab j into a per-warp stage (lane
// l < 6 copies one section: K codes, K scales, K zeros, V codes, V scales, V zeros, as described by
// `chunk_section`) and arms the stage's barrier with their bytes. KIVI key scales and zeros are
// copied only when the warp enters their token group (`first`: the warp's first slab). Three: the
// instance whose stages hold 3-bit pages, whose code section's lane also copies the bit plane
// (`section_copy::bit_plane`).
template <int D, bool Three = false>
__device__ __forceinline__ void issue_chunk(const attend_params& p, const page_table_cache& pc, const section_copy (*sect)[2][3], int j,
                                            bool first, int lane, uint32_t stage, uint32_t bar) {
  const int P = p.kv.page_tokens;
  const int tok0 = j * slab, e = (tok0 >> log2i(P)) - pc.first_page;
  const uint32_t row0 = uint32_t(tok0 & (P - 1));
  const bool is_v = lane >= 3;
  const section_copy d = sect[is_v ? pc.vid[e] : pc.kid[e]][is_v][lane % 3];
  const uint32_t shift = d.row_shift();
  uint32_t bytes = lane < 6 ? d.bytes() : 0u;
  // (a KIVI key group's scales and zeros: once per group, when the warp enters it)
  if (d.key_group() && !first && (row0 & ((1u << shift) - 1u))) bytes = 0;
  const bool plane = Three && d.bit_plane() && bytes;  // (a 3-bit page's codes: bit plane rows of half the bytes)
  const uint32_t total = __reduce_add_sync(0xffffffffu, plane ? bytes + bytes / 2 : bytes);
  if (bytes) {
    const uint8_t* block = p.pages + size_t(pc.page16[e]) * 16 + (is_v ? pc.v_offset[e] : 0u) + d.offset();
    const uint32_t dst = stage + (is_v ? stage_k_bytes(D, p.stage_cap) : 0u) + d.stage_offset();
    bulk_copy(dst, block + (row0 >> shift) * d.row_bytes(), bytes, bar);
    if (plane)
      bulk_copy(dst + bytes, block + uint32_t(p.kv.page_tokens) * d.row_bytes() + row0 * (d.row_bytes() / 2), bytes / 2, bar);
  }
  if (lane == 0) mbar_expect_tx(bar, total);
}


// S^T of S consecutive staged slabs (sk: the stage as a `rows`-row page, row0 the first slab's
// row) for one kind of K format; slab s's scores in sc[4s..4s+3], each column's accumulators
// starting from `init` (KIVI: the score offsets of the token group's zeros). HeadScale: codebook
// keys of whole-head scales (group 0), which multiply the scores (`rs`, as fp8's) instead of
// every level.
template <int D, int Cap, family Fam, int Bits, int S, bool Sub = false, bool HeadScale = false>  // Sub: `k_frags_sub`
__device__ __forceinline__ void scores_kind(const slab_ref& sk, uint16_t group, int rows, int window, int g, int t,
                                            const uint32_t (&qb)[D / 8], float (&sc)[4 * S], float (&rs)[2 * S],
                                            int valid, float2 init = make_float2(0.f, 0.f)) {
  static_assert(!Sub || (Fam == family::kivi && Bits <= 4), "subnormal codes: 4- and 2-bit KIVI keys");
  static_assert(!HeadScale || Fam == family::codebook, "whole-head scales on the scores: codebook keys");
  static_assert(staged_family<Fam>, "a kind of a decode family with no staged code here: add its K path");
  constexpr bool Cb = Fam == family::codebook;
  const format_traits f{Fam, uint8_t(Bits), group};
  constexpr bool F4 = Fam == family::nvfp4;
  cb_lut<Bits == 2 ? 2 : 4> lut;  // (codebook keys: the page's levels, once for the S slabs)
  if constexpr (Cb) lut = cb_table<Bits, false>(cb_levels<D, Bits>(sk.k, rows, group));
  float ts = 1.f;  // (nvfp4 keys: the page's tensor scale)
  if constexpr (F4) ts = fp4_tensor_scale<D, false>(sk.k, rows);
#pragma unroll
  for (int s = 0; s < S; ++s) {
    slab_ref ss = sk;
    ss.row0 = sk.row0 + slab * s;
    k_raw<D, Cap> kr;
    load_k<D, Cap, false, Bits == 3>(ss, f, rows, window, g, t, kr);
    uint32_t kg[D / 8], kg8[D / 8];
    if constexpr (Sub) k_frags_sub<D, Bits>(kr.w, kg, kg8);
    else if constexpr (Cb && HeadScale) {  // the levels alone (the rows' scales: `rs`, below)
      cb_pairs<Bits, D / 8>(kr.w[0], lut, kg);
      cb_pairs<Bits, D / 8>(kr.w[1], lut, kg8);
    }
    else if constexpr (Cb) k_frags_cb<D, Bits, Cap>(kr.w, kr.ps, lut, kg, kg8);
    else if constexpr (F4) k_frags_fp4<D, Cap>(kr.w, kr.ps, ts, kg, kg8);
    else k_frags<D, Bits, Cap>(kr.w, Fam, kr.ps, kg, kg8);
    float part[4] = {init.x, init.y, init.x, init.y};
    scores_mma<D, Sub ? Bits : 0>(kg, kg8, qb, part);
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[4 * s + e] = part[e];
    if constexpr (Fam == family::fp8_e4m3 || HeadScale) {
      const float2 r = HeadScale ? half_scales(kr.ps[0], kr.ps[1], g, valid - slab * s)
                                 : fp8_scales(kr.ps[0], kr.ps[1], g, valid - slab * s);
      rs[2 * s] = r.x, rs[2 * s + 1] = r.y;
    }
  }
}

// Whole-head codebook V scales fold into P (`values_kind`'s HeadScale) times `fold`, a power of
// two kept per warp, so that P x s x fold stays an fp16 operand: P reaches 2^8 (the online
// softmax's slack), and fold keeps s x fold <= 2^7, as close to it as the first unit with a
// nonzero scale allows (0: none yet; the accumulators hold nothing then), so that small scales
// stay clear of fp16's subnormals too. Before a unit's P V, `head_fold` sets fold, or lowers it
// where one of the unit's scales (`smax`, this lane's largest) needs it and rescales the
// accumulators to match; `head_unfold` takes the fold back out when the units are done.
template <int D>
__device__ __forceinline__ void scale_acc(float r, float (&acc)[D / 16][4]) {
#pragma unroll
  for (int m = 0; m < D / 16; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[m][e] *= r;
}

template <int D>
__device__ __forceinline__ void head_fold(float smax, float& fold, float (&acc)[D / 16][4]) {
  constexpr float limit = 128.f;
  if (!__any_sync(0xffffffffu, fold == 0.f ? smax > 0.f : smax * fold > limit)) return;
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) smax = fmaxf(smax, __shfl_xor_sync(0xffffffffu, smax, o));
  // the largest power of two f with smax f <= limit: limit / smax without its mantissa (smax is
  // a valid row's fp16 scale, 2^-24 .. 65504: the quotient is a normal float)
  const float next = __uint_as_float(__float_as_uint(limit / smax) & 0x7f800000u);
  if (fold != 0.f) scale_acc<D>(next / fold, acc);
  fold = next;
}

// The accumulators back to the values' scale after the units (`fold` is warp-uniform; 0 and 1
// leave them as they are).
template <int D>
__device__ __forceinline__ void head_unfold(float fold, float (&acc)[D / 16][4]) {
  if (fold != 0.f && fold != 1.f) scale_acc<D>(1.f / fold, acc);
}

// O^T += V^T P^T for S consecutive staged slabs for one kind of V format (slab s's P in
// pv[4s..4s+3]). HeadScale: codebook values of whole-head scales (group 0), which multiply P
// (as fp8's) times `*fold` (`head_fold`) instead of every level.
template <int D, int Cap, family Fam, int Bits, int S, bool HeadScale = false>
__device__ __forceinline__ void values_kind(const slab_ref& sk, uint16_t group, int rows, int window, int g, int t,
                                            float (&pv)[4 * S], int valid, float (&acc)[D / 16][4],
                                            float* fold = nullptr) {
  static_assert(!HeadScale || Fam == family::codebook, "whole-head scales on P: codebook values");
  static_assert(staged_family<Fam>, "a kind of a decode family with no staged code here: add its V path");
  constexpr bool Cb = Fam == family::codebook;
  const format_traits f{Fam, uint8_t(Bits), group};
  constexpr bool F4 = Fam == family::nvfp4;
  cb_lut<Bits == 2 ? 2 : 4> lut;  // (codebook values: the page's levels, once for the S slabs)
  if constexpr (Cb) lut = cb_table<Bits, false>(cb_levels<D, Bits>(sk.v, rows, group));
  float ts = 1.f;  // (nvfp4 values: the page's tensor scale)
  if constexpr (F4) ts = fp4_tensor_scale<D, false>(sk.v, rows);
  float2 hs[HeadScale ? S : 1];  // (whole-head scales: every slab's, read first for the fold)
  if constexpr (HeadScale) {
    const uint16_t* sc = reinterpret_cast<const uint16_t*>(sk.v + uint32_t(rows) * (D * Bits / 8));
    float smax = 0.f;
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const int r = sk.row0 + slab * s + g;
      hs[s] = half_scales(sc[r], sc[r + 8], g, valid - slab * s);
      smax = fmaxf(smax, fmaxf(hs[s].x, hs[s].y));
    }
    head_fold<D>(smax, *fold, acc);
  }
#pragma unroll
  for (int s = 0; s < S; ++s) {
    slab_ref ss = sk;
    ss.row0 = sk.row0 + slab * s;
    const int vs = valid - slab * s;
    v_raw<D, Cap> vr;
    load_v<D, Cap, false, Bits == 3, !HeadScale>(ss, f, rows, window, g, t, vr);
    float ps[4] = {pv[4 * s], pv[4 * s + 1], pv[4 * s + 2], pv[4 * s + 3]};
    uint32_t pb0, pb1;
    if constexpr (HeadScale) {  // the levels alone; the rows' scales (x fold) on P
      const float a = hs[s].x * *fold, b = hs[s].y * *fold;
      ps[0] *= a, ps[1] *= a, ps[2] *= b, ps[3] *= b;
      p_frags(ps, pb0, pb1);
      values_cb<D, Bits, Cap, false>(vr, lut, 0, t, pb0, pb1, acc);
      continue;
    }
    if constexpr (Fam == family::fp8_e4m3) {  // per-token V scales fold into P
      const float2 v = fp8_scales(vr.s[0], vr.s[1], g, vs);
      ps[0] *= v.x, ps[1] *= v.x, ps[2] *= v.y, ps[3] *= v.y;
      p_frags(ps, pb0, pb1);
      uint32_t va[D / 16], vb[D / 16], vc[D / 16], vd[D / 16];
      v_all<D, 8, Cap>(vr, Fam, va, vb, vc, vd);
      values_mma<D>(va, vb, vc, vd, min(vs, slab), t, pb0, pb1, acc);
    } else if constexpr (Cb) {
      p_frags(ps, pb0, pb1);
      values_cb<D, Bits, Cap>(vr, lut, min(vs, slab), t, pb0, pb1, acc);
    } else if constexpr (F4) {
      p_frags(ps, pb0, pb1);
      values_fp4<D, Cap>(vr, ts, min(vs, slab), t, pb0, pb1, acc);
    } else {
      p_frags(ps, pb0, pb1);
      values_int<D, Bits, Cap>(vr, Fam == family::sym, min(vs, slab), t, pb0, pb1, acc);
    }
  }
}

// The K part and the V part of a step of S staged slabs of one page, compiled per kind of format:
// the kind `Kind` (a block whose pages are all of one kind), or the page's (`kind::dispatch`; with
// the 3-bit kinds, `kind::dispatch3`: the Three instances, the only code with both).
template <int D, int Cap, int S, int Kind = kind::dispatch>
__device__ __forceinline__ void scores_staged(format_traits fk, const slab_ref& sk, int rows, int window, int g, int t,
                                              const uint32_t (&qb)[D / 8], float (&sc)[4 * S], float (&rs)[2 * S], int valid) {
  if constexpr (!per_page(Kind)) {
    scores_kind<D, Cap, kind_family(Kind), kind_bits(Kind), S>(sk, fk.group, rows, window, g, t, qb, sc, rs, valid);
    return;
  }
  if constexpr (Kind == kind::dispatch3) {  // (both 3-bit kinds: kivi3, sym3)
    static_assert(kind_count - page_kind_count == 2, "a 3-bit kind without its case here");
    if (sk.kk == three_kind<kind::kivi3>) return scores_staged<D, Cap, S, kind::kivi3>(fk, sk, rows, window, g, t, qb, sc, rs, valid);
    if (sk.kk == three_kind<kind::sym3>) return scores_staged<D, Cap, S, kind::sym3>(fk, sk, rows, window, g, t, qb, sc, rs, valid);
  }
  // (the page table gives a staged page its kind; every kind of the per-page dispatch has its case)
  static_assert(page_kind_count == 10, "a kind without its case here");
  switch (sk.kk) {
    case listed_kind<kind::kivi8>: scores_staged<D, Cap, S, kind::kivi8>(fk, sk, rows, window, g, t, qb, sc, rs, valid); break;
    case listed_kind<kind::kivi4>: scores_staged<D, Cap, S, kind::kivi4>(fk, sk, rows, window, g, t, qb, sc, rs, valid); break;
    case listed_kind<kind::kivi2>: scores_staged<D, Cap, S, kind::kivi2>(fk, sk, rows, window, g, t, qb, sc, rs, valid); break;
    case listed_kind<kind::sym8>: scores_staged<D, Cap, S, kind::sym8>(fk, sk, rows, window, g, t, qb, sc, rs, valid); break;
    case listed_kind<kind::sym4>: scores_staged<D, Cap, S, kind::sym4>(fk, sk, rows, window, g, t, qb, sc, rs, valid); break;
    case listed_kind<kind::sym2>: scores_staged<D, Cap, S, kind::sym2>(fk, sk, rows, window, g, t, qb, sc, rs, valid); break;
    case listed_kind<kind::cb4>: scores_staged<D, Cap, S, kind::cb4>(fk, sk, rows, window, g, t, qb, sc, rs, valid); break;
    case listed_kind<kind::cb2>: scores_staged<D, Cap, S, kind::cb2>(fk, sk, rows, window, g, t, qb, sc, rs, valid); break;
    case listed_kind<kind::fp4>: scores_staged<D, Cap, S, kind::fp4>(fk, sk, rows, window, g, t, qb, sc, rs, valid); break;
    case listed_kind<kind::fp8>:
    default: scores_staged<D, Cap, S, kind::fp8>(fk, sk, rows, window, g, t, qb, sc, rs, valid); break;
  }
}
template <int D, int Cap, int S, int Kind = kind::dispatch>
__device__ __forceinline__ void values_staged(format_traits fv, const slab_ref& sk, int rows, int window, int g, int t,
                                              float (&pv)[4 * S], int valid, float (&acc)[D / 16][4]) {
  if constexpr (!per_page(Kind)) {
    values_kind<D, Cap, kind_family(Kind), kind_bits(Kind), S>(sk, fv.group, rows, window, g, t, pv, valid, acc);
    return;
  }
  if constexpr (Kind == kind::dispatch3) {
    if (sk.kv == three_kind<kind::kivi3>) return values_staged<D, Cap, S, kind::kivi3>(fv, sk, rows, window, g, t, pv, valid, acc);
    if (sk.kv == three_kind<kind::sym3>) return values_staged<D, Cap, S, kind::sym3>(fv, sk, rows, window, g, t, pv, valid, acc);
  }
  // (the page table gives a staged page its kind; every kind of the per-page dispatch has its case)
  static_assert(page_kind_count == 10, "a kind without its case here");
  switch (sk.kv) {
    case listed_kind<kind::kivi8>: values_staged<D, Cap, S, kind::kivi8>(fv, sk, rows, window, g, t, pv, valid, acc); break;
    case listed_kind<kind::kivi4>: values_staged<D, Cap, S, kind::kivi4>(fv, sk, rows, window, g, t, pv, valid, acc); break;
    case listed_kind<kind::kivi2>: values_staged<D, Cap, S, kind::kivi2>(fv, sk, rows, window, g, t, pv, valid, acc); break;
    case listed_kind<kind::sym8>: values_staged<D, Cap, S, kind::sym8>(fv, sk, rows, window, g, t, pv, valid, acc); break;
    case listed_kind<kind::sym4>: values_staged<D, Cap, S, kind::sym4>(fv, sk, rows, window, g, t, pv, valid, acc); break;
    case listed_kind<kind::sym2>: values_staged<D, Cap, S, kind::sym2>(fv, sk, rows, window, g, t, pv, valid, acc); break;
    case listed_kind<kind::cb4>: values_staged<D, Cap, S, kind::cb4>(fv, sk, rows, window, g, t, pv, valid, acc); break;
    case listed_kind<kind::cb2>: values_staged<D, Cap, S, kind::cb2>(fv, sk, rows, window, g, t, pv, valid, acc); break;
    case listed_kind<kind::fp4>: values_staged<D, Cap, S, kind::fp4>(fv, sk, rows, window, g, t, pv, valid, acc); break;
    case listed_kind<kind::fp8>:
    default: values_staged<D, Cap, S, kind::fp8>(fv, sk, rows, window, g, t, pv, valid, acc); break;
  }
}

// 16-bit formats (fp16, bf16) in a stage: S slabs' scores or P V, read from shared memory.
template <int D, int S>
__device__ __forceinline__ void scores_wide_staged(const slab_ref& sk, family fam, int g, int t, int window,
                                                   const uint32_t (&qb)[D / 8], float (&sc)[4 * S]) {
#pragma unroll
  for (int s = 0; s < S; ++s) {
    slab_ref ss = sk;
    ss.row0 = sk.row0 + slab * s;
    float part[4] = {0.f, 0.f, 0.f, 0.f};
    scores_wide<D, false>(ss, fam, g, t, window, qb, part);
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[4 * s + e] = part[e];
  }
}
template <int D, int S>
__device__ __forceinline__ void values_wide_staged(const slab_ref& sk, family fam, int g, int t, int window,
                                                   const float (&pv)[4 * S], int valid, float (&acc)[D / 16][4]) {
#pragma unroll
  for (int s = 0; s < S; ++s) {
    slab_ref ss = sk;
    ss.row0 = sk.row0 + slab * s;
    ss.valid = valid - slab * s;
    const float ps[4] = {pv[4 * s], pv[4 * s + 1], pv[4 * s + 2], pv[4 * s + 3]};
    uint32_t pb0, pb1;
    p_frags(ps, pb0, pb1);
    values_wide<D, false>(ss, fam, g, t, window, pb0, pb1, acc);
  }
}

// One step of a staged decode kernel: the query for the step's K format (KIVI keys: their token
// group's scales folded in), then scores, online softmax and P V for one slab, or for the two slabs
// of a staged chunk (`pair`). cur: the slab(s) in memory; sk: the same rows in their stage, which
// has the shape of a `rows`-row page (a chunk stage holds one token group's KIVI key parameters, a
// page stage (`page_stage`) the whole page's). KK, KV: the kinds of every page of the block
// (`kind::staged16`: 16-bit pages, staged), or `kind::dispatch` (per page; `kind::dispatch3` with
// the 3-bit kinds). Pages the stages do not
// hold (k_st, v_st false) are read from global memory: 16-bit pages and the FP16 ring, pages read
// by element, and pages wider than the stages (under a smaller `max_page_bits` hint). Wide: the
// instance of a 16-bit stage plan, the only one with the code for 16-bit stages and for pages read
// by element (the instances of narrower plans keep the code and registers they had without it).
// Window, Capped: with the window masks, the soft-capping code (`softmax_tiles`).
template <int D, int Cap, int KK, int KV, bool Wide, bool Window, bool Capped>
__device__ __forceinline__ void decode_step(const attend_params& p, const slab_ref& cur, const slab_ref& sk, int rows,
                                            bool page_stage, bool k_st, bool v_st, bool pair, int g, int t, int lane,
                                            const uint4 (&qh)[D / 32][32], uint32_t (&qb)[D / 8], int& q_key,
                                            column_state<D>& cs) {
  const int P = p.kv.page_tokens;
  const format_traits fk = cur.fk, fv = cur.fv;
  // ---- the query for this slab's K format ----
  const bool k_codes = KK != kind::staged16 && !cur.ring && (!Wide || cur.kk >= 0) && fk.k_along_tokens();  // (by element: plain query)
  const int lgk = k_codes ? log2i(fk.group) : 0;
  const int key = k_codes ? cur.tok0 & ~(int(fk.group) - 1) : -1;
  if (key != q_key) {
    const uint32_t rbk = uint32_t(D * fk.bits) >> 3;
    if (!k_codes) {
      get_query<D>(qh, lane, qb);
      cs.cz[0] = cs.cz[1] = 0.f;
    } else if (k_st) {  // a chunk stage holds its token group's scales and zeros; a page stage, all groups
      const uint8_t* ks = sk.k + rows * rbk + (page_stage ? uint32_t(sk.row0 >> lgk) * D * 2 : 0u);
      fold_kivi<D>(ks, ks + (page_stage ? uint32_t(rows >> lgk) * D * 2 : uint32_t(D * 2)), fk.bits, qh, lane, t, qb, cs.cz);
    } else {
      const uint8_t* sc = cur.k + uint32_t(P) * rbk + uint32_t(cur.row0 >> lgk) * D * 2;
      fold_kivi<D>(sc, sc + uint32_t(P >> lgk) * D * 2, fk.bits, qh, lane, t, qb, cs.cz);
    }
    q_key = key;
  }
  const int wnd = p.kv.window;
  // S staged slabs: scores and P V of the kinds KK, KV, or of the page's (16-bit: `*_wide_staged`)
  const auto scores_st = [&]<int S>(float (&sc)[4 * S], float (&rs)[2 * S]) __attribute__((always_inline)) {
    if constexpr (KK == kind::staged16) scores_wide_staged<D, S>(sk, fk.fam, g, t, wnd, qb, sc);
    else if constexpr (!per_page(KK)) scores_staged<D, Cap, S, KK>(fk, sk, rows, wnd, g, t, qb, sc, rs, cur.valid);
    else if (Wide && fk.bits == 16) scores_wide_staged<D, S>(sk, fk.fam, g, t, wnd, qb, sc);
    else scores_staged<D, Cap, S, KK>(fk, sk, rows, wnd, g, t, qb, sc, rs, cur.valid);
  };
  const auto values_st = [&]<int S>(float (&pv)[4 * S]) __attribute__((always_inline)) {
    if constexpr (KV == kind::staged16) values_wide_staged<D, S>(sk, fv.fam, g, t, wnd, pv, cur.valid, cs.acc);
    else if constexpr (!per_page(KV)) values_staged<D, Cap, S, KV>(fv, sk, rows, wnd, g, t, pv, cur.valid, cs.acc);
    else if (Wide && fv.bits == 16) values_wide_staged<D, S>(sk, fv.fam, g, t, wnd, pv, cur.valid, cs.acc);
    else values_staged<D, Cap, S, KV>(fv, sk, rows, wnd, g, t, pv, cur.valid, cs.acc);
  };
  if (pair) {
    float sc[8], rs[4] = {1.f, 1.f, 1.f, 1.f}, pv[8];
    scores_st.template operator()<2>(sc, rs);
    softmax_tiles<D, 2, Window, Capped>(p, sc, rs, p.scale_log2, cur.tok0, cur.valid, g, cs, pv);
    values_st.template operator()<2>(pv);
  } else {
    // ---- S^T = K Q^T ----
    float sc[4] = {0.f, 0.f, 0.f, 0.f};
    float rs[2] = {1.f, 1.f};  // fp8 keys: per-token scales of rows g, g+8
    if (k_st) {
      scores_st.template operator()<1>(sc, rs);
    } else if (fk.bits == 16) {  // the FP16 ring, a 16-bit page under a stage plan of at most 8 bits
      scores_wide<D>(cur, fk.fam, g, t, wnd, qb, sc);
    } else if (Wide && cur.kk < 0) {  // a page read by element
      scores_by_element<D>(cur, P, g, t, qh, lane, sc);
    } else {  // a page wider than the stages (under a smaller `max_page_bits` hint)
      k_raw<D, Cap> kr;
      load_k<D, Cap, true>(cur, fk, P, wnd, g, t, kr);
      uint32_t kg[D / 8], kg8[D / 8];
      if (fk.bits == 8) k_frags<D, 8, Cap>(kr.w, fk.fam, kr.ps, kg, kg8);
      else if (fk.fam == family::codebook)  // (cb4)
        k_frags_cb<D, 4, Cap>(kr.w, kr.ps, cb_table<4, true>(cb_levels<D, 4>(cur.k, P, fk.group)), kg, kg8);
      else if (fk.fam == family::nvfp4) k_frags_fp4<D, Cap>(kr.w, kr.ps, fp4_tensor_scale<D, true>(cur.k, P), kg, kg8);
      else k_frags<D, 4, Cap>(kr.w, fk.fam, kr.ps, kg, kg8);  // (a 2-bit page is never wider)
      scores_mma<D>(kg, kg8, qb, sc);
      if (fk.fam == family::fp8_e4m3) {
        const float2 r = fp8_scales(kr.ps[0], kr.ps[1], g, cur.valid);
        rs[0] = r.x, rs[1] = r.y;
      }
    }
    float pv[4];
    softmax_tiles<D, 1, Window, Capped>(p, sc, rs, p.scale_log2, cur.tok0, cur.valid, g, cs, pv);

    // ---- O^T += V^T P^T ----
    if (v_st) {
      values_st.template operator()<1>(pv);
    } else if (fv.bits == 16) {
      uint32_t pb0, pb1;
      p_frags(pv, pb0, pb1);
      values_wide<D>(cur, fv.fam, g, t, wnd, pb0, pb1, cs.acc);
    } else if (Wide && cur.kv < 0) {  // a page read by element
      uint32_t pb0, pb1;
      p_frags(pv, pb0, pb1);
      values_by_element<D>(cur, P, g, t, pb0, pb1, cs.acc);
    } else {  // a page wider than the stages
      v_raw<D, Cap> vr;
      load_v<D, Cap, true>(cur, fv, P, wnd, g, t, vr);
      if (fv.fam == family::fp8_e4m3) {
        const float2 v = fp8_scales(vr.s[0], vr.s[1], g, cur.valid);
        pv[0] *= v.x, pv[1] *= v.x, pv[2] *= v.y, pv[3] *= v.y;
      }
      uint32_t pb0, pb1;
      p_frags(pv, pb0, pb1);
      if (fv.fam == family::codebook)  // (cb4)
        values_cb<D, 4, Cap>(vr, cb_table<4, true>(cb_levels<D, 4>(cur.v, P, fv.group)), min(cur.valid, slab), t, pb0, pb1, cs.acc);
      else if (fv.fam == family::nvfp4)
        values_fp4<D, Cap>(vr, fp4_tensor_scale<D, true>(cur.v, P), min(cur.valid, slab), t, pb0, pb1, cs.acc);
      else values_slab<D, Cap>(vr, fv, cur.valid, t, pb0, pb1, cs.acc);
    }
  }
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
