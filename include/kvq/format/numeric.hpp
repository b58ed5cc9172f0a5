#pragma once
/// \file
/// Bit-exact scalar conversions between float and the 16- and 8-bit storage types of kvq
/// (IEEE fp16, bfloat16, OCP fp8 e4m3), written once for host and device so that the CPU
/// reference and the CUDA kernels produce identical bytes.
/// All conversions round to nearest, ties to even. fp16 and bf16 overflow to Inf (callers
/// validate range first); fp8 e4m3 saturates to ±448 ("satfinite"), as NVIDIA's cvt does.

#include <kvq/config.hpp>

#include <cstdint>
#include <cstring>

KVQ_NAMESPACE_BEGIN

KVQ_HOST_DEVICE uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

KVQ_HOST_DEVICE float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

/// Largest finite fp16 value.
inline constexpr float fp16_max = 65504.0f;
/// Largest finite fp8 e4m3 value.
inline constexpr float fp8_e4m3_max = 448.0f;

/// float -> IEEE binary16 bits, round to nearest even; overflow gives ±Inf, NaN stays NaN.
KVQ_HOST_DEVICE uint16_t float_to_half(float f) {
  const uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) return uint16_t(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0u));
  if (absx >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: Inf
  if (absx < 0x38800000u) {                                  // result is subnormal or zero
    // value = absx as float; subnormal half = round(value * 2^24)
    const uint32_t e = absx >> 23;
    if (e < 102) return uint16_t(sign);  // < 2^-25: rounds to zero
    const uint32_t m = (absx & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return uint16_t(sign | r);
  }
  uint32_t r = ((absx >> 13) - (112u << 10));
  const uint32_t rem = absx & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return uint16_t(sign | r);
}

/// IEEE binary16 bits -> float (exact).
KVQ_HOST_DEVICE float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  if (e == 0) {
    // subnormal or zero: m * 2^-24
    const float v = float(m) * 5.9604644775390625e-8f;
    return bits_float(float_bits(v) | sign);
  }
  if (e == 31) return bits_float(sign | 0x7f800000u | (m << 13));
  return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}

/// float -> bfloat16 bits, round to nearest even; NaN stays NaN.
KVQ_HOST_DEVICE uint16_t float_to_bf16(float f) {
  const uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);
  const uint32_t r = x + 0x7fffu + ((x >> 16) & 1u);
  return uint16_t(r >> 16);
}

/// bfloat16 bits -> float (exact).
KVQ_HOST_DEVICE float bf16_to_float(uint16_t b) { return bits_float(uint32_t(b) << 16); }

/// float -> fp8 e4m3 (OCP; bias 7, no Inf, 0x7f/0xff NaN), round to nearest even, saturating
/// finite values to ±448. NaN maps to 0x7f.
KVQ_HOST_DEVICE uint8_t float_to_e4m3(float f) {
  const uint32_t x = float_bits(f);
  const uint8_t sign = uint8_t((x >> 24) & 0x80u);
  const uint32_t absx = x & 0x7fffffffu;
  if (absx > 0x7f800000u) return 0x7f;
  if (absx >= 0x43e00000u) return uint8_t(sign | 0x7e);  // >= 448 (and Inf): saturate
  if (absx < 0x3c800000u) {
    // below 2^-6: subnormal e4m3, value = m * 2^-9, m in [0, 7]
    const float a = bits_float(absx) * 512.0f;  // exact scaling by a power of two
    // round to nearest even integer in [0, 8]
    uint32_t r = uint32_t(a);
    const float frac = a - float(r);
    if (frac > 0.5f || (frac == 0.5f && (r & 1u))) ++r;
    return uint8_t(sign | r);  // r == 8 becomes exponent 1, mantissa 0: correct encoding
  }
  // normal: exponent e-127 in [-6, 8]
  uint32_t r = ((absx >> 20) - (120u << 3));  // (e - 127 + 7) << 3 | top 3 mantissa bits
  const uint32_t rem = absx & 0xfffffu;
  if (rem > 0x80000u || (rem == 0x80000u && (r & 1u))) ++r;
  if (r > 0x7eu) r = 0x7eu;  // would be 480 (or the NaN code): saturate to 448
  return uint8_t(sign | r);
}

/// fp8 e4m3 -> float (exact). 0x7f / 0xff decode to NaN.
KVQ_HOST_DEVICE float e4m3_to_float(uint8_t v) {
  const uint32_t sign = uint32_t(v & 0x80u) << 24;
  const uint32_t e = (v >> 3) & 0xfu;
  const uint32_t m = v & 0x7u;
  if (e == 15 && m == 7) return bits_float(sign | 0x7fc00000u);
  if (e == 0) return bits_float(float_bits(float(m) * 0.001953125f) | sign);
  return bits_float(sign | ((e + 120u) << 23) | (m << 20));
}

/// Round half to even, identical on host and device.
KVQ_HOST_DEVICE float round_even(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return __builtin_rintf(x);
#endif
}

/// True when x is neither NaN nor Inf.
KVQ_HOST_DEVICE bool is_finite(float x) { return (float_bits(x) & 0x7f800000u) != 0x7f800000u; }

KVQ_NAMESPACE_END
