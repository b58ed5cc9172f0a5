#pragma once
// The split merge `merge_kernel`: the log-sum-exp merge of every split's partial result into the
// output rows, rotated back for a rotated head.
#include "attention/params.cuh"
#include "ptx.cuh"
#include "rotation.cuh"

#include <cub/block/block_reduce.cuh>

#include <cmath>
#include <type_traits>

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// The split merge: one block per output row (blockIdx.z: the row within its 16-row m-tile), two
// dependent rounds of loads: every split's max and sum at once (a thread per split), then the
// partial outputs, the warps taking the splits in turn and the lanes D / 32 channels each, with
// up to 8 loads in flight per lane; the warps' sums meet in shared memory. (A thread per output
// element walking the splits one dependent load at a time took 21 us of a 1 x 128K step: 49
// splits on 8 blocks.)
// `Rotated`: the instance for layers with rotated heads (the plain one stays as it is); `Replay`:
// the items from `attend_params::table` (a replayed step).
constexpr int merge_threads = 256;
template <int D, bool Rotated = false, bool Replay = false>
__global__ void __launch_bounds__(merge_threads) merge_kernel(const __grid_constant__ attend_params p) {
  pdl_wait();  // the attention grid's partials
  constexpr int warps = merge_threads / 32, per_lane = D / 32;
  using vec = std::conditional_t<per_lane % 4 == 0, float4, float2>;  // a lane's channels in 16- or 8-byte loads
  constexpr int vec_n = sizeof(vec) / sizeof(float);
  using block_reduce_t = cub::BlockReduce<float, merge_threads>;
  __shared__ typename block_reduce_t::TempStorage red;
  __shared__ float red_out, f_s[merge_threads];
  __shared__ __align__(16) float wo_sum[warps][D];
  const int h = blockIdx.y / p.mtiles, mt = blockIdx.y % p.mtiles, r = blockIdx.z;
  decode_item item;
  if (!load_item<Replay>(p, int(blockIdx.x), item)) return;
  const int rows_used = p.group * item.q_len;
  if (mt * 16 + r >= rows_used) return;
  if (r == 0 && p.q_stage && item.stage_row >= 0) {  // the canary's copy of this m-tile's query rows
    const int width = p.q_heads * D;
    if (Rotated && !p.q_rotated && head_rotated(p.rot, h)) {  // rotated here, a warp per row: the canary measures R q
      const int w = threadIdx.x / 32, ln = threadIdx.x % 32;
      for (int rr = w; rr < 16 && mt * 16 + rr < rows_used; rr += merge_threads / 32) {
        const int mm = mt * 16 + rr, i = mm / p.group, qh = h * p.group + mm % p.group;
        float x[D / 32];
#pragma unroll
        for (int c = 0; c < D / 32; ++c)
          x[c] = load_any(p.q, p.q_type, int64_t(item.q_row + i) * p.q_stride + int64_t(qh) * D + ln * (D / 32) + c);
        warp_rotate<D / 32>(x, ln, p.rot.seed, p.layer, h, false);
#pragma unroll
        for (int c = 0; c < D / 32; ++c) p.q_stage[int64_t(item.stage_row + i) * width + qh * D + ln * (D / 32) + c] = x[c];
      }
    } else {
      for (int idx = threadIdx.x; idx < 16 * D; idx += merge_threads) {
        const int mm = mt * 16 + idx / D, c = idx % D;
        if (mm >= rows_used) break;
        const int i = mm / p.group, qh = h * p.group + mm % p.group;
        p.q_stage[int64_t(item.stage_row + i) * width + qh * D + c] =
            load_any(p.q, p.q_type, int64_t(item.q_row + i) * p.q_stride + int64_t(qh) * D + c);
      }
    }
  }
  const int T = ceil_div(item.from_pages, p.unit_tokens) + ceil_div(item.n - item.from_pages, p.unit_tokens);
  // the item's splits (a sliding layer's sink split may be empty: from split 1 on), a prefill
  // chunk's part last
  const split_span sp = item_splits(p, T, item_skip(p, item));
  const int splits = sp.end - sp.first + p.extra_splits;
  const size_t part0 = ((size_t(blockIdx.x) * p.kv.kv_heads + h) * p.mtiles + mt) * p.max_splits + sp.first;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float2* ml = reinterpret_cast<const float2*>(p.ws_ml + (part0 * 16 + r) * 2);  // split s: ml[s * 16] (max, sum)
  const auto block_reduce = [&](float x, bool is_max) {  // the block's max or sum, in every thread
    __syncthreads();  // red's and red_out's previous readers are done
    x = is_max ? block_reduce_t(red).Reduce(x, [](float a, float b) { return fmaxf(a, b); }) : block_reduce_t(red).Sum(x);
    if (threadIdx.x == 0) red_out = x;
    __syncthreads();
    return red_out;
  };
  // (more than merge_threads splits: the maxima in a loop, then the splits in chunks)
  const float2 first = threadIdx.x < splits ? ml[size_t(threadIdx.x) * 16] : make_float2(-INFINITY, 0.f);
  float m = first.x;
  for (int s = threadIdx.x + merge_threads; s < splits; s += merge_threads) m = fmaxf(m, ml[size_t(s) * 16].x);
  m = block_reduce(m, true);
  float l = 0.f, acc[per_lane] = {};
  const float* wo = p.ws_o + (part0 * 16 + r) * D + lane * per_lane;  // split s: wo[s * 16 * D]
  for (int base = 0; base < splits; base += merge_threads) {
    const float2 e = base == 0 ? first : base + threadIdx.x < splits ? ml[size_t(base + threadIdx.x) * 16] : make_float2(-INFINITY, 0.f);
    const float f = e.x == -INFINITY ? 0.f : exp2f(e.x - m);
    l += f * e.y;
    if (base > 0) __syncthreads();  // f_s's previous readers are done
    f_s[threadIdx.x] = f;
    __syncthreads();
    const int n = min(merge_threads, splits - base);
#pragma unroll 8
    for (int s = warp; s < n; s += warps) {
      const float fs = f_s[s];
#pragma unroll
      for (int c = 0; c < per_lane; c += vec_n) {
        const vec x = *reinterpret_cast<const vec*>(wo + size_t(base + s) * 16 * D + c);
        acc[c] += fs * x.x, acc[c + 1] += fs * x.y;
        if constexpr (vec_n == 4) acc[c + 2] += fs * x.z, acc[c + 3] += fs * x.w;
      }
    }
  }
  l = block_reduce(l, false);
#pragma unroll
  for (int c = 0; c < per_lane; ++c) wo_sum[warp][lane * per_lane + c] = acc[c];
  __syncthreads();
  const int mm = mt * 16 + r, i = mm / p.group, qh = h * p.group + mm % p.group;
  const int64_t out = int64_t(item.q_row + i) * p.o_stride + int64_t(qh) * D;
  const bool rotated = Rotated && head_rotated(p.rot, h);
  const row_end end = end_row(m, l, p.sinks, qh);
  for (int c = threadIdx.x; c < D; c += merge_threads) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < warps; ++w) o += wo_sum[w][c];
    o = end.out(o);
    if (rotated) f_s[c] = o;  // (f_s's readers finished before the reductions' barriers)
    else store_any(p.o, p.o_type, out + c, o);
  }
  if (p.lse && threadIdx.x == 0) p.lse[int64_t(item.q_row + i) * p.q_heads + qh] = end.lse;
  if constexpr (Rotated) {
    if (!rotated) return;
    // A rotated head's output is R o: the first warp rotates it back (R^T) and stores it.
    __syncthreads();
    if (warp != 0) return;
    float x[per_lane];
#pragma unroll
    for (int c = 0; c < per_lane; ++c) x[c] = f_s[lane * per_lane + c];
    warp_rotate<per_lane>(x, lane, p.rot.seed, p.layer, h, true);
#pragma unroll
    for (int c = 0; c < per_lane; ++c) store_any(p.o, p.o_type, out + lane * per_lane + c, x[c]);
  }
}

