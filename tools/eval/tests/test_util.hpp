#pragma once
/// \file
/// Paths shared by the kvq-eval tests.

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>

namespace kvq::eval::test {

/// tests/data/stories260K/stories260K.gguf of the repository (head_dim 8: fp16/bf16 only).
inline std::string stories_path() { return KVQ_EVAL_STORIES; }
/// tools/eval/tests/data/<name>
inline std::string own_data(std::string_view name) { return std::string(KVQ_EVAL_OWN_DATA) + "/" + std::string(name); }
/// Folder the eval:smoke_run ctest writes smoke.json and smoke.html to.
inline std::string smoke_out(std::string_view name) {
  return std::string(KVQ_EVAL_SMOKE_OUT) + "/" + std::string(name);
}

/// models/SmolLM2-135M-Instruct.Q4_1.gguf (git-ignored; put there by the setup script).
inline std::string smollm2_path() { return KVQ_EVAL_SMOLLM2; }
inline bool have_smollm2() { return std::filesystem::exists(smollm2_path()); }
/// models/gemma-3-270m-q4_k_m.gguf (git-ignored; put there by the setup script).
inline std::string gemma3_path() { return KVQ_EVAL_GEMMA3; }
inline bool have_gemma3() { return std::filesystem::exists(gemma3_path()); }

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace kvq::eval::test
