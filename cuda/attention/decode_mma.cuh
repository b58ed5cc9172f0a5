#pragma once
// The MMAs of one decode slab (operands swapped: S^T = K Q^T with tokens as M, queries as N) and
// the per-lane fragments they take: lane (g, t) owns the K channels [(D/4) t, (D/4)(t+1)) of rows
// g and g+8; lane g reads the V channels [(D/8) g, (D/8)(g+1)) of tokens 2t, 2t+1, 2t+8, 2t+9, so
// that the A fragments of O^T = V^T P^T pair two tokens per channel; P^T comes from the S^T
// accumulators by movmatrix (register transpose).
#include "attention/slabs.cuh"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// Raw K words -> this lane's A fragments (pairs in channel order). KIVI keys: centered codes (their
// scales are folded into q); sym: values; fp8: values (the token scale multiplies the scores).
template <int D, int Bits, int Cap>
__device__ __forceinline__ void k_frags(const uint32_t (&w)[2][D * Cap / 128], family fam,
                                        const uint32_t (&ps)[k_scale_words<D>],
                                        uint32_t (&kg)[D / 8], uint32_t (&kg8)[D / 8]) {
  to_pairs<Bits, D / 8>(w[0], fam, kg);
  to_pairs<Bits, D / 8>(w[1], fam, kg8);
  if constexpr (Bits != 16) {
    if (fam == family::fp8_e4m3) return;
    // centered code c - 2^(b-1) = m * mul - (1024 mul + 2^(b-1)), one exact fma per pair
    const float mid = float(1 << (Bits - 1));
    const auto center = [&](uint32_t m, int i) {
      const __half2 mul = magic_mul<Bits>(i);
      const __half2 bias = __floats2half2_rn(-(1024.f * __low2float(mul) + mid), -(1024.f * __high2float(mul) + mid));
      return __hfma2(bits_h2(m), mul, bias);
    };
    if (fam == family::sym) {  // (pair i: channels 2i, 2i + 1 of the lane's D/4; head_dim 256: two scale groups)
      const auto h2 = [&](int k) { return __half2half2(__ushort_as_half(uint16_t(ps[k]))); };
      const __half2 s0 = h2(0), s8 = h2(1), s0b = h2(k_scale_words<D> - 2), s8b = h2(k_scale_words<D> - 1);
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        const bool second = i >= D / 16;
        kg[i] = h2_bits(__hmul2(center(kg[i], i), second ? s0b : s0));
        kg8[i] = h2_bits(__hmul2(center(kg8[i], i), second ? s8b : s8));
      }
    } else {
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        kg[i] = h2_bits(center(kg[i], i));
        kg8[i] = h2_bits(center(kg8[i], i));
      }
    }
  }
}

// The levels of a codebook page of `rows` rows (a page, or a stage holding a 16-row page) whose
// role block starts at `block`: after the codes and the per-row scales (format/codebook.hpp).
template <int D, int Bits>
__device__ __forceinline__ const uint8_t* cb_levels(const uint8_t* block, int rows, uint16_t group) {
  const int ng = D >> log2i(group == 0 ? D : group);
  return block + uint32_t(rows) * (D * Bits / 8) + uint32_t(rows * ng) * 2;
}

// Raw codebook K words -> this lane's A fragments: the levels (`cb_pairs`) times the rows' group
// scales (head_dim 256: two groups per lane, as for sym).
template <int D, int Bits, int Cap>
__device__ __forceinline__ void k_frags_cb(const uint32_t (&w)[2][D * Cap / 128], const uint32_t (&ps)[k_scale_words<D>],
                                           const cb_lut<Bits>& lut, uint32_t (&kg)[D / 8], uint32_t (&kg8)[D / 8]) {
  cb_pairs<Bits, D / 8>(w[0], lut, kg);
  cb_pairs<Bits, D / 8>(w[1], lut, kg8);
  const auto h2 = [&](int k) { return __half2half2(__ushort_as_half(uint16_t(ps[k]))); };
  const __half2 s0 = h2(0), s8 = h2(1), s0b = h2(k_scale_words<D> - 2), s8b = h2(k_scale_words<D> - 1);
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    const bool second = i >= D / 16;
    kg[i] = h2_bits(__hmul2(bits_h2(kg[i]), second ? s0b : s0));
    kg8[i] = h2_bits(__hmul2(bits_h2(kg8[i]), second ? s8b : s8));
  }
}

