#pragma once
// Dequantization: integer and float codes -> fp16 MMA operands, by byte-permute / magic-number bit
// tricks. The tile kernel dequantizes 16-byte chunks into swizzled shared-memory tiles
// (`dequant_int_chunk`, `tile_from_raw`); the decode kernels turn a lane's raw words into half2
// channel pairs (`to_pairs`, `pair_codes`), KIVI keys also into fp16 subnormal codes
// (`k_frags_sub`).
#include <kvq/format/format.hpp>

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "ptx.cuh"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// Shared-memory tiles are [rows][D] halves with 16-byte chunks XOR-swizzled by row, so that
// ldmatrix's 8 row addresses hit 8 different bank groups.
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);
}

// Codes -> halves (1024 + code) by bit tricks. `out` receives channel pairs in order.
// 8-bit: one byte-permute per pair. 4-bit: split even/odd nibbles once per word, then one
// permute + one lop3 per pair. 2-bit likewise with four phases.
template <int Bits>
__device__ __forceinline__ void codes_to_magic(const uint32_t (&w)[4], uint32_t (&out)[64 / Bits]) {
  if constexpr (Bits == 8) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __byte_perm(w[i], 0x64646464u, 0x5140);
      out[2 * i + 1] = __byte_perm(w[i], 0x64646464u, 0x7342);
    }
  } else if constexpr (Bits == 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t ev = w[i] & 0x0F0F0F0Fu, od = (w[i] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
      for (int k = 0; k < 4; ++k)
        out[4 * i + k] = (__byte_perm(ev, od, k | (k << 4) | ((4 + k) << 8) | ((4 + k) << 12)) & 0x00FF00FFu) | 0x64006400u;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t c0 = w[i] & 0x03030303u, c1 = (w[i] >> 2) & 0x03030303u, c2 = (w[i] >> 4) & 0x03030303u,
                     c3 = (w[i] >> 6) & 0x03030303u;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t sel = k | (k << 4) | ((4 + k) << 8) | ((4 + k) << 12);
        out[8 * i + 2 * k] = (__byte_perm(c0, c1, sel) & 0x00FF00FFu) | 0x64006400u;
        out[8 * i + 2 * k + 1] = (__byte_perm(c2, c3, sel) & 0x00FF00FFu) | 0x64006400u;
      }
    }
  }
}

// How a 16-byte chunk of integer codes becomes halves: KIVI/RoleAlign keys as centered codes
// (code - 2^(b-1), exact in fp16; the caller folds their scales and zero points into the query) or
// as values through their per-channel scales and zeros; every other role as values through the
// scales of its token's channel groups.
enum class int_read { centered, channel_scales, token_groups };

