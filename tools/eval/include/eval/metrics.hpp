#pragma once
/// \file
/// The quality measures of kvq-eval on next-token distributions: log-softmax, KL divergence of
/// the FP16-cache distribution to a quantized-cache distribution, top-1 agreement and negative
/// log-likelihood, and an accumulator that turns per-position values into the reported means.
///
/// All sums run in double: a KL of 1e-6 nats over a 49152-token vocabulary is a sum of terms
/// that cancel to 7 significant digits, which float cannot hold.

#include <cstdint>
#include <span>
#include <vector>

namespace kvq::eval {

/// Natural-log softmax of `logits` into `out` (same size), computed in double and stable for any
/// finite logits (the maximum is subtracted first). `out` may alias nothing in `logits`.
/// \param logits [n_vocab] raw model outputs
/// \param out [n_vocab] log-probabilities, each <= 0, logsumexp(out) = 0
void log_softmax(std::span<const float> logits, std::span<double> out);

/// KL(P ‖ Q) = Σ_i p_i (log p_i − log q_i) in nats, from log-probabilities. Terms with p_i = 0
/// contribute 0; the result is >= 0 up to rounding and clamped at 0.
/// \param log_p [n] reference log-probabilities (the FP16 cache)
/// \param log_q [n] compared log-probabilities (a quantized cache)
double kl_divergence(std::span<const double> log_p, std::span<const double> log_q);

/// Index of the largest value, the first on ties; -1 for an empty span.
int64_t argmax(std::span<const double> values);

/// Means of the measures over one range of absolute positions [first, end).
struct position_bucket {
  int64_t first = 0;      ///< first absolute position of the range
  int64_t end = 0;        ///< one past the last absolute position of the range
  int64_t positions = 0;  ///< measured positions that fell in the range (> 0)
  double mean_kl = 0;     ///< mean KL(P_ref ‖ P_this), nats
  double top1_agreement = 1;
  double mean_nll = 0;  ///< mean −log P(true next token), nats
  /// exp(mean NLL) over the range.
  double perplexity() const;
};

/// The fixed edges of the long-context position buckets, absolute positions: 0, 512, 1K, 2K, 4K,
/// 8K, then doubling until `end` (one past the last position) is covered. Fixed edges keep the
/// buckets of runs with different prefills and lengths comparable, and doubling reads well on a
/// log position axis.
std::vector<int64_t> position_bucket_edges(int64_t end);

/// Per-position measures of one configuration against the reference, accumulated over the
/// teacher-forced positions. `add` takes one position; the accessors give the reported values.
class metric_accumulator {
 public:
  /// Adds one position: `kl` = KL(P_ref ‖ P_this), `agree` = argmax equal to the reference's,
  /// `nll` = −log P_this(true next token).
  void add(double kl, bool agree, double nll);

  int64_t positions() const { return n_; }
  /// Mean KL(P_ref ‖ P_this) in nats; 0 with no positions.
  double mean_kl() const { return n_ ? kl_sum_ / double(n_) : 0.0; }
  /// Largest per-position KL.
  double max_kl() const { return kl_max_; }
  /// The q-quantile (0..1) of the per-position KL values (nearest rank); 0 with no positions.
  double kl_quantile(double q) const;
  /// Fraction of positions whose argmax equals the reference's; 1 with no positions.
  double top1_agreement() const { return n_ ? double(agree_) / double(n_) : 1.0; }
  /// Mean negative log-likelihood of the true next token, nats.
  double mean_nll() const { return n_ ? nll_sum_ / double(n_) : 0.0; }
  /// exp(mean NLL).
  double perplexity() const;
  /// Per-position KL values in order (for quantiles and the KL-over-position chart).
  const std::vector<double>& kl_values() const { return kl_; }
  /// Per-position top-1 agreement (1 = argmax equal to the reference's), in order.
  const std::vector<uint8_t>& agree_values() const { return agree_v_; }
  /// Per-position negative log-likelihoods, in order.
  const std::vector<double>& nll_values() const { return nll_; }
  /// Mean KL of consecutive buckets of `bucket` positions (the last one may be shorter).
  std::vector<double> kl_by_bucket(int64_t bucket) const;
  /// Means over the ranges between consecutive `edges` (absolute positions, ascending), the
  /// first value added being at absolute position `first_position`; ranges holding no measured
  /// position are left out.
  std::vector<position_bucket> by_position(int64_t first_position, std::span<const int64_t> edges) const;

 private:
  int64_t n_ = 0, agree_ = 0;
  double kl_sum_ = 0, kl_max_ = 0, nll_sum_ = 0;
  std::vector<double> kl_, nll_;
  std::vector<uint8_t> agree_v_;
};

}  // namespace kvq::eval
