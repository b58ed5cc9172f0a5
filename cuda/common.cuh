#pragma once
// Helpers shared by the CUDA translation units of kvq (kernels.cu, canary.cu): status from a CUDA
// error, messages built with a stream, and loads of any input dtype.
#include <kvq/status.hpp>

#include <kvq/tensor.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <sstream>
#include <string>

KVQ_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

// NOTE: fmt's compile-time format checks do not survive nvcc's host pass; messages in .cu files
// are built with a stream.
template <class... A>
std::string msg(const A&... a) {
  std::ostringstream os;
  (os << ... << a);
  return os.str();
}

inline status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  return {errc::cuda_error, msg(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")")};
}

// One element of a tensor of floats, halves or bfloat16s, as float.
__device__ __forceinline__ float load_any(const void* base, dtype t, int64_t i) {
  switch (t) {
    case dtype::f32: return static_cast<const float*>(base)[i];
    case dtype::f16: return __half2float(static_cast<const __half*>(base)[i]);
    default: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
  }
}

}  // namespace detail
}  // namespace cuda
KVQ_NAMESPACE_END
