#pragma once
// The randomized Hadamard rotation of one head row by a group of `Lanes` lanes of a warp (the
// callers all use the whole warp; rotation/hadamard.hpp): the group's lane l holds channels
// [l * PerLane, (l + 1) * PerLane), PerLane = head_dim / Lanes. The butterfly stages below
// PerLane run inside a lane, the others between the group's lanes by shuffles; each stage
// computes the same a + b and a - b as the host's `walsh_hadamard`, so the rows equal the CPU's
// bit for bit. Every lane of the warp must call (the shuffles span the warp). Used by the append
// kernels (K/V), the decode kernels' query columns (a column per warp), the query rotation of the
// tile kernel and the split merge (the output rotated back).
#include <kvq/cuda/paged_attention.hpp>
#include <kvq/rotation/hadamard.hpp>

#include <cuda_runtime.h>

#include <type_traits>

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// True when kv head h of a layer is rotated under `r`.
__device__ __forceinline__ bool head_rotated(const head_rotation& r, int h) { return (r.mask >> h) & 1u; }

// Walsh-Hadamard transform (unnormalized) of the group's row, in place; `lane`: this lane's index
// in its group.
template <int PerLane, int Lanes = 32>
__device__ __forceinline__ void warp_walsh_hadamard(float (&x)[PerLane], int lane) {
#pragma unroll
  for (int h = 1; h < PerLane; h <<= 1)
#pragma unroll
    for (int i = 0; i < PerLane; ++i)
      if ((i & h) == 0) {
        const float a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
#pragma unroll
  for (int lane_bit = 1; lane_bit < Lanes; lane_bit <<= 1) {
    const bool upper = lane & lane_bit;
#pragma unroll
    for (int i = 0; i < PerLane; ++i) {
      const float other = __shfl_xor_sync(0xffffffffu, x[i], lane_bit);
      x[i] = upper ? other - x[i] : x[i] + other;  // (a, b) -> (a + b, a - b)
    }
  }
}

// x <- R x (forward) or R^T x (inverse) of the group's row of d = Lanes * PerLane channels, for
// (layer, kv head) under `seed`; `lane`: this lane's index in its group.
template <int PerLane, int Lanes = 32>
__device__ __forceinline__ void warp_rotate(float (&x)[PerLane], int lane, uint64_t seed, int layer, int kv_head,
                                            bool inverse) {
  // The lane's channels lie in one sign word (PerLane <= 64, aligned): its bits, from bit 0 on.
  // (Indexing `rotation::signs` by the lane's channel would put its words in local memory.)
  const int c0 = lane * PerLane;
  const uint64_t flips = rotation::sign_word(seed, layer, kv_head, c0 >> 6) >> (c0 & 63);
  const auto sign = [&](float v, int i) { return (flips >> i) & 1u ? -v : v; };
  constexpr float n = rotation::inv_sqrt(Lanes * PerLane);
  if (!inverse)
#pragma unroll
    for (int i = 0; i < PerLane; ++i) x[i] = sign(x[i], i);
  warp_walsh_hadamard<PerLane, Lanes>(x, lane);
#pragma unroll
  for (int i = 0; i < PerLane; ++i) x[i] = inverse ? sign(x[i] * n, i) : x[i] * n;
}

// Calls f(std::integral_constant<int, PerLane>) for head_dim d (32, 64, 128 or 256).
template <class F>
__device__ __forceinline__ void with_per_lane(int d, F&& f) {
  switch (d) {
    case 32: f(std::integral_constant<int, 1>{}); break;
    case 64: f(std::integral_constant<int, 2>{}); break;
    case 128: f(std::integral_constant<int, 4>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
