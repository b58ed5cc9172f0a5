#pragma once
// Aborts a benchmark on a CUDA error, naming the call.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CUDA_CHECK(x)                                                       \
  do {                                                                      \
    cudaError_t e_ = (x);                                                   \
    if (e_ != cudaSuccess) {                                                \
      std::fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                         \
    }                                                                       \
  } while (0)
