#pragma once
/// \file
/// The codec of every format: encode and decode of one *unit* of a page, `KVQ_HOST_DEVICE`, used
/// unchanged by the CPU reference (a loop over units) and by the CUDA append kernel (a thread per
/// unit), so the two write identical bytes.
///
/// A unit is the smallest independent piece of a page:
/// - `kivi`/`rolealign` K: one token group (G tokens) x 8 channels; writes b bytes per token;
/// - `sym` and `kivi`/`rolealign` V: one token x one channel group (g channels);
/// - `fp16`, `bf16`, `fp8_e4m3`: one token.
///
/// Quantization math (float32, every step correctly rounded; on the device through the `__f*_rn`
/// intrinsics so that no fused multiply-add changes a bit):
/// - sym b:  s = fp16(absmax / (2^(b-1)-1)); q = clamp(rint(x/s), -qmax, qmax); stored q + 2^(b-1);
///           x^ = (u - 2^(b-1)) * s.
/// - kivi b: [lo, hi] = group range, narrowed about its midpoint by the clip ratio (rolealign);
///           s = fp16((hi-lo)/(2^b-1)), z = fp16(lo); q = clamp(rint((x-z)/s), 0, 2^b-1);
///           x^ = q*s + z.
/// - fp8:    s = absmax/448 (fp32); code = e4m3(x/s); x^ = e4m3(code) * s.
/// - A zero scale (all-zero or constant group) stores code 0; decode gives the zero point (or 0).
/// Inputs are fp16 (the recent window's precision) and finite: callers validate before encoding.

#include <kvq/config.hpp>
#include <kvq/format/format.hpp>
#include <kvq/format/numeric.hpp>

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

/// Geometry of one page: its format, role, shape and section sizes.
struct page_geom {
  format_traits fmt;
  role r;
  int page_tokens;
  int head_dim;
  page_layout lay;

  KVQ_HOST_DEVICE int row_bytes() const { return head_dim * fmt.bits / 8; }
  KVQ_HOST_DEVICE int group() const { return fmt.group == 0 ? head_dim : fmt.group; }
  KVQ_HOST_DEVICE bool k_columns() const { return r == role::k && fmt.k_along_tokens(); }
  /// Number of independent encode units of the page (see file comment).
  KVQ_HOST_DEVICE int unit_count() const {
    if (k_columns()) return (page_tokens / fmt.group) * (head_dim / 8);
    if (fmt.fam == family::sym || fmt.has_zero()) return page_tokens * (head_dim / group());
    return page_tokens;
  }
};

