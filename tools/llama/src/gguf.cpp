#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <llama/gguf.hpp>

namespace kvq::llama {

namespace detail {

/// The bytes of a file: either a read-only private mapping or an owned buffer.
struct gguf_storage {
  const uint8_t* data = nullptr;
  uint64_t size = 0;
  void* map = nullptr;  // non-null: munmap on destruction
  std::vector<uint8_t> owned;

  gguf_storage() = default;
  gguf_storage(const gguf_storage&) = delete;
  gguf_storage& operator=(const gguf_storage&) = delete;
  ~gguf_storage() {
    if (map) ::munmap(map, size);
  }
};

}  // namespace detail

namespace {

constexpr uint64_t default_alignment = 32;
constexpr int max_array_depth = 8;  // nested arrays deeper than this are rejected, not recursed
// Memory the parsed metadata may take beyond the file's own size. A one-byte array element takes
// a whole `gguf_value` in memory (tens of bytes), so checking counts against the bytes left
// alone would let a file make the reader allocate many times its size. Real metadata (a 256k
// vocabulary with scores and types) takes well under this.
constexpr uint64_t metadata_memory_floor = uint64_t(64) << 20;

/// Bounds-checked little-endian cursor over the file. Each read either succeeds or returns an
/// io_error naming the file, the byte offset and what was being read.
class reader {
 public:
  reader(const uint8_t* data, uint64_t size, const std::string& path) : p_(data), size_(size), path_(path) {}

  uint64_t pos() const { return pos_; }
  uint64_t left() const { return size_ - pos_; }

  /// Accounts `bytes` more of metadata memory; false (nothing accounted) when that would take the
  /// metadata past the file's size plus `metadata_memory_floor`.
  bool charge(uint64_t bytes) {
    if (bytes > size_ + metadata_memory_floor - charged_) return false;
    charged_ += bytes;
    return true;
  }
  /// io_error for the metadata `what` (with its count) whose `charge` failed.
  status over_limit(const std::string& what) const {
    return error(fmt::format("{} would take the metadata's memory past {} bytes, the limit for a file of {} bytes",
                             what, size_ + metadata_memory_floor, size_));
  }

  /// io_error "<path>: <message>".
  status error(const std::string& message) const { return {errc::io_error, fmt::format("{}: {}", path_, message)}; }

  status fail(const std::string& what, uint64_t need) const {
    return {errc::io_error, fmt::format("{}: truncated at byte {} while reading {} (needs {} bytes, {} left)", path_,
                                        pos_, what, need, left())};
  }

  template <class T>
  status read(T& out, const std::string& what) {
    if (left() < sizeof(T)) return fail(what, sizeof(T));
    std::memcpy(&out, p_ + pos_, sizeof(T));  // NOTE: hosts are little-endian (x86-64, aarch64)
    pos_ += sizeof(T);
    return {};
  }

  status read_string(std::string& out, const std::string& what) {
    uint64_t n = 0;
    KVQ_TRY(read(n, what + " (length)"));
    if (n > left()) return fail(fmt::format("{} of length {}", what, n), n);
    out.assign(reinterpret_cast<const char*>(p_ + pos_), size_t(n));
    pos_ += n;
    return {};
  }

