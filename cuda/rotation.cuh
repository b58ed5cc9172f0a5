#pragma once
// The randomized Hadamard rotation of one head row by one warp (rotation/hadamard.hpp): lane l
// holds channels [l * PerLane, (l + 1) * PerLane), PerLane = head_dim / 32 (1 to 8). The
// butterfly stages below PerLane run inside a lane, the others between lanes by shuffles; each
// stage computes the same a + b and a - b as the host's `walsh_hadamard`, so the rows equal the
// CPU's bit for bit. Used by the append kernels (K/V), the query rotation and the split merge
// (the output rotated back).
#include <kvq/cuda/paged_attention.hpp>
#include <kvq/rotation/hadamard.hpp>

#include <cuda_runtime.h>

#include <type_traits>

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// True when kv head h of a layer is rotated under `r`.
__device__ __forceinline__ bool head_rotated(const head_rotation& r, int h) { return (r.mask >> h) & 1u; }

// Walsh-Hadamard transform (unnormalized) of the warp's row, in place.
template <int PerLane>
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
  for (int lane_bit = 1; lane_bit < 32; lane_bit <<= 1) {
    const bool upper = lane & lane_bit;
#pragma unroll
    for (int i = 0; i < PerLane; ++i) {
      const float other = __shfl_xor_sync(0xffffffffu, x[i], lane_bit);
      x[i] = upper ? other - x[i] : x[i] + other;  // (a, b) -> (a + b, a - b)
    }
  }
}

// x <- R x (forward) or R^T x (inverse) of the warp's row of d = 32 * PerLane channels, for
// (layer, kv head) under `seed`.
template <int PerLane>
__device__ __forceinline__ void warp_rotate(float (&x)[PerLane], int lane, uint64_t seed, int layer, int kv_head,
                                            bool inverse) {
  const rotation::signs s = rotation::signs::of(seed, layer, kv_head);
  constexpr float n = rotation::inv_sqrt(32 * PerLane);
  if (!inverse)
#pragma unroll
    for (int i = 0; i < PerLane; ++i) x[i] = s.apply(x[i], lane * PerLane + i);
  warp_walsh_hadamard<PerLane>(x, lane);
#pragma unroll
  for (int i = 0; i < PerLane; ++i) x[i] = inverse ? s.apply(x[i] * n, lane * PerLane + i) : x[i] * n;
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