// The fp32 tensor scale of an nvfp4 page of `rows` rows (a page or a stage) whose role block
// starts at `block`: after the codes and the block scales (format/nvfp4.hpp).
template <int D, bool Global>
__device__ __forceinline__ float fp4_tensor_scale(const uint8_t* block, int rows) {
  return ld<Global>(reinterpret_cast<const float*>(block + uint32_t(rows) * (D / 2 + D / 16)));
}

// Raw nvfp4 K words -> this lane's A fragments: e2m1 values (`fp4_pairs`) times their block's
// scale (the lane's D/4 channels span D/64 blocks, whose e4m3 bytes are ps[0] (row g) and ps[1]
// (row g + 8)) times the page's tensor scale `ts`.
template <int D, int Cap>
__device__ __forceinline__ void k_frags_fp4(const uint32_t (&w)[2][D * Cap / 128], const uint32_t (&ps)[k_scale_words<D>],
                                            float ts, uint32_t (&kg)[D / 8], uint32_t (&kg8)[D / 8]) {
  constexpr int nb = D / 64;  // blocks of 16 channels (8 pairs) each
  fp4_pairs<D / 8>(w[0], kg);
  fp4_pairs<D / 8>(w[1], kg8);
#pragma unroll
  for (int b = 0; b < nb; ++b) {
    const __half2 s0 = fp4_scale(ps[0] >> (8 * b), ts), s8 = fp4_scale(ps[1] >> (8 * b), ts);
#pragma unroll
    for (int i = 8 * b; i < 8 * b + 8; ++i) {
      kg[i] = h2_bits(__hmul2(bits_h2(kg[i]), s0));
      kg8[i] = h2_bits(__hmul2(bits_h2(kg8[i]), s8));
    }
  }
}

// Raw V words of the lane's four rows -> half2 channel pairs of each (fp8: unscaled, the token
// scale multiplies P; 16 bits: the values).
template <int D, int Bits, int Cap>
__device__ __forceinline__ void v_all(const v_raw<D, Cap>& vr, family fam, uint32_t (&va)[D / 16], uint32_t (&vb)[D / 16],
                                      uint32_t (&vc)[D / 16], uint32_t (&vd)[D / 16]) {
  to_pairs<Bits, D / 16>(vr.w[0], fam, va);
  to_pairs<Bits, D / 16>(vr.w[1], fam, vb);
  to_pairs<Bits, D / 16>(vr.w[2], fam, vc);
  to_pairs<Bits, D / 16>(vr.w[3], fam, vd);
}

