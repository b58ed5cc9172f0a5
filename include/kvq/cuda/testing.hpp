#pragma once
/// \file
/// Test hooks of the CUDA backend (host-compilable). Not for production use: they exist so that
/// tests can check what a call leaves behind when one of its kernel launches fails.

#include <kvq/config.hpp>

KVQ_NAMESPACE_BEGIN
namespace cuda::testing {

/// Makes the `nth` kernel launch of kvq on the calling thread from now on (1: the next one) fail
/// with `errc::cuda_error` without running or queuing anything, as a refused launch would; 0
/// turns the hook off. The hook is per thread and disarms itself once it fires.
KVQ_EXPORT void fail_launch(int nth);
/// Kernel launches kvq has made (or refused through the hook) on the calling thread: a test
/// counts the launches of a call to aim the hook at each of them in turn.
KVQ_EXPORT long launch_count();

}  // namespace cuda::testing
KVQ_NAMESPACE_END