 private:
  const uint8_t* p_;
  uint64_t size_;
  uint64_t pos_ = 0;
  uint64_t charged_ = 0;  // memory accounted by `charge`
  const std::string& path_;
};

// Smallest possible encoded size of one value of type t (0 for an unknown type).
uint64_t min_value_bytes(gguf_value_type t) {
  switch (t) {
    case gguf_value_type::u8:
    case gguf_value_type::i8:
    case gguf_value_type::boolean:
      return 1;
    case gguf_value_type::u16:
    case gguf_value_type::i16:
      return 2;
    case gguf_value_type::u32:
    case gguf_value_type::i32:
    case gguf_value_type::f32:
      return 4;
    case gguf_value_type::u64:
    case gguf_value_type::i64:
    case gguf_value_type::f64:
    case gguf_value_type::string:
      return 8;
    case gguf_value_type::array:
      return 12;
  }
  return 0;
}

bool known_value_type(uint32_t t) { return t <= uint32_t(gguf_value_type::f64); }

status read_value(reader& r, gguf_value_type t, gguf_value& out, const std::string& what, int depth) {
  out.type = t;
  switch (t) {
    case gguf_value_type::u8: {
      uint8_t v;
      KVQ_TRY(r.read(v, what));
      out.scalar = uint64_t(v);
      return {};
    }
    case gguf_value_type::i8: {
      int8_t v;
      KVQ_TRY(r.read(v, what));
      out.scalar = int64_t(v);
      return {};
    }
    case gguf_value_type::u16: {
      uint16_t v;
      KVQ_TRY(r.read(v, what));
      out.scalar = uint64_t(v);
      return {};
    }
    case gguf_value_type::i16: {
      int16_t v;
      KVQ_TRY(r.read(v, what));
      out.scalar = int64_t(v);
      return {};
    }
    case gguf_value_type::u32: {
      uint32_t v;
      KVQ_TRY(r.read(v, what));
      out.scalar = uint64_t(v);
      return {};
    }
    case gguf_value_type::i32: {
      int32_t v;
      KVQ_TRY(r.read(v, what));
      out.scalar = int64_t(v);
      return {};
    }
    case gguf_value_type::u64: {
      uint64_t v;
      KVQ_TRY(r.read(v, what));
      out.scalar = v;
      return {};
    }
    case gguf_value_type::i64: {
      int64_t v;
      KVQ_TRY(r.read(v, what));
      out.scalar = v;
      return {};
    }
    case gguf_value_type::f32: {
      float v;
      KVQ_TRY(r.read(v, what));
      out.scalar = double(v);
      return {};
    }
    case gguf_value_type::f64: {
      double v;
      KVQ_TRY(r.read(v, what));
      out.scalar = v;
      return {};
    }
    case gguf_value_type::boolean: {
      uint8_t v;
      KVQ_TRY(r.read(v, what));
      out.scalar = v != 0;
      return {};
    }
    case gguf_value_type::string: {
      std::string s;
      KVQ_TRY(r.read_string(s, what));
      if (!r.charge(s.size())) return r.over_limit(fmt::format("{} ({} bytes)", what, s.size()));
      out.scalar = std::move(s);
      return {};
    }
    case gguf_value_type::array: {
      if (depth >= max_array_depth)
        return r.error(fmt::format("{} nests arrays deeper than {} levels", what, max_array_depth));
      uint32_t et = 0;
      uint64_t n = 0;
      KVQ_TRY(r.read(et, what + " (element type)"));
      if (!known_value_type(et)) return r.error(fmt::format("{} has unknown element type {}", what, et));
      KVQ_TRY(r.read(n, what + " (element count)"));
      out.elem_type = gguf_value_type(et);
      const uint64_t min_bytes = min_value_bytes(out.elem_type);
      if (n > r.left() / min_bytes)
        return r.error(fmt::format("{} claims {} elements of type {} but only {} bytes are left", what, n,
                                   gguf_value_type_name(out.elem_type), r.left()));
      if (!r.charge(n * sizeof(gguf_value)))  // n <= the file's size: no overflow
        return r.over_limit(fmt::format("{} ({} elements)", what, n));
      out.items.resize(size_t(n));
      for (uint64_t i = 0; i < n; ++i)
        KVQ_TRY(read_value(r, out.elem_type, out.items[size_t(i)], fmt::format("{} element {}", what, i), depth + 1));
      return {};
    }
  }
  return r.error(fmt::format("{} has unknown value type {}", what, uint32_t(t)));
}

// a * b, or false on overflow of int64.
bool mul_ok(int64_t a, int64_t b, int64_t& out) {
  if (a != 0 && b > std::numeric_limits<int64_t>::max() / a) return false;
  out = a * b;
  return true;
}

}  // namespace

std::string gguf_value_type_name(gguf_value_type t) {
  switch (t) {
    case gguf_value_type::u8:
      return "u8";
    case gguf_value_type::i8:
      return "i8";
    case gguf_value_type::u16:
      return "u16";
    case gguf_value_type::i16:
      return "i16";
    case gguf_value_type::u32:
      return "u32";
    case gguf_value_type::i32:
      return "i32";
    case gguf_value_type::f32:
      return "f32";
    case gguf_value_type::boolean:
      return "bool";
    case gguf_value_type::string:
      return "string";
    case gguf_value_type::array:
      return "array";
    case gguf_value_type::u64:
      return "u64";
    case gguf_value_type::i64:
      return "i64";
    case gguf_value_type::f64:
      return "f64";
  }
  return fmt::format("type {}", uint32_t(t));
}

bool gguf_value::is_integer() const {
  return std::holds_alternative<uint64_t>(scalar) || std::holds_alternative<int64_t>(scalar);
}

std::string gguf_tensor_info::shape_string() const {
  std::string s = "[";
  for (int i = 0; i < n_dims; ++i) s += fmt::format("{}{}", i ? ", " : "", ne[size_t(i)]);
  return s + "]";
}

// ---- opening and parsing ------------------------------------------------------------------------

result<gguf_file> gguf_file::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return status{errc::io_error, fmt::format("{}: cannot open: {}", path, std::strerror(errno))};
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    return status{errc::io_error, fmt::format("{}: cannot stat: {}", path, std::strerror(e))};
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return status{errc::io_error, fmt::format("{}: not a regular file", path)};
  }
  auto storage = std::make_shared<detail::gguf_storage>();
  storage->size = uint64_t(st.st_size);
  if (storage->size > 0) {
    void* m = ::mmap(nullptr, size_t(storage->size), PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      return status{errc::io_error, fmt::format("{}: cannot mmap {} bytes: {}", path, storage->size, std::strerror(e))};
    }
    storage->map = m;
    storage->data = static_cast<const uint8_t*>(m);
  }
  ::close(fd);  // the mapping stays valid
  return parse(std::move(storage), path);
}

