#pragma once
/// \file
/// Llama-architecture forward pass on the CPU (Eigen), attention through `kvq::KVCache`; files of
/// architecture `llama`, `qwen2` (the same block with Q/K/V biases and RoPE on channel halves),
/// `gemma` (Gemma 1: RoPE on halves, embeddings scaled by sqrt(n_embd), GELU gating, tied output)
/// or `gemma3` (Gemma 1's block plus a per-head RMSNorm of q and k before RoPE, "sandwich" norms
/// on the attention and FFN outputs before their residual adds, and sliding-window layers: five
/// of every six layers attend to their last `sliding_window` tokens with RoPE base 10000, every
/// sixth is global with the file's `rope.freq_base`).
///
/// Per layer: RMSNorm → Q, K, V projections → RoPE (llama.cpp "normal" layout: adjacent pairs
/// (2i, 2i+1) rotated by pos * base^(-2i/n_rot), divided by the file's `rope_freqs.weight` factor
/// of pair i where it has one (Llama 3.1+), as GGUF llama files expect) → K, V appended to
/// the cache, attention of the chunk's queries → output projection and residual → RMSNorm →
/// SwiGLU FFN (down(silu(gate(x)) * up(x))) and residual. Then the final RMSNorm and the output
/// head (tied to `token_embd.weight` when the file has no `output.weight`).
///
/// Weight matrices stay in their GGUF quantization (`weight_matrix`, [out][in] row-major as in
/// GGUF) and the projections run on the quantized blocks over a thread pool (`llama/matmul.hpp`):
/// the activations of quantized weights are quantized to 8 bits per block first, as llama.cpp
/// does; F32 and F16 weights take float activations. Norm weights are float.
///
/// Positions: a chunk's first token has position `cache.length(seq, 0)`, so a sequence is fed
/// chunk after chunk (prefill) and then one token at a time (decode). A chunk of any length is one
/// call per layer: `append` + `attend` up to the cache's window R, `KVCache::prefill` beyond (the
/// same semantics: the chunk attends to itself in FP16 and to the prefix as stored,
/// docs/architecture.md "Prefill of any length").
///
/// `prefill_shared` feeds one prompt into several empty sequences (of several caches) at once:
/// every layer's q, k and v are computed once, K and V are appended to every cache (each stores
/// them in its own format), and the prompt's causal attention is computed once in float over K
/// and V rounded to fp16, which is what each cache computes for a fresh sequence whose prompt
/// attends to itself in FP16. A prompt is prefilled once, in full precision, as an inference
/// engine does; decoding then reads it from each cache as stored.
///
/// A reference path (`forward_reference`) recomputes attention from scratch in plain float over
/// K and V kept in a `reference_kv`, with no kvq cache at all: the baseline that a cache
/// configuration is compared to.

#include <cstdint>
#include <functional>
#include <kvq/attention/variant.hpp>
#include <kvq/cache/cache.hpp>
#include <kvq/status.hpp>
#include <llama/gguf.hpp>
#include <llama/matmul.hpp>
#include <llama/thread_pool.hpp>
#include <llama/tokenizer.hpp>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvq::llama {

/// Hyper-parameters of a Llama-architecture model, from `llama.*` metadata.
struct llama_hparams {
  int n_vocab = 0;
  int n_embd = 0;  ///< model width
  int n_layer = 0;
  int n_head = 0;     ///< query heads
  int n_head_kv = 0;  ///< key/value heads (GQA: n_head is a multiple)
  int head_dim = 0;
  int n_ff = 0;         ///< FFN hidden width
  int n_rot = 0;        ///< rotated channels per head (`rope.dimension_count`, default head_dim)
  int n_ctx_train = 0;  ///< training context (informational)
  float rms_eps = 1e-5f;
  float rope_base = 10000.f;
  bool rope_freq_factors = false;  ///< `rope_freqs.weight` divides the pairs' frequencies (Llama 3.1+ scaling)
  bool rope_neox = false;          ///< RoPE pairs (i, i + n_rot/2) (qwen2, gemma), else (2i, 2i + 1)
  bool gemma = false;              ///< gemma or gemma3: embeddings x sqrt(n_embd), GELU (tanh) gating
  bool gemma3 = false;             ///< gemma3: q/k RMSNorm per head, post-attention and post-FFN norms
  /// Tokens a sliding layer's query sees (itself and the window - 1 before it); 0: no sliding layer.
  int sliding_window = 0;
  /// [n_layer]: 1 where the layer attends within `sliding_window` (gemma3: layer l with l % 6 < 5,
  /// llama.cpp's swa pattern 6), 0 where it is global. Empty when no layer slides.
  std::vector<uint8_t> sliding;
  float rope_base_local = 10000.f;  ///< RoPE base of the sliding layers (gemma3); global ones use rope_base
  /// Softmax scale of the scores q . k (gemma3: 1/sqrt(head_dim), but 1/sqrt(n_embd / n_head) for
  /// the 62-layer 27B, as llama.cpp's f_attention_scale); default 1/sqrt(head_dim).
  float attn_scale = 0.f;
};

