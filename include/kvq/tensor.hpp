#pragma once
/// \file
/// Non-owning, trivially copyable views of the tensors an engine hands to kvq. The same view
/// describes host memory (CPU backend) or device memory (CUDA backend); the cache's backend says
/// which.

#include <kvq/config.hpp>

#include <cstdint>

KVQ_NAMESPACE_BEGIN

/// Element type of a tensor the engine passes in or receives.
enum class dtype : uint8_t { f32, f16, bf16 };

constexpr int dtype_size(dtype t) { return t == dtype::f32 ? 4 : 2; }
constexpr const char* dtype_name(dtype t) {
  return t == dtype::f32 ? "f32" : t == dtype::f16 ? "f16" : "bf16";
}

/// [tokens][heads][head_dim] view over `Data` (`const void*` or `void*`). Heads and channels are
/// contiguous; consecutive tokens are `token_stride` elements apart (>= heads * head_dim; the
/// default 0 means packed), so a K slice of a fused QKV projection output can be passed without a
/// copy.
template <class Data>
struct basic_tensor {
  Data data = nullptr;
  dtype type = dtype::f32;
  int64_t tokens = 0;
  int heads = 0;
  int head_dim = 0;
  int64_t token_stride = 0;

  constexpr int64_t stride() const { return token_stride ? token_stride : int64_t(heads) * head_dim; }
};

/// Read-only view.
using tensor_view = basic_tensor<const void*>;
/// Writable view, same conventions as `tensor_view`.
using tensor_mut = basic_tensor<void*>;

KVQ_NAMESPACE_END