result<gguf_file> gguf_file::from_bytes(std::vector<uint8_t> bytes, std::string name) {
  auto storage = std::make_shared<detail::gguf_storage>();
  storage->owned = std::move(bytes);
  storage->data = storage->owned.data();
  storage->size = storage->owned.size();
  return parse(std::move(storage), std::move(name));
}

result<gguf_file> gguf_file::parse(std::shared_ptr<const detail::gguf_storage> storage, std::string name) {
  gguf_file f;
  f.storage_ = storage;
  f.path_ = std::move(name);
  const std::string& path = f.path_;
  reader r(storage->data, storage->size, path);

  // Header.
  if (storage->size < 4)
    return status{errc::io_error, fmt::format("{}: {} bytes is too short for a GGUF file", path, storage->size)};
  if (std::memcmp(storage->data, "GGUF", 4) != 0)
    return status{errc::io_error,
                  fmt::format("{}: not a GGUF file (magic bytes {:02x} {:02x} {:02x} {:02x}, expected "
                              "\"GGUF\")",
                              path, storage->data[0], storage->data[1], storage->data[2], storage->data[3])};
  uint32_t magic = 0;
  KVQ_TRY(r.read(magic, "the magic"));
  KVQ_TRY(r.read(f.version_, "the version"));
  if (f.version_ == 0x03000000u || f.version_ == 0x02000000u)
    return status{errc::unsupported, fmt::format("{}: big-endian GGUF files are not supported", path)};
  if (f.version_ != 3 && f.version_ != 2)
    return status{errc::unsupported,
                  fmt::format("{}: GGUF version {} is not supported (expected 3)", path, f.version_)};
  uint64_t n_tensors = 0, n_kv = 0;
  KVQ_TRY(r.read(n_tensors, "the tensor count"));
  KVQ_TRY(r.read(n_kv, "the metadata count"));
  // Each entry takes at least 13 bytes (key length, type, 1-byte value); each tensor info 32
  // (checked after the metadata).
  if (n_kv > r.left() / 13)
    return status{errc::io_error, fmt::format("{}: header claims {} metadata entries but the file has only {} bytes "
                                              "left",
                                              path, n_kv, r.left())};

  // Metadata.
  if (!r.charge(n_kv * sizeof(gguf_kv))) return r.over_limit(fmt::format("the metadata table ({} entries)", n_kv));
  f.kv_.reserve(size_t(n_kv));
  for (uint64_t i = 0; i < n_kv; ++i) {
    gguf_kv kv;
    KVQ_TRY(r.read_string(kv.key, fmt::format("the key of metadata entry {}", i)));
    uint32_t t = 0;
    const std::string what = fmt::format("metadata '{}'", kv.key);
    KVQ_TRY(r.read(t, what + " (type)"));
    if (!known_value_type(t))
      return status{errc::io_error, fmt::format("{}: {} has unknown value type {}", path, what, t)};
    KVQ_TRY(read_value(r, gguf_value_type(t), kv.value, what, 0));
    if (f.kv_index_.count(kv.key))
      return status{errc::io_error, fmt::format("{}: metadata key '{}' appears twice", path, kv.key)};
    f.kv_index_.emplace(kv.key, f.kv_.size());
    f.kv_.push_back(std::move(kv));
  }

  // Alignment.
  if (const gguf_value* a = f.find("general.alignment")) {
    if (a->type != gguf_value_type::u32)
      return status{errc::io_error, fmt::format("{}: general.alignment has type {}, expected u32", path,
                                                gguf_value_type_name(a->type))};
    const uint64_t al = std::get<uint64_t>(a->scalar);
    if (al == 0 || (al & (al - 1)) != 0)
      return status{errc::io_error, fmt::format("{}: general.alignment {} is not a power of two", path, al)};
    f.alignment_ = al;
  } else {
    f.alignment_ = default_alignment;
  }

  // Tensor infos.
  if (n_tensors > r.left() / 32)
    return status{errc::io_error, fmt::format("{}: header claims {} tensors but the file has only {} bytes left", path,
                                              n_tensors, r.left())};
  f.tensors_.reserve(size_t(n_tensors));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    gguf_tensor_info t;
    KVQ_TRY(r.read_string(t.name, fmt::format("the name of tensor {}", i)));
    const std::string what = fmt::format("tensor '{}'", t.name);
    uint32_t n_dims = 0;
    KVQ_TRY(r.read(n_dims, what + " (dimension count)"));
    if (n_dims < 1 || n_dims > 4)
      return status{errc::io_error, fmt::format("{}: {} has {} dimensions (expected 1 to 4)", path, what, n_dims)};
    t.n_dims = int(n_dims);
    for (uint32_t d = 0; d < n_dims; ++d) {
      uint64_t ne = 0;
      KVQ_TRY(r.read(ne, fmt::format("{} (dimension {})", what, d)));
      if (ne == 0 || ne > uint64_t(std::numeric_limits<int64_t>::max()))
        return status{errc::io_error, fmt::format("{}: {} has invalid dimension {} = {}", path, what, d, ne)};
      t.ne[d] = int64_t(ne);
    }
    KVQ_TRY(r.read(t.type, what + " (type)"));
    KVQ_TRY(r.read(t.offset, what + " (offset)"));
    const type_info* ti = find_type(t.type);
    if (!ti) return status{errc::unsupported, fmt::format("{}: {} has unknown type id {}", path, what, t.type)};
    int64_t elems = 1;
    for (int d = 0; d < 4; ++d)
      if (!mul_ok(elems, t.ne[size_t(d)], elems))
        return status{errc::io_error,
                      fmt::format("{}: {} shape {} overflows the element count", path, what, t.shape_string())};
    t.elements = elems;
    if (t.ne[0] % ti->block_elems != 0)
      return status{errc::io_error, fmt::format("{}: {} of type {} has ne[0] = {}, not a multiple of its block of {}",
                                                path, what, ti->name, t.ne[0], ti->block_elems)};
    int64_t bytes = 0;
    if (!mul_ok(elems / ti->block_elems, ti->block_bytes, bytes))
      return status{errc::io_error, fmt::format("{}: {} byte size overflows", path, what)};
    t.bytes = uint64_t(bytes);
    if (t.offset % f.alignment_ != 0)
      return status{errc::io_error, fmt::format("{}: {} offset {} is not a multiple of the alignment {}", path, what,
                                                t.offset, f.alignment_)};
    if (f.tensor_index_.count(t.name))
      return status{errc::io_error, fmt::format("{}: tensor name '{}' appears twice", path, t.name)};
    f.tensor_index_.emplace(t.name, f.tensors_.size());
    f.tensors_.push_back(std::move(t));
  }

  // Data section: starts at the next multiple of the alignment; every tensor must lie inside.
  const uint64_t header_end = r.pos();
  f.data_offset_ = (header_end + f.alignment_ - 1) / f.alignment_ * f.alignment_;
  if (!f.tensors_.empty()) {
    if (f.data_offset_ > storage->size)
      return status{errc::io_error, fmt::format("{}: truncated: the data section would start at byte {} but the file "
                                                "has {} bytes",
                                                path, f.data_offset_, storage->size)};
    const uint64_t data_size = storage->size - f.data_offset_;
    for (const auto& t : f.tensors_) {
      if (t.offset > data_size || t.bytes > data_size - t.offset)
        return status{errc::io_error,
                      fmt::format("{}: tensor '{}' ({} {}, {} bytes at data offset {}) extends past "
                                  "the end of the file ({} data bytes)",
                                  path, t.name, type_name(t.type), t.shape_string(), t.bytes, t.offset, data_size)};
    }
  }
  return f;
}

