// Page-at-a-time decode for the CPU attention (see attention/cpu_attention.hpp): the codecs'
// decode math (format/*.hpp), restated as loops over whole rows that the compiler vectorizes,
// bit-identical to codec::decode_element.
#include "cpu_attention_simd.hpp"

#include <kvq/attention/cpu_attention.hpp>
#include <kvq/codec/codec.hpp>


KVQ_NAMESPACE_BEGIN
namespace cpu {
namespace {

// The `Bits`-bit codes of channels c0..c0+7 (c0 a multiple of 8) of one packed token row (low
// bits first, Bits < 8), as integer lanes.
template <int Bits>
KVQ_CPU_INLINE i8 codes8(const uint8_t* row, int c0) {
  int32_t w = 0;
  __builtin_memcpy(&w, row + c0 * Bits / 8, Bits);  // 8 codes of Bits bits: Bits bytes
  constexpr int32_t mask = (1 << Bits) - 1;
  return ((i8{} + w) >> i8{0, Bits, 2 * Bits, 3 * Bits, 4 * Bits, 5 * Bits, 6 * Bits, 7 * Bits}) & mask;
}

// The codes of a whole row minus `Offset`, as floats: u [d].
// NOTE: bytes go through a plain loop, which the loop vectorizer turns into zero-extending loads;
// an 8-lane vector conversion of bytes compiles to scalar extracts (GCC 12).
template <int Bits, int Offset>
KVQ_CPU_INLINE void unpack(const uint8_t* row, int d, float* u) {
  if constexpr (Bits == 8) {
    for (int c = 0; c < d; ++c) u[c] = float(int(row[c]) - Offset);
  } else {
    for (int c = 0; c < d; c += 8) store8(u + c, __builtin_convertvector(codes8<Bits>(row, c) - Offset, f8));
  }
}

// The 3-bit codes of channels c0..c0+7 of token t (c0 a multiple of 8): the 2-bit plane's codes
// plus bit 2 from the 1-bit plane (codec::page_code).
KVQ_CPU_INLINE i8 codes8_3(const codec::page_geom& g, const uint8_t* page, int t, int c0) {
  const int d = g.head_dim;
  const int32_t hi = page[g.page_tokens * (d / 4) + t * (d / 8) + c0 / 8];
  return codes8<2>(page + t * (d / 4), c0) | ((((i8{} + hi) >> i8{0, 1, 2, 3, 4, 5, 6, 7}) & 1) << 2);
}

// The codes of channels c0..c0+7 of token t, any width below 8.
template <int Bits>
KVQ_CPU_INLINE i8 page_codes8(const codec::page_geom& g, const uint8_t* page, int t, int c0) {
  if constexpr (Bits == 3) return codes8_3(g, page, t, c0);
  else return codes8<Bits>(page + t * g.row_bytes(), c0);
}

// The codes of token t minus `Offset`, as floats: u [d] (3 bits: from the two planes).
template <int Bits, int Offset>
KVQ_CPU_INLINE void unpack_row(const codec::page_geom& g, const uint8_t* page, int t, float* u) {
  if constexpr (Bits == 3) {
    for (int c = 0; c < g.head_dim; c += 8) store8(u + c, __builtin_convertvector(page_codes8<3>(g, page, t, c) - Offset, f8));
  } else {
    unpack<Bits, Offset>(page + t * g.row_bytes(), g.head_dim, u);
  }
}

// The codes of channels c..c+7 of token t minus `Offset`, as floats: 8 bits from the row `o`
// that `unpack_row` filled, narrower codes straight from the page.
template <int Bits, int Offset>
KVQ_CPU_INLINE f8 row_codes8(const codec::page_geom& g, const uint8_t* page, int t, int c, const float* o) {
  if constexpr (Bits == 8) return load8(o + c);
  else return __builtin_convertvector(page_codes8<Bits>(g, page, t, c) - Offset, f8);
}

// sym: x = (u - 2^(b-1)) * s, one fp16 scale per token per channel group.
template <int Bits>
KVQ_CPU_INLINE void decode_sym(const codec::page_geom& g, const uint8_t* page, int rows, float* out) {
  const int d = g.head_dim, gs = g.group(), ng = d / gs;
  const uint16_t* sc = g.scales(page);
  for (int t = 0; t < rows; ++t) {
    float* o = out + int64_t(t) * d;
    constexpr int offset = 1 << (Bits - 1);
    if constexpr (Bits == 8) unpack_row<Bits, offset>(g, page, t, o);
    for (int j = 0; j < ng; ++j) {
      const float s = half_to_float_finite(sc[t * ng + j]);
      for (int c = j * gs; c < (j + 1) * gs; c += 8) {
        const f8 u = row_codes8<Bits, offset>(g, page, t, c, o);
        store8(o + c, u * s);
      }
    }
  }
}

// kivi / rolealign: x = u * s + z; K groups run along tokens (a scale and zero per channel per
// G tokens), V groups along channels.
template <int Bits>
KVQ_CPU_INLINE void decode_kivi(const codec::page_geom& g, const uint8_t* page, int rows, float* out) {
  const int d = g.head_dim, gs = g.fmt.group;
  const uint16_t* sc = g.scales(page);
  const uint16_t* zr = g.zeros(page);
  if (g.k_columns()) {
    float s[256], z[256];  // head_dim <= 256 (cache_config validation)
    for (int t = 0; t < rows; ++t) {
      if (t % gs == 0)
        for (int c = 0; c < d; ++c) {
          s[c] = half_to_float_finite(sc[(t / gs) * d + c]);
          z[c] = half_to_float_finite(zr[(t / gs) * d + c]);
        }
      float* o = out + int64_t(t) * d;
      if constexpr (Bits == 8) {
        unpack_row<Bits, 0>(g, page, t, o);
        for (int c = 0; c < d; c += 8) store8(o + c, load8(o + c) * load8(s + c) + load8(z + c));
      } else {  // codes, scale and zero in one pass: the row is written once
        for (int c = 0; c < d; c += 8)
          store8(o + c, __builtin_convertvector(page_codes8<Bits>(g, page, t, c), f8) * load8(s + c) + load8(z + c));
      }
    }
    return;
  }
  const int ng = d / gs;
  for (int t = 0; t < rows; ++t) {
    float* o = out + int64_t(t) * d;
    if constexpr (Bits == 8) unpack_row<Bits, 0>(g, page, t, o);
    for (int j = 0; j < ng; ++j) {
      const float s = half_to_float_finite(sc[t * ng + j]), z = half_to_float_finite(zr[t * ng + j]);
      for (int c = j * gs; c < (j + 1) * gs; c += 8) {
        const f8 u = row_codes8<Bits, 0>(g, page, t, c, o);
        store8(o + c, u * s + z);
      }
    }
  }
}

// The entries of a table of up to 16 floats at 8 codes (0 <= q < 16): exact table values.
// NOTE: GCC turns the variable shuffles into vpermps in the AVX2 clone (two table halves and a
// select): cb2 attention 2.3x faster than a scalar lookup (docs/decisions.md). Clang has no
// variable vector shuffle: a select chain there, exact as well.
struct lut16 {
  f8 lo, hi;  // entries 0-7, 8-15
  KVQ_CPU_INLINE explicit lut16(const float* v, int n) {
    for (int k = 0; k < 8; ++k) lo[k] = v[k < n ? k : 0], hi[k] = v[k + 8 < n ? k + 8 : 0];
  }
  KVQ_CPU_INLINE f8 operator()(i8 q) const {
#if defined(__clang__)
    i8 y = std::bit_cast<i8>(splat8(lo[0]));
    for (int k = 1; k < 16; ++k) {
      const i8 m = q == k;
      y = (y & ~m) | (std::bit_cast<i8>(splat8(k < 8 ? lo[k] : hi[k - 8])) & m);
    }
    return std::bit_cast<f8>(y);
#else
    const i8 low = q & 7, m = (q & 8) != 0;
    const i8 a = std::bit_cast<i8>(__builtin_shuffle(lo, low)), b = std::bit_cast<i8>(__builtin_shuffle(hi, low));
    return std::bit_cast<f8>((a & ~m) | (b & m));
#endif
  }
};

// codebook: x = level[u] * s, the levels from the page, one fp16 scale per token per channel
// group.
template <int Bits>
KVQ_CPU_INLINE void decode_codebook(const codec::page_geom& g, const uint8_t* page, int rows, float* out) {
  const int d = g.head_dim, gs = g.group(), ng = d / gs;
  const uint16_t* sc = g.scales(page);
  const lut16 level(codebook_codec::levels(g, page), 1 << Bits);
  for (int t = 0; t < rows; ++t) {
    float* o = out + int64_t(t) * d;
    for (int c = 0; c < d; c += 8) {
      const float s = half_to_float_finite(sc[t * ng + c / gs]);
      store8(o + c, level(page_codes8<Bits>(g, page, t, c)) * s);
    }
  }
}

// nvfp4: x = (e2m1(u) * block scale) * tensor scale.
KVQ_CPU_INLINE void decode_nvfp4(const codec::page_geom& g, const uint8_t* page, int rows, float* out) {
  const int d = g.head_dim;
  float values[16];
  for (uint32_t k = 0; k < 16; ++k) values[k] = e2m1_to_float(k);
  const lut16 e2m1(values, 16);
  const float ts = nvfp4_codec::tensor_scale(g, page);
  for (int t = 0; t < rows; ++t) {
    float* o = out + int64_t(t) * d;
    const uint8_t* row = page + t * (d / 2);
    const uint8_t* bs = page + g.lay.code_bytes + t * (d / 16);
    for (int c = 0; c < d; c += 8) {
      const float b = e4m3_to_float(bs[c / 16]);
      store8(o + c, (e2m1(codes8<4>(row, c)) * b) * ts);
    }
  }
}

}  // namespace

KVQ_CPU_CLONES void decode_page_rows(const codec::page_geom& g, const uint8_t* page, int rows, float* out) {
  const int d = g.head_dim;
  switch (g.fmt.fam) {
    case family::fp16:
    case family::bf16: {
      const bool half = g.fmt.fam == family::fp16;
      const uint16_t* x = reinterpret_cast<const uint16_t*>(page);
      const int64_t count = int64_t(rows) * d;
      if (half)
        halves_to_floats(x, out, count);
      else
        for (int64_t i = 0; i < count; ++i) out[i] = bf16_to_float(x[i]);
      return;
    }
    case family::fp8_e4m3: {
      // e4m3 magnitude bits moved into a float's exponent and mantissa give the value times
      // 2^-120 (subnormals included), then the sign and the token's scale.
      const float* sc = reinterpret_cast<const float*>(g.scales(page));
      for (int t = 0; t < rows; ++t) {
        const uint8_t* row = page + t * d;
        float* o = out + int64_t(t) * d;
        const float s = sc[t];
        for (int c = 0; c < d; ++c) {
          const uint32_t u = row[c];
          const float mag = std::bit_cast<float>((u & 0x7fu) << 20) * 0x1p120f;
          o[c] = std::bit_cast<float>(std::bit_cast<uint32_t>(mag) | ((u & 0x80u) << 24)) * s;
        }
      }
      return;
    }
    // NOTE: plain calls, no lambdas: a lambda is a function of its own, compiled without the
    // clone's instruction set, and the decode loops inlined into it would not use AVX2.
    case family::sym:
      if (g.fmt.bits == 8) decode_sym<8>(g, page, rows, out);
      else if (g.fmt.bits == 4) decode_sym<4>(g, page, rows, out);
      else if (g.fmt.bits == 3) decode_sym<3>(g, page, rows, out);
      else decode_sym<2>(g, page, rows, out);
      return;
    case family::kivi:
    case family::rolealign:
      if (g.fmt.bits == 8) decode_kivi<8>(g, page, rows, out);
      else if (g.fmt.bits == 4) decode_kivi<4>(g, page, rows, out);
      else if (g.fmt.bits == 3) decode_kivi<3>(g, page, rows, out);
      else decode_kivi<2>(g, page, rows, out);
      return;
    case family::codebook:
      if (g.fmt.bits == 4) decode_codebook<4>(g, page, rows, out);
      else if (g.fmt.bits == 3) decode_codebook<3>(g, page, rows, out);
      else decode_codebook<2>(g, page, rows, out);
      return;
    case family::nvfp4:
      decode_nvfp4(g, page, rows, out);
      return;
  }
  // A family without a row decoder above: the codec, element by element.
  for (int t = 0; t < rows; ++t)
    for (int c = 0; c < d; ++c) out[int64_t(t) * d + c] = codec::decode_element(g, page, t, c);
}

}  // namespace cpu
KVQ_NAMESPACE_END
