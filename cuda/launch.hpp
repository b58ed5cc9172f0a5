#pragma once
// Every kernel launch of kvq goes through `launch`: the runtime's launch call itself
// (cudaLaunchKernel, or cudaLaunchKernelEx where launch attributes are needed), whose return value
// is the error of that launch alone. kvq never calls cudaGetLastError (which would clear, and
// report as kvq's, an error the engine has not read yet) and never peeks at it. The launch also
// honours the test hook of include/kvq/cuda/testing.hpp (a chosen launch fails without running).
#include <cuda_runtime.h>

#include <kvq/cuda/testing.hpp>
#include <memory>
#include <span>
#include <type_traits>

#include "status.hpp"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

/// True when the test hook makes this launch fail (it counts every launch of the thread).
bool injected_launch_failure();

/// Allows `kernel` `bytes` of dynamic shared memory on the current device, through the driver's
/// cuFuncSetAttribute (the runtime's cudaFuncSetAttribute resets the thread's last error, so an
/// error the engine has not read yet would be lost: measured on the H200, docs/decisions.md
/// "CUDA hygiene").
status set_max_dynamic_smem(const void* kernel, int bytes);
template <class... P>
status set_max_dynamic_smem(void (*kernel)(P...), int bytes) {
  return set_max_dynamic_smem(reinterpret_cast<const void*>(kernel), bytes);
}

/// Launches `kernel(args...)` on `stream` with `attrs` (may be empty); a failed launch (or an
/// injected one) is `errc::cuda_error` naming `what`, and nothing is queued. Each argument must
/// have its parameter's type: the launch passes their addresses, without copies.
/// NOTE: without attributes it calls cudaLaunchKernel, the call `<<<>>>` makes; cudaLaunchKernelEx
/// measured 14-27 % slower on an idle-GPU append (docs/decisions.md, "CUDA hygiene").
template <class... P, class... A>
status launch(const char* what, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
              std::span<cudaLaunchAttribute> attrs, A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "one argument per kernel parameter");
  static_assert((std::is_same_v<std::remove_cvref_t<P>, std::remove_cvref_t<A>> && ...),
                "each argument has its parameter's type (no conversion at launch)");
  if (injected_launch_failure())
    return {errc::cuda_error, msg(what, ": launch failed (injected by cuda::testing::fail_launch)")};
  void* ptrs[] = {const_cast<void*>(static_cast<const void*>(std::addressof(args)))...};
  const void* fn = reinterpret_cast<const void*>(kernel);
  if (attrs.empty()) return cuda_status(cudaLaunchKernel(fn, grid, block, ptrs, smem, stream), what);
  cudaLaunchConfig_t c = {};
  c.gridDim = grid;
  c.blockDim = block;
  c.dynamicSmemBytes = smem;
  c.stream = stream;
  c.attrs = attrs.data();
  c.numAttrs = unsigned(attrs.size());
  return cuda_status(cudaLaunchKernelExC(&c, fn, ptrs), what);
}

/// `launch` without attributes.
template <class... P, class... A>
status launch(const char* what, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
              A&&... args) {
  return launch(what, kernel, grid, block, smem, stream, std::span<cudaLaunchAttribute>{}, std::forward<A>(args)...);
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
