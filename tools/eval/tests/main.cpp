// Catch2 v2 main of the kvq-eval tests: a run whose test cases were all skipped (SmolLM2
// missing) exits with 77, which ctest reports as skipped.
#define CATCH_CONFIG_RUNNER
#include <catch_skip.hpp>

int main(int argc, char** argv) { return kvq::test::run_catch_session(argc, argv); }
