#pragma once
/// \file
/// Skipping a Catch2 v2 test case so that it cannot count as passed (Catch2 v2 has no SKIP).
///
/// `KVQ_SKIP(reason)` prints "SKIPPED: <reason>", records the skip and leaves the test case. The
/// test binary's main, `kvq::test::run_catch_session`, returns `skip_exit_code` (77) when test
/// cases ran, none failed and every one of them was skipped; CMake registers that code as the
/// ctest entry's SKIP_RETURN_CODE, so ctest reports the entry as skipped. Entries that mix
/// skippable and ordinary cases are split by tag (e.g. "[gguf]~[smollm2]" and "[smollm2]").
///
/// The one main file (catch_main.cpp, the library kvq_catch_main) defines CATCH_CONFIG_RUNNER
/// before including this header; test files include it for the macro only.

#include <catch2/catch.hpp>

#include <cstdio>
#include <set>
#include <string>

namespace kvq::test {

/// Exit code of a run whose test cases were all skipped (ctest's SKIP_RETURN_CODE).
inline constexpr int skip_exit_code = 77;

/// Names of the test cases skipped so far in this process.
inline std::set<std::string>& skipped_cases() {
  static std::set<std::string> s;
  return s;
}

/// Records that the running test case is skipped.
inline void record_skip() { skipped_cases().insert(Catch::getResultCapture().getCurrentTestName()); }

}  // namespace kvq::test

/// Leaves the running test case as skipped, printing `reason` (a stream expression).
#define KVQ_SKIP(reason)         \
  do {                           \
    WARN("SKIPPED: " << reason); \
    ::kvq::test::record_skip();  \
    return;                      \
  } while (false)

#ifdef CATCH_CONFIG_RUNNER
namespace kvq::test {

/// Counts the test cases that run, so the main can tell "all skipped" from "some passed".
struct run_counter : Catch::TestEventListenerBase {
  using TestEventListenerBase::TestEventListenerBase;
  static std::set<std::string>& started() {
    static std::set<std::string> s;
    return s;
  }
  void testCaseStarting(Catch::TestCaseInfo const& info) override { started().insert(info.name); }
};

/// Runs the Catch2 session: its failure count, or `skip_exit_code` when every test case that ran
/// was skipped. Skips are listed on stderr either way.
inline int run_catch_session(int argc, char** argv) {
  const int failed = Catch::Session().run(argc, argv);
  const auto& skipped = skipped_cases();
  for (const auto& name : skipped) std::fprintf(stderr, "SKIPPED (not counted as passed): %s\n", name.c_str());
  if (failed == 0 && !skipped.empty() && skipped.size() == run_counter::started().size()) return skip_exit_code;
  return failed;
}

CATCH_REGISTER_LISTENER(run_counter)

}  // namespace kvq::test
#endif
