#pragma once
// The vector building blocks of the CPU attention (src/cpu_attention.cpp,
// src/cpu_page_decode.cpp): plain loops written so that the compiler vectorizes them, and the
// attribute that compiles each kernel entry point twice.
//
// NOTE: runtime choice by GCC/Clang function multiversioning (`target_clones`): the library is
// built for baseline x86-64, and each kernel entry point gets an x86-64-v3 clone (AVX2 + FMA;
// AVX2 under Clang) picked at load time (ifunc) where the CPU has those features. Every helper below is always-inline, so it is compiled inside
// the clone that calls it and vectorized for that clone's instruction set. One set of C++ loops,
// no intrinsics: another architecture compiles the same code once, for its own baseline.

#include <kvq/config.hpp>
#include <kvq/format/numeric.hpp>

#include <bit>
#include <cstdint>

#if defined(__x86_64__) && defined(__clang__) && !defined(KVQ_NO_TARGET_CLONES)
#define KVQ_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__) && !defined(KVQ_NO_TARGET_CLONES)
// x86-64-v3: AVX2, FMA and F16C, chosen by feature (GCC's "arch=haswell" would test the CPU model
// and miss every later or AMD processor)
#define KVQ_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define KVQ_CPU_CLONES
#endif
#define KVQ_CPU_INLINE [[gnu::always_inline]] inline

KVQ_NAMESPACE_BEGIN
namespace cpu {

/// fp16 bits -> float, exact for every finite value (zero, subnormal, normal), branch-free: the
/// 15 magnitude bits moved into a float's exponent and mantissa give the value times 2^-112.
/// Infinity and NaN do not occur (stored values are finite).
KVQ_CPU_INLINE float half_to_float_finite(uint16_t h) {
  const float mag = std::bit_cast<float>(uint32_t(h & 0x7fffu) << 13) * 0x1p112f;
  return std::bit_cast<float>(std::bit_cast<uint32_t>(mag) | (uint32_t(h & 0x8000u) << 16));
}

/// Eight floats: one AVX2 register in the AVX2 clone, two SSE registers in the baseline one
/// (GCC/Clang vector extensions; element-wise operators, no intrinsics).
using f8 = float __attribute__((vector_size(32)));
using i8 = int32_t __attribute__((vector_size(32)));

KVQ_CPU_INLINE f8 load8(const float* p) {
  f8 x;
  __builtin_memcpy(&x, p, sizeof x);
  return x;
}
KVQ_CPU_INLINE void store8(float* p, f8 x) { __builtin_memcpy(p, &x, sizeof x); }
KVQ_CPU_INLINE f8 splat8(float x) { return f8{} + x; }
KVQ_CPU_INLINE float hsum8(f8 s) { return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7])); }

/// exp(x) lane-wise for x <= 0, relative error below 3e-7 down to x = -87 (below that it returns
/// exp(-87) ~ 1.6e-38 where exp gives less: a weight no sum of at least 1 can see).
KVQ_CPU_INLINE f8 exp8_nonpositive(f8 x) {
  x = x < -87.f ? splat8(-87.f) : x;
  const f8 n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // nearest integer
  f8 r = x - n * 0.693145751953125f;                                  // ln 2, high part
  r = r - n * 1.428606765330187045e-06f;                              // ln 2, low part
  f8 p = splat8(1.f / 720.f);
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const i8 e = (__builtin_convertvector(n, i8) + 127) << 23;
  f8 scale;
  __builtin_memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

/// exp(x) for one x <= 0, as `exp8_nonpositive`.
KVQ_CPU_INLINE float exp_nonpositive(float x) { return exp8_nonpositive(splat8(x))[0]; }

/// a . b over d channels (d a multiple of 8).
KVQ_CPU_INLINE float dot(const float* a, const float* b, int d) {
  f8 s = {};
  for (int c = 0; c < d; c += 8) s += load8(a + c) * load8(b + c);
  return hsum8(s);
}

/// q . k_t for four rows k_0..k_3 of a [.][d] tile starting at k (d a multiple of 8).
KVQ_CPU_INLINE void dot4(const float* q, const float* k, int d, float* out) {
  f8 s0 = {}, s1 = {}, s2 = {}, s3 = {};
  for (int c = 0; c < d; c += 8) {
    const f8 x = load8(q + c);
    s0 += x * load8(k + c);
    s1 += x * load8(k + d + c);
    s2 += x * load8(k + 2 * d + c);
    s3 += x * load8(k + 3 * d + c);
  }
  out[0] = hsum8(s0);
  out[1] = hsum8(s1);
  out[2] = hsum8(s2);
  out[3] = hsum8(s3);
}

}  // namespace cpu
KVQ_NAMESPACE_END