// One 16-byte chunk of integer codes (128/Bits channels of one token) -> halves in the tile.
// `scales`/`zeros`: the tile's scales and zeros as the raw ring holds them, group g, `tok` the
// token in the tile: for channel_scales [token group][D] halves (the groups the tile touches),
// else the page role's [token][D / g].
template <int D, int Bits>
__device__ __forceinline__ void dequant_int_chunk(const uint32_t (&w)[4], format_traits f, int_read how,
                                                  const uint16_t* scales, const uint16_t* zeros, int tok, int ch0, int g,
                                                  uint4* out, int row) {
  constexpr int elems = 128 / Bits, pairs = elems / 2;
  uint32_t m[pairs];
  codes_to_magic<Bits>(w, m);
  if (how == int_read::centered) {  // smaller terms to cancel against q . z
    const __half2 bias = __float2half2_rn(1024.f + float(1 << (Bits - 1)));
#pragma unroll
    for (int i = 0; i < pairs; ++i) m[i] = h2_bits(__hsub2(bits_h2(m[i]), bias));
  } else if (how == int_read::channel_scales) {  // code x s + z, one hfma2 per channel pair
    const __half2 magic = __float2half2_rn(1024.f);
    const int at = (tok >> log2i(g)) * D + ch0;  // (a group of 64 tokens or more: the tile's one group)
    const uint4* s4 = reinterpret_cast<const uint4*>(scales + at);
    const uint4* z4 = reinterpret_cast<const uint4*>(zeros + at);
#pragma unroll
    for (int q = 0; q < elems / 8; ++q) {
      const uint4 sv = s4[q], zv = z4[q];
      const uint32_t sw[4] = {sv.x, sv.y, sv.z, sv.w}, zw[4] = {zv.x, zv.y, zv.z, zv.w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        m[4 * q + j] = h2_bits(__hfma2(__hsub2(bits_h2(m[4 * q + j]), magic), bits_h2(sw[j]), bits_h2(zw[j])));
    }
  } else {
    const int lg = log2i(g), ng = D >> lg;
    const bool sym = f.fam == family::sym;
    const __half2 bias = __float2half2_rn(sym ? 1024.f + float(1 << (Bits - 1)) : 1024.f);
    // a chunk spans at most two groups (g >= 32); scales change only at 8-channel boundaries
#pragma unroll
    for (int q = 0; q < elems / 8; ++q) {
      const int gi = tok * ng + ((ch0 + 8 * q) >> lg);
      const __half2 s = __half2half2(__ushort_as_half(scales[gi]));
      const __half2 z = sym ? __float2half2_rn(0.f) : __half2half2(__ushort_as_half(zeros[gi]));
#pragma unroll
      for (int i = 4 * q; i < 4 * q + 4; ++i) m[i] = h2_bits(__hfma2(__hsub2(bits_h2(m[i]), bias), s, z));
    }
  }
#pragma unroll
  for (int k = 0; k < elems / 8; ++k) out[swz<D>(row, ch0 / 8 + k) / 8] = make_uint4(m[4 * k], m[4 * k + 1], m[4 * k + 2], m[4 * k + 3]);
}

// Codes of `Pairs` channel pairs (in channel order) -> half2 words holding 1024 + code (8-bit
// integer families), 1024 + code / magic_mul (4 and 2 bits: one byte-permute and one lop3 per pair,
// no shifts), or the values (fp16; bf16 and fp8 converted).
template <int Bits, int Pairs>
__device__ __forceinline__ void to_pairs(const uint32_t* w, family fam, uint32_t (&out)[Pairs]) {
  if constexpr (Bits == 16) {
    if (fam == family::fp16) {
#pragma unroll
      for (int i = 0; i < Pairs; ++i) out[i] = w[i];
    } else {  // bf16 (a warp-uniform branch: a per-element select would convert fp16 pages too)
#pragma unroll
      for (int i = 0; i < Pairs; ++i)
        out[i] = h2_bits(__floats2half2_rn(__uint_as_float(w[i] << 16), __uint_as_float(w[i] & 0xffff0000u)));
    }
  } else if constexpr (Bits == 8) {
    if (fam == family::fp8_e4m3) {
#pragma unroll
      for (int i = 0; i < Pairs; ++i) {
        const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t((w[i / 2] >> (16 * (i % 2))) & 0xffffu), __NV_E4M3);
        out[i] = uint32_t(hr.x) | (uint32_t(hr.y) << 16);
      }
    } else {
#pragma unroll
      for (int i = 0; i < Pairs; ++i) out[i] = __byte_perm(w[i / 2], 0x64646464u, (i % 2) ? 0x7342 : 0x5140);
    }
  } else if constexpr (Bits == 4) {  // [byte j, 0x64, byte j, 0x64], then one mask per pair
#pragma unroll
    for (int i = 0; i < Pairs; ++i) out[i] = __byte_perm(w[i / 4], 0x64646464u, (i % 4) * 0x0101u + 0x4040u) & 0xFFF0FF0Fu;
  } else if constexpr (Bits == 2) {
#pragma unroll
    for (int b = 0; b < Pairs / 2; ++b) {  // byte b holds channels 4b .. 4b+3
      const uint32_t x = __byte_perm(w[b / 4], 0x64646464u, (b % 4) * 0x0101u + 0x4040u);
      out[2 * b] = x & 0xFF0CFF03u;
      out[2 * b + 1] = x & 0xFFC0FF30u;
    }
  } else {
    static_assert(Bits == 3, "codes of 16, 8, 4, 3 or 2 bits");
    // The low two bits as 2-bit codes, then each code's bit 2 (bit plane: channel c in bit c of
    // word c / 32, after the (Pairs + 7) / 8 words of the 2-bit plane) set just above them: bit 2
    // of a low half, bit 4 of a high half in the first pair of a byte; bits 6 and 8 in the second.
    to_pairs<2, Pairs>(w, fam, out);
    const uint32_t* plane = w + (Pairs + 7) / 8;
#pragma unroll
    for (int pw = 0; pw < (Pairs + 15) / 16; ++pw) {  // a plane word: 32 channels, bytes 8 pw .. 8 pw + 7
      const uint32_t x = plane[pw];
      // two 64-bit words (lo, hi): e holds channels 4i in place and 4i + 1 17 bits up (4i + 18),
      // f channels 4i + 2 in place and 4i + 3 at 4i + 20, so that one funnel shift of e (f) brings
      // a byte's first (second) pair's two bits to their places
      const uint32_t e1 = x & 0x22222222u, f1 = x & 0x88888888u;
      const uint32_t el = (x & 0x11111111u) | (e1 << 17), eh = e1 >> 15;
      const uint32_t fl = (x & 0x44444444u) | (f1 << 17), fh = f1 >> 15;
#pragma unroll
      for (int bb = 0; bb < 8; ++bb) {
        const int b = 8 * pw + bb;
        if (2 * b >= Pairs) break;
        const uint32_t he = bb == 0 ? el << 2 : __funnelshift_r(el, eh, 4 * bb - 2);
        const uint32_t hf = bb == 0 ? fl << 4 : bb == 1 ? fl : __funnelshift_r(fl, fh, 4 * bb - 4);
        out[2 * b] = lop3_or_masked(he, 0x00100004u, out[2 * b]);
        out[2 * b + 1] = lop3_or_masked(hf, 0x01000040u, out[2 * b + 1]);
      }
    }
  }
}

