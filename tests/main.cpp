// Catch2 entry point of kvq's tests; prints the random seed so that a failure can be replayed.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

int main(int argc, char** argv) { return Catch::Session().run(argc, argv); }
