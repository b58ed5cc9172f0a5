#pragma once
/// \file
/// A progress bar on stderr for the long phases of kvq-eval:
///
///     teacher-forced [##########..........] 4224/8448 pos  21.4 pos/s  ETA 3m17s
///
/// On a terminal it redraws one line (at most four times a second); otherwise (a log file, CI) it
/// writes a line every 10 seconds so logs stay short. Nothing is shown during the first second,
/// so quick runs stay quiet. The rate and the ETA are over the last 30 seconds, so a burst at the
/// start (a prefill) does not make the ETA too short. `advance` may be called from several
/// threads.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <mutex>
#include <string>

namespace kvq::eval {

/// "4m47s", "1h02m", "12s".
std::string format_duration(double seconds);

class progress_bar {
 public:
  /// \param phase label printed first
  /// \param total units (tokens) the phase will process
  /// \param enabled false: prints nothing at all
  /// \param unit what is counted ("tok", "pos"), printed after the counts and in the rate
  /// \param out the stream (stderr); redrawn in place when it is a terminal
  progress_bar(std::string phase, int64_t total, bool enabled, std::string unit = "tok", std::FILE* out = stderr);
  ~progress_bar();
  progress_bar(const progress_bar&) = delete;
  progress_bar& operator=(const progress_bar&) = delete;

  /// Marks `n` more units done; thread-safe.
  void advance(int64_t n);
  /// Prints the final state (if anything was shown) and ends the line; called by the destructor.
  void finish();
  /// Seconds since construction.
  double elapsed() const;

 private:
  void draw(bool final);

  /// Shortest time between two redraws on a terminal, and between two lines in a log.
  static constexpr std::chrono::milliseconds tty_interval{250}, log_interval{10000};
  /// The rate is measured over this much of the recent past.
  static constexpr std::chrono::seconds rate_window{30};

  std::string phase_, unit_;
  int64_t total_ = 0, done_ = 0;
  bool enabled_ = false, tty_ = false, shown_ = false, finished_ = false;
  std::FILE* out_ = nullptr;
  std::chrono::steady_clock::time_point start_, last_draw_;
  /// (time, units done) every half second or more, the last rate_window of them.
  std::deque<std::pair<std::chrono::steady_clock::time_point, int64_t>> samples_;
  std::mutex mu_;
};

}  // namespace kvq::eval
