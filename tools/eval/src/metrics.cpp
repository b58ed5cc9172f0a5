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
  nll_.push_back(nll);
  agree_v_.push_back(agree ? 1 : 0);
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

double position_bucket::perplexity() const { return std::exp(mean_nll); }

std::vector<int64_t> position_bucket_edges(int64_t end) {
  std::vector<int64_t> edges = {0, 512};
  while (edges.back() < end) edges.push_back(edges.back() * 2);
  return edges;
}

std::vector<position_bucket> metric_accumulator::by_position(int64_t first_position,
                                                             std::span<const int64_t> edges) const {
  std::vector<position_bucket> out;
  for (size_t e = 0; e + 1 < edges.size(); ++e) {
    const int64_t lo = std::max(edges[e] - first_position, int64_t(0));
    const int64_t hi = std::min(edges[e + 1] - first_position, n_);
    if (hi <= lo) continue;
    position_bucket b;
    b.first = edges[e];
    b.end = edges[e + 1];
    b.positions = hi - lo;
    double kl = 0, nll = 0;
    int64_t agree = 0;
    for (int64_t i = lo; i < hi; ++i) {
      kl += kl_[size_t(i)];
      nll += nll_[size_t(i)];
      agree += agree_v_[size_t(i)];
    }
    b.mean_kl = kl / double(b.positions);
    b.mean_nll = nll / double(b.positions);
    b.top1_agreement = double(agree) / double(b.positions);
    out.push_back(b);
  }
  return out;
}

}  // namespace kvq::eval
