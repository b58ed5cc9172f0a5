#pragma once
// The online-softmax step of the row-major tile loops (the tile kernel, the prefill's chunk and
// prefix kernels) and their O += P V: one warp's 16 query rows over NT n-tiles of 8 scores in
// the mma.sync accumulator layout (lane holds rows lane/4 and lane/4 + 8, columns 2 (lane % 4)
// and 2 (lane % 4) + 1).
#include <cuda_fp16.h>

#include "attention/dequant.cuh"
#include "ptx.cuh"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// A score soft-capped (`attention_variant::cap`) in the kernels' units: x raw (its scaled score is
// x scale), `scale_log2` the scale x log2(e) the softmax applies to it, `softcap_log2` the cap x
// log2(e) (> 0). Returns x' with x' scale = softcap tanh(x scale / softcap), tanh(u) as
// 1 - 2 / (e^(2u) + 1) by one MUFU exponential and a fast division: an absolute error of a few
// ulp of 1 (tanhf's code, unrolled over a tile's scores, made the prefill kernels spill;
// tanh.approx's 2^-11 relative error would be 0.02 of a logit at a cap of 50).
struct score_cap {
  float in, out;  // x' = out (1 - 2 / (2^(x in) + 1))
  __device__ __forceinline__ score_cap(float softcap_log2, float scale_log2)
      : in(2.f * scale_log2 / softcap_log2 * 1.4426950408889634f), out(softcap_log2 / scale_log2) {}
  __device__ __forceinline__ float operator()(float x) const {
    float e;
    asm volatile("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(e) : "f"(x * in));  // (in order: one score at a time)
    return out * (1.f - __fdividef(2.f, e + 1.f));
  }
};

// The sum (`Max`: the max) of x[0 .. N), N a power of two, as a tree (depth log2 N, where a chain
// of N - 1 dependent adds would wait on each one's latency); x is overwritten.
template <int N, bool Max = false>
__device__ __forceinline__ float tree_reduce(float (&x)[N]) {
#pragma unroll
  for (int w = N / 2; w >= 1; w /= 2)
#pragma unroll
    for (int i = 0; i < w; ++i) x[i] = Max ? fmaxf(x[i], x[i + w]) : x[i] + x[i + w];
  return x[0];
}

// 2^x on the MUFU unit (ex2.approx.ftz: about 2^-22 relative error, results below 2^-126 flushed
// to 0, -inf -> 0). Branch-free: `exp2f` adds a subnormal fix-up around each MUFU, and a select
// between it and a constant compiled to a branch around every pair of exponentials.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// `s`: the tile's raw scores, masked (-inf); `scale_log2`: the softmax scale in base 2 (> 0),
// applied here, inside each exponential's FFMA (2^(s x scale - max), FlashAttention's form: no
// separate scaling pass); `tile_max`: each of the lane's two rows' max over its own raw scores.
// Updates the rows' running max (scaled) and sum, rescales the output accumulators `acc`
// ([D/8][4], same layout) when the max moves, and leaves P as fp16 pairs in `pf` ([n-tile][row
// half]: the A fragments of O += P V). A row with every score so far masked keeps max -inf and
// exponentiates against 0, so its P, sum and output stay 0 (no inf - inf).
template <int NT, int D>
__device__ __forceinline__ void row_softmax_step(const float (&s)[NT][4], float scale_log2, float (&tile_max)[2],
                                                 float (&row_max)[2], float (&row_sum)[2], float (&acc)[D / 8][4],
                                                 uint32_t (&pf)[NT][2]) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    tile_max[hr] = fmaxf(tile_max[hr], __shfl_xor_sync(0xffffffffu, tile_max[hr], 1));
    tile_max[hr] = fmaxf(tile_max[hr], __shfl_xor_sync(0xffffffffu, tile_max[hr], 2));
    const float m_new = fmaxf(row_max[hr], tile_max[hr] * scale_log2);
    const float m_ref = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = fast_exp2(row_max[hr] - m_ref);
    row_max[hr] = m_new;
    row_sum[hr] *= alpha;
    if (__any_sync(0xffffffffu, alpha != 1.f)) {  // the running max rarely moves once settled
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        acc[j][2 * hr] *= alpha;
        acc[j][2 * hr + 1] *= alpha;
      }
    }
    float ps[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const float p0 = fast_exp2(fmaf(s[nt][2 * hr], scale_log2, -m_ref));
      const float p1 = fast_exp2(fmaf(s[nt][2 * hr + 1], scale_log2, -m_ref));
      ps[nt] = p0 + p1;
      pf[nt][hr] = h2_bits(__floats2half2_rn(p0, p1));
    }
    row_sum[hr] += tree_reduce<NT>(ps);
  }
}

// Stores one warp's 16 rows as a split's partial of the split merge (max, sum, unnormalized O, in
// base 2): `wo` [16][D], `wml` [16][2] (max, sum). The row sums are summed over each lane quad
// first.
template <int D>
__device__ __forceinline__ void store_warp_partial(float* wo, float* wml, const float (&acc)[D / 8][4],
                                                   const float (&row_max)[2], float (&row_sum)[2]) {
  const int lane = threadIdx.x % 32, r_lo = lane / 4;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    row_sum[hr] += __shfl_xor_sync(0xffffffffu, row_sum[hr], 1);
    row_sum[hr] += __shfl_xor_sync(0xffffffffu, row_sum[hr], 2);
  }
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) wo[(r_lo + (e / 2) * 8) * D + j * 8 + (lane % 4) * 2 + (e % 2)] = acc[j][e];
  if (lane % 4 == 0)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      wml[(r_lo + hr * 8) * 2] = row_max[hr];
      wml[(r_lo + hr * 8) * 2 + 1] = row_sum[hr];
    }
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
