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

/// [tokens][heads][head_dim] read-only view. Heads and channels are contiguous; consecutive
/// tokens are `token_stride` elements apart (>= heads * head_dim; the default 0 means packed), so
/// a K slice of a fused QKV projection output can be passed without a copy.
struct tensor_view {
  const void* data = nullptr;
  dtype type = dtype::f32;
  int64_t tokens = 0;
  int heads = 0;
  int head_dim = 0;
  int64_t token_stride = 0;

  constexpr int64_t stride() const { return token_stride ? token_stride : int64_t(heads) * head_dim; }
};

/// [tokens][heads][head_dim] writable view, same conventions as `tensor_view`.
struct tensor_mut {
  void* data = nullptr;
  dtype type = dtype::f32;
  int64_t tokens = 0;
  int heads = 0;
  int head_dim = 0;
  int64_t token_stride = 0;

  constexpr int64_t stride() const { return token_stride ? token_stride : int64_t(heads) * head_dim; }
};

KVQ_NAMESPACE_END
