#pragma once
/// \file
/// Build-wide macros of kvq: host/device qualifiers, the inline versioned namespace and the
/// symbol-visibility markers. Every other header includes this one first.

#define KVQ_VERSION_MAJOR 0
#define KVQ_VERSION_MINOR 1
#define KVQ_VERSION_PATCH 0

#if defined(__CUDACC__) || defined(__HIPCC__)
#define KVQ_HOST_DEVICE __host__ __device__ __forceinline__
#define KVQ_DEVICE __device__ __forceinline__
#else
#define KVQ_HOST_DEVICE inline
#define KVQ_DEVICE inline
#endif

/// Two engines linking two different kvq versions must not collide: every symbol lives in an
/// inline namespace named after the ABI version (the fmt / CCCL convention).
#define KVQ_NAMESPACE_BEGIN \
  namespace kvq {           \
  inline namespace v0 {
#define KVQ_NAMESPACE_END \
  }                       \
  }

#if defined(_WIN32)
#define KVQ_EXPORT
#else
#define KVQ_EXPORT __attribute__((visibility("default")))
#endif
