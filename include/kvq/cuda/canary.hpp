#pragma once
/// \file
/// The device canary of a policy (`kvq::canary_spec`, e.g. EchoKV's): for a batch of sequences of
/// one layer, the attention KL that quantizing the FP16 window's keys with each tier's K format
/// would cause on the step's live queries, computed where the queries and the window already are.
/// Host-compilable: streams are passed as `void*` (a `cudaStream_t`).
///
/// Per item, kv head h and tier t the kernel writes
///
///     out[item][h][t] = Σ over the item's query rows i that see a key and the query heads qh of
///                       h's GQA group of  KL( softmax(s·q·K) ‖ softmax(s·q·f_t(K)) )
///
/// with K the keys [first, first + keys) of the ring (fp16, slot = token % window), f_t the
/// codec of tier t (`kvq::codec`, the bytes the CPU writes) applied in groups of `align` tokens,
/// and the KL taken over the keys row i may see (up to token context - q_len + i) as
/// log1p(Σ p expm1(D)) - Σ p D, D = s·q·(f_t(k) - k), in fp64 — the arithmetic of
/// `echokv_policy::measure`. The caller divides by the number of (row, head) samples
/// (`canary_keys::rows_seeing` x heads) to get the means.
///
/// Supported: head_dim a multiple of 32 up to 256, up to `max_canary_tiers` tiers, windows whose
/// shared-memory need (`canary_smem_bytes`, with the error table in blocks of whole groups of
/// align keys where the whole window's does not fit) fits the device. Launches take the caller's stream,
/// allocate nothing and never synchronize.

#include <kvq/config.hpp>
#include <kvq/format/format.hpp>
#include <kvq/status.hpp>
#include <kvq/tensor.hpp>

#include <cstddef>
#include <cstdint>
#include <span>

KVQ_NAMESPACE_BEGIN
namespace cuda {

/// Tiers one launch measures at most.
inline constexpr int max_canary_tiers = 8;

/// One sequence of a canary launch.
struct canary_item {
  const uint16_t* ring;  ///< device fp16 K ring [window][head_dim] of kv head 0 of the (sequence, layer)
  int32_t q_row;         ///< first row of the item's queries in q
  int32_t q_len;         ///< the step's query rows (its tokens are the last q_len of the context)
  int32_t context;       ///< tokens the step attends to
  int32_t first;         ///< first key measured, a multiple of align
  int32_t keys;          ///< keys measured, a positive multiple of align (at most the window)
};

/// Arguments of one canary launch (its items may come from different layers: each carries its
/// own ring).
struct canary_args {
  int q_heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int window = 0;                     ///< ring slots
  int64_t ring_head_stride = 0;       ///< fp16 elements from the K ring of kv head h to that of h + 1
  std::span<const format_id> tiers;   ///< K format of each tier (host memory)
  int align = 1;                      ///< token group of the cut; divides the window
  float scale = 0.f;                  ///< softmax scale s
  std::span<const canary_item> items; ///< host memory; copied into the launch parameters
  const void* q = nullptr;            ///< device [rows][q_heads][head_dim]
  dtype q_type = dtype::f16;
  int64_t q_stride = 0;               ///< elements between rows (0: packed)
  double* out = nullptr;              ///< device-writable [items][kv_heads][tiers] (mapped host memory works)
};

/// Shared memory one block needs for `keys` keys (at most the window) and the given tiers, with
/// an error table of `error_keys` keys (0: all of them). A launch takes the whole window's table
/// where it fits the device, else blocks of the most whole groups of align keys that fit (a
/// 128-token window at head_dim 256 with 8-bit tiers: 270,464 bytes in one table, 227,968 in blocks of
/// 96 keys).
KVQ_EXPORT size_t canary_smem_bytes(std::span<const format_id> tiers, int align, int head_dim, int keys,
                                    int error_keys = 0);
/// Checks the arguments' shape (items may be empty); the message names what is not supported.
KVQ_EXPORT status canary_can_implement(const canary_args& a);
/// Launches the canary of every item on `stream` (one kernel per up to 64 items).
KVQ_EXPORT status canary_run(const canary_args& a, void* stream);

}  // namespace cuda
KVQ_NAMESPACE_END
