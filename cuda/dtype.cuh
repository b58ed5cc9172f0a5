#pragma once
// Device loads and stores of tensors of any `dtype` (f32, f16, bf16): the one switch over the
// element type (`with_dtype`), and the conversions to and from float built on it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <kvq/tensor.hpp>
#include <type_traits>

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {

/// The K and V rows an append's kernels read ([0] K, [1] V: base pointers, element types, row
/// strides in elements), set from the call's views: the append kernels' parameters and the value
/// check's read the same rows the same way.
template <class P>
void set_kv_rows(const tensor_view& k, const tensor_view& v, P& p) {
  p.src[0] = k.data;
  p.src[1] = v.data;
  p.src_type[0] = k.type;
  p.src_type[1] = v.type;
  p.src_stride[0] = k.stride();
  p.src_stride[1] = v.stride();
}

/// Calls `f` with a value of the C++ element type of `t` (float, __half or __nv_bfloat16) and
/// returns its result.
template <class F>
__device__ __forceinline__ decltype(auto) with_dtype(dtype t, F&& f) {
  switch (t) {
    case dtype::f32:
      return f(float{});
    case dtype::f16:
      return f(__half{});
    default:
      return f(__nv_bfloat16{});
  }
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

/// Element `i` of a tensor of floats, halves or bfloat16s, as float.
__device__ __forceinline__ float load_any(const void* base, dtype t, int64_t i) {
  return with_dtype(t, [&](auto z) { return to_float(static_cast<const decltype(z)*>(base)[i]); });
}

/// Stores `x` (rounded to nearest) as element `i` of a tensor of floats, halves or bfloat16s.
__device__ __forceinline__ void store_any(void* base, dtype t, int64_t i, float x) {
  with_dtype(t, [&](auto z) {
    using T = decltype(z);
    if constexpr (std::is_same_v<T, float>)
      static_cast<float*>(base)[i] = x;
    else if constexpr (std::is_same_v<T, __half>)
      static_cast<__half*>(base)[i] = __float2half_rn(x);
    else
      static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(x);
  });
}

}  // namespace cuda::detail
KVQ_NAMESPACE_END