// O^T += V^T P^T for a slab of integer V codes (sym, kivi, rolealign): each A fragment is built from
// its token pair's raw words and dequantized with the two tokens' scales and zeros (exact: subtract
// the magic, then one fma); rows at or beyond `valid` (stale bytes) get scale and zero 0. 3 bits:
// each row's words are its 2-bit plane, then its bit plane (`load_v`).
template <int D, int Bits, int Cap>
__device__ __forceinline__ void values_int(const v_raw<D, Cap>& vr, bool sym, int valid, int t, uint32_t pb0, uint32_t pb1,
                                           float (&acc)[D / 16][4]) {
  uint32_t sr[4], zr[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) sr[r] = vr.s[r], zr[r] = sym ? 0u : vr.z[r];
  if (valid < slab) {  // (warp-uniform: a slab's last rows)
#pragma unroll
    for (int r = 0; r < 4; ++r)
      if (2 * t + (r & 1) + 8 * (r >> 1) >= valid) sr[r] = zr[r] = 0u;
  }
  const __half2 s01 = bits_h2(__byte_perm(sr[0], sr[1], 0x5410)), s89 = bits_h2(__byte_perm(sr[2], sr[3], 0x5410));
  const __half2 z01 = bits_h2(__byte_perm(zr[0], zr[1], 0x5410)), z89 = bits_h2(__byte_perm(zr[2], zr[3], 0x5410));
  const float mid = sym ? float(1 << (Bits - 1)) : 0.f;
  uint32_t magic;  // 0x64006400 in a register (opaque, so that it is not folded back into an immediate)
  asm("mov.b32 %0, 0x64006400;\n" : "=r"(magic));
  constexpr int plane = (D / 4 + 31) / 32;  // (3 bits: the bit plane's first word, after the 2-bit plane's)
  const auto codes = [&](int ra, int c) { return pair_codes<Bits, plane>(vr.w[ra], vr.w[ra + 1], c, magic); };
  const auto deq = [&](uint32_t x, int c, __half2 sc, __half2 z) {
    const float mul = code_mul<Bits>(c);  // compile-time after unrolling
    const __half2 v = __hsub2(bits_h2(x), __float2half2_rn(1024.f + mid / mul));  // (code - mid) / mul, exact
    return h2_bits(__hfma2(v, mul == 1.f ? sc : __hmul2(sc, __float2half2_rn(mul)), z));
  };
#pragma unroll
  for (int m = 0; m < D / 16; ++m)
    mma16816(acc[m], deq(codes(0, 2 * m), 2 * m, s01, z01), deq(codes(0, 2 * m + 1), 2 * m + 1, s01, z01),
             deq(codes(2, 2 * m), 2 * m, s89, z89), deq(codes(2, 2 * m + 1), 2 * m + 1, s89, z89), pb0, pb1);
}

// The staged decode kernels' path for 16-bit slabs (fp16/bf16 pages, the FP16 ring): read where
// used, from global memory or from a stage in shared memory (Global = false), in two halves of the
// lane's channels so that at most 16 raw words per row are live.
template <int D, bool Global = true>
__device__ __forceinline__ void scores_wide(const slab_ref& s, family fam, int g, int t, int window,
                                            const uint32_t (&qb)[D / 8], float (&sc)[4]) {
  constexpr uint32_t row_bytes = D * 2;
  const uint8_t* r0 = slab_row<D>(s, s.k, g, row_bytes, window) + t * (D / 2);
  const uint8_t* r8 = slab_row<D>(s, s.k, g + 8, row_bytes, window) + t * (D / 2);
#pragma unroll
  for (int hs = 0; hs < 2; ++hs) {
    uint32_t w0[D / 16], w8[D / 16], a0[D / 16], a8[D / 16];
    ldg_words<D / 4, Global>(r0 + hs * (D / 4), w0);
    ldg_words<D / 4, Global>(r8 + hs * (D / 4), w8);
    to_pairs<16, D / 16>(w0, fam, a0);
    to_pairs<16, D / 16>(w8, fam, a8);
#pragma unroll
    for (int ks = 0; ks < D / 32; ++ks)
      mma16816(sc, a0[2 * ks], a8[2 * ks], a0[2 * ks + 1], a8[2 * ks + 1], qb[hs * (D / 16) + 2 * ks],
               qb[hs * (D / 16) + 2 * ks + 1]);
  }
}

template <int D, bool Global = true>
__device__ __forceinline__ void values_wide(const slab_ref& s, family fam, int g, int t, int window, uint32_t pb0,
                                            uint32_t pb1, float (&acc)[D / 16][4]) {
  constexpr uint32_t row_bytes = D * 2;
  const int rows[4] = {2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9};
#pragma unroll
  for (int hs = 0; hs < 2; ++hs) {
    uint32_t v[4][D / 32];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      uint32_t w[D / 32];
      ldg_words<D / 8, Global>(slab_row<D>(s, s.v, rows[r], row_bytes, window) + g * (D / 4) + hs * (D / 8), w);
      to_pairs<16, D / 32>(w, fam, v[r]);
      if (rows[r] >= s.valid) {
#pragma unroll
        for (int i = 0; i < D / 32; ++i) v[r][i] = 0u;
      }
    }
#pragma unroll
    for (int i = 0; i < D / 32; ++i)
      mma16816(acc[hs * (D / 32) + i], __byte_perm(v[0][i], v[1][i], 0x5410), __byte_perm(v[0][i], v[1][i], 0x7632),
               __byte_perm(v[2][i], v[3][i], 0x5410), __byte_perm(v[2][i], v[3][i], 0x7632), pb0, pb1);
  }
}