// Codes read in place within their byte (4 bits: the high nibble 16x; 2 bits: 1x, 4x, 16x, 64x)
// hold 1024 + code / mul in fp16, exact, with mul = code_mul(c) for channel c of the word.
// 3-bit codes sit where their low two bits do (the 2-bit plane's places, bit 2 just above).
template <int Bits>
__host__ __device__ constexpr float code_mul(int c) {
  constexpr int b = Bits == 3 ? 2 : Bits;
  return b == 8 ? 1.f : 1.f / float(1 << (b * (c % (8 / b))));
}
// The multipliers of the two halves of pair i of `to_pairs` (channels 2i, 2i + 1).
template <int Bits>
__device__ __forceinline__ __half2 magic_mul(int i) {
  return __floats2half2_rn(code_mul<Bits>(2 * i), code_mul<Bits>(2 * i + 1));
}

// The codes of channel c (of the lane's D/8) of two tokens, as the half2 (1024 + c_a / mul, 1024 +
// c_b / mul) with mul = code_mul<Bits>(c): one byte permute places the two tokens' bytes of the
// channel in bytes 0 and 2 (shared by the channels of that byte), one lop3 masks the code in place
// and inserts the magic exponent, so that V^T's A fragments (token pairs) come straight from the
// raw words. (The permute's selector is an immediate and the magic a register: a permute that
// inserted the magic itself took its selector from a register, rematerialized at every use.)
// 3 bits: the 2-bit plane's code, and bit 2 from the bit plane (channel c of the row in bit c,
// at word `Plane` of wa / wb) shifted to just above it, for both tokens in one shift and one lop3.
template <int Bits, int Plane = 0>
__device__ __forceinline__ uint32_t pair_codes(const uint32_t* wa, const uint32_t* wb, int c, uint32_t magic) {
  constexpr int b = Bits == 3 ? 2 : Bits;
  constexpr int per_word = 32 / b, per_byte = 8 / b;
  constexpr uint32_t mask = ((1u << b) - 1) * 0x00010001u;
  const int wi = c / per_word, j = (c % per_word) / per_byte, k = c % per_byte;
  const uint32_t x = __byte_perm(wa[wi], wb[wi], uint32_t(j * 0x11 + (4 + j) * 0x1100));  // a_j, a_j, b_j, b_j
  uint32_t d = lop3_or_masked(x, mask << (b * k), magic);
  if constexpr (Bits == 3) {
    static_assert(Plane > 0, "3 bits: the bit plane's word");
    // bits c % 16 of token a (low half) and of token b (high half), then to bit 2k + 2 of each
    const uint32_t q = __byte_perm(wa[Plane + c / 32], wb[Plane + c / 32], (c % 32) < 16 ? 0x5410u : 0x7632u);
    const int s = c % 16 - 2 * k - 2;
    d = lop3_or_masked(s >= 0 ? q >> s : q << -s, 0x00040004u << (2 * k), d);
  }
  return d;
}

