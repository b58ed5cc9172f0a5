#pragma once
// The decode kernels' query: the block's query columns as MMA B fragments, their fp16 copy in
// shared memory, the KIVI key fold (a token group's channel scales into q, its zeros into one
// score offset per column), and the rotation of the queries of rotated heads.
#include "attention/dequant.cuh"
#include "attention/params.cuh"
#include "rotation.cuh"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// The block's query columns as MMA B fragments: column n is query n / group of head
// h * group + n % group; lane (g, t) holds column g, the pairs of its channels [(D/4) t, (D/4)(t+1)).
// Unrotated heads (or queries the call rotated already, `attend_params::q_rotated`); a rotated
// head's columns come from `rotate_query_columns`.
template <int D>
__device__ __forceinline__ void load_query(const attend_params& p, const decode_item& item, int h, int g, int t,
                                           uint32_t (&qb)[D / 8]) {
  const bool live = g < p.group * item.q_len;
  const int i = g / p.group, qh_i = h * p.group + g % p.group;
  const int64_t base = int64_t(item.q_row + i) * p.q_stride + int64_t(qh_i) * D + t * (D / 4);
#pragma unroll
  for (int c = 0; c < D / 8; ++c)
    qb[c] = h2_bits(__floats2half2_rn(live ? load_any(p.q, p.q_type, base + 2 * c) : 0.f,
                                      live ? load_any(p.q, p.q_type, base + 2 * c + 1) : 0.f));
}

// A rotated head's query columns R q, written in fp16 into `qh` (the layout `put_query` writes,
// 0 for columns past the block's queries): warp w rotates columns w, w + warps, ..., a column
// across the whole warp (D / 32 channels a lane). The caller syncs the block before reading qh.
// (Each warp rotating all 8 columns itself, a quad per column with D / 4 channels a lane, cost
// every warp about 650 instructions: 1-4 us of a short decode step, 3 % of 8 x 128K.)
template <int D>
__device__ __forceinline__ void rotate_query_columns(const attend_params& p, const decode_item& item, int h, int warp,
                                                     int warps, int lane, uint4 (&qh)[D / 32][32]) {
  constexpr int per_lane = D / 32;
  uint32_t* words = reinterpret_cast<uint32_t*>(&qh[0][0]);
  for (int n = warp; n < 8; n += warps) {  // (warp-uniform: every lane takes part in the shuffles)
    const bool live = n < p.group * item.q_len;
    const int i = n / p.group, qh_i = h * p.group + n % p.group;
    const int64_t base = int64_t(item.q_row + i) * p.q_stride + int64_t(qh_i) * D + lane * per_lane;
    float x[per_lane];
#pragma unroll
    for (int c = 0; c < per_lane; ++c) x[c] = live ? load_any(p.q, p.q_type, base + c) : 0.f;
    if (live) warp_rotate<per_lane>(x, lane, p.rot.seed, p.layer, h, false);
    // channel pair c0 / 2 of column n: fragment lane n x 4 + c0 / (D / 4), its pair k = (c0 mod D / 4) / 2
#pragma unroll
    for (int j = 0; j < per_lane / 2; ++j) {
      const int c0 = lane * per_lane + 2 * j, k = (c0 % (D / 4)) / 2;
      words[((k / 4) * 32 + n * 4 + c0 / (D / 4)) * 4 + k % 4] = h2_bits(__floats2half2_rn(x[2 * j], x[2 * j + 1]));
    }
  }
}

// Each lane's query fragments kept in shared memory for re-scaling, as [D / 32][lane] 16-byte
// words: one conflict-free 16-byte load per 4 fragments ([fragment][lane] words took one 4-byte
// load each).
template <int D>
__device__ __forceinline__ void put_query(uint4 (&qh)[D / 32][32], int lane, const uint32_t (&qb)[D / 8]) {
#pragma unroll
  for (int i = 0; i < D / 32; ++i) qh[i][lane] = make_uint4(qb[4 * i], qb[4 * i + 1], qb[4 * i + 2], qb[4 * i + 3]);
}
template <int D>
__device__ __forceinline__ void get_query(const uint4 (&qh)[D / 32][32], int lane, uint32_t (&qb)[D / 8]) {
#pragma unroll
  for (int i = 0; i < D / 32; ++i) {
    const uint4 v = qh[i][lane];
    qb[4 * i] = v.x, qb[4 * i + 1] = v.y, qb[4 * i + 2] = v.z, qb[4 * i + 3] = v.w;
  }
}

