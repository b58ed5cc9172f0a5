#pragma once
/// \file
/// Shared helpers of the kvq_llama tests: data paths, file reading, and a minimal GGUF writer for
/// crafting valid and deliberately broken files.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

namespace kvq::llama::test {

/// tests/data/stories260K/stories260K.gguf of the repository.
inline std::string stories_path() { return std::string(KVQ_LLAMA_TEST_DATA) + "/stories260K/stories260K.gguf"; }
inline std::string stories_dir() { return std::string(KVQ_LLAMA_TEST_DATA) + "/stories260K"; }
/// tools/llama/tests/data/<name>
inline std::string own_data(std::string_view name) { return std::string(KVQ_LLAMA_OWN_DATA) + "/" + std::string(name); }
/// models/SmolLM2-135M-Instruct.Q4_1.gguf (git-ignored; put there by the setup script).
inline std::string smollm2_path() { return KVQ_LLAMA_SMOLLM2; }
inline bool have_smollm2() { return std::filesystem::exists(smollm2_path()); }
/// models/gemma-3-270m-q4_k_m.gguf (git-ignored; put there by the setup script).
inline std::string gemma3_path() { return KVQ_LLAMA_GEMMA3; }
inline bool have_gemma3() { return std::filesystem::exists(gemma3_path()); }
/// data/eval/<name> of the repository (the evaluation texts).
inline std::string eval_data(std::string_view name) {
  return std::string(KVQ_LLAMA_EVAL_DATA) + "/" + std::string(name);
}

inline std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// Writes GGUF files field by field. Values are appended in the order of the calls; `build`
/// lays out header, metadata, tensor infos, padding and data.
class gguf_builder {
 public:
  template <class T>
  static void put(std::vector<uint8_t>& b, T v) {
    uint8_t raw[sizeof(T)];
    std::memcpy(raw, &v, sizeof(T));
    b.insert(b.end(), raw, raw + sizeof(T));
  }
  static void put_str(std::vector<uint8_t>& b, std::string_view s) {
    put<uint64_t>(b, s.size());
    b.insert(b.end(), s.begin(), s.end());
  }

  /// A metadata entry of type `type` whose encoded value is `value` (written verbatim).
  gguf_builder& raw_kv(std::string_view key, uint32_t type, const std::vector<uint8_t>& value) {
    put_str(kv_, key);
    put<uint32_t>(kv_, type);
    kv_.insert(kv_.end(), value.begin(), value.end());
    ++n_kv_;
    return *this;
  }
  template <class T>
  gguf_builder& scalar(std::string_view key, uint32_t type, T v) {
    std::vector<uint8_t> b;
    put<T>(b, v);
    return raw_kv(key, type, b);
  }
  gguf_builder& u32(std::string_view key, uint32_t v) { return scalar(key, 4, v); }
  gguf_builder& f32(std::string_view key, float v) { return scalar(key, 6, v); }
  gguf_builder& boolean(std::string_view key, bool v) { return scalar(key, 7, uint8_t(v)); }
  gguf_builder& str(std::string_view key, std::string_view v) {
    std::vector<uint8_t> b;
    put_str(b, v);
    return raw_kv(key, 8, b);
  }
  gguf_builder& str_array(std::string_view key, const std::vector<std::string>& v) {
    std::vector<uint8_t> b;
    put<uint32_t>(b, 8);
    put<uint64_t>(b, v.size());
    for (const auto& s : v) put_str(b, s);
    return raw_kv(key, 9, b);
  }
  template <class T>
  gguf_builder& num_array(std::string_view key, uint32_t elem_type, const std::vector<T>& v) {
    std::vector<uint8_t> b;
    put<uint32_t>(b, elem_type);
    put<uint64_t>(b, v.size());
    for (T x : v) put<T>(b, x);
    return raw_kv(key, 9, b);
  }

  /// A tensor with `data` as its bytes (offset chosen by `build` unless `offset` is given).
  gguf_builder& tensor(std::string_view name, std::vector<uint64_t> ne, uint32_t type, std::vector<uint8_t> data,
                       int64_t offset = -1) {
    tensors_.push_back({std::string(name), std::move(ne), type, std::move(data), offset});
    return *this;
  }

  std::vector<uint8_t> build(uint64_t alignment = 32, uint32_t version = 3) const {
    std::vector<uint8_t> out = {'G', 'G', 'U', 'F'};
    put<uint32_t>(out, version);
    put<uint64_t>(out, tensors_.size());
    put<uint64_t>(out, n_kv_);
    out.insert(out.end(), kv_.begin(), kv_.end());
    std::vector<uint64_t> offsets;
    uint64_t off = 0;
    for (const auto& t : tensors_) {
      off = (off + alignment - 1) / alignment * alignment;
      offsets.push_back(t.offset >= 0 ? uint64_t(t.offset) : off);
      off += t.data.size();
    }
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const auto& t = tensors_[i];
      put_str(out, t.name);
      put<uint32_t>(out, uint32_t(t.ne.size()));
      for (uint64_t d : t.ne) put<uint64_t>(out, d);
      put<uint32_t>(out, t.type);
      put<uint64_t>(out, offsets[i]);
    }
    const uint64_t data_start = (out.size() + alignment - 1) / alignment * alignment;
    out.resize(data_start, 0);
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const auto& t = tensors_[i];
      if (t.offset >= 0) continue;  // explicit offsets are for broken files: no data written
      out.resize(std::max<size_t>(out.size(), data_start + offsets[i]), 0);
      out.insert(out.end(), t.data.begin(), t.data.end());
    }
    return out;
  }

 private:
  struct tensor_spec {
    std::string name;
    std::vector<uint64_t> ne;
    uint32_t type;
    std::vector<uint8_t> data;
    int64_t offset;
  };
  std::vector<uint8_t> kv_;
  uint64_t n_kv_ = 0;
  std::vector<tensor_spec> tensors_;
};

/// The F32 bytes of `v`.
inline std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

/// Position of the first occurrence of `needle` in `hay` (npos if none).
inline size_t find_bytes(const std::vector<uint8_t>& hay, std::string_view needle) {
  auto it = std::search(hay.begin(), hay.end(), needle.begin(), needle.end());
  return it == hay.end() ? std::string::npos : size_t(it - hay.begin());
}

}  // namespace kvq::llama::test
