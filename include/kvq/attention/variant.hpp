#pragma once
/// \file
/// `kvq::attention_variant`: how one layer's attention turns scores into weights, beyond
/// softmax(q . k x scale) over every earlier key: a sliding window (Gemma 2/3, Mistral, gpt-oss),
/// logit soft-capping (Gemma 2) and learned sink logits (gpt-oss). A cache takes one per layer
/// (`cache_config::attention`); the reference (`ref::attend`), the CPU and the CUDA kernels apply
/// them the same way (docs/architecture.md, "Attention variants").

#include <kvq/config.hpp>
#include <kvq/status.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

KVQ_NAMESPACE_BEGIN

/// One layer's attention rule. The default is a global layer with a plain softmax.
struct attention_variant {
  /// Sliding window of `window` tokens: a query at position p attends to the keys at positions
  /// p - window < j <= p (itself and the window - 1 before it). 0: every key 0..p (global).
  /// A cache returns the pages of a sliding layer that no later query can see to its budget.
  int32_t window = 0;
  /// Logit soft-capping: each scaled score s becomes softcap x tanh(s / softcap) before the
  /// softmax (Gemma 2: 50). 0: off.
  float softcap = 0.f;
  /// Learned attention-sink logits (gpt-oss), one per query head, in the units of the scaled
  /// scores: head h's softmax runs over its scores and sink_logits[h], and the sink's weight
  /// multiplies no value (the weights of the keys then sum to less than 1). Empty: none.
  /// (Not kvq's FP16 sink *pages*, `cache_config::sink_pages`, which are a storage choice.)
  std::vector<float> sink_logits;

  /// True for a global layer with a plain softmax (what every kernel did before variants).
  bool plain() const { return window == 0 && softcap == 0.f && sink_logits.empty(); }
  /// The first key position a query at position `pos` attends to.
  int64_t first_key(int64_t pos) const { return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0; }
  /// A scaled score as the softmax takes it (soft-capped when softcap is set).
  float cap(float s) const { return softcap > 0.f ? softcap * std::tanh(s / softcap) : s; }
  /// The sink logit of query head h, or -inf when there are none.
  float sink(int h) const { return sink_logits.empty() ? -INFINITY : sink_logits[size_t(h)]; }

  bool operator==(const attention_variant&) const = default;
};

/// A layer's attention rule as the low-level calls take it (`cuda::attend_args::variant`,
/// `cuda::prefill_args::variant`, and `cpu::pool_*` with them): plain values and the sink logits
/// by pointer, [q_heads] floats in the memory the call reads (the device's for the CUDA calls,
/// the host's for the CPU ones).
struct variant_args {
  int32_t window = 0;                  ///< as `attention_variant::window`
  float softcap = 0.f;                 ///< as `attention_variant::softcap`
  const float* sink_logits = nullptr;  ///< [q_heads], nullptr: none
  bool plain() const { return window == 0 && softcap == 0.f && sink_logits == nullptr; }
};

/// The variant `a` stands for, its sink logits copied from host memory ([q_heads] floats).
inline attention_variant variant_of(const variant_args& a, int q_heads) {
  attention_variant v{a.window, a.softcap, {}};
  if (a.sink_logits) v.sink_logits.assign(a.sink_logits, a.sink_logits + q_heads);
  return v;
}

/// Checks a layer's variant against the model's query heads: window >= 0, softcap >= 0 and
/// finite, sink_logits empty or one finite value per query head. Errors name `what` (e.g.
/// "layer 3") and the bad field.
KVQ_EXPORT status check_variant(const attention_variant& v, int q_heads, const char* what);

KVQ_NAMESPACE_END
