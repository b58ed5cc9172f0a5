// The one Catch2 v2 implementation and main of kvq's CPU test binaries (kvq_tests,
// kvq_cuda_plan_tests, kvq_llama_tests, kvq_eval_tests), compiled once per build into the static
// library kvq_catch_main. A run whose test cases were all skipped exits with 77, which ctest
// reports as skipped (catch_skip.hpp).
#define CATCH_CONFIG_RUNNER
#include "catch_skip.hpp"

int main(int argc, char** argv) { return kvq::test::run_catch_session(argc, argv); }
