#pragma once
// Every kernel launch of kvq goes through `launch`: cudaLaunchKernelEx, whose return value is the
// error of that launch alone. kvq never calls cudaGetLastError (which would clear, and report as
// kvq's, an error the engine has not read yet) and never peeks at it. The launch also honours the
// test hook of include/kvq/cuda/testing.hpp (a chosen launch fails without running).
#include <cuda_runtime.h>

#include <kvq/cuda/testing.hpp>
#include <span>

#include "status.hpp"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

/// True when the test hook makes this launch fail (it counts every launch of the thread).
bool injected_launch_failure();

/// Launches `kernel(args...)` on `stream` with `attrs` (may be empty); a failed launch (or an
/// injected one) is `errc::cuda_error` naming `what`. Nothing is queued when it fails.
template <class... P, class... A>
status launch(const char* what, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
              std::span<cudaLaunchAttribute> attrs, A&&... args) {
  if (injected_launch_failure())
    return {errc::cuda_error, msg(what, ": launch failed (injected by cuda::testing::fail_launch)")};
  cudaLaunchConfig_t c = {};
  c.gridDim = grid;
  c.blockDim = block;
  c.dynamicSmemBytes = smem;
  c.stream = stream;
  c.attrs = attrs.data();
  c.numAttrs = unsigned(attrs.size());
  return cuda_status(cudaLaunchKernelEx(&c, kernel, std::forward<A>(args)...), what);
}

/// `launch` without attributes.
template <class... P, class... A>
status launch(const char* what, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
              A&&... args) {
  return launch(what, kernel, grid, block, smem, stream, std::span<cudaLaunchAttribute>{}, std::forward<A>(args)...);
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
