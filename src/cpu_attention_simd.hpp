#pragma once
// The vector building blocks of the CPU attention (src/cpu_attention.cpp,
// src/cpu_page_decode.cpp): plain loops written so that the compiler vectorizes them, and the
// attribute that compiles each kernel entry point twice.
//
// NOTE: runtime choice by GCC/Clang function multiversioning (`target_clones`): the library is
// built for baseline x86-64, and each kernel entry point gets an AVX2 clone picked at load time
// (ifunc) where the CPU has AVX2. Every helper below is always-inline, so it is compiled inside
// the clone that calls it and vectorized for that clone's instruction set. One set of C++ loops,
// no intrinsics: another architecture compiles the same code once, for its own baseline.

#include <kvq/config.hpp>
#include <kvq/format/numeric.hpp>

#include <bit>
#include <cstdint>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__) && \
    !defined(KVQ_NO_TARGET_CLONES)
#define KVQ_CPU_CLONES __attribute__((target_clones("avx2", "default")))
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

/// exp(x) for x <= 0, relative error below 3e-7 down to x = -87 (below that it returns
/// exp(-87) ~ 1.6e-38 where exp gives less: a weight no sum of at least 1 can see).
KVQ_CPU_INLINE float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // nearest integer
  float r = x - n * 0.693145751953125f;                                     // ln 2, high part
  r = r - n * 1.428606765330187045e-06f;                                    // ln 2, low part
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  return p * std::bit_cast<float>(uint32_t(int(n) + 127) << 23);
}

/// a . b over d channels (d a multiple of 8), eight independent partial sums.
KVQ_CPU_INLINE float dot(const float* a, const float* b, int d) {
  float acc[8] = {};
  for (int c = 0; c < d; c += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[c + j] * b[c + j];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

}  // namespace cpu
KVQ_NAMESPACE_END