// S^T = K Q^T of one slab from this lane's K fragments (rows g, g + 8): two accumulators, half
// the dependency chain each (Sub: the odd one holds 2^Sub x codes).
template <int D, int Sub = 0>
__device__ __forceinline__ void scores_mma(const uint32_t (&kg)[D / 8], const uint32_t (&kg8)[D / 8], const uint32_t (&qb)[D / 8],
                                           float (&sc)[4]) {
  float sd[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int ks = 0; ks < D / 16; ks += 2) {
    mma16816(sc, kg[2 * ks], kg8[2 * ks], kg[2 * ks + 1], kg8[2 * ks + 1], qb[2 * ks], qb[2 * ks + 1]);
    mma16816(sd, kg[2 * ks + 2], kg8[2 * ks + 2], kg[2 * ks + 3], kg8[2 * ks + 3], qb[2 * ks + 2], qb[2 * ks + 3]);
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) sc[e] = Sub ? fmaf(sd[e], 1.f / float(1 << Sub), sc[e]) : sc[e] + sd[e];
}

// P^T as B fragments of O^T += V^T P^T, from the S^T accumulators by register transpose.
__device__ __forceinline__ void p_frags(const float (&pv)[4], uint32_t& pb0, uint32_t& pb1) {
  pb0 = movmatrix_t(h2_bits(__floats2half2_rn(pv[0], pv[1])));
  pb1 = movmatrix_t(h2_bits(__floats2half2_rn(pv[2], pv[3])));
}

// O^T += V^T P^T from this lane's V halves of tokens 2t, 2t+1, 2t+8, 2t+9 (va..vd): A fragments
// pair two tokens per channel. Rows at or beyond `valid` hold stale bytes and are zeroed (P is 0
// there, but 0 x NaN is not).
template <int D>
__device__ __forceinline__ void values_mma(uint32_t (&va)[D / 16], uint32_t (&vb)[D / 16], uint32_t (&vc)[D / 16],
                                           uint32_t (&vd)[D / 16], int valid, int t, uint32_t pb0, uint32_t pb1,
                                           float (&acc)[D / 16][4]) {
  if (valid < slab) {
    const bool za = 2 * t < valid, zb = 2 * t + 1 < valid, zc = 2 * t + 8 < valid, zd = 2 * t + 9 < valid;
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      va[i] = za ? va[i] : 0u, vb[i] = zb ? vb[i] : 0u, vc[i] = zc ? vc[i] : 0u, vd[i] = zd ? vd[i] : 0u;
    }
  }
#pragma unroll
  for (int mtile = 0; mtile < D / 16; ++mtile)
    mma16816(acc[mtile], __byte_perm(va[mtile], vb[mtile], 0x5410), __byte_perm(va[mtile], vb[mtile], 0x7632),
             __byte_perm(vc[mtile], vd[mtile], 0x5410), __byte_perm(vc[mtile], vd[mtile], 0x7632), pb0, pb1);
}

// Token-pair A fragments of V codes read through a table (codebook, nvfp4): the selectors are
// built from two rows' codes at once, so that a lookup yields (token a, token b) of a channel,
// the A fragment itself (the rows' channel pairs need no interleave afterwards), and each m-tile's
// MMA follows its lookups (no slab of looked-up values held in registers). Lane (g, t) holds rows
// 2t, 2t + 1 (fragments a0, a1) and 2t + 8, 2t + 9 (a2, a3) of its D/8 channels; m-tile m is
// channel pair m of them. `row_scales(m)` gives the two rows pairs' half2 scales of m-tile m
// (rows at or beyond `valid` with scale 0: their codes are stale, their levels finite); Scaled =
// false: none (the scales are on P).

