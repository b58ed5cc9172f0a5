// The progress bar: durations, and silence where it must be silent.
#include <catch2/catch.hpp>
#include <cstdio>
#include <eval/progress.hpp>
#include <string>

using namespace kvq::eval;

namespace {
/// Everything written to `f` so far.
std::string contents(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string s;
  for (int c; (c = std::fgetc(f)) != EOF;) s += char(c);
  return s;
}
}  // namespace

TEST_CASE("format_duration", "[progress]") {
  CHECK(format_duration(0) == "0s");
  CHECK(format_duration(59.4) == "59s");
  CHECK(format_duration(287) == "4m47s");
  CHECK(format_duration(3720) == "1h02m");
  CHECK(format_duration(-1) == "?");
  CHECK(format_duration(1.0 / 0.0) == "?");
}

TEST_CASE("progress_bar: a log (not a terminal) gets nothing from a phase shorter than its interval", "[progress]") {
  std::FILE* f = std::tmpfile();
  REQUIRE(f);
  {
    progress_bar bar("teacher-forced", 100, true, "pos", f);
    for (int i = 0; i < 100; ++i) bar.advance(1);
    bar.finish();
  }
  CHECK(contents(f).empty());
  std::fclose(f);
}

TEST_CASE("progress_bar: disabled prints nothing", "[progress]") {
  std::FILE* f = std::tmpfile();
  REQUIRE(f);
  {
    progress_bar bar("needle", 10, false, "tok", f);
    bar.advance(10);
  }
  CHECK(contents(f).empty());
  std::fclose(f);
}