// The prefill's merge `merge_rows_kernel`: a warp per output row, for calls with many rows and
// few splits (a prefill chunk: one or two prefix splits and the chunk's part). The lanes read
// every split's max and sum at once (32 splits a round), then each lane its D / 32 channels of
// every split's partial, and the warp rotates a rotated head's row back itself: no barrier, no
// shared memory. (`merge_kernel`'s block per row, built for decode's many splits over few rows,
// took 0.49 ms of every 4K-token chunk of a 32K prefill on the H200: 131,072 rows of 3 splits.)
// Grid (item, kv head x m-tile, 16 / merge_rows_warps), `merge_rows_warps` warps a block.
constexpr int merge_rows_warps = 4;
template <int D, bool Rotated = false>
__global__ void __launch_bounds__(merge_rows_warps * 32) merge_rows_kernel(const __grid_constant__ attend_params p) {
  pdl_wait();  // the attention grids' partials
  constexpr int per_lane = D / 32;
  using vec = std::conditional_t<per_lane % 4 == 0, float4, float2>;
  constexpr int vec_n = sizeof(vec) / sizeof(float);
  const int lane = threadIdx.x % 32, r = int(blockIdx.z) * merge_rows_warps + int(threadIdx.x) / 32;
  const int h = blockIdx.y / p.mtiles, mt = blockIdx.y % p.mtiles;
  const decode_item item = p.items[blockIdx.x];
  const int mm = mt * 16 + r;
  if (mm >= p.group * item.q_len) return;  // (warp-uniform)
  const int T = ceil_div(item.from_pages, p.unit_tokens) + ceil_div(item.n - item.from_pages, p.unit_tokens);
  const split_span sp = item_splits(p, T, item_skip(p, item));
  const int splits = sp.end - sp.first + p.extra_splits;  // (a prefill chunk's part last)
  const size_t part0 = ((size_t(blockIdx.x) * p.kv.kv_heads + h) * p.mtiles + mt) * p.max_splits + sp.first;
  const float2* ml = reinterpret_cast<const float2*>(p.ws_ml + (part0 * 16 + r) * 2);  // split s: ml[s * 16]
  const float* wo = p.ws_o + (part0 * 16 + r) * D + lane * per_lane;             // split s: wo[s * 16 * D]
  float m = -INFINITY;
  for (int s = lane; s < splits; s += 32) m = fmaxf(m, ml[size_t(s) * 16].x);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float l = 0.f, acc[per_lane] = {};
  for (int base = 0; base < splits; base += 32) {
    const float2 e = base + lane < splits ? ml[size_t(base + lane) * 16] : make_float2(-INFINITY, 0.f);
    const float f = e.x == -INFINITY ? 0.f : exp2f(e.x - m);
    l += f * e.y;
    const int n = min(32, splits - base);
    for (int s = 0; s < n; ++s) {
      const float fs = __shfl_sync(0xffffffffu, f, s);
#pragma unroll
      for (int c = 0; c < per_lane; c += vec_n) {
        const vec x = *reinterpret_cast<const vec*>(wo + size_t(base + s) * 16 * D + c);
        acc[c] += fs * x.x, acc[c + 1] += fs * x.y;
        if constexpr (vec_n == 4) acc[c + 2] += fs * x.z, acc[c + 3] += fs * x.w;
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) l += __shfl_xor_sync(0xffffffffu, l, o);
  const int i = mm / p.group, qh = h * p.group + mm % p.group;
  const row_end end = end_row(m, l, p.sinks, qh);
#pragma unroll
  for (int c = 0; c < per_lane; ++c) acc[c] = end.out(acc[c]);
  if constexpr (Rotated)  // a rotated head's output is R o: rotated back (R^T)
    if (head_rotated(p.rot, h)) warp_rotate<per_lane>(acc, lane, p.rot.seed, p.layer, h, true);
  const int64_t out = int64_t(item.q_row + i) * p.o_stride + int64_t(qh) * D + lane * per_lane;
#pragma unroll
  for (int c = 0; c < per_lane; ++c) store_any(p.o, p.o_type, out + c, acc[c]);
  if (p.lse && lane == 0) p.lse[int64_t(item.q_row + i) * p.q_heads + qh] = end.lse;
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
