#pragma once
/// \file
/// The randomized Hadamard rotation along head_dim, host and device (docs/architecture.md,
/// "Rotation").
///
/// For a (layer, kv head) with seed s the rotation is R = H·D/√d: D flips the sign of channel c
/// when bit c of the head's sign words is set, H is the Sylvester Hadamard matrix of order d (d a
/// power of two), applied by the fast Walsh-Hadamard transform in log2(d) butterfly stages. R is
/// orthogonal, so (R q)·(R k) = q·k and an attention output over rotated values is R times the
/// unrotated one; the inverse is R^T = D·H/√d. An outlier channel of K is spread over every
/// channel, so a quantization group's range stops being set by one channel.
///
/// The arithmetic is fixed (sign flip, the butterflies in the order below, one multiply by
/// 1/√d at the end), so the host and the CUDA kernels produce the same floats bit for bit.

#include <kvq/config.hpp>

#include <cstdint>

KVQ_NAMESPACE_BEGIN
namespace rotation {

/// The seed a cache uses unless its configuration gives another.
inline constexpr uint64_t default_seed = 0x6b76712d726f7461ull;

/// True when `d` is a power of two (the Hadamard transform's order), d >= 1.
KVQ_HOST_DEVICE constexpr bool is_power_of_two(int d) { return d > 0 && (d & (d - 1)) == 0; }

/// SplitMix64's finalizer: a bijective 64-bit mix, the counter-based source of the signs.
KVQ_HOST_DEVICE constexpr uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/// Sign word `w` (channels 64w .. 64w+63; bit set = flip) of (layer, kv head) under `seed`.
KVQ_HOST_DEVICE constexpr uint64_t sign_word(uint64_t seed, int layer, int kv_head, int w) {
  const uint64_t head = mix64(seed ^ mix64((uint64_t(uint32_t(layer)) << 32) | uint32_t(kv_head)));
  return mix64(head + uint64_t(w) * 0x9e3779b97f4a7c15ull);
}

/// The sign words of one (layer, kv head): the D of R = H·D/√d for head_dim up to 256.
struct signs {
  uint64_t w[4] = {};

  /// Signs of (layer, kv head) under `seed`.
  static KVQ_HOST_DEVICE constexpr signs of(uint64_t seed, int layer, int kv_head) {
    signs s;
    for (int i = 0; i < 4; ++i) s.w[i] = sign_word(seed, layer, kv_head, i);
    return s;
  }
  /// True when channel c (< 256) is flipped.
  KVQ_HOST_DEVICE constexpr bool flip(int c) const { return (w[c >> 6] >> (c & 63)) & 1u; }
  /// x with its sign flipped when channel c is.
  KVQ_HOST_DEVICE constexpr float apply(float x, int c) const { return flip(c) ? -x : x; }
};

/// 1/√d of a power of two d, exact in its float rounding (the same constant on host and device).
KVQ_HOST_DEVICE constexpr float inv_sqrt(int d) {
  float v = 1.0f;
  int k = 0;
  while ((1 << k) < d) ++k;
  for (int i = 0; i < k / 2; ++i) v *= 0.5f;
  return (k & 1) ? v * 0.70710678118654752f : v;
}

/// Unnormalized Walsh-Hadamard transform of x [d] in place (d a power of two): stage h pairs
/// channel i with i + h inside blocks of 2h, (a, b) -> (a + b, a - b), h = 1, 2, ..., d/2.
KVQ_HOST_DEVICE void walsh_hadamard(float* x, int d) {
  for (int h = 1; h < d; h <<= 1)
    for (int i = 0; i < d; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}

/// x <- R x = H·D·x/√d, in place; x [d], d a power of two <= 256.
KVQ_HOST_DEVICE void rotate(float* x, int d, const signs& s) {
  for (int c = 0; c < d; ++c) x[c] = s.apply(x[c], c);
  walsh_hadamard(x, d);
  const float n = inv_sqrt(d);
  for (int c = 0; c < d; ++c) x[c] *= n;
}

/// x <- R^T x = D·H·x/√d, in place: the inverse of `rotate`.
KVQ_HOST_DEVICE void unrotate(float* x, int d, const signs& s) {
  walsh_hadamard(x, d);
  const float n = inv_sqrt(d);
  for (int c = 0; c < d; ++c) x[c] = s.apply(x[c] * n, c);
}

}  // namespace rotation
KVQ_NAMESPACE_END
