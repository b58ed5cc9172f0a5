#pragma once
// Online softmax of the decode kernels: each warp's running max, sum and output accumulators per
// query column, the masked exponentials of a step's slabs, and the block's partial (split) result
// written for the split merge.
#include "attention/params.cuh"
#include "attention/row_softmax.cuh"
#include "ptx.cuh"

#include <climits>

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// A warp's running state of its query columns 2t, 2t+1: online-softmax max and sum, the output
// accumulators, the KIVI score offsets and the last token each column may see (causal within the
// step's queries).
template <int D>
struct column_state {
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float acc[D / 16][4];
  float cz[2] = {0.f, 0.f};
  int last_visible[2];
  int all_visible;  // the last token every column may see (warp-uniform)
  // (A sliding layer, `attend_params::window`: a column's first token is its last_visible -
  // window + 1, from the parameters where used, so that a global layer's loop holds no more
  // registers than before: the decode kernels run at their register cap.)
  __device__ column_state(const attend_params& p, const decode_item& item, int t) {
    const int q_first = item.n - item.q_len;
    all_visible = q_first;
    last_visible[0] = q_first + (2 * t) / p.group;
    last_visible[1] = q_first + (2 * t + 1) / p.group;
#pragma unroll
    for (int i = 0; i < D / 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  }
};

__device__ __forceinline__ float ex2(float x) {  // 2^x, one MUFU op (-inf -> 0)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Online softmax over S consecutive slabs' scores (S^T rows g, g + 8 of slab s in sc[4s..4s+3],
// columns 2t, 2t + 1): rows at or beyond `valid` (counted from the first slab's row 0) and tokens
// after a column's query are masked; the running max, sum and accumulators are updated once for
// the S slabs and P is left in `pv`. `rs`: per-row score scales (fp8 keys), `cz`: per-column
// score offsets (KIVI zeros).
// `p`: the layer's attention rule (a sliding window's first tokens, soft-capping), read from the
// parameters where used. Window = false: no window masks, Capped = false: no soft-capping code
// (the instances of layers without them, `launch_plan::rules`: the code made the plain decode
// loops spill, up to 10 % slower; and the whole-unit instance, which the plan never gives a
// soft-capped layer).
template <int D, int S, bool Window, bool Capped>
__device__ __forceinline__ void softmax_tiles(const attend_params& p, float (&sc)[4 * S], const float (&rs)[2 * S],
                                              float scale_log2, int tok0, int valid, int g, column_state<D>& cs,
                                              float (&pv)[4 * S]) {
  float(&m_col)[2] = cs.m;
  float(&l_col)[2] = cs.l;
  float(&acc)[D / 16][4] = cs.acc;
  const float(&cz)[2] = cs.cz;
  const int(&last_visible)[2] = cs.last_visible;
  // The scores stay unscaled (the softmax scale is positive: the max commutes with it); the scale
  // goes into the exponent's fma, and into the two columns' maxima.
  float tile_max[2] = {-INFINITY, -INFINITY};
  // A column sees the rows before `valid`, from its window's first token to its query's.
  const auto seen = [&](int i) {
    const int e = i % 4, row = slab * (i / 4) + g + (e / 2) * 8;
    if constexpr (!Window) return row < valid && tok0 + row <= last_visible[e % 2];
    const int w = p.window > 0 ? p.window - 1 : INT_MAX / 2;  // (window 0: every first token below 0)
    return row < valid && tok0 + row <= last_visible[e % 2] && tok0 + row >= last_visible[e % 2] - w;
  };
  if (Capped && p.softcap_log2 > 0.f) {  // (warp-uniform) a soft-capped layer: each score capped, then masked
    const score_cap cap(p.softcap_log2, scale_log2);
#pragma unroll
    for (int i = 0; i < 4 * S; ++i) {
      const float x = cap(sc[i] * rs[i / 2] + cz[i % 2]);
      sc[i] = seen(i) ? x : -INFINITY;
      tile_max[i % 2] = fmaxf(tile_max[i % 2], sc[i]);
    }
  } else if (valid >= slab * S && tok0 + slab * S - 1 <= cs.all_visible &&
             (!Window || p.window == 0 ||  // (warp-uniform) nothing to mask; a sliding layer's: every column's window holds tok0
              __all_sync(0xffffffffu, tok0 >= max(last_visible[0], last_visible[1]) - (p.window - 1)))) {
#pragma unroll
    for (int i = 0; i < 4 * S; ++i) {
      sc[i] = sc[i] * rs[i / 2] + cz[i % 2];
      tile_max[i % 2] = fmaxf(tile_max[i % 2], sc[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4 * S; ++i) {
      const float x = sc[i] * rs[i / 2] + cz[i % 2];
      sc[i] = seen(i) ? x : -INFINITY;
      tile_max[i % 2] = fmaxf(tile_max[i % 2], sc[i]);
    }
  }
  tile_max[0] *= scale_log2;
  tile_max[1] *= scale_log2;
  // The running max is raised only when a score exceeds it by more than `slack` (a warp vote
  // instead of a shuffle reduction per step): until then P = 2^(s - m) may reach 2^slack, far
  // inside fp16 P and fp32 sums, and the sums and accumulators keep their scale.
  constexpr float slack = 8.f;
  float alpha[2] = {1.f, 1.f};
  if (__any_sync(0xffffffffu, tile_max[0] > m_col[0] + slack || tile_max[1] > m_col[1] + slack)) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      tile_max[c] = fmaxf(tile_max[c], __shfl_xor_sync(0xffffffffu, tile_max[c], 4));
      tile_max[c] = fmaxf(tile_max[c], __shfl_xor_sync(0xffffffffu, tile_max[c], 8));
      tile_max[c] = fmaxf(tile_max[c], __shfl_xor_sync(0xffffffffu, tile_max[c], 16));
      const float m_new = fmaxf(m_col[c], tile_max[c]);
      alpha[c] = m_new == -INFINITY ? 1.f : ex2(m_col[c] - m_new);
      m_col[c] = m_new;
    }
  }
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < 4 * S; ++i) {
    pv[i] = m_col[i % 2] == -INFINITY ? 0.f : ex2(fmaf(sc[i], scale_log2, -m_col[i % 2]));
    sum[i % 2] += pv[i];
  }
  l_col[0] = l_col[0] * alpha[0] + sum[0];
  l_col[1] = l_col[1] * alpha[1] + sum[1];
  if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      acc[i][0] *= alpha[0];
      acc[i][1] *= alpha[1];
      acc[i][2] *= alpha[0];
      acc[i][3] *= alpha[1];
    }
  }
}

