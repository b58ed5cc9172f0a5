#pragma once
// Page access and staging of the decode kernels: 16-token slabs (`slab_ref`), the block's page
// table cache, per-lane raw loads of a slab's K and V words (from a page, the FP16 ring or a
// stage in shared memory) and the bulk-copy sections of the per-warp stages.
#include "attention/dequant.cuh"
#include "attention/kinds.cuh"
#include "attention/params.cuh"

#include <kvq/store/window_layout.hpp>

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// One 16-token slab: the K and V page-head blocks it lies in (or the two FP16 rings).
struct slab_ref {
  const uint8_t* k;
  const uint8_t* v;
  int tok0, valid, row0;
  format_traits fk, fv;
  int8_t kk, kv;  // staged_kind(fk), staged_kind(fv) (page slabs)
  bool ring;
};

template <int D>
__device__ __forceinline__ slab_ref locate_slab(const attend_params& p, const decode_item& item, int h, int j,
                                                int page_slabs, const page_table_cache& pc) {
  slab_ref s;
  if (j < page_slabs) {
    s.ring = false;
    s.tok0 = j * slab;
    s.valid = min(slab, item.from_pages - s.tok0);
    s.row0 = s.tok0 & (p.kv.page_tokens - 1);
    const int e = (s.tok0 >> log2i(p.kv.page_tokens)) - pc.first_page;
    s.fk = pc.fk[e];
    s.fv = pc.fv[e];
    s.kk = pc.kk[e];
    s.kv = pc.kv[e];
    s.k = p.pages + size_t(pc.page16[e]) * 16;
    s.v = s.k + pc.v_offset[e];
  } else {
    s.ring = true;
    s.tok0 = item.from_pages + (j - page_slabs) * slab;
    s.valid = min(slab, item.n - s.tok0);
    s.row0 = 0;
    s.fk = s.fv = traits_of(fp16_format);
    s.kk = s.kv = kind::wide;
    s.k = ring_base<D>(p, item, h);
    s.v = s.k + size_t(p.kv.window) * D * 2;
  }
  return s;
}

// Row r of a slab in one role: page row row0 + r, or the ring slot of token tok0 + r. Rows at or
// beyond `valid` are in bounds (a slab never leaves its page; ring slots wrap) but hold stale
// bytes: scores of such rows are selected away and their V zeroed.
template <int D>
__device__ __forceinline__ const uint8_t* slab_row(const slab_ref& s, const uint8_t* base, int r, uint32_t row_bytes,
                                                   int window) {
  return s.ring ? base + size_t((s.tok0 + r) % window) * (D * 2) : base + uint32_t(s.row0 + r) * row_bytes;
}

// Loads of global memory through the read-only path, or of any memory (Global = false: the
// staged V slabs in shared memory).
template <bool Global, class T>
__device__ __forceinline__ T ld(const T* p) {
  if constexpr (Global) return __ldg(p);
  else return *p;
}

