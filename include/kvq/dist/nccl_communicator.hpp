#pragma once
/// \file
/// A communicator over NCCL, one rank per GPU (threads or processes). Built with `KVQ_NCCL=ON`;
/// without it every function here returns `errc::unsupported` (`nccl_available()` says which).
///
/// The NCCL communicator is created non-blocking, so that no call can hang: every wait (the
/// creation, a host-space collective) polls NCCL's asynchronous error and the stream with a
/// deadline, and a timeout or an NCCL error aborts the NCCL communicator (`ncclCommAbort`) and
/// breaks the group on this rank; its peers then fail by their own timeout. Host-space
/// collectives stage through device and pinned buffers the communicator allocates at creation
/// (`max_host_bytes`), so the collective itself allocates nothing.

#include <array>
#include <chrono>
#include <kvq/dist/communicator.hpp>
#include <memory>

KVQ_NAMESPACE_BEGIN

namespace dist {

/// The identifier every rank of one NCCL group is created with: made once (`nccl_make_id`) and
/// handed to the other ranks (shared memory for threads; any channel between processes).
struct nccl_id {
  std::array<char, 128> bytes{};  ///< an ncclUniqueId, opaque
};

/// Options of an NCCL rank.
struct nccl_options {
  std::chrono::milliseconds timeout = std::chrono::seconds(30);  ///< creation and each host-space wait
  size_t max_host_bytes = 64 << 10;  ///< largest host-space contribution (staging buffers), per rank
};

/// True if this build has NCCL (`KVQ_NCCL=ON`).
KVQ_EXPORT bool nccl_available();

/// A new group identifier. Errors: no NCCL in this build (`unsupported`), NCCL's own failure.
KVQ_EXPORT result<nccl_id> nccl_make_id();

/// Creates rank `rank` of a group of `size` on CUDA device `device`; every rank calls it
/// concurrently with the same `id` (it waits for all, at most `opt.timeout`). The current device
/// is restored before it returns, as after every call of the communicator. Errors: no NCCL in
/// this build (`unsupported`), bad rank, size or device (`invalid_argument`), a CUDA or NCCL
/// failure or a timeout (`comm_error`).
KVQ_EXPORT result<std::unique_ptr<communicator>> make_nccl_communicator(int size, int rank, const nccl_id& id,
                                                                        int device, const nccl_options& opt = {});

}  // namespace dist

KVQ_NAMESPACE_END