/// One transformer block's weights, [out][in] row-major.
struct llama_layer {
  std::vector<float> attn_norm;  ///< [n_embd]
  weight_matrix wq;              ///< [n_head * head_dim][n_embd]
  weight_matrix wk;              ///< [n_head_kv * head_dim][n_embd]
  weight_matrix wv;              ///< [n_head_kv * head_dim][n_embd]
  std::vector<float> bq, bk, bv;  ///< projection biases ([n_head * head_dim], [n_head_kv * head_dim] x 2), empty: none
  weight_matrix wo;              ///< [n_embd][n_head * head_dim]
  std::vector<float> ffn_norm;   ///< [n_embd]
  weight_matrix w_gate;          ///< [n_ff][n_embd]
  weight_matrix w_up;            ///< [n_ff][n_embd]
  weight_matrix w_down;          ///< [n_embd][n_ff]
  // gemma3 only (empty otherwise):
  std::vector<float> q_norm, k_norm;  ///< [head_dim] RMSNorm weights of each q and k head, before RoPE
  std::vector<float> post_attn_norm;  ///< [n_embd] RMSNorm of the attention output before its residual add
  std::vector<float> post_ffn_norm;   ///< [n_embd] RMSNorm of the FFN output before its residual add
};

/// K and V of one sequence for the reference path: per layer [tokens][n_head_kv][head_dim].
struct reference_kv {
  std::vector<std::vector<float>> k, v;
  int64_t length = 0;  ///< tokens held (same in every layer)
  /// Round K and V through fp16 as they are stored (what an FP16 cache does to them), so the
  /// reference isolates the cache's attention from its storage rounding.
  bool round_to_f16 = false;
};

/// Optional hook of the forward calls: called once per layer with the chunk's attention inputs,
/// after RoPE and before attention. `q` is [T][n_head][head_dim], `k` and `v` are
/// [T][n_head_kv][head_dim], float as computed (before the cache or the reference rounds K and V
/// to fp16); `pos0` is the position of the chunk's first token. Valid only during the call. What
/// calibration (`kvq-calibrate`, tools/calib) feeds to `kvq::calib::calibrator`; an empty
/// function is never called.
using layer_observer = std::function<void(int layer, int64_t pos0, std::span<const float> q, std::span<const float> k,
                                          std::span<const float> v)>;

/// Which logits a forward call writes.
enum class logits_mode : uint8_t {
  last,  ///< [n_vocab]: the chunk's last token only
  all,   ///< [tokens][n_vocab]: every token of the chunk
};

/// A loaded model: hyper-parameters, weights and the thread pool of its matrix products.
/// Immutable after load (but for `set_threads` and `set_isa`, which must not race a forward
/// call); forward calls may run concurrently on distinct caches: one of them at a time uses the
/// pool, the others run their products on their own thread.
class llama_model {
 public:
  /// Reads hyper-parameters and the weights of a GGUF file of architecture
  /// `llama`. Errors name the file and the key or tensor: missing tensor (not_found), wrong
  /// shape or inconsistent hyper-parameters (io_error), unsupported architecture, RoPE scaling
  /// or tensor type (unsupported).
  static result<llama_model> load(const gguf_file& f);
  /// Opens (memory-maps) and loads `path`.
  static result<llama_model> load(const std::string& path);