// ---- accessors ----------------------------------------------------------------------------------

uint64_t gguf_file::file_size() const { return storage_ ? storage_->size : 0; }

const gguf_value* gguf_file::find(std::string_view key) const {
  auto it = kv_index_.find(std::string(key));
  return it == kv_index_.end() ? nullptr : &kv_[it->second].value;
}

namespace {

status missing_key(const std::string& path, std::string_view key) {
  return {errc::not_found, fmt::format("{}: metadata key '{}' is missing", path, key)};
}

status wrong_type(const std::string& path, std::string_view key, const gguf_value& v, const char* expected) {
  std::string got = gguf_value_type_name(v.type);
  if (v.is_array()) got += " of " + gguf_value_type_name(v.elem_type);
  return {errc::invalid_argument,
          fmt::format("{}: metadata key '{}' has type {}, expected {}", path, key, got, expected)};
}

bool as_int(const gguf_value& v, int64_t& out) {
  if (const auto* u = std::get_if<uint64_t>(&v.scalar)) {
    if (*u > uint64_t(std::numeric_limits<int64_t>::max())) return false;
    out = int64_t(*u);
    return true;
  }
  if (const auto* s = std::get_if<int64_t>(&v.scalar)) {
    out = *s;
    return true;
  }
  return false;
}

bool as_float(const gguf_value& v, double& out) {
  if (const auto* d = std::get_if<double>(&v.scalar)) {
    out = *d;
    return true;
  }
  int64_t i;
  if (as_int(v, i)) {
    out = double(i);
    return true;
  }
  return false;
}

}  // namespace

