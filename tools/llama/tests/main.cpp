// Catch2 v2 main of the kvq_llama tests.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