// Reads `Bytes` bytes (4-byte multiples 16-byte aligned as they come, or 2, or 1).
template <int Bytes, bool Global = true>
__device__ __forceinline__ void ldg_words(const uint8_t* src, uint32_t* w) {
  if constexpr (Bytes % 16 == 0) {
#pragma unroll
    for (int i = 0; i < Bytes / 16; ++i) {
      const uint4 v = ld<Global>(reinterpret_cast<const uint4*>(src) + i);
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  } else if constexpr (Bytes == 8) {
    const uint2 v = ld<Global>(reinterpret_cast<const uint2*>(src));
    w[0] = v.x, w[1] = v.y;
  } else if constexpr (Bytes == 4) {
    w[0] = ld<Global>(reinterpret_cast<const unsigned int*>(src));
  } else if constexpr (Bytes == 1) {
    w[0] = ld<Global>(src);
  } else {
    w[0] = ld<Global>(reinterpret_cast<const unsigned short*>(src));
  }
}

// `N` (1, 2 or 4) consecutive e4m3 block scales of an nvfp4 row, as the low bytes of a word.
template <int N, bool Global>
__device__ __forceinline__ uint32_t fp4_block_scales(const uint8_t* p) {
  if constexpr (N == 4) return ld<Global>(reinterpret_cast<const unsigned int*>(p));
  else if constexpr (N == 2) return ld<Global>(reinterpret_cast<const unsigned short*>(p));
  else return ld<Global>(p);
}

// Scale words a lane holds for a slab's K: 2 (rows g and g + 8) while the lane's D/4 channels lie
// in one sym group (every group is at least 32 channels), 4 at head_dim 256.
template <int D>
constexpr int k_scale_words = D / 4 > 32 ? 4 : 2;
// Raw K words of one slab for lane (g, t): rows g and g + 8, the lane's D/4 channels, plus the
// per-row parameters (sym: the half scales of the lane's channel groups; fp8: the float token
// scale). Sized for formats of up to `Cap` bits; wider slabs are read where they are used.
template <int D, int Cap>
struct k_raw {
  uint32_t w[2][D * Cap / 128];
  // sym scales (fp16) or fp8 token scales (fp32) of rows g, g + 8; at head_dim 256 also the sym
  // scales of the second half of the lane's D/4 channels (rows g, g + 8), which a 32-channel
  // group does not cover with the first
  uint32_t ps[k_scale_words<D>];
};
// Raw V words of one slab for lane (g, t): rows 2t, 2t+1, 2t+8, 2t+9, the lane's D/8 channels,
// and their scales and zeros (sym, kivi) or the float token scales of rows g, g + 8 (fp8).
template <int D, int Cap>
struct v_raw {
  uint32_t w[4][(D * Cap + 255) / 256];
  uint32_t s[4], z[4];
};

template <int D, int Bits, int Cap, bool Global>
__device__ __forceinline__ void load_k_rows(const slab_ref& s, int g, int t, int window, uint32_t (&w)[2][D * Cap / 128]) {
  constexpr int lane_bytes = (D / 4) * Bits / 8;
  constexpr uint32_t row_bytes = D * Bits / 8;
  ldg_words<lane_bytes, Global>(slab_row<D>(s, s.k, g, row_bytes, window) + t * lane_bytes, w[0]);
  ldg_words<lane_bytes, Global>(slab_row<D>(s, s.k, g + 8, row_bytes, window) + t * lane_bytes, w[1]);
}

// 3-bit codes of `rows` rows of a page of P rows (a page, or a stage holding a 16-row page) for a
// lane: each row's `Lane` channels from offset `Lane` x `lane` of the 2-bit plane ([P][D/4] bytes),
// then of the bit plane ([P][D/8] bytes after it), as the words w[r][0 ..] and w[r][plane ..].
template <int D, int Lane, int Plane, int Rows, int N>
__device__ __forceinline__ void load_rows3(const uint8_t* block, int P, const int (&rows)[Rows], int lane,
                                           uint32_t (&w)[Rows][N]) {
  static_assert(Plane * 4 >= Lane / 4 && N * 4 >= Plane * 4 + Lane / 8, "the lane's two planes fit its words");
  const uint8_t* bits = block + uint32_t(P) * (D / 4);
#pragma unroll
  for (int r = 0; r < Rows; ++r) {
    ldg_words<Lane / 4, false>(block + uint32_t(rows[r]) * (D / 4) + lane * (Lane / 4), w[r]);
    ldg_words<Lane / 8, false>(bits + uint32_t(rows[r]) * (D / 8) + lane * (Lane / 8), w[r] + Plane);
  }
}

// Calls fn.template operator()<B>() with B the code width `bits` (16, 8, 4 or 2) of a page that
// is not 3-bit; 16 only where stages of Cap bits can hold it.
template <int Cap, class F>
__device__ __forceinline__ void with_code_width(int bits, F&& fn) {
  switch (bits) {
    case 16:
      if constexpr (Cap >= 16) fn.template operator()<16>();
      break;
    case 8: fn.template operator()<8>(); break;
    case 4: fn.template operator()<4>(); break;
    default: fn.template operator()<2>(); break;
  }
}

// K of a slab for lane (g, t), from its page (Global) or from its staged copy in shared memory
// (a 16-row page: P = 16, row0 = 0). Three: a 3-bit page (the kinds kivi3, sym3), always staged;
// a compile-time case, so that the per-page dispatch (whose pages are never 3-bit) keeps the
// code and stack frame it has without it.
template <int D, int Cap, bool Global = true, bool Three = false>
__device__ __forceinline__ void load_k(const slab_ref& s, format_traits f, int P, int window, int g, int t, k_raw<D, Cap>& kr) {
  static_assert(!Three || (!Global && Cap >= 4), "3-bit pages: staged, in stages of 4 or 8 bits");
  if constexpr (Three) {
    load_rows3<D, D / 4, D / 64>(s.k, P, {s.row0 + g, s.row0 + g + 8}, t, kr.w);
  } else {
    with_code_width<Cap>(f.bits, [&]<int B>() { load_k_rows<D, B, Cap, Global>(s, g, t, window, kr.w); });
  }
  if (s.ring) return;
  const uint32_t code_bytes = uint32_t(P) * ((D * f.bits) >> 3);
  if (f.channel_groups()) {  // sym, codebook
    const int lg = log2i(f.group == 0 ? D : f.group), ng = D >> lg, grp = (t * (D / 4)) >> lg;
    const uint16_t* sc = reinterpret_cast<const uint16_t*>(s.k + code_bytes);
    kr.ps[0] = ld<Global>(sc + (s.row0 + g) * ng + grp);
    kr.ps[1] = ld<Global>(sc + (s.row0 + g + 8) * ng + grp);
    if constexpr (k_scale_words<D> == 4) {
      const int grp2 = (t * (D / 4) + D / 8) >> lg;
      kr.ps[2] = ld<Global>(sc + (s.row0 + g) * ng + grp2);
      kr.ps[3] = ld<Global>(sc + (s.row0 + g + 8) * ng + grp2);
    }
  } else if (f.fam == family::fp8_e4m3) {
    const uint32_t* sc = reinterpret_cast<const uint32_t*>(s.k + code_bytes);
    kr.ps[0] = ld<Global>(sc + s.row0 + g);
    kr.ps[1] = ld<Global>(sc + s.row0 + g + 8);
  } else if (f.fam == family::nvfp4) {  // the e4m3 block scales of the lane's D/4 channels (D/64 bytes a row)
    const uint8_t* sc = s.k + code_bytes + t * (D / 64);
    kr.ps[0] = fp4_block_scales<D / 64, Global>(sc + (s.row0 + g) * (D / 16));
    kr.ps[1] = fp4_block_scales<D / 64, Global>(sc + (s.row0 + g + 8) * (D / 16));
  }
}

template <int D, int Bits, int Cap, bool Global>
__device__ __forceinline__ void load_v_rows(const slab_ref& s, int g, int t, int window, uint32_t (&w)[4][(D * Cap + 255) / 256]) {
  constexpr int lane_bytes = (D / 8) * Bits / 8;
  constexpr uint32_t row_bytes = D * Bits / 8;
  const int rows[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};
#pragma unroll
  for (int r = 0; r < 4; ++r)
    ldg_words<lane_bytes, Global>(slab_row<D>(s, s.v, rows[r], row_bytes, window) + g * lane_bytes, w[r]);
}

// V of a slab for lane (g, t), from its page (Global) or from its staged copy in shared memory,
// which has the shape of a 16-row page (P = 16, row0 = 0). Three: a 3-bit page (as `load_k`).
// Scales = false: the codes only (a whole-head codebook's scales, which the caller folds into P).
template <int D, int Cap, bool Global, bool Three = false, bool Scales = true>
__device__ __forceinline__ void load_v(const slab_ref& s, format_traits f, int P, int window, int g, int t, v_raw<D, Cap>& vr) {
  static_assert(!Three || (!Global && Cap >= 4), "3-bit pages: staged, in stages of 4 or 8 bits");
  if constexpr (Three) {
    const int r0 = s.row0 + 2 * t;
    load_rows3<D, D / 8, (D / 4 + 31) / 32>(s.v, P, {r0, r0 + 1, r0 + 8, r0 + 9}, g, vr.w);
  } else {
    with_code_width<Cap>(f.bits, [&]<int B>() { load_v_rows<D, B, Cap, Global>(s, g, t, window, vr.w); });
  }
  if (s.ring || !Scales) return;
  const uint32_t code_bytes = uint32_t(P) * ((D * f.bits) >> 3);
  if (f.fam == family::fp8_e4m3) {
    const uint32_t* sc = reinterpret_cast<const uint32_t*>(s.v + code_bytes);
    vr.s[0] = ld<Global>(sc + s.row0 + g);
    vr.s[1] = ld<Global>(sc + s.row0 + g + 8);
  } else if (f.fam == family::nvfp4) {  // the e4m3 block scales of the lane's D/8 channels (D/128 bytes, at least 1)
    constexpr int nb = D / 128 > 0 ? D / 128 : 1;
    const uint8_t* sc = s.v + code_bytes + (g * (D / 8)) / 16;
    const int rows[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};
#pragma unroll
    for (int r = 0; r < 4; ++r) vr.s[r] = fp4_block_scales<nb, Global>(sc + (s.row0 + rows[r]) * (D / 16));
  } else if (f.is_integer() || f.fam == family::codebook) {
    const int lg = log2i(f.group == 0 ? D : f.group), ng = D >> lg, grp = (g * (D / 8)) >> lg;
    const uint16_t* sc = reinterpret_cast<const uint16_t*>(s.v + code_bytes);
    const uint16_t* zr = sc + P * ng;
    const int rows[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int gi = (s.row0 + rows[r]) * ng + grp;
      vr.s[r] = ld<Global>(sc + gi);
      if (f.has_zero()) vr.z[r] = ld<Global>(zr + gi);
    }
  }
}

// Page lookups of the block's slabs [c0, c1), once per block (threads of the block in parallel).
template <int D>
__device__ __forceinline__ void fill_page_table(const attend_params& p, const decode_item& item, int h, int c0, int c1,
                                                int page_slabs, page_table_cache& pc) {
  const int lg = log2i(p.kv.page_tokens);
  const int first = (c0 * slab) >> lg;
  const int last_slab = min(c1, page_slabs) - 1;
  const int npages = last_slab >= c0 ? ((last_slab * slab) >> lg) - first + 1 : 0;
  if (threadIdx.x == 0) pc.first_page = first;
  for (int e = threadIdx.x; e < npages; e += dec_warps * 32) {
    const block_ref b = locate_block(p.kv, p.layer, item.slot, first + e);
    const uint8_t* fm = b.fmts;
    uint32_t off = 0;
    for (int hh = 0; hh < h; ++hh) off += p.kv.k_page_bytes[fm[2 * hh]] + p.kv.v_page_bytes[fm[2 * hh + 1]];
    pc.page16[e] = uint32_t((b.offset + off) / 16);
    const uint32_t kb = p.kv.k_page_bytes[fm[2 * h]], vb = p.kv.v_page_bytes[fm[2 * h + 1]];
    const format_traits fk = traits_of(fm[2 * h]), fv = traits_of(fm[2 * h + 1]);
    const bool k_st = stages_hold(fm[2 * h], p.stage_cap), v_st = stages_hold(fm[2 * h + 1], p.stage_cap);
    pc.v_offset[e] = p.page_stage && !k_st && v_st ? 0u : kb;
    pc.copy_from[e] = k_st ? 0u : kb;
    pc.copy_bytes[e] = (k_st ? kb : 0u) + (v_st ? vb : 0u);  // (K and V blocks are contiguous)
    pc.fk[e] = fk, pc.fv[e] = fv;
    pc.kk[e] = int8_t(staged_kind(fk, p.stage_cap)), pc.kv[e] = int8_t(staged_kind(fv, p.stage_cap));
    pc.kid[e] = fm[2 * h];
    pc.vid[e] = fm[2 * h + 1];
  }
}

// The block's slab range and this warp's part of it (whole slabs; the block-staged kernel deals
// its 32-token chunks itself).
struct slab_range {
  int page_slabs, c0, c1, s0, s1;
};
__device__ __forceinline__ slab_range block_slabs(const attend_params& p, const decode_item& item, int warp) {
  slab_range r;
  r.page_slabs = ceil_div(item.from_pages, slab);
  const int S = r.page_slabs + ceil_div(item.n - item.from_pages, slab);
  // a multiple of dec_warps (x 2: block-staged) after the sink split, which is whole pages; in a
  // sliding layer from the first page of the first query's window on (whole pages, `item_skip`)
  const int b = int(blockIdx.x), skip = item_skip(p, item), rest = max(skip, p.sink_units);
  r.c0 = p.sink_units == 0 ? skip + b * p.tiles_per_split : b == 0 ? skip : rest + (b - 1) * p.tiles_per_split;
  r.c1 = min(S, p.sink_units != 0 && b == 0 ? rest : r.c0 + p.tiles_per_split);
  const int per_warp = ceil_div(r.c1 - r.c0, dec_warps);
  r.s0 = r.c0 + warp * per_warp;
  r.s1 = min(r.c1, r.s0 + per_warp);
  return r;
}

// The bulk copy of one section (0 codes, 1 scales, 2 zeros or a codebook's levels) of a format's
// page in one role, for one slab (16 rows) (`section_copy`, cuda/attention/layout.hpp); all zero:
// nothing to copy (a section the format has not, or a format the stages do not hold).
__device__ __forceinline__ section_copy chunk_section(format_id f, int r, int part, uint32_t D, uint32_t P, int cap) {
  constexpr uint32_t rows = slab;
  const format_traits t = traits_of(f);
  const section_copy none{};
  if (!stages_hold(f, cap)) return none;  // (pages read by element: from memory)
  const uint32_t rb = D * t.bits / 8, code = P * rb;
  if (part == 0)  // (3 bits: the 2-bit plane, its bit plane after it: `section_copy::bit_plane`)
    return t.bits == 3 ? section_copy::make(0, D / 4, 0, false, rows * (D / 4), 0, true) : section_copy::make(0, rb, 0, false, rows * rb, 0);
  if (t.fam == family::fp8_e4m3) return part == 1 ? section_copy::make(code, 4, 0, false, rows * 4, rows * rb) : none;
  if (r == 0 && t.has_zero()) {  // KIVI keys: the chunk's token group, scales then zeros
    const uint32_t lg = uint32_t(log2i(t.group));
    return part == 1 ? section_copy::make(code, D * 2, lg, true, D * 2, rows * rb)
                     : section_copy::make(code + (P >> lg) * D * 2, D * 2, lg, true, D * 2, rows * rb + D * 2);
  }
  if (t.fam == family::nvfp4)  // per-row e4m3 block scales, then the page's tensor scale (16 bytes)
    return part == 1 ? section_copy::make(code, D / 16, 0, false, rows * (D / 16), rows * rb)
                     : section_copy::make(code + P * (D / 16), 0, 0, false, 16, rows * rb + rows * (D / 16));
  const uint32_t ng = D >> log2i(group_of(t, int(D)));  // per-row scales (and zeros)
  if (t.fam == family::codebook)  // per-row scales, then the page's levels (after the stage's scales: a 16-row page)
    return part == 1 ? section_copy::make(code, ng * 2, 0, false, rows * ng * 2, rows * rb)
                     : section_copy::make(code + P * ng * 2, 0, 0, false, (4u << t.bits), rows * rb + rows * ng * 2);
  if (!t.is_integer() || (part == 2 && !t.has_zero())) return none;
  return part == 1 ? section_copy::make(code, ng * 2, 0, false, rows * ng * 2, rows * rb)
                   : section_copy::make(code + P * ng * 2, ng * 2, 0, false, rows * ng * 2, rows * rb + rows * ng * 2);
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