result<std::string> gguf_file::get_string(std::string_view key) const {
  const gguf_value* v = find(key);
  if (!v) return missing_key(path_, key);
  if (const auto* s = std::get_if<std::string>(&v->scalar)) return *s;
  return wrong_type(path_, key, *v, "string");
}

result<int64_t> gguf_file::get_int(std::string_view key) const {
  const gguf_value* v = find(key);
  if (!v) return missing_key(path_, key);
  int64_t i;
  if (as_int(*v, i)) return i;
  return wrong_type(path_, key, *v, "an integer");
}

result<double> gguf_file::get_float(std::string_view key) const {
  const gguf_value* v = find(key);
  if (!v) return missing_key(path_, key);
  double d;
  if (as_float(*v, d)) return d;
  return wrong_type(path_, key, *v, "a number");
}

result<bool> gguf_file::get_bool(std::string_view key) const {
  const gguf_value* v = find(key);
  if (!v) return missing_key(path_, key);
  if (const auto* b = std::get_if<bool>(&v->scalar)) return *b;
  return wrong_type(path_, key, *v, "bool");
}

result<std::vector<std::string>> gguf_file::get_string_array(std::string_view key) const {
  const gguf_value* v = find(key);
  if (!v) return missing_key(path_, key);
  if (!v->is_array() || v->elem_type != gguf_value_type::string) return wrong_type(path_, key, *v, "array of string");
  std::vector<std::string> out;
  out.reserve(v->items.size());
  for (const auto& it : v->items) out.push_back(std::get<std::string>(it.scalar));
  return out;
}