// The query for a KIVI key slab: the token group's channel scales fold into q (q' = q s) and the
// centered zeros (z + s 2^(b-1)) into one score offset per column, itself an MMA of the zero row
// with q. `scales`/`zeros`: the group's D halves each (any memory).
//
// Sub (keys read as subnormal codes, `k_frags_sub<D, Bits>`): q' takes the keys' pair order, and
// the codes are not centered, so the offset also takes -2^(b-1) sum_c q'_c, the sum of the fp16
// q' the keys' MMAs use (one more MMA per k-step): the scores then equal the centered ones up to
// fp32 rounding. (Without it, the fp16 rounding errors of q' meet codes 0..2^b - 1 instead of
// -2^(b-1)..2^(b-1) - 1: the kivi4 d64 NMSE of the GPU tests rose about 3x, past the bound.)
template <int D, int Sub = 0>
__device__ __forceinline__ void fold_kivi(const uint8_t* scales, const uint8_t* zeros, int bits, const uint4 (&qh)[D / 32][32],
                                          int lane, int t, uint32_t (&qb)[D / 8], float (&cz_col)[2]) {
  uint32_t sw[D / 8], zw[D / 8];
  ldg_words<D / 2, false>(scales + t * (D / 4) * 2, sw);
  ldg_words<D / 2, false>(zeros + t * (D / 4) * 2, zw);
  const __half2 mid = __float2half2_rn(float(1 << (bits - 1)));
  float cz[4] = {0.f, 0.f, 0.f, 0.f}, cq[4] = {0.f, 0.f, 0.f, 0.f};
  const uint32_t neg_mid = h2_bits(__hneg2(mid));
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const uint32_t z0 = h2_bits(__hfma2(bits_h2(sw[2 * ks]), mid, bits_h2(zw[2 * ks])));
    const uint32_t z1 = h2_bits(__hfma2(bits_h2(sw[2 * ks + 1]), mid, bits_h2(zw[2 * ks + 1])));
    const uint4 q4 = qh[ks / 2][lane];
    const uint32_t q0 = ks % 2 ? q4.z : q4.x, q1 = ks % 2 ? q4.w : q4.y;
    mma16816(cz, z0, 0u, z1, 0u, q0, q1);  // (rows g + 8 unused)
    qb[2 * ks] = h2_bits(__hmul2(bits_h2(q0), bits_h2(sw[2 * ks])));
    qb[2 * ks + 1] = h2_bits(__hmul2(bits_h2(q1), bits_h2(sw[2 * ks + 1])));
    if constexpr (Sub > 0) mma16816(cq, neg_mid, 0u, neg_mid, 0u, qb[2 * ks], qb[2 * ks + 1]);
  }
  if constexpr (Sub > 0) cz[0] += cq[0], cz[1] += cq[1];
  if constexpr (Sub > 0) {  // plain pairs (2k, 2k + 1) of a word's n channels -> (c, c + n / 2), `k_frags_sub`
    constexpr int np = 16 / Sub;  // plain pairs per word
#pragma unroll
    for (int w = 0; w < D * Sub / 128; ++w) {
      uint32_t pp[np];
#pragma unroll
      for (int k = 0; k < np; ++k) pp[k] = qb[np * w + k];
#pragma unroll
      for (int b = 0; b < np / 4; ++b) {
        qb[np * w + 4 * b] = __byte_perm(pp[2 * b], pp[2 * b + np / 2], 0x5410);
        qb[np * w + 4 * b + 1] = __byte_perm(pp[2 * b + 1], pp[2 * b + 1 + np / 2], 0x5410);
        qb[np * w + 4 * b + 2] = __byte_perm(pp[2 * b], pp[2 * b + np / 2], 0x7632);
        qb[np * w + 4 * b + 3] = __byte_perm(pp[2 * b + 1], pp[2 * b + 1 + np / 2], 0x7632);
      }
    }
  }
  cz_col[0] = cz[0], cz_col[1] = cz[1];
}

// The queries of a tile-kernel call with rotated heads as fp32 into the workspace, which the
// tile kernel then reads: one warp per (row, query head); the heads of a rotated kv head get R q
// (docs/architecture.md, "Rotation"), the others are copied. One small launch for the batch,
// before the attention kernel (the decode kernels rotate in their prologue instead,
// `rotate_query_columns`).
constexpr int rotate_query_threads = 128;
template <int D>
__global__ void __launch_bounds__(rotate_query_threads)
    rotate_query_kernel(const void* q, dtype q_type, int64_t q_stride, int rows, int q_heads, int group, int layer,
                        head_rotation rot, float* out /* [rows][q_heads][D] */) {
  constexpr int per_lane = D / 32;
  const int lane = threadIdx.x % 32, w = blockIdx.x * (rotate_query_threads / 32) + threadIdx.x / 32;
  if (w >= rows * q_heads) return;  // (warp-uniform)
  const int row = w / q_heads, qh = w % q_heads, kvh = qh / group;
  float x[per_lane];
#pragma unroll
  for (int i = 0; i < per_lane; ++i) x[i] = load_any(q, q_type, int64_t(row) * q_stride + int64_t(qh) * D + lane * per_lane + i);
  if (head_rotated(rot, kvh)) warp_rotate<per_lane>(x, lane, rot.seed, layer, kvh, false);
#pragma unroll
  for (int i = 0; i < per_lane; ++i) out[(int64_t(row) * q_heads + qh) * D + lane * per_lane + i] = x[i];
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
