// The launch test hook (include/kvq/cuda/testing.hpp): per-thread counters, so caches used from
// different threads never see each other's hook.
#include "launch.hpp"

KVQ_NAMESPACE_BEGIN
namespace cuda {
namespace {
thread_local int fail_countdown = 0;  // > 0: the launch that brings it to 0 fails
thread_local long launches = 0;
}  // namespace

void testing::fail_launch(int nth) { fail_countdown = nth > 0 ? nth : 0; }
long testing::launch_count() { return launches; }

bool detail::injected_launch_failure() {
  ++launches;
  return fail_countdown > 0 && --fail_countdown == 0;
}

}  // namespace cuda
KVQ_NAMESPACE_END