result<std::vector<float>> gguf_file::get_float_array(std::string_view key) const {
  const gguf_value* v = find(key);
  if (!v) return missing_key(path_, key);
  if (!v->is_array() || v->elem_type == gguf_value_type::string || v->elem_type == gguf_value_type::array ||
      v->elem_type == gguf_value_type::boolean)
    return wrong_type(path_, key, *v, "array of numbers");
  std::vector<float> out;
  out.reserve(v->items.size());
  for (const auto& it : v->items) {
    double d = 0;
    if (!as_float(it, d)) return wrong_type(path_, key, *v, "array of numbers");
    out.push_back(float(d));
  }
  return out;
}

result<std::vector<int64_t>> gguf_file::get_int_array(std::string_view key) const {
  const gguf_value* v = find(key);
  if (!v) return missing_key(path_, key);
  if (!v->is_array()) return wrong_type(path_, key, *v, "array of integers");
  std::vector<int64_t> out;
  out.reserve(v->items.size());
  for (const auto& it : v->items) {
    int64_t i = 0;
    if (!as_int(it, i)) return wrong_type(path_, key, *v, "array of integers");
    out.push_back(i);
  }
  return out;
}

result<int64_t> gguf_file::get_int_or(std::string_view key, int64_t fallback) const {
  return find(key) ? get_int(key) : result<int64_t>(fallback);
}

result<double> gguf_file::get_float_or(std::string_view key, double fallback) const {
  return find(key) ? get_float(key) : result<double>(fallback);
}

result<bool> gguf_file::get_bool_or(std::string_view key, bool fallback) const {
  return find(key) ? get_bool(key) : result<bool>(fallback);
}

const gguf_tensor_info* gguf_file::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(std::string(name));
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

std::span<const uint8_t> gguf_file::tensor_bytes(const gguf_tensor_info& t) const {
  return {storage_->data + data_offset_ + t.offset, size_t(t.bytes)};
}

status gguf_file::dequantize_into(const gguf_tensor_info& t, std::span<float> out) const {
  if (out.size() != size_t(t.elements))
    return {errc::invalid_argument,
            fmt::format("{}: tensor '{}' has {} elements, the output {}", path_, t.name, t.elements, out.size())};
  status s = kvq::llama::dequantize(ggml_type(t.type), tensor_bytes(t), out);
  if (!s.ok()) return {s.code(), fmt::format("{}: tensor '{}': {}", path_, t.name, s.message())};
  return {};
}

result<std::vector<float>> gguf_file::dequantize(std::string_view name) const {
  const gguf_tensor_info* t = find_tensor(name);
  if (!t) return status{errc::not_found, fmt::format("{}: tensor '{}' is missing", path_, name)};
  const type_info* ti = find_type(t->type);
  if (!ti || !ti->dequantizable)
    return status{errc::unsupported, fmt::format("{}: tensor '{}' has type {}, which this loader cannot convert to "
                                                 "float",
                                                 path_, name, type_name(t->type))};
  std::vector<float> out(size_t(t->elements));
  KVQ_TRY(dequantize_into(*t, out));
  return out;
}

}  // namespace kvq::llama
