#pragma once
// Kernel launches that report their own error only. A `<<<...>>>` launch reports through
// `cudaGetLastError`, which also returns (and clears) an error the engine's own work left pending
// on the thread, making it kvq's; `cudaLaunchKernelEx` returns the error of this launch alone.
#include "status.hpp"

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

/// Launches `kernel<<<grid, block, smem, stream>>>(args...)`; the status names the launch (`what`)
/// and carries its error, nothing else's.
template <class... Params, class... Args>
status launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, const char* what,
              Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  return cuda_status(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...), what);
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