// fp8: the float token scales of rows g and g + 8 of a slab. Rows at or beyond `valid` hold stale
// bytes: their scale is 0, so that a masked score or P = 0 never meets a NaN.
__device__ __forceinline__ float2 fp8_scales(uint32_t s0, uint32_t s8, int g, int valid) {
  return make_float2(g < valid ? __uint_as_float(s0) : 0.f, g + 8 < valid ? __uint_as_float(s8) : 0.f);
}

// Whole-head codebook scales (fp16 bits in the low half of s0, s8) of rows g and g + 8 as floats,
// 0 for rows at or beyond `valid` (as `fp8_scales`).
__device__ __forceinline__ float2 half_scales(uint32_t s0, uint32_t s8, int g, int valid) {
  return make_float2(g < valid ? __half2float(__ushort_as_half(uint16_t(s0))) : 0.f,
                     g + 8 < valid ? __half2float(__ushort_as_half(uint16_t(s8))) : 0.f);
}

// Codebook levels as byte-permute tables: a code's fp16 level is looked up in registers, by
// `__byte_perm` (which picks 4 bytes of 8 by 4 selector nibbles), with no shared-memory table.
// 2 bits: the four levels fill two words (level k in bytes 2k, 2k + 1), and a channel pair's
// half2 is one permute whose selector is the pair's codes spread to nibbles (2c, 2c + 1). 4 bits:
// the levels' low bytes (levels 0-3, 4-7, 8-11, 12-15: w[0..3]) and high bytes (w[4..7]); four
// codes take one permute in each 8-entry half of each byte table (selector: the codes' low 3
// bits), a select by each code's bit 3 (a byte mask from one permute in sign-replicate mode), and
// two permutes that interleave low and high bytes into two half2.
template <int Bits>
struct cb_lut {
  static_assert(Bits == 2 || Bits == 4, "codebook kinds: 4 and 2 bits");
  uint32_t w[Bits == 2 ? 2 : 8];
};

// The table of a page's (or a stage's) levels: [2^Bits] fp32 at `levels` (16-byte aligned),
// rounded to fp16 (the tensor cores' operand type; the CPU reference rounds level x scale once).
template <int Bits, bool Global>
__device__ __forceinline__ cb_lut<Bits> cb_table(const uint8_t* levels) {
  const float4* l4 = reinterpret_cast<const float4*>(levels);
  const auto ld4 = [&](int i) {
    if constexpr (Global) return __ldg(l4 + i);
    else return l4[i];
  };
  cb_lut<Bits> t;
  if constexpr (Bits == 2) {
    const float4 a = ld4(0);
    t.w[0] = h2_bits(__floats2half2_rn(a.x, a.y));
    t.w[1] = h2_bits(__floats2half2_rn(a.z, a.w));
  } else {
    uint32_t h[8];  // (level 2i, level 2i + 1)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 a = ld4(i);
      h[2 * i] = h2_bits(__floats2half2_rn(a.x, a.y));
      h[2 * i + 1] = h2_bits(__floats2half2_rn(a.z, a.w));
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      t.w[i] = __byte_perm(h[2 * i], h[2 * i + 1], 0x6420);      // low bytes of levels 4i .. 4i + 3
      t.w[4 + i] = __byte_perm(h[2 * i], h[2 * i + 1], 0x7531);  // high bytes
    }
  }
  return t;
}

