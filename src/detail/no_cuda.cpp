// Built when kvq is configured without CUDA: the CUDA backend reports that it is absent.
#include <kvq/detail/backend.hpp>

KVQ_NAMESPACE_BEGIN
namespace detail {
result<std::unique_ptr<cache_backend>> make_cuda_backend(const cache_state&) {
  return status{errc::unsupported, "this kvq was built without CUDA (no nvcc at configure time); use backend::cpu"};
}
}  // namespace detail
KVQ_NAMESPACE_END