// 4-bit codes (codebook levels or e2m1 values): byte m of a row is its channel pair m, so one
// permute of two rows' words gives the selectors of two m-tiles (nibbles a_c, a_c+1, b_c, b_c+1),
// looked up four codes at a time by `bytes` (`cb4_bytes`, `fp4_bytes`).
template <int D, int Cap, bool Scaled, class Bytes, class Scales>
__device__ __forceinline__ void values_nibbles(const v_raw<D, Cap>& vr, Bytes&& bytes, Scales&& row_scales, uint32_t pb0,
                                               uint32_t pb1, float (&acc)[D / 16][4]) {
#pragma unroll
  for (int i = 0; i < (D / 16 + 3) / 4; ++i)  // word i: m-tiles 4i .. 4i + 3
#pragma unroll
    for (int q = 0; q < 2; ++q) {  // bytes 0-1 (q = 0) or 2-3 of the word
      if (4 * i + 2 * q >= D / 16) continue;
      const uint32_t sel = q ? 0x7362u : 0x5140u;
      const uint32_t p01 = __byte_perm(vr.w[0][i], vr.w[1][i], sel), p89 = __byte_perm(vr.w[2][i], vr.w[3][i], sel);
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int m = 4 * i + 2 * q + hh;
        const nibble_bytes b01 = bytes(p01, hh), b89 = bytes(p89, hh);  // codes a_c, a_c+1, b_c, b_c+1
        const __half2 s01 = row_scales(m, 0), s89 = row_scales(m, 1);
        const auto frag = [](const nibble_bytes& b, uint32_t sel, __half2 sc) {  // (a_c, b_c) or (a_c+1, b_c+1)
          const uint32_t x = __byte_perm(b.lo, b.hi, sel);
          if constexpr (Scaled) return h2_bits(__hmul2(bits_h2(x), sc));
          else return x;
        };
        mma16816(acc[m], frag(b01, 0x6240, s01), frag(b01, 0x7351, s01), frag(b89, 0x6240, s89), frag(b89, 0x7351, s89),
                 pb0, pb1);
      }
    }
}

// The half2 (scale of row a, scale of row b) from two fp16 scale words, 0 for rows at or beyond
// `valid` (the rows of lane t: 2t, 2t + 1, 2t + 8, 2t + 9).
__device__ __forceinline__ __half2 pair_scales(uint32_t sa, uint32_t sb, int ra, int valid) {
  return bits_h2(__byte_perm(ra < valid ? sa : 0u, ra + 1 < valid ? sb : 0u, 0x5410));
}

// O^T += V^T P^T for a slab of codebook V codes: levels by token-pair lookups, times the rows'
// group scales (a lane's D/8 channels lie in one group). Scaled = false: the levels alone (whole-
// head scales, on P: `values_kind`'s HeadScale; `valid` and `t` unused).
template <int D, int Bits, int Cap, bool Scaled = true>
__device__ __forceinline__ void values_cb(const v_raw<D, Cap>& vr, const cb_lut<Bits>& lut, int valid, int t, uint32_t pb0,
                                          uint32_t pb1, float (&acc)[D / 16][4]) {
  __half2 s01 = __float2half2_rn(1.f), s89 = s01;
  if constexpr (Scaled)
    s01 = pair_scales(vr.s[0], vr.s[1], 2 * t, valid), s89 = pair_scales(vr.s[2], vr.s[3], 2 * t + 8, valid);
  const auto scales = [&](int, int rp) { return rp ? s89 : s01; };
  const auto scaled = [&](uint32_t x, __half2 sc) { return Scaled ? h2_bits(__hmul2(bits_h2(x), sc)) : x; };
  if constexpr (Bits == 4) {
    values_nibbles<D, Cap, Scaled>(vr, [&](uint32_t x, int hh) { return cb4_bytes(x, hh, lut); }, scales, pb0, pb1, acc);
  } else {
    // 2 bits: per word (16 channels), each phase k's codes (channel 4j + k in byte j) of two rows
    // interleaved by byte into token-pair selectors (0x22 c + 0x10 per code: nibbles 2c, 2c + 1)
#pragma unroll
    for (int i = 0; i < (D / 16 + 7) / 8; ++i)  // word i: channels 16i .., m-tiles 8i .. 8i + 7
#pragma unroll
      for (int q = 0; q < 2; ++q) {  // bytes 0-1 (q = 0) or 2-3: m-tiles 8i + 4q .. + 3
        if (8 * i + 4 * q >= D / 16) continue;
        uint32_t sel[4][2];  // [phase][row pair]
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
          for (int rp = 0; rp < 2; ++rp) {
            const uint32_t ea = (vr.w[2 * rp][i] >> (2 * k)) & 0x03030303u, eb = (vr.w[2 * rp + 1][i] >> (2 * k)) & 0x03030303u;
            sel[k][rp] = __byte_perm(ea, eb, q ? 0x7362u : 0x5140u) * 0x22u + 0x10101010u;
          }
#pragma unroll
        for (int jj = 0; jj < 2; ++jj)    // byte j = 2q + jj: channels 16i + 4j .. + 3
#pragma unroll
          for (int mm = 0; mm < 2; ++mm) {  // m-tile 8i + 2j + mm: phases 2mm, 2mm + 1
            const int m = 8 * i + 4 * q + 2 * jj + mm;
            const auto look = [&](int k, int rp) { return __byte_perm(lut.w[0], lut.w[1], jj ? sel[k][rp] >> 16 : sel[k][rp]); };
            mma16816(acc[m], scaled(look(2 * mm, 0), s01), scaled(look(2 * mm + 1, 0), s01), scaled(look(2 * mm, 1), s89),
                     scaled(look(2 * mm + 1, 1), s89), pb0, pb1);
          }
      }
  }
}