// The fp16 values of four 4-bit codes (nibbles 4hh .. 4hh + 3 of x) as byte words: byte k of
// `lo` / `hi` is the low / high byte of code k's value. The callers interleave them into half2
// pairs: in channel order (`nibble_pairs`) or in token pairs (`values_nibbles`).
struct nibble_bytes {
  uint32_t lo, hi;
};

// 0xff in byte k where nibble 4hh + k of x has its top bit set (one permute in sign-replicate mode).
__device__ __forceinline__ uint32_t nibble_top_bits(uint32_t x, int hh) {
  return prmt_sign(x << 4, x, hh ? 0xFBEAu : 0xD9C8u);
}

// cb4: permutes in each 8-entry half of the levels' low- and high-byte tables (selector: the
// codes' low 3 bits), then a select by each code's top bit.
__device__ __forceinline__ nibble_bytes cb4_bytes(uint32_t x, int hh, const cb_lut<4>& lut) {
  const uint32_t id = (hh ? x >> 16 : x) & 0x7777u, m = nibble_top_bits(x, hh);
  return {(__byte_perm(lut.w[0], lut.w[1], id) & ~m) | (__byte_perm(lut.w[2], lut.w[3], id) & m),
          (__byte_perm(lut.w[4], lut.w[5], id) & ~m) | (__byte_perm(lut.w[6], lut.w[7], id) & m)};
}

// nvfp4: the fp16 forms of the eight e2m1 magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6) have a zero low
// byte, so one permute of an 8-byte table of high bytes (selector: the codes' low 3 bits) and the
// sign bits OR-ed in.
__device__ __forceinline__ nibble_bytes fp4_bytes(uint32_t x, int hh) {
  constexpr uint32_t mag_lo = 0x3E3C3800u, mag_hi = 0x46444240u;  // high bytes of 0, .5, 1, 1.5 | 2, 3, 4, 6
  return {0u, __byte_perm(mag_lo, mag_hi, (hh ? x >> 16 : x) & 0x7777u) | (nibble_top_bits(x, hh) & 0x80808080u)};
}

// 4-bit codes of `Pairs` channel pairs (in channel order, packed as a 4-bit sym page's) -> half2
// values, four codes at a time through `bytes` (`cb4_bytes`, `fp4_bytes`).
template <int Pairs, class Bytes>
__device__ __forceinline__ void nibble_pairs(const uint32_t* w, Bytes&& bytes, uint32_t (&out)[Pairs]) {
#pragma unroll
  for (int i = 0; i < (Pairs + 3) / 4; ++i)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {  // channels 8i + 4hh .. + 3
      if (4 * i + 2 * hh >= Pairs) continue;
      const nibble_bytes b = bytes(w[i], hh);
      out[4 * i + 2 * hh] = __byte_perm(b.lo, b.hi, 0x5140);
      out[4 * i + 2 * hh + 1] = __byte_perm(b.lo, b.hi, 0x7362);
    }
}

