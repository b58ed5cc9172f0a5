#pragma once
// Host launches shared by the attention calls (attention/attend.cu) and the prefill calls
// (attention/prefill.cu): the tile kernel with its shared-memory opt-in, and the split merge as
// a programmatic dependent launch of the kernel before it.
#include <cuda_runtime.h>

#include "attention/attend_tile.cuh"
#include "attention/merge.cuh"
#include "launch.hpp"
#include "status.hpp"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

// The tile kernel over `grid` (split, kv head x m-tile, item). The shared-memory opt-in belongs
// to the current device: set before every launch.
template <int D>
status launch_tile(const char* what, const attend_params& p, dim3 grid, cudaStream_t st) {
  const int smem = int(sizeof(attend_smem<D>));
  KVQ_TRY(set_max_dynamic_smem(attend_kernel<D>, smem));
  return launch(what, attend_kernel<D>, grid, dim3(threads), size_t(smem), st, p);
}

// A merge kernel over `grid`, on sm_90+ a programmatic dependent launch of the attention kernel
// before it (`pdl_trigger` / `pdl_wait`), elsewhere in plain stream order.
template <class Kernel>
status launch_dependent(const char* what, Kernel kernel, dim3 grid, int block, const attend_params& p,
                        cudaStream_t st) {
  cudaLaunchAttribute pdl[1];
  pdl[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl[0].val.programmaticStreamSerializationAllowed = 1;
  int dev = 0, major = 0;
  KVQ_TRY(cuda_status(cudaGetDevice(&dev), "cudaGetDevice"));
  KVQ_TRY(
      cuda_status(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "cudaDeviceGetAttribute"));
  return launch(what, kernel, grid, dim3(block), 0, st, std::span<cudaLaunchAttribute>(pdl, major >= 9 ? 1 : 0), p);
}

// The split merge over `grid` (item, kv head x m-tile, row of the m-tile). `Replay`: the items
// from `attend_params::table`.
template <int D, bool Replay = false>
status launch_merge(const char* what, const attend_params& p, dim3 grid, cudaStream_t st) {
  const auto merge = p.rot.mask != 0 ? merge_kernel<D, true, Replay> : merge_kernel<D, false, Replay>;
  return launch_dependent(what, merge, grid, merge_threads, p, st);
}

// The prefill's merge, a warp per row (`merge_rows_kernel`) over `items` items of `p.mtiles`
// m-tiles per kv head.
template <int D>
status launch_merge_rows(const char* what, const attend_params& p, int items, cudaStream_t st) {
  const auto merge = p.rot.mask != 0 ? merge_rows_kernel<D, true> : merge_rows_kernel<D, false>;
  const dim3 grid(unsigned(items), unsigned(p.kv.kv_heads * p.mtiles), unsigned(16 / merge_rows_warps));
  return launch_dependent(what, merge, grid, merge_rows_warps * 32, p, st);
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