/// Builds the geometry of a page of format `id` (host or device).
KVQ_HOST_DEVICE page_geom make_geom(format_id id, role r, int page_tokens, int head_dim) {
  page_geom g{traits_of(id), r, page_tokens, head_dim, {}};
  g.lay = layout_of(g.fmt, r, page_tokens, head_dim);
  return g;
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

/// Encodes unit `u` of a page.
/// \param src  [page_tokens][src_stride] fp16 bits; row t is token t of the page
/// \param page the page's bytes (layout in format.hpp)
/// \param clip rolealign clip ratio in (0, 1]; ignored by other families
KVQ_HOST_DEVICE void encode_unit(const page_geom& g, const uint16_t* src, int src_stride, int u,
                                 uint8_t* page, float clip) {
  const int d = g.head_dim, bits = g.fmt.bits;
  uint8_t* codes = page;
  uint16_t* scales = reinterpret_cast<uint16_t*>(page + g.lay.code_bytes);
  uint16_t* zeros = reinterpret_cast<uint16_t*>(page + g.lay.code_bytes + g.lay.scale_bytes);
  const int rb = g.row_bytes();
  switch (g.fmt.fam) {
    case family::fp16:
    case family::bf16: {
      uint16_t* dst = reinterpret_cast<uint16_t*>(codes + u * rb);
      for (int c = 0; c < d; ++c) {
        const uint16_t h = src[u * src_stride + c];
        dst[c] = g.fmt.fam == family::fp16 ? h : float_to_bf16(half_to_float(h));
      }
      return;
    }
    case family::fp8_e4m3: {
      const uint16_t* x = src + u * src_stride;
      float amax = 0.f;
      for (int c = 0; c < d; ++c) amax = fmax_(amax, fabs_(half_to_float(x[c])));
      const float s = div_rn(amax, fp8_e4m3_max);
      reinterpret_cast<float*>(scales)[u] = s;
      for (int c = 0; c < d; ++c)
        codes[u * rb + c] = s > 0.f ? float_to_e4m3(div_rn(half_to_float(x[c]), s)) : uint8_t(0);
      return;
    }
    case family::sym: {
      const int gs = g.group(), ng = d / gs, t = u / ng, c0 = (u % ng) * gs;
      const uint16_t* x = src + t * src_stride + c0;
      float amax = 0.f;
      for (int c = 0; c < gs; ++c) amax = fmax_(amax, fabs_(half_to_float(x[c])));
      const int qmax = (1 << (bits - 1)) - 1;
      const uint16_t s16 = float_to_half(div_rn(amax, float(qmax)));
      scales[t * ng + u % ng] = s16;
      const float s = half_to_float(s16);
      for (int c = 0; c < gs; ++c) {
        float q = s > 0.f ? round_even(div_rn(half_to_float(x[c]), s)) : 0.f;
        q = fmin_(fmax_(q, float(-qmax)), float(qmax));
        put_code(codes + t * rb, bits, c0 + c, uint32_t(int(q) + (1 << (bits - 1))));
      }
      return;
    }
    case family::kivi:
    case family::rolealign: {
      const bool ra = g.fmt.fam == family::rolealign;
      auto quant_range = [&](float lo, float hi, uint16_t& s16, uint16_t& z16) { kivi_range(lo, hi, bits, ra, clip, s16, z16); };
      auto quant = [&](float x, float s, float z) { return kivi_code(x, s, z, bits); };
      if (g.k_columns()) {
        // unit = (token group, 8-channel block): per channel, the range over G tokens
        const int G = g.fmt.group, nb = d / 8, tg = u / nb, c0 = (u % nb) * 8;
        for (int cc = 0; cc < 8; ++cc) {
          const int c = c0 + cc;
          float lo = half_to_float(src[(tg * G) * src_stride + c]), hi = lo;
          for (int t = 1; t < G; ++t) {
            const float x = half_to_float(src[(tg * G + t) * src_stride + c]);
            lo = fmin_(lo, x);
            hi = fmax_(hi, x);
          }
          uint16_t s16, z16;
          quant_range(lo, hi, s16, z16);
          scales[tg * d + c] = s16;
          zeros[tg * d + c] = z16;
          const float s = half_to_float(s16), z = half_to_float(z16);
          for (int t = 0; t < G; ++t) {
            const int tok = tg * G + t;
            put_code(codes + tok * rb, bits, c, quant(half_to_float(src[tok * src_stride + c]), s, z));
          }
        }
      } else {
        const int gs = g.fmt.group, ng = d / gs, t = u / ng, c0 = (u % ng) * gs;
        const uint16_t* x = src + t * src_stride + c0;
        float lo = half_to_float(x[0]), hi = lo;
        for (int c = 1; c < gs; ++c) {
          lo = fmin_(lo, half_to_float(x[c]));
          hi = fmax_(hi, half_to_float(x[c]));
        }
        uint16_t s16, z16;
        quant_range(lo, hi, s16, z16);
        scales[t * ng + u % ng] = s16;
        zeros[t * ng + u % ng] = z16;
        const float s = half_to_float(s16), z = half_to_float(z16);
        for (int c = 0; c < gs; ++c) put_code(codes + t * rb, bits, c0 + c, quant(half_to_float(x[c]), s, z));
      }
      return;
    }
  }
}

/// Decodes element (t, c) of a page to float. The reference path: plain and obviously right.
KVQ_HOST_DEVICE float decode_element(const page_geom& g, const uint8_t* page, int t, int c) {
  const int d = g.head_dim, bits = g.fmt.bits, rb = g.row_bytes();
  const uint8_t* codes = page;
  const uint16_t* scales = reinterpret_cast<const uint16_t*>(page + g.lay.code_bytes);
  const uint16_t* zeros = reinterpret_cast<const uint16_t*>(page + g.lay.code_bytes + g.lay.scale_bytes);
  switch (g.fmt.fam) {
    case family::fp16: return half_to_float(reinterpret_cast<const uint16_t*>(codes + t * rb)[c]);
    case family::bf16: return bf16_to_float(reinterpret_cast<const uint16_t*>(codes + t * rb)[c]);
    case family::fp8_e4m3:
      return mul_rn(e4m3_to_float(codes[t * rb + c]), reinterpret_cast<const float*>(scales)[t]);
    case family::sym: {
      const int gs = g.group(), ng = d / gs;
      const float s = half_to_float(scales[t * ng + c / gs]);
      return mul_rn(float(int(get_code(codes + t * rb, bits, c)) - (1 << (bits - 1))), s);
    }
    case family::kivi:
    case family::rolealign: {
      int idx;
      if (g.k_columns())
        idx = (t / g.fmt.group) * d + c;
      else
        idx = t * (d / g.fmt.group) + c / g.fmt.group;
      const float s = half_to_float(scales[idx]), z = half_to_float(zeros[idx]);
      return add_rn(mul_rn(float(get_code(codes + t * rb, bits, c)), s), z);
    }
  }
  return 0.f;
}

}  // namespace codec
KVQ_NAMESPACE_END