  const llama_hparams& hparams() const { return hp_; }
  const std::string& name() const { return name_; }
  /// True when the output head is `token_embd.weight` (no `output.weight` in the file).
  bool tied_output() const { return tied_output_; }

  /// A cache shape for this model (layers, heads, head_dim) with kvq's default page_tokens,
  /// window and recent.
  kvq::cache_shape cache_shape() const;

  /// Each layer's attention rule, what `kvq::cache_config::attention` of a cache for this model
  /// must hold: window `sliding_window` on the sliding layers, plain on the global ones. Empty
  /// for a model without sliding layers (every layer plain).
  const std::vector<kvq::attention_variant>& attention_variants() const { return variants_; }
  /// Layer `l`'s attention rule (plain when `attention_variants()` is empty).
  const kvq::attention_variant& layer_attention(int l) const;

  /// Runs one chunk of `tokens` of sequence `seq` through the model, appending its K and V to
  /// `cache` and attending through it. Positions start at `cache.length(seq, 0)`.
  /// \param tokens [T] token ids, T >= 1
  /// \param logits [n_vocab] (mode last) or [T][n_vocab] (mode all) output
  /// \param observer called per layer with the chunk's q, k, v (see `layer_observer`)
  /// Errors: invalid_argument (bad chunk, token id or logits size), not_found (unknown sequence),
  /// or the cache's status (budget, non-finite K/V). After a failed call the sequence's layers may
  /// hold different lengths: release it.
  status forward(kvq::KVCache& cache, kvq::seq_id seq, std::span<const token_id> tokens, std::span<float> logits,
                 logits_mode mode = logits_mode::last, const layer_observer& observer = {}) const;

  /// One step of several independent streams ("lanes"): lane i feeds its C tokens
  /// `tokens[i * C .. i * C + C - 1]` (C = tokens.size() / lanes, 1 for a decode step, at most
  /// every cache's window) to sequence `seqs[i]` of `*caches[i]` from that sequence's own
  /// position. The matrix products run once over all lanes' rows (each weight read once per
  /// step, as in a batched engine), each lane appends and attends its C queries through its own
  /// cache, the caches' attention spread over the model's threads (one task per distinct cache,
  /// its lanes in order: several sequences of one cache are allowed; give the caches
  /// `cpu_threads` 1). Each lane's logits equal a `forward` of its C tokens alone bit for bit.
  /// \param logits [lanes][C][n_vocab] output
  /// \param seconds empty, or [lanes]: adds to each lane the wall time of the step's products
  ///        divided equally among the lanes plus the time of its own cache calls
  /// Errors (before anything is appended): invalid_argument (no lane, sizes that disagree, a
  /// token count that is not a multiple of the lanes or above a window, a null or mis-shaped
  /// cache, a (cache, sequence) pair given twice, a token outside the vocabulary), not_found
  /// (unknown sequence). A cache's refusal (budget, non-finite K/V) is returned after the layer
  /// in which it happened: the lanes may then hold different lengths.
  status forward_lanes(std::span<kvq::KVCache* const> caches, std::span<const kvq::seq_id> seqs,
                       std::span<const token_id> tokens, std::span<float> logits,
                       std::span<double> seconds = {}) const;

  /// Prefills `tokens` (any number, at least one) into `seqs[i]` of `*caches[i]` for every i,
  /// computing the model once: each layer's K and V are appended to every cache, the prompt's
  /// causal attention is computed once in float over K and V rounded to fp16 (the library's
  /// `kvq::cpu::causal_attention`, on the model's threads),
  /// in chunks of `shared_chunk` tokens. Positions start at 0. Logits as in `forward`, over all
  /// of `tokens` for mode all.
  /// Errors (before anything is appended): invalid_argument (no cache, caches and seqs of
  /// different sizes, a null or mis-shaped cache, a (cache, sequence) pair given twice, a
  /// sequence that is not empty, bad tokens or logits size), not_found (unknown sequence). When
  /// a cache refuses an append (budget), every sequence is released and created again (empty,
  /// as before the call) and the cache's status is returned.
  status prefill_shared(std::span<kvq::KVCache* const> caches, std::span<const kvq::seq_id> seqs,
                        std::span<const token_id> tokens, std::span<float> logits,
                        logits_mode mode = logits_mode::last) const;

