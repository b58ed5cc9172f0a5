#pragma once
/// \file
/// GGUF v3 reader: header, metadata of every value type (arrays included, nested or not), tensor
/// infos, alignment, and the tensor bytes of a memory-mapped file, with dequantization to float.
///
/// File layout (all integers little-endian; `str` = u64 byte length + bytes, no terminator):
///
/// | part          | contents                                                                |
/// |---------------|-------------------------------------------------------------------------|
/// | header        | magic "GGUF", u32 version (3; 2 is read the same way), u64 n_tensors, u64 n_kv |
/// | metadata × n_kv | str key, u32 value type, value (array: u32 elem type, u64 n, n values)  |
/// | tensor info × n_tensors | str name, u32 n_dims (1..4), u64 ne[n_dims], u32 type, u64 offset |
/// | padding       | to a multiple of `general.alignment` (u32, default 32)                  |
/// | tensor data   | each tensor at data start + offset (offset a multiple of the alignment) |
///
/// Robustness: every count, length and offset is checked against the bytes that remain before it
/// is used, so a truncated or corrupt file gives an `errc::io_error` naming the file, the entry
/// and the problem; nothing reads outside the file and no count read from the file can make the
/// reader allocate more than the file's size allows.

#include <array>
#include <cstdint>
#include <kvq/status.hpp>
#include <llama/quant.hpp>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <variant>
#include <vector>

namespace kvq::llama {

/// Value types of GGUF metadata, numbered as in the file.
enum class gguf_value_type : uint32_t {
  u8 = 0,
  i8 = 1,
  u16 = 2,
  i16 = 3,
  u32 = 4,
  i32 = 5,
  f32 = 6,
  boolean = 7,
  string = 8,
  array = 9,
  u64 = 10,
  i64 = 11,
  f64 = 12,
};

/// "u32", "string", "array", ... ("type 42" for an unknown id).
std::string gguf_value_type_name(gguf_value_type t);

/// One metadata value. Scalars keep their type: unsigned integers in `uint64_t`, signed ones in
/// `int64_t`, floats in `double`; an array holds its elements in `items` (which may be arrays).
struct gguf_value {
  gguf_value_type type = gguf_value_type::u8;
  gguf_value_type elem_type = gguf_value_type::u8;  ///< arrays only
  std::variant<std::monostate, uint64_t, int64_t, double, bool, std::string> scalar;
  std::vector<gguf_value> items;  ///< arrays only

  bool is_array() const { return type == gguf_value_type::array; }
  bool is_integer() const;
  bool is_float() const { return type == gguf_value_type::f32 || type == gguf_value_type::f64; }
};

/// One metadata entry, in file order.
struct gguf_kv {
  std::string key;
  gguf_value value;
};

/// One tensor's description.
struct gguf_tensor_info {
  std::string name;
  int n_dims = 0;
  std::array<int64_t, 4> ne{1, 1, 1, 1};  ///< ne[0] is the contiguous (innermost) dimension
  uint32_t type = 0;                      ///< `ggml_type` value as read from the file
  uint64_t offset = 0;                    ///< from the start of the data section
  int64_t elements = 0;
  uint64_t bytes = 0;

  /// Rows of ne[0] elements (ne[1] * ne[2] * ne[3]).
  int64_t rows() const { return ne[1] * ne[2] * ne[3]; }
  /// "[64, 512]"
  std::string shape_string() const;
};

namespace detail {
struct gguf_storage;
}

/// A parsed GGUF file. Cheap to move; the tensor bytes stay mapped while any copy lives.
class gguf_file {
 public:
  /// Memory-maps (read-only, private) and parses `path`. Errors: io_error naming the path and
  /// the problem. NOTE: like every mmap reader, a file truncated by someone else while mapped
  /// makes later reads of its tensor bytes fault (SIGBUS); kvq's model files are read-only.
  static result<gguf_file> open(const std::string& path);
  /// Parses bytes already in memory (takes ownership); `name` stands for the path in messages.
  static result<gguf_file> from_bytes(std::vector<uint8_t> bytes, std::string name);

  /// The path (or the name given to `from_bytes`).
  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  /// Byte offset of the data section in the file.
  uint64_t data_offset() const { return data_offset_; }
  /// Total file size in bytes.
  uint64_t file_size() const;

  /// Every metadata entry in file order.
  const std::vector<gguf_kv>& metadata() const { return kv_; }
  /// The value of `key`, or nullptr.
  const gguf_value* find(std::string_view key) const;

  /// Typed getters. Errors: not_found for a missing key, invalid_argument for a value of another
  /// type; each names the file and the key. Integer getters accept every integer type whose value
  /// fits; float getters accept f32, f64 and integers.
  result<std::string> get_string(std::string_view key) const;
  result<int64_t> get_int(std::string_view key) const;
  result<double> get_float(std::string_view key) const;
  result<bool> get_bool(std::string_view key) const;
  result<std::vector<std::string>> get_string_array(std::string_view key) const;
  result<std::vector<float>> get_float_array(std::string_view key) const;
  result<std::vector<int64_t>> get_int_array(std::string_view key) const;
  /// `fallback` when the key is missing; still an error if present with a wrong type.
  result<int64_t> get_int_or(std::string_view key, int64_t fallback) const;
  result<double> get_float_or(std::string_view key, double fallback) const;
  result<bool> get_bool_or(std::string_view key, bool fallback) const;

  /// Every tensor in file order.
  const std::vector<gguf_tensor_info>& tensors() const { return tensors_; }
  /// The tensor called `name`, or nullptr.
  const gguf_tensor_info* find_tensor(std::string_view name) const;
  /// The tensor's raw bytes (validated at parse time to lie inside the file).
  std::span<const uint8_t> tensor_bytes(const gguf_tensor_info& t) const;

  /// Dequantizes the tensor called `name` to float, [rows][ne0]. Errors: not_found (missing
  /// tensor), unsupported (type without a dequantizer); each names the file and the tensor.
  result<std::vector<float>> dequantize(std::string_view name) const;
  /// As above, into `out` of exactly `t.elements` floats.
  status dequantize_into(const gguf_tensor_info& t, std::span<float> out) const;

 private:
  gguf_file() = default;
  static result<gguf_file> parse(std::shared_ptr<const detail::gguf_storage> storage, std::string name);

  std::shared_ptr<const detail::gguf_storage> storage_;
  std::string path_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<gguf_kv> kv_;
  std::unordered_map<std::string, size_t> kv_index_;
  std::vector<gguf_tensor_info> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
};

}  // namespace kvq::llama
