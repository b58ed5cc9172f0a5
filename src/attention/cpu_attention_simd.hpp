#pragma once
// The vector building blocks of the CPU attention (src/attention/cpu_attention.cpp,
// src/attention/cpu_page_decode.cpp): plain loops written so that the compiler vectorizes them, and the
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

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(KVQ_NO_TARGET_CLONES) && \
    !defined(__CUDACC__)
#include <cpuid.h>
#include <immintrin.h>
#define KVQ_CPU_F16C 1
#endif

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

#if KVQ_CPU_F16C
/// `halves_to_floats` with F16C (eight values per instruction); called only where the CPU has it.
__attribute__((target("avx2,f16c"))) inline void halves_to_floats_f16c(const uint16_t* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
  for (; i < n; ++i) out[i] = half_to_float_finite(x[i]);
}
#endif

/// n finite fp16 values -> float: the F16C conversion where the CPU has it (the one place with
/// an intrinsic: compilers do not emit the 8-wide conversion from portable code), else
/// `half_to_float_finite`.
inline void halves_to_floats(const uint16_t* x, float* out, int64_t n) {
#if KVQ_CPU_F16C
  // F16C from CPUID leaf 1 (Clang's __builtin_cpu_supports does not know "f16c"), asked once
  static const bool f16c = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __builtin_cpu_supports("avx2") && __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
  }();
  if (f16c) return halves_to_floats_f16c(x, out, n);
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = half_to_float_finite(x[i]);
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
KVQ_CPU_INLINE f8 splat8(float x) {
  const f8 one = {x};  // lane 0, then broadcast (one vbroadcastss in the AVX2 build)
  return __builtin_shufflevector(one, one, 0, 0, 0, 0, 0, 0, 0, 0);
}
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

/// Lane-pair sums of a and b: [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7].
KVQ_CPU_INLINE f8 hadd_pairs(f8 a, f8 b) {
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

/// Eight horizontal sums at once: lane j of the result is the sum of s[j]'s lanes.
KVQ_CPU_INLINE f8 hsum8x8(const f8* s) {
  const f8 w0 = hadd_pairs(hadd_pairs(s[0], s[1]), hadd_pairs(s[2], s[3]));
  const f8 w1 = hadd_pairs(hadd_pairs(s[4], s[5]), hadd_pairs(s[6], s[7]));
  return __builtin_shufflevector(w0, w1, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(w0, w1, 4, 5, 6, 7, 12, 13, 14, 15);
}

/// q . k_j for eight rows k_0..k_7 of a [.][d] tile starting at k (d a multiple of 8): eight
/// independent accumulators, reduced together.
KVQ_CPU_INLINE f8 dot8(const float* q, const float* k, int d) {
  f8 s[8] = {};
  for (int c = 0; c < d; c += 8) {
    const f8 x = load8(q + c);
    for (int j = 0; j < 8; ++j) s[j] += x * load8(k + int64_t(j) * d + c);
  }
  return hsum8x8(s);
}

/// Lane-wise maximum.
KVQ_CPU_INLINE f8 max8(f8 a, f8 b) { return a > b ? a : b; }
KVQ_CPU_INLINE float hmax8(f8 s) {
  float m = s[0];
  for (int j = 1; j < 8; ++j) m = s[j] > m ? s[j] : m;
  return m;
}

}  // namespace cpu
KVQ_NAMESPACE_END
