// libFuzzer target of the calibration artifact reader: any input must give an error status or an
// artifact that validates and writes back, without an exception escaping, a crash, a leak or an
// out-of-bounds read. Built with clang and -DKVQ_FUZZ=ON (scripts/test does, in build-fuzz/):
//   build-fuzz/tools/calib/fuzz_artifact -max_total_time=30 corpus/ tools/calib/fuzz/corpus/
// The seed in tools/calib/fuzz/corpus/ is an artifact of `fuzz_shape`.
#include <kvq/calib/artifact.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

namespace {
// 1 layer, 2 q heads, 1 kv head, head_dim 32: small enough that the fuzzer reaches every field.
const kvq::calib::model_shape fuzz_shape{1, 2, 1, 32};
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto a = kvq::calib::artifact::parse(text, "fuzz.json", fuzz_shape);
  if (!a.ok()) return 0;
  // What parses must be valid and serialize again.
  if (!a->validate().ok() || !a->to_json().ok()) std::abort();
  return 0;
}
