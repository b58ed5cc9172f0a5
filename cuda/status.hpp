#pragma once
// Host helpers of the CUDA sources of kvq: a `status` from a CUDA error, and messages built with a
// stream.
#include <cuda_runtime.h>

#include <kvq/status.hpp>
#include <sstream>
#include <string>

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

/// The pieces `a` written one after the other.
/// NOTE: fmt's compile-time format checks do not survive nvcc's host pass; messages in .cu files
/// are built with a stream.
template <class... A>
std::string msg(const A&... a) {
  std::ostringstream os;
  (os << ... << a);
  return os.str();
}

/// Success, or `errc::cuda_error` naming the call (`what`) and the error.
inline status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  return {errc::cuda_error, msg(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")")};
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
