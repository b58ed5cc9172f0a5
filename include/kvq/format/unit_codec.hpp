#pragma once
/// \file
/// The unit-codec protocol (`unit_codec`) and what every format's codec is built from: correctly
/// rounded float steps that give the same bits on host and device, packed code access, and
/// `page_geom`, the geometry a codec reads. The codecs themselves live beside their formats
/// (`format/*.hpp`); `codec/codec.hpp` encodes and decodes whole pages through them (codec/
/// depends on format/, never the other way).

#include <kvq/config.hpp>
#include <kvq/format/numeric.hpp>
#include <kvq/format/traits.hpp>

#include <concepts>
#include <cstdint>

KVQ_NAMESPACE_BEGIN
namespace codec {

KVQ_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KVQ_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
KVQ_HOST_DEVICE float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
KVQ_HOST_DEVICE float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
KVQ_HOST_DEVICE float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return __builtin_sqrtf(a);
#endif
}
KVQ_HOST_DEVICE float fmax_(float a, float b) { return a > b ? a : b; }
KVQ_HOST_DEVICE float fmin_(float a, float b) { return a < b ? a : b; }
KVQ_HOST_DEVICE float fabs_(float a) { return bits_float(float_bits(a) & 0x7fffffffu); }

/// Writes a `bits`-wide code for channel `c` into a packed token row (low bits first).
KVQ_HOST_DEVICE void put_code(uint8_t* row, int bits, int c, uint32_t q) {
  if (bits == 8) {
    row[c] = uint8_t(q);
    return;
  }
  const int per_byte = 8 / bits;
  const int shift = (c % per_byte) * bits;
  uint8_t& b = row[c / per_byte];
  const uint8_t mask = uint8_t(((1u << bits) - 1u) << shift);
  b = uint8_t((b & ~mask) | ((q << shift) & mask));
}

/// Reads the code of channel `c` from a packed token row.
KVQ_HOST_DEVICE uint32_t get_code(const uint8_t* row, int bits, int c) {
  if (bits == 8) return row[c];
  const int per_byte = 8 / bits;
  return (uint32_t(row[c / per_byte]) >> ((c % per_byte) * bits)) & ((1u << bits) - 1u);
}

/// Geometry of one page: its format, role, shape and section sizes (built by `make_geom`).
struct page_geom {
  format_traits fmt;
  role r;
  int page_tokens;
  int head_dim;
  page_layout lay;

  /// Bytes of one token's codes; for 3 bits, what a row takes over both planes (see `page_code`).
  KVQ_HOST_DEVICE int row_bytes() const { return head_dim * fmt.bits / 8; }
  KVQ_HOST_DEVICE int group() const { return fmt.group == 0 ? head_dim : fmt.group; }
  KVQ_HOST_DEVICE bool k_columns() const { return r == role::k && fmt.k_along_tokens(); }
  /// Number of independent encode units of the page: (G tokens x 8 channels) blocks for
  /// kivi/rolealign K, (token, channel group) pairs for the other integer and the codebook
  /// formats, the whole page for nvfp4 (its tensor scale spans the page), tokens else.
  KVQ_HOST_DEVICE int unit_count() const {
    if (k_columns()) return (page_tokens / fmt.group) * (head_dim / 8);
    if (fmt.channel_groups() || fmt.has_zero()) return page_tokens * (head_dim / group());
    if (fmt.fam == family::nvfp4) return 1;
    return page_tokens;
  }
  /// The scale and zero sections of a page (fp16 bits; fp8 scales are floats).
  KVQ_HOST_DEVICE uint16_t* scales(uint8_t* page) const { return reinterpret_cast<uint16_t*>(page + lay.code_bytes); }
  KVQ_HOST_DEVICE uint16_t* zeros(uint8_t* page) const { return reinterpret_cast<uint16_t*>(page + lay.zero_offset()); }
  KVQ_HOST_DEVICE const uint16_t* scales(const uint8_t* page) const {
    return reinterpret_cast<const uint16_t*>(page + lay.code_bytes);
  }
  KVQ_HOST_DEVICE const uint16_t* zeros(const uint8_t* page) const {
    return reinterpret_cast<const uint16_t*>(page + lay.zero_offset());
  }
};