// Codebook codes of `Pairs` channel pairs (in channel order, packed as `sym`'s) -> half2 levels.
template <int Bits, int Pairs>
__device__ __forceinline__ void cb_pairs(const uint32_t* w, const cb_lut<Bits>& lut, uint32_t (&out)[Pairs]) {
  if constexpr (Bits == 2) {
    // per word (16 channels): codes to bytes by phase (e_k: channels 4i + k), two phases' bytes
    // interleaved into pairs, then selector bytes 0x22 c + 0x10 (nibbles 2c, 2c + 1) in one multiply-add
#pragma unroll
    for (int i = 0; i < (Pairs + 7) / 8; ++i) {
      const uint32_t x = w[i];
      const uint32_t e[4] = {x & 0x03030303u, (x >> 2) & 0x03030303u, (x >> 4) & 0x03030303u, (x >> 6) & 0x03030303u};
#pragma unroll
      for (int q = 0; q < 4; ++q) {  // q: (phases 0/1 or 2/3) x (bytes 0-1 or 2-3)
        const int base = 8 * i + (q & 1) + 4 * (q >> 1);  // pairs base and base + 2
        if (base >= Pairs) continue;
        const uint32_t z = __byte_perm(e[2 * (q & 1)], e[2 * (q & 1) + 1], (q >> 1) ? 0x7362 : 0x5140);
        const uint32_t sel = z * 0x22u + 0x10101010u;
        out[base] = __byte_perm(lut.w[0], lut.w[1], sel);
        if (base + 2 < Pairs) out[base + 2] = __byte_perm(lut.w[0], lut.w[1], sel >> 16);
      }
    }
  } else {
    nibble_pairs<Pairs>(w, [&](uint32_t x, int hh) { return cb4_bytes(x, hh, lut); }, out);
  }
}

// nvfp4's e2m1 codes (sign in bit 3) of `Pairs` channel pairs (in channel order, packed as a
// 4-bit sym page's) -> half2 values (`fp4_bytes`).
template <int Pairs>
__device__ __forceinline__ void fp4_pairs(const uint32_t* w, uint32_t (&out)[Pairs]) {
  nibble_pairs<Pairs>(w, [](uint32_t x, int hh) { return fp4_bytes(x, hh); }, out);
}

// An nvfp4 block's scale as an fp16 operand: e4m3 (exact in fp16) times the page's fp32 tensor
// scale, rounded once.
__device__ __forceinline__ __half2 fp4_scale(uint32_t e4m3, float ts) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(e4m3 & 0xffu), __NV_E4M3);
  return __half2half2(__float2half_rn(__half2float(__half(h)) * ts));
}

// 4- and 2-bit KIVI keys as fp16 subnormals: a code c in the low bits of a half with exponent
// field 0 is c 2^-24, exactly, so one lop3 (a mask) turns two channels of a word into a half2 with
// no magic to remove and no fma (the tensor cores take subnormal operands exactly, and products
// of about 2^-24 q' are far inside the fp32 accumulators' normal range). A
// word of n channels gives pairs (c, c + n / 2), c's code at bit Bits c of each half: shifted down
// by 2 Bits k, the mask of the lowest code takes channels (2k, 2k + n / 2), the mask of the next
// one channels (2k + 1, ...) as 2^Bits c. The pairs go to the MMA k-steps so that even steps hold
// the first and odd steps the second (`scores_mma<D, Bits>` adds the odd chain / 2^Bits); the
// query takes the same order (`fold_kivi<D, Bits>`); the scores come out in units of 2^-24.
template <int D, int Bits>
__device__ __forceinline__ void k_frags_sub(const uint32_t (&w)[2][D / 16], uint32_t (&kg)[D / 8],
                                            uint32_t (&kg8)[D / 8]) {
  constexpr int np = 16 / Bits;  // pairs per word
  constexpr uint32_t lo = ((1u << Bits) - 1) * 0x00010001u, hi = lo << Bits;
  const auto split = [](const uint32_t* ws, uint32_t* out) {
#pragma unroll
    for (int i = 0; i < D * Bits / 128; ++i)
#pragma unroll
      for (int b = 0; b < np / 4; ++b) {
        const uint32_t x = ws[i] >> (4 * Bits * b), y = ws[i] >> (4 * Bits * b + 2 * Bits);
        out[np * i + 4 * b] = x & lo;
        out[np * i + 4 * b + 1] = y & lo;
        out[np * i + 4 * b + 2] = x & hi;
        out[np * i + 4 * b + 3] = y & hi;
      }
  };
  split(w[0], kg);
  split(w[1], kg8);
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
