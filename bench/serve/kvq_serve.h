#pragma once
/// \file
/// The C ABI of the serving benchmark (bench/serve/README.md): one `kvq::KVCache` behind plain C
/// functions, so that a Python decode loop (bench/serve/serve.py, through ctypes) hands it raw
/// device pointers of its own tensors and its current stream. Bench-only: not part of kvq's API.
///
/// Every function validates its arguments first and returns 0 or the `kvq::errc` value of the
/// failure; `kvq_serve_error` then says what was wrong. A failed call changes nothing stored.
/// Tensors are [tokens][heads][head_dim] with a stride of elements between tokens (0: packed), in
/// the cache's memory (device on CUDA, host on the CPU backend).
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/// A cache and its policy.
typedef struct kvq_serve kvq_serve;

/// Element types of the tensors passed in (the values of `kvq::dtype`).
enum { KVQ_SERVE_F32 = 0, KVQ_SERVE_F16 = 1, KVQ_SERVE_BF16 = 2 };

/// Statistics of the cache now (`kvq::cache_stats`, flattened).
typedef struct kvq_serve_stats {
  uint64_t budget_bytes;
  uint64_t used_bytes;
  uint64_t free_bytes;
  uint64_t largest_free_block;
  uint64_t page_bytes;
  uint64_t window_bytes;
  uint64_t encoded_elements;
  uint64_t overhead_device_bytes;  ///< page tables and workspaces, outside the budget
  int64_t sequences;
  int64_t tokens;  ///< summed over sequences and layers
} kvq_serve_stats;

/// Creates a cache. `policy`: a static format spec (`fp16`, `int8`/`sym8`, `kivi4/g32`,
/// `k=kivi4/g32,v=kivi2/g32`, any `parse_format_pair` spelling) or `echokv` (EchoKV, tiers
/// kivi2/4/8 g32, starting in kivi4/g32, canary rate 1/64). `cuda`: 1 for the CUDA backend on
/// `stream` (a cudaStream_t, NULL: the legacy default stream), 0 for the CPU backend. The shape is
/// Llama's (page_tokens 64, window 128, recent 64). Returns NULL and writes the reason into `err`
/// (`err_len` bytes, NUL-terminated) on failure.
kvq_serve* kvq_serve_create(const char* policy, int cuda, int layers, int q_heads, int kv_heads, int head_dim,
                            uint64_t budget_bytes, int max_sequences, int64_t max_tokens, void* stream, char* err,
                            int err_len);
/// Destroys a cache (NULL: nothing).
void kvq_serve_destroy(kvq_serve* s);
/// The message of the last failed call on `s` ("" after a successful one).
const char* kvq_serve_error(const kvq_serve* s);

int kvq_serve_create_sequence(kvq_serve* s, int64_t seq);
int kvq_serve_release_sequence(kvq_serve* s, int64_t seq);
/// `KVCache::bytes_for`: budget bytes `tokens` more tokens of `seq` take, or a new sequence of
/// `tokens` tokens when `seq` < 0.
int kvq_serve_bytes_for(kvq_serve* s, int64_t tokens, int64_t seq, uint64_t* out);
int kvq_serve_stats_get(kvq_serve* s, kvq_serve_stats* out);

/// Appends `tokens` tokens of one sequence to one layer (a synthetic context's fill).
/// \param k [tokens][kv_heads][head_dim] of `dtype`, `k_stride` elements between tokens
/// \param v same shape as k, `v_stride` elements between tokens
int kvq_serve_append(kvq_serve* s, int64_t seq, int layer, const void* k, const void* v, int64_t tokens,
                     int64_t k_stride, int64_t v_stride, int dtype);
/// A decode step's append of one layer: one token for each of `n` distinct sequences.
/// \param seqs [n] sequence ids
/// \param k [n][kv_heads][head_dim] of `dtype`, `k_stride` elements between rows (a slice of a
///        fused QKV projection's output needs no copy)
/// \param v same shape as k, `v_stride` elements between rows
int kvq_serve_append_batch(kvq_serve* s, int layer, const int64_t* seqs, int n, const void* k, const void* v,
                           int64_t k_stride, int64_t v_stride, int dtype);
/// A decode step's attention of one layer: one query row per sequence.
/// \param q [n][q_heads][head_dim] of `dtype`, `q_stride` elements between rows
/// \param o [n][q_heads][head_dim] of `dtype`, packed
int kvq_serve_attend(kvq_serve* s, int layer, const int64_t* seqs, int n, const void* q, int64_t q_stride, void* o,
                     int dtype);
/// EchoKV's canary on (1) or off (0, the policy frozen: no canary, no tier move); the canaries in
/// flight are finished and ingested first. `unsupported` for a static policy.
int kvq_serve_set_canary(kvq_serve* s, int on);
/// Waits for and ingests the policy's canaries in flight (`KVCache::sync_policy`).
int kvq_serve_sync_policy(kvq_serve* s);

#ifdef __cplusplus
}
#endif
