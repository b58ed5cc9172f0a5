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

/// KIVI / rolealign scale and zero (fp16 bits) of a group whose values are mapped to [lo, hi] at
/// `bits` bits.
KVQ_HOST_DEVICE void kivi_range(float lo, float hi, int bits, uint16_t& s16, uint16_t& z16) {
  s16 = float_to_half(div_rn(sub_rn(hi, lo), float((1 << bits) - 1)));
  z16 = float_to_half(lo);
}

/// The most order statistics `percentile_range` keeps from each end of a group.
inline constexpr int max_percentile_tail = 16;

/// How many of a group's n values, from each end, the (100-p)-th and p-th percentiles read
/// (`percentile_range`); 1 for p >= 100 (min and max). A percentile whose tail exceeds
/// `max_percentile_tail` for the largest group it is used with is refused where it is set.
KVQ_HOST_DEVICE int percentile_tail(float p, int n) {
  if (!(p < 100.f) || n < 2) return 1;
  const float span = float(n - 1);
  const float pos_hi = mul_rn(div_rn(p, 100.f), span), pos_lo = mul_rn(div_rn(sub_rn(100.f, p), 100.f), span);
  const int i_hi = int(pos_hi), i_lo = int(pos_lo);  // floors: both >= 0
  const int top = n - i_hi, bottom = i_lo + 2;       // x[i_hi], x[i_hi+1]; x[i_lo], x[i_lo+1]
  const int m = top > bottom ? top : bottom;
  return m < n ? m : n;
}

/// [lo, hi] of a rolealign group of n fp16 values x[0], x[stride], ..., x[(n-1)*stride]: the
/// (100-p)-th and p-th percentiles, linear between order statistics as numpy's default
/// ('linear': position q*(n-1), q = p/100, then a + (b-a)*frac). p >= 100 is the group's min and
/// max, exactly what kivi computes. Keeps the m smallest and m largest values by insertion in
/// fixed local arrays (m = `percentile_tail`, at most `max_percentile_tail`; a tail beyond it,
/// which the setters refuse, reads the m-th value from the end): no heap, device-compatible.
KVQ_HOST_DEVICE void percentile_range(const uint16_t* x, int stride, int n, float p, float& lo, float& hi) {
  lo = half_to_float(x[0]);
  hi = lo;
  if (!(p < 100.f) || n < 2) {
    for (int i = 1; i < n; ++i) {
      const float v = half_to_float(x[i * stride]);
      lo = fmin_(lo, v);
      hi = fmax_(hi, v);
    }
    return;
  }
  int m = percentile_tail(p, n);
  if (m > max_percentile_tail) m = max_percentile_tail;
  float small[max_percentile_tail], large[max_percentile_tail];  // ascending; descending
  int kept = 0;
  for (int i = 0; i < n; ++i) {
    const float v = half_to_float(x[i * stride]);
    const bool grow = kept < m;
    if (grow || v < small[m - 1]) {
      int j = grow ? kept : m - 1;
      while (j > 0 && small[j - 1] > v) {
        small[j] = small[j - 1];
        --j;
      }
      small[j] = v;
    }
    if (grow || v > large[m - 1]) {
      int j = grow ? kept : m - 1;
      while (j > 0 && large[j - 1] < v) {
        large[j] = large[j - 1];
        --j;
      }
      large[j] = v;
    }
    if (grow) ++kept;
  }
  const float span = float(n - 1);
  const float pos_hi = mul_rn(div_rn(p, 100.f), span), pos_lo = mul_rn(div_rn(sub_rn(100.f, p), 100.f), span);
  const int i_hi = int(pos_hi), i_lo = int(pos_lo);
  const float f_hi = sub_rn(pos_hi, float(i_hi)), f_lo = sub_rn(pos_lo, float(i_lo));
  // k-th largest / smallest (0-based) of the group, within what was kept
  const int t0 = n - 1 - i_hi < m ? n - 1 - i_hi : m - 1, t1 = n - 2 - i_hi < m ? n - 2 - i_hi : m - 1;
  const int b0 = i_lo < m ? i_lo : m - 1, b1 = i_lo + 1 < m ? i_lo + 1 : m - 1;
  hi = f_hi > 0.f ? add_rn(large[t0], mul_rn(sub_rn(large[t1], large[t0]), f_hi)) : large[t0];
  lo = f_lo > 0.f ? add_rn(small[b0], mul_rn(sub_rn(small[b1], small[b0]), f_lo)) : small[b0];
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
