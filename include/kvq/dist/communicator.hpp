#pragma once
/// \file
/// The communicator: the few collectives tensor-parallel ranks need to agree on small things
/// (EchoKV's tier vote, docs/architecture.md "Tensor parallel"). One object per rank; every rank
/// of a group calls the same collectives in the same order. Two implementations: threads of one
/// process (`thread_communicator.hpp`, tests and CPU engines) and NCCL (`nccl_communicator.hpp`,
/// built with `KVQ_NCCL=ON`).
///
/// **Failure is collective.** A collective either completes on every rank or returns a status on
/// every rank: a rank that times out, aborts or calls with arguments that do not match the
/// others' breaks the group, and from then on every call of every rank returns
/// `errc::comm_error` naming the first failure. A broken group is not repaired; the engine makes
/// a new one.

#include <cstddef>
#include <cstdint>
#include <kvq/config.hpp>
#include <kvq/status.hpp>
#include <string>

KVQ_NAMESPACE_BEGIN

namespace dist {

/// Element type of an all-reduce.
enum class element_type : uint8_t { u8, i32, i64, f32, f64 };

/// Bytes of one element of `t`.
constexpr size_t element_bytes(element_type t) {
  switch (t) {
    case element_type::u8:
      return 1;
    case element_type::i32:
      return 4;
    case element_type::f32:
      return 4;
    case element_type::i64:
      return 8;
    case element_type::f64:
      return 8;
  }
  return 0;
}

/// Reduction of an all-reduce.
enum class reduce_op : uint8_t { sum, max, min };

/// Where the buffers of a collective live.
enum class memory_space : uint8_t {
  /// Host memory. The call blocks until `recv` holds the result (or the timeout passes); a
  /// device communicator stages the bytes through buffers of its own on `stream` and waits for
  /// that stream.
  host,
  /// Device memory of the rank's GPU. The call enqueues the collective on `stream` and returns;
  /// only communicators whose `device_capable()` is true take it.
  device,
};

/// One rank's end of a group of `size()` ranks.
class KVQ_EXPORT communicator {
 public:
  virtual ~communicator() = default;

  /// This rank, in [0, size()).
  virtual int rank() const = 0;
  /// Ranks in the group.
  virtual int size() const = 0;
  /// True if `memory_space::device` buffers are accepted (NCCL).
  virtual bool device_capable() const = 0;
  /// Short description: "threads(rank 0 of 2)", "nccl(rank 1 of 2, device 1)".
  virtual std::string name() const = 0;

  /// Every rank contributes `bytes` bytes; every rank receives all contributions in rank order.
  /// \param send [bytes] this rank's contribution
  /// \param recv [size()][bytes] the gathered contributions; must not overlap `send`
  /// \param stream the rank's cudaStream_t for a device communicator (nullptr: the legacy default
  ///        stream); ignored by host communicators
  /// Errors: null buffers, bytes 0, a device space this communicator cannot take
  /// (`invalid_argument`, and the group breaks so no rank waits for this one); a broken group,
  /// a timeout or a mismatch with the other ranks' calls (`comm_error`).
  virtual status all_gather(const void* send, void* recv, size_t bytes, memory_space where, void* stream) = 0;

  /// Element-wise reduction of every rank's `count` elements; every rank receives the same result
  /// (the thread communicator reduces in rank order; NCCL in the order of its algorithm).
  /// \param send [count] elements of `type`
  /// \param recv [count] elements of `type`; may equal `send`
  /// Errors as `all_gather`.
  virtual status all_reduce(const void* send, void* recv, size_t count, element_type type, reduce_op op,
                            memory_space where, void* stream) = 0;

  /// Breaks the group: pending and later collectives of every rank return `comm_error` naming
  /// this rank and `reason`. For a rank that has failed on its own (its step threw, its device
  /// faulted) and will not take part in the next collective. Peers of an NCCL group learn of it
  /// by their timeout.
  virtual void abort(const std::string& reason) = 0;
  /// True once the group is broken, as far as this rank knows.
  virtual bool broken() const = 0;
};

}  // namespace dist

KVQ_NAMESPACE_END
