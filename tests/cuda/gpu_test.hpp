#pragma once
// Helpers shared by the GPU test files (and the host-only plan test): a device buffer, a
// synchronous upload, random fp16 data, NMSE, the page bytes of every format, the check that a
// CPU and a CUDA cache store the same.
#include <kvq/cache/cache.hpp>
#include <kvq/cuda/paged_attention.hpp>
#include <kvq/format/format.hpp>
#include <kvq/format/numeric.hpp>

#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace kvq::gpu_test {

// Device memory owned for a test's scope.
struct dev_mem {
  void* p = nullptr;
  explicit dev_mem(size_t bytes) { REQUIRE(cudaMalloc(&p, bytes) == cudaSuccess); }
  dev_mem(const dev_mem&) = delete;
  dev_mem& operator=(const dev_mem&) = delete;
  ~dev_mem() { cudaFree(p); }
};

// Page bytes of every format in role `r` at this page shape: what `cuda::paged_view::k_page_bytes`
// / `v_page_bytes` hold.
using cuda::page_bytes;

// Host to device, synchronous (legacy stream).
template <class T>
void upload(dev_mem& d, const std::vector<T>& h) {
  REQUIRE(cudaMemcpy(d.p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
}

// fp16 normal draws (standard deviation `sigma`), every 16th element (index 5 mod 16) six times
// larger: channel outliers as real keys have them.
inline std::vector<uint16_t> randn_h(std::mt19937& rng, size_t n, float sigma = 1.f) {
  std::normal_distribution<float> nd(0.f, sigma);
  std::vector<uint16_t> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = float_to_half(nd(rng) * ((i % 16) == 5 ? 6.f : 1.f));
  return x;
}

// Normalized mean squared error of `got` against `want` (every element of `got` must be finite).
inline double nmse(const std::vector<float>& got, const std::vector<float>& want) {
  REQUIRE(got.size() == want.size());
  double e = 0, n = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    REQUIRE(std::isfinite(got[i]));
    e += (got[i] - want[i]) * double(got[i] - want[i]);
    n += double(want[i]) * want[i];
  }
  return e / n;
}

// The same fp16 tokens ([m][kv_heads][head_dim] each, host memory) appended to (s, layer) of a
// CPU-backend and a CUDA-backend cache; the device is synchronized after.
inline void append_same(KVCache& cpu, KVCache& gpu, seq_id s, int layer, const std::vector<uint16_t>& k,
                        const std::vector<uint16_t>& v, int64_t m) {
  const int h = cpu.config().shape.kv_heads, d = cpu.config().shape.head_dim;
  check(cpu.append(s, layer, {k.data(), dtype::f16, m, h, d}, {v.data(), dtype::f16, m, h, d}));
  dev_mem dk(k.size() * 2), dv(v.size() * 2);
  upload(dk, k);
  upload(dv, v);
  check(gpu.append(s, layer, {dk.p, dtype::f16, m, h, d}, {dv.p, dtype::f16, m, h, d}));
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
}

// A CPU-backend and a CUDA-backend cache hold the same (sequence, layer): `read` equal bit for
// bit for both roles, and the same page bytes.
inline void require_same_store(const KVCache& cpu, const KVCache& gpu, seq_id s, int layer) {
  const auto& sh = cpu.config().shape;
  const size_t n = size_t(cpu.length(s, layer)) * sh.kv_heads * sh.head_dim;
  for (role r : {role::k, role::v}) {
    std::vector<float> a(n), b(n);
    check(cpu.read(s, layer, r, a));
    check(gpu.read(s, layer, r, b));
    for (size_t i = 0; i < n; ++i) {
      if (a[i] != b[i]) {
        CAPTURE(int(r), i, a[i], b[i]);
        REQUIRE(a[i] == b[i]);
      }
    }
  }
  REQUIRE(cpu.stats().page_bytes == gpu.stats().page_bytes);
}

}  // namespace kvq::gpu_test