// An nvfp4 block's scale (`fp4_scale`) as one half.
__device__ __forceinline__ uint32_t fp4_scale_bits(uint32_t e4m3, float ts) {
  return h2_bits(fp4_scale(e4m3, ts)) & 0xffffu;
}

// O^T += V^T P^T for a slab of nvfp4 V codes: e2m1 values by token-pair lookups, times their
// block's scale (vr.s[r]: the row's e4m3 bytes of the lane's D/8 channels, 2 blocks at head_dim
// 256) and the tensor scale `ts`.
template <int D, int Cap>
__device__ __forceinline__ void values_fp4(const v_raw<D, Cap>& vr, float ts, int valid, int t, uint32_t pb0, uint32_t pb1,
                                           float (&acc)[D / 16][4]) {
  constexpr int nb = D / 16 > 8 ? 2 : 1;  // blocks in the lane's D/8 channels (8 m-tiles each)
  __half2 s[nb][2];
#pragma unroll
  for (int b = 0; b < nb; ++b)
#pragma unroll
    for (int rp = 0; rp < 2; ++rp)
      s[b][rp] = pair_scales(fp4_scale_bits(vr.s[2 * rp] >> (8 * b), ts), fp4_scale_bits(vr.s[2 * rp + 1] >> (8 * b), ts),
                             2 * t + 8 * rp, valid);
  const auto scales = [&](int m, int rp) { return s[nb == 2 && m >= 8 ? 1 : 0][rp]; };
  values_nibbles<D, Cap, true>(vr, [](uint32_t x, int hh) { return fp4_bytes(x, hh); }, scales, pb0, pb1, acc);
}

// O^T += V^T P^T for one slab from the lane's raw V words (any format the kernel holds in
// registers: up to Cap bits).
template <int D, int Cap>
__device__ __forceinline__ void values_slab(const v_raw<D, Cap>& vr, format_traits fv, int valid, int t, uint32_t pb0,
                                            uint32_t pb1, float (&acc)[D / 16][4]) {
  if (fv.is_integer()) {
    const bool sym = fv.fam == family::sym;
    switch (fv.bits) {
      case 8: values_int<D, 8, Cap>(vr, sym, valid, t, pb0, pb1, acc); break;
      case 4: values_int<D, 4, Cap>(vr, sym, valid, t, pb0, pb1, acc); break;
      default: values_int<D, 2, Cap>(vr, sym, valid, t, pb0, pb1, acc); break;
    }
    return;
  }
  uint32_t va[D / 16], vb[D / 16], vc[D / 16], vd[D / 16];
  if (Cap >= 16 && fv.bits == 16) v_all<D, Cap >= 16 ? 16 : 8, Cap>(vr, fv.fam, va, vb, vc, vd);
  else v_all<D, 8, Cap>(vr, fv.fam, va, vb, vc, vd);  // fp8
  values_mma<D>(va, vb, vc, vd, valid, t, pb0, pb1, acc);
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
