// The launch test hook (include/kvq/cuda/testing.hpp): per-thread counters, so caches used from
// different threads never see each other's hook.
#include "launch.hpp"

#include <cuda.h>

KVQ_NAMESPACE_BEGIN
namespace cuda {
namespace {
thread_local int fail_countdown = 0;  // > 0: the launch that brings it to 0 fails
thread_local long launches = 0;
}  // namespace

void testing::fail_launch(int nth) { fail_countdown = nth > 0 ? nth : 0; }
long testing::launch_count() { return launches; }

status detail::set_max_dynamic_smem(const void* kernel, int bytes) {
  using set_attribute_fn = CUresult (*)(CUfunction, CUfunction_attribute, int);
  // The driver's entry point, looked up once (immutable afterwards; no link against libcuda).
  static const set_attribute_fn set_attribute = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuFuncSetAttribute", &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<set_attribute_fn>(fn);
  }();
  if (!set_attribute) return {errc::cuda_error, "the driver's cuFuncSetAttribute is not available"};
  cudaFunction_t f = nullptr;
  KVQ_TRY(cuda_status(cudaGetFuncBySymbol(&f, kernel), "cudaGetFuncBySymbol"));
  const CUresult r =
      set_attribute(reinterpret_cast<CUfunction>(f), CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes);
  if (r != CUDA_SUCCESS)
    return {errc::cuda_error, msg("cuFuncSetAttribute (", bytes, " bytes of dynamic shared memory): driver error ", int(r))};
  return {};
}

bool detail::injected_launch_failure() {
  ++launches;
  return fail_countdown > 0 && --fail_countdown == 0;
}

}  // namespace cuda
KVQ_NAMESPACE_END