  /// Tokens per chunk of `prefill_shared` (bounds its activation memory).
  static constexpr int64_t shared_chunk = 512;

  /// The same computation with attention recomputed from scratch in plain float over `kv` (no
  /// cache, no chunk limit; the library's reference attention, `kvq::ref::attend`). Positions
  /// start at `kv.length`.
  status forward_reference(reference_kv& kv, std::span<const token_id> tokens, std::span<float> logits,
                           logits_mode mode = logits_mode::last, const layer_observer& observer = {}) const;

  /// Threads of the matrix products, the caller included (default: hardware_concurrency).
  int threads() const { return pool_->threads(); }
  /// Sets the threads of the matrix products (0: hardware_concurrency).
  void set_threads(int threads);
  /// Instruction set of the dot products (default: `best_isa()`).
  cpu_isa isa() const { return isa_; }
  /// Chooses the instruction set of the dot products. Errors: unsupported when this CPU lacks it.
  status set_isa(cpu_isa isa);

  /// Weights as stored (for tests and analysis).
  const weight_matrix& token_embd() const { return tok_embd_; }
  const std::vector<llama_layer>& layers() const { return layers_; }

 private:
  llama_model() = default;

  // Shared pieces of both forward paths, on [T][...] row-major float buffers.
  status check_chunk(std::span<const token_id> tokens, std::span<const float> logits, logits_mode mode) const;
  status check_cache_shape(const kvq::KVCache& cache, std::string_view what) const;
  void embed(std::span<const token_id> tokens, std::vector<float>& x) const;
  status check_lanes(std::span<kvq::KVCache* const> caches, std::span<const kvq::seq_id> seqs,
                     std::string_view what) const;
  // pos: the position of each of the T rows
  void attention_inputs(int layer, const std::vector<float>& x, int64_t T, std::span<const int64_t> pos, std::vector<float>& q,
                        std::vector<float>& k, std::vector<float>& v) const;
  void attention_output_and_ffn(int layer, std::vector<float>& x, const std::vector<float>& attn, int64_t T) const;
  void output_logits(const std::vector<float>& x, int64_t T, std::span<float> logits, logits_mode mode) const;
  void rope(float* rows, int64_t T, int heads, std::span<const int64_t> pos, const std::vector<double>& inv_freq) const;

  std::string name_;
  llama_hparams hp_;
  std::vector<double> inv_freq_;                  // [n_rot / 2] base^(-2i / n_rot)
  std::vector<double> inv_freq_local_;            // [n_rot / 2] the sliding layers' (rope_base_local); empty: none
  std::vector<kvq::attention_variant> variants_;  // [n_layer] or empty (see attention_variants)
  weight_matrix tok_embd_;        // [n_vocab][n_embd]
  std::vector<float> out_norm_;   // [n_embd]
  weight_matrix output_;          // [n_vocab][n_embd]; empty when tied
  bool tied_output_ = false;
  std::vector<llama_layer> layers_;
  std::shared_ptr<thread_pool> pool_ = std::make_shared<thread_pool>();
  cpu_isa isa_ = best_isa();
};

/// Index of the largest logit (the first on ties); -1 for an empty span.
token_id argmax(std::span<const float> logits);

/// Creates a CPU cache for `model` under a static policy given by `policy_spec` (the grammar of
/// `kvq::static_policy::parse`, e.g. "fp16", "k=kivi4/g32,v=kivi2/g32;0=fp16"), with a budget
/// in bytes and the paging of `kvq::cache_shape` (page_tokens, window R, recent r); it attends
/// as the model does (`attention_variants()` as `cache_config::attention`, the model's softmax
/// scale), on as many threads as the model's products (`cache_config::cpu_threads`: one stream).
/// Errors: the spec parser's or the cache's (e.g. a quantized format with head_dim not a multiple of 32).
result<kvq::KVCache> make_cache(const llama_model& model, std::string_view policy_spec, uint64_t budget_bytes,
                                int page_tokens = 64, int window = 128, int recent = 64);

}  // namespace kvq::llama
