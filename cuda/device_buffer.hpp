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
  ~device_buffer() { release(); }
  /// Replaces the buffer (its contents are not kept). On failure it is empty (count 0), so a later
  /// size check asks for it again instead of writing through a null pointer.
  status allocate(size_t n, const char* what) {
    release();
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
  /// Replaces the buffer in the order of `stream` (its contents are not kept): the old one is
  /// freed once the work queued on `stream` before this call is done, and the new one comes from
  /// the device's memory pool, so the host never waits for the device (`cudaFree` would). For a
  /// buffer only work on `stream` uses. Where the device has no memory pools, as `allocate`.
  status allocate_on(size_t n, const char* what, cudaStream_t stream) {
    if (ptr && pooled_)
      (void)cudaFreeAsync(ptr, stream);
    else
      release();
    ptr = nullptr;
    count = 0;
    pooled_ = false;
    if (n == 0) return {};
    int device = 0, pools = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device) != cudaSuccess || pools == 0)
      return allocate(n, what);
    const cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&ptr), n * sizeof(T), stream);
    if (e != cudaSuccess) {
      ptr = nullptr;
      return {errc::out_of_budget, fmt::format("cudaMallocAsync of {} bytes for the {} failed: {}", n * sizeof(T), what,
                                               cudaGetErrorString(e))};
    }
    pooled_ = true;
    count = n;
    return {};
  }

 private:
  // Frees the buffer now. A stream-ordered allocation goes back to its pool with cudaFreeAsync,
  // once the device is done with it (the stream it was used on may be gone): cudaFree of pool
  // memory left later cudaMallocAsync calls with unbacked addresses on the H100/H200 (the prefill
  // tests' "Warp illegal address", 2026-12-06).
  void release() {
    if (ptr && pooled_) {
      (void)cudaDeviceSynchronize();
      (void)cudaFreeAsync(ptr, cudaStreamLegacy);
    } else if (ptr) {
      cudaFree(ptr);
    }
    ptr = nullptr;
    count = 0;
    pooled_ = false;
  }
  bool pooled_ = false;  // from cudaMallocAsync
};

}  // namespace detail
KVQ_NAMESPACE_END
