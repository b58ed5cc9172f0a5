#include <algorithm>
#include <cmath>
#include <eval/metrics.hpp>
#include <limits>

namespace kvq::eval {

void log_softmax(std::span<const float> logits, std::span<double> out) {
  if (logits.empty()) return;
  double mx = -std::numeric_limits<double>::infinity();
  for (float v : logits) mx = std::max(mx, double(v));
  double sum = 0;
  for (float v : logits) sum += std::exp(double(v) - mx);
  const double lse = mx + std::log(sum);
  for (size_t i = 0; i < logits.size(); ++i) out[i] = double(logits[i]) - lse;
}

double kl_divergence(std::span<const double> log_p, std::span<const double> log_q) {
  double kl = 0;
  for (size_t i = 0; i < log_p.size(); ++i) {
    const double p = std::exp(log_p[i]);
    if (p == 0) continue;
    kl += p * (log_p[i] - log_q[i]);
  }
  return std::max(kl, 0.0);
}

int64_t argmax(std::span<const double> values) {
  if (values.empty()) return -1;
  return int64_t(std::max_element(values.begin(), values.end()) - values.begin());
}

void metric_accumulator::add(double kl, bool agree, double nll) {
  ++n_;
  agree_ += agree ? 1 : 0;
  kl_sum_ += kl;
  kl_max_ = std::max(kl_max_, kl);
  nll_sum_ += nll;
  kl_.push_back(kl);
}

double metric_accumulator::kl_quantile(double q) const {
  if (kl_.empty()) return 0.0;
  std::vector<double> s = kl_;
  // NaN (never expected) sorts last, so the order stays a strict weak ordering.
  std::sort(s.begin(), s.end(), [](double a, double b) { return a < b || (!std::isnan(a) && std::isnan(b)); });
  const double rank = std::ceil(std::clamp(q, 0.0, 1.0) * double(s.size()));
  const size_t i = size_t(std::clamp(rank, 1.0, double(s.size()))) - 1;
  return s[i];
}

double metric_accumulator::perplexity() const { return std::exp(mean_nll()); }

std::vector<double> metric_accumulator::kl_by_bucket(int64_t bucket) const {
  std::vector<double> out;
  if (bucket <= 0) return out;
  for (size_t start = 0; start < kl_.size(); start += size_t(bucket)) {
    const size_t end = std::min(kl_.size(), start + size_t(bucket));
    double s = 0;
    for (size_t i = start; i < end; ++i) s += kl_[i];
    out.push_back(s / double(end - start));
  }
  return out;
}

}  // namespace kvq::eval
