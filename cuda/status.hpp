#pragma once
// Host helpers of the CUDA sources of kvq: a `status` from a CUDA error, and messages built with a
// stream.
#include <cuda_runtime.h>

#include <kvq/detail/view_checks.hpp>
#include <kvq/status.hpp>
#include <string>

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

/// Success, or `errc::cuda_error` naming the call (`what`) and the error.
inline status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  return {errc::cuda_error, msg(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")")};
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
