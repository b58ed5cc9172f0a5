// The input check of appends (`check_values`): a flag set where any K or V value is NaN, Inf or
// beyond the fp16 range.
#include <kvq/cuda/paged_attention.hpp>
#include <kvq/format/numeric.hpp>

#include "dtype.cuh"
#include "launch.hpp"
#include "status.hpp"

#include <cuda_runtime.h>

#include <algorithm>

KVQ_NAMESPACE_BEGIN
namespace cuda {
namespace {

using detail::cuda_status;
using detail::launch;
using detail::load_any;

__global__ void check_kernel(const void* k, const void* v, dtype kt, dtype vt, int64_t tokens, int hd, int64_t ks,
                             int64_t vs, int* flag) {
  const int64_t total = tokens * hd;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = idx / hd, e = idx % hd;
    const float a = load_any(k, kt, t * ks + e), b = load_any(v, vt, t * vs + e);
    if (!(fabsf(a) <= fp16_max) || !(fabsf(b) <= fp16_max)) *flag = 1;
  }
}

}  // namespace

status check_values(const tensor_view& k, const tensor_view& v, int* flag, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  KVQ_TRY(cuda_status(cudaMemsetAsync(flag, 0, sizeof(int), st), "cudaMemsetAsync"));
  const int64_t total = k.tokens * k.heads * k.head_dim;
  const int blocks = int(std::min<int64_t>(1024, (total + 255) / 256));
  return launch("check launch", check_kernel, dim3(unsigned(std::max(1, blocks))), dim3(256), 0, st, k.data, v.data, k.type,
                v.type, k.tokens, k.heads * k.head_dim, k.stride(), v.stride(), flag);
}

}  // namespace cuda
KVQ_NAMESPACE_END
