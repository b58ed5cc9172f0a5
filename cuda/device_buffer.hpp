#pragma once
// An owned, growable device allocation of the CUDA backend (the arena, tables, workspaces).
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cstddef>
#include <kvq/status.hpp>

KVQ_NAMESPACE_BEGIN
namespace detail {

/// `count` elements of device memory, freed on destruction; not copyable.
template <class T>
struct device_buffer {
  T* ptr = nullptr;
  size_t count = 0;
  device_buffer() = default;
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() {
    if (ptr) cudaFree(ptr);
  }
  /// Replaces the buffer (its contents are not kept). On failure it is empty (count 0), so a later
  /// size check asks for it again instead of writing through a null pointer.
  status allocate(size_t n, const char* what) {
    if (ptr) cudaFree(ptr);
    ptr = nullptr;
    count = 0;
    if (n == 0) return {};
    const cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&ptr), n * sizeof(T));
    if (e != cudaSuccess) {
      ptr = nullptr;
      return {errc::out_of_budget,
              fmt::format("cudaMalloc of {} bytes for the {} failed: {}", n * sizeof(T), what, cudaGetErrorString(e))};
    }
    count = n;
    return {};
  }
};

}  // namespace detail
KVQ_NAMESPACE_END
