// Entry point of the GPU tests: skips loudly (exit 77, reported by ctest as skipped) where no CUDA
// device exists. KVQ_GPU_TEST_SMALL=1 selects reduced sizes for compute-sanitizer runs.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <cstdio>

int main(int argc, char** argv) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    std::fprintf(stderr, "SKIPPED: kvq GPU tests need a CUDA device (%s); NOT counted as passed\n",
                 e != cudaSuccess ? cudaGetErrorString(e) : "none found");
    return 77;
  }
  cudaDeviceProp p{};
  cudaGetDeviceProperties(&p, 0);
  std::printf("kvq GPU tests on %s (sm_%d%d, %d SMs)\n", p.name, p.major, p.minor, p.multiProcessorCount);
  return Catch::Session().run(argc, argv);
}
