#pragma once
/// \file
/// A communicator over threads of one process: one object per rank, all sharing one rendezvous.
/// For tests without GPUs and for CPU engines that run their tensor-parallel ranks as threads.
/// Host buffers only. A collective waits at most `timeout` for the other ranks; then the group
/// breaks and every rank's call returns `errc::comm_error` (docs/architecture.md, "Tensor
/// parallel").

#include <chrono>
#include <kvq/dist/communicator.hpp>
#include <memory>
#include <vector>

KVQ_NAMESPACE_BEGIN

namespace dist {

/// Makes the `size` ranks of one group, rank i at index i. Hand each to the thread that runs that
/// rank; each object is used by one thread at a time. The group lives while any of them does.
/// Errors: size < 1, a timeout <= 0.
KVQ_EXPORT result<std::vector<std::unique_ptr<communicator>>> make_thread_group(
    int size, std::chrono::milliseconds timeout = std::chrono::seconds(30));

}  // namespace dist

KVQ_NAMESPACE_END