// Merges the block's warps and writes the block's partial (split) result. The caller has synced
// the block after the last use of the memory that `m` overlays.
template <int D>
__device__ __forceinline__ void write_partial(const attend_params& p, merge_area<D>& m, const column_state<D>& cs, bool has_work,
                                              int warp, int g, int t) {
  const float(&acc)[D / 16][4] = cs.acc;
  const float(&m_col)[2] = cs.m;
  const float(&l_col)[2] = cs.l;
  float l_tot[2] = {l_col[0], l_col[1]};
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    l_tot[c] += __shfl_xor_sync(0xffffffffu, l_tot[c], 4);
    l_tot[c] += __shfl_xor_sync(0xffffffffu, l_tot[c], 8);
    l_tot[c] += __shfl_xor_sync(0xffffffffu, l_tot[c], 16);
  }
#pragma unroll
  for (int i = 0; i < D / 16; ++i) {
    const int ch = (D / 8) * g + 2 * i;
    m.wo[warp][2 * t][ch] = has_work ? acc[i][0] : 0.f;
    m.wo[warp][2 * t + 1][ch] = has_work ? acc[i][1] : 0.f;
    m.wo[warp][2 * t][ch + 1] = has_work ? acc[i][2] : 0.f;
    m.wo[warp][2 * t + 1][ch + 1] = has_work ? acc[i][3] : 0.f;
  }
  if (g == 0)
    for (int c = 0; c < 2; ++c) {
      m.wml[warp][2 * t + c][0] = has_work ? m_col[c] : -INFINITY;
      m.wml[warp][2 * t + c][1] = has_work ? l_tot[c] : 0.f;
    }
  __syncthreads();
  const size_t part = (size_t(blockIdx.z) * p.kv.kv_heads + blockIdx.y) * p.max_splits + blockIdx.x;
  for (int idx = threadIdx.x; idx < 8 * D; idx += dec_warps * 32) {
    const int r = idx / D, c = idx % D;
    float mx = -INFINITY;
    for (int w = 0; w < dec_warps; ++w) mx = fmaxf(mx, m.wml[w][r][0]);
    float o = 0.f, l = 0.f;
    for (int w = 0; w < dec_warps; ++w) {
      const float mw = m.wml[w][r][0];
      const float f = mw == -INFINITY ? 0.f : exp2f(mw - mx);
      o += f * m.wo[w][r][c];
      l += f * m.wml[w][r][1];
    }
    p.ws_o[part * 16 * D + r * D + c] = o;
    if (c == 0) {
      p.ws_ml[(part * 16 + r) * 2] = mx;
      p.ws_ml[(part * 16 + r) * 2 + 1] = l;
    }
  }
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
