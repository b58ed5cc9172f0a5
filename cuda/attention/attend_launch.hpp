#pragma once
// The attention launches of one head_dim, declared for the host glue (attention/attend.cu) and
// defined per head_dim in their own translation units (attend_d64.cu, attend_d128.cu,
// attend_d256.cu, over attend_launch.cuh): each head_dim's kernels compile in parallel, and a
// change to one rebuilds only its own.
#include <cuda_runtime.h>

#include "launch_plan.hpp"
#include "status.hpp"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

struct attend_params;

/// The head_dims the CUDA attention kernels are compiled for.
constexpr int attention_head_dims[] = {64, 128, 256};
constexpr bool attention_head_dim(int d) { return d == 64 || d == 128 || d == 256; }

/// The attention kernel `lp` names over a part of `items` items, then the split merge.
template <int D>
status launch_attend_d(const attend_params& p, const launch_plan& lp, int kv_heads, int items, cudaStream_t st);

/// The replayed instances (items from `p.table`) of the decode kernel and merge over the fixed grids.
template <int D>
status launch_attend_replay_d(const attend_params& p, const launch_plan& lp, dim3 grid, dim3 mgrid, cudaStream_t st);

/// The query rotation of a tile-kernel call with rotated heads (query.cuh, `rotate_query_kernel`).
template <int D>
status launch_rotate_query_d(const void* q, dtype q_type, int64_t q_stride, int rows, int q_heads, int group, int layer,
                             const head_rotation& rot, float* out, cudaStream_t st);

/// `f.template operator()<D>()` for the compiled head_dim `d` (`attention_head_dim(d)` holds).
template <class F>
decltype(auto) with_head_dim(int d, F&& f) {
  if (d == 256) return f.template operator()<256>();
  if (d == 128) return f.template operator()<128>();
  return f.template operator()<64>();
}

#define KVQ_ATTEND_INSTANTIATE(D)                                                                                    \
  template status launch_attend_d<D>(const attend_params&, const launch_plan&, int, int, cudaStream_t);             \
  template status launch_attend_replay_d<D>(const attend_params&, const launch_plan&, dim3, dim3, cudaStream_t);    \
  template status launch_rotate_query_d<D>(const void*, dtype, int64_t, int, int, int, int, const head_rotation&, \
                                           float*, cudaStream_t);

}  // namespace cuda::detail
KVQ_NAMESPACE_END