/// 3-bit codes are two planes, so that each keeps whole-byte packing and 16-byte rows of loads:
/// plane 0, [page_tokens][d/4] bytes, holds the low 2 bits of every code packed as 2-bit codes
/// (channel 4i in bits 0-1 of byte i); plane 1, [page_tokens][d/8] bytes from offset
/// page_tokens*d/4, holds bit 2 (channel c in bit c%8 of byte c/8). Dequantization is the 2-bit
/// unpack plus one masked bit per channel.
KVQ_HOST_DEVICE uint32_t page_code(const page_geom& g, const uint8_t* page, int t, int c) {
  if (g.fmt.bits != 3) return get_code(page + t * g.row_bytes(), g.fmt.bits, c);
  const int d = g.head_dim;
  const uint32_t lo = get_code(page + t * (d / 4), 2, c);
  const uint32_t hi = get_code(page + g.page_tokens * (d / 4) + t * (d / 8), 1, c);
  return lo | (hi << 2);
}

/// Writes the code of channel c of token t (3-bit planes: see `page_code`).
KVQ_HOST_DEVICE void put_page_code(const page_geom& g, uint8_t* page, int t, int c, uint32_t q) {
  if (g.fmt.bits != 3) {
    put_code(page + t * g.row_bytes(), g.fmt.bits, c, q);
    return;
  }
  const int d = g.head_dim;
  put_code(page + t * (d / 4), 2, c, q & 3u);
  put_code(page + g.page_tokens * (d / 4) + t * (d / 8), 1, c, q >> 2);
}

/// KIVI / rolealign range of one group: scale and zero (fp16 bits) for values in [lo, hi] at
/// `bits` bits; rolealign with clip < 1 shrinks the range about its middle first.
KVQ_HOST_DEVICE void kivi_range(float lo, float hi, int bits, bool ra, float clip, uint16_t& s16, uint16_t& z16) {
  if (ra && clip != 1.0f) {
    const float mid = mul_rn(0.5f, add_rn(hi, lo));
    const float half = mul_rn(mul_rn(0.5f, sub_rn(hi, lo)), clip);
    lo = sub_rn(mid, half);
    hi = add_rn(mid, half);
  }
  s16 = float_to_half(div_rn(sub_rn(hi, lo), float((1 << bits) - 1)));
  z16 = float_to_half(lo);
}

/// KIVI / rolealign code of x for scale s and zero z (the decoded fp16 values of `kivi_range`).
KVQ_HOST_DEVICE uint32_t kivi_code(float x, float s, float z, int bits) {
  if (!(s > 0.f)) return 0u;
  const float num = sub_rn(x, z);
  if (num == 0.f) return 0u;  // 0 / s, and keeps the device division off its slow path (zero operand)
  const float q = round_even(div_rn(num, s));
  return uint32_t(fmin_(fmax_(q, 0.f), float((1 << bits) - 1)));
}

/// A unit codec: the page layout of a format of its family and the encode of one unit and decode
/// of one element, host and device, bit-identical (format/registry.hpp dispatches to them).
/// `encode_unit(geom, src, src_stride, u, page, clip)` writes unit `u` of the page (units:
/// `page_geom::unit_count`) from fp16 rows `src`; `clip` is rolealign's clipping (others ignore it).
template <class C>
concept unit_codec = requires(const format_traits& t, const page_geom& g, const uint16_t* src, uint8_t* page,
                              const uint8_t* cpage) {
  { C::layout(t, role::k, 64, 64) } -> std::same_as<page_layout>;
  C::encode_unit(g, src, 64, 0, page, 1.f);
  { C::decode_element(g, cpage, 0, 0) } -> std::same_as<float>;
};

}  // namespace codec
KVQ_NAMESPACE_END
