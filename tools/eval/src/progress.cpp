#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <eval/progress.hpp>

namespace kvq::eval {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = int64_t(std::llround(seconds));
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}h{:02}m", s / 3600, (s % 3600) / 60);
}

progress_bar::progress_bar(std::string phase, int64_t total, bool enabled, std::string unit, std::FILE* out)
    : phase_(std::move(phase)),
      unit_(std::move(unit)),
      total_(std::max<int64_t>(total, 1)),
      enabled_(enabled),
      out_(out) {
  tty_ = out_ && isatty(fileno(out_));
  start_ = last_draw_ = std::chrono::steady_clock::now();
}

progress_bar::~progress_bar() { finish(); }

double progress_bar::elapsed() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void progress_bar::advance(int64_t n) {
  if (!enabled_) return;
  std::lock_guard lock(mu_);
  done_ = std::min(total_, done_ + n);
  const auto now = std::chrono::steady_clock::now();
  if (samples_.empty() || now - samples_.back().first >= std::chrono::milliseconds(500))
    samples_.emplace_back(now, done_);
  draw(false);
}

void progress_bar::finish() {
  if (!enabled_) return;
  std::lock_guard lock(mu_);
  if (finished_) return;
  finished_ = true;
  if (shown_) draw(true);
}

void progress_bar::draw(bool final) {
  const auto now = std::chrono::steady_clock::now();
  const double t = std::chrono::duration<double>(now - start_).count();
  if (!final && t < 1.0) return;
  if (!final && now - last_draw_ < (tty_ ? tty_interval : log_interval)) return;
  last_draw_ = now;
  shown_ = true;
  // The rate over the last rate_window (a burst at the start, such as a prefill, would make the
  // average since the start promise too much); the average since the start at the end.
  while (samples_.size() > 1 && now - samples_[1].first >= rate_window) samples_.pop_front();
  double rate = t > 0 ? double(done_) / t : 0.0;
  if (!final && !samples_.empty()) {
    const double span = std::chrono::duration<double>(now - samples_.front().first).count();
    if (span >= 2.0) rate = double(done_ - samples_.front().second) / span;
  }
  const double eta = rate > 0 ? double(total_ - done_) / rate : -1;
  constexpr int width = 24;
  const int filled = int(width * done_ / total_);
  std::string bar(size_t(filled), '#');
  bar.resize(width, '.');
  const std::string line = fmt::format("{} [{}] {}/{} {}  {:.1f} {}/s  {} {}", phase_, bar, done_, total_, unit_, rate,
                                       unit_, final ? "took" : "ETA", format_duration(final ? t : eta));
  if (tty_)
    fmt::print(out_, "\r{}\x1b[K{}", line, final ? "\n" : "");
  else
    fmt::print(out_, "{}\n", line);
  std::fflush(out_);
}

}  // namespace kvq::eval
