#pragma once
// The definitions of attend_launch.hpp's launches for one head_dim: the decode kernel a plan
// names (per-warp staged or block-staged, with its fill variant and stage width), or the tile
// kernel, then the split merge. Included only by the per-head_dim translation units (attend_d*.cu).
#include "attention/attend_launch.hpp"
#include "attention/decode_paged.cuh"
#include "attention/decode_staged.cuh"
#include "attention/query.cuh"
#include "attention/tile_launch.cuh"
#include "launch.hpp"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {
namespace {

// The decode kernel `lp` names over `grid` (splits, kv heads, items): a 16-bit stage plan's Wide
// instances, the window and soft-capping code only in the `Rules` instances (`launch_plan::rules`),
// the 3-bit kinds' dispatch only in the Three instances (`launch_plan::three`).
// (A replayed step's kernels read its items from `p.table`: the same instances.)
template <int D, bool Rules>
auto decode_instance(const launch_plan& lp) {
  const bool w = lp.stage_cap == 16;
  if (lp.three)  // (3-bit pages among other formats, or in a per-warp plan: narrow stages, not Whole)
    return !lp.page_stage ? decode_kernel<D, false, Rules, true>
           : lp.two_full  ? decode_paged_kernel<D, true, false, false, Rules, true>
                          : decode_paged_kernel<D, false, false, false, Rules, true>;
  return !lp.page_stage ? (w ? decode_kernel<D, true, Rules> : decode_kernel<D, false, Rules>)
         : lp.two_full  ? (w ? decode_paged_kernel<D, true, false, true, Rules> : decode_paged_kernel<D, true, false, false, Rules>)
         : lp.whole     ? decode_paged_kernel<D, false, true, false, Rules>
         : w            ? decode_paged_kernel<D, false, false, true, Rules>
                        : decode_paged_kernel<D, false, false, false, Rules>;
}

template <int D>
status launch_decode(const char* what, const attend_params& p, const launch_plan& lp, dim3 grid, cudaStream_t st) {
  const auto kernel = lp.rules ? decode_instance<D, true>(lp) : decode_instance<D, false>(lp);
  // The shared-memory opt-in belongs to the current device: set before every launch.
  KVQ_TRY(set_max_dynamic_smem(kernel, lp.smem));
  return launch(what, kernel, grid, dim3(dec_warps * 32), size_t(lp.smem), st, p);
}

}  // namespace

template <int D>
status launch_attend_d(const attend_params& p, const launch_plan& lp, int kv_heads, int items, cudaStream_t st) {
  const dim3 mgrid(unsigned(items), unsigned(kv_heads * lp.mtiles), unsigned(lp.rows));
  if (lp.decode) {
    const dim3 grid(unsigned(lp.max_splits), unsigned(kv_heads), unsigned(items));
    KVQ_TRY((launch_decode<D>("attention launch", p, lp, grid, st)));
  } else {
    KVQ_TRY(launch_tile<D>("attention launch", p,
                           dim3(unsigned(lp.max_splits), unsigned(kv_heads * lp.mtiles), unsigned(items)), st));
  }
  return launch_merge<D>("merge launch", p, mgrid, st);
}

template <int D>
status launch_attend_replay_d(const attend_params& p, const launch_plan& lp, dim3 grid, dim3 mgrid, cudaStream_t st) {
  KVQ_TRY((launch_decode<D>("attention launch (replay)", p, lp, grid, st)));
  return launch_merge<D, true>("merge launch (replay)", p, mgrid, st);
}

template <int D>
status launch_rotate_query_d(const void* q, dtype q_type, int64_t q_stride, int rows, int q_heads, int group, int layer,
                             const head_rotation& rot, float* out, cudaStream_t st) {
  const int warps = rotate_query_threads / 32, blocks = (rows * q_heads + warps - 1) / warps;
  return launch("query rotation launch", rotate_query_kernel<D>, dim3(unsigned(blocks)), dim3(rotate_query_threads), 0,
                st, q, q_type, q_stride, rows, q_heads, group, layer, rot, out);
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
