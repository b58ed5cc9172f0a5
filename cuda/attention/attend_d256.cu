// The attention launches of head_dim 256 (attend_launch.hpp).
#include "attention/attend_launch.cuh"

KVQ_NAMESPACE_BEGIN
namespace cuda::detail {
KVQ_ATTEND_INSTANTIATE(256)
}  // namespace cuda::detail
KVQ_NAMESPACE_END
