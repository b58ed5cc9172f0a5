// kvq._kvq: the Python binding of kvq's C++ API (python/README.md). A thin layer: tensors come in
// through DLPack (torch, numpy, cupy, jax, ...) as views without a copy, every call is the C++
// call of the same name, and a failed call raises the exception class of its error code with
// kvq's message (nothing stored changes: the C++ call validates first).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <kvq/cache/cache.hpp>
#include <kvq/cache/config_string.hpp>
#include <kvq/cache/decode_step.hpp>
#include <kvq/cache/sequence_blob.hpp>
#include <kvq/format/format.hpp>
#include <kvq/policy/echokv.hpp>
#include <kvq/policy/registry.hpp>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#if KVQ_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// ---- errors: one Python class per kvq::errc, all subclasses of kvq.Error ------------------------

std::array<PyObject*, 9> error_types{};  // indexed by kvq::errc; [0] is the base class kvq.Error

[[noreturn]] void raise(const kvq::status& s) { throw kvq::error(s); }
void ok(const kvq::status& s) {
  if (!s.ok()) raise(s);
}
template <class T>
T ok(kvq::result<T>&& r) {
  if (!r.ok()) raise(r.error());
  return std::move(r).value();
}
[[noreturn]] void invalid(std::string message) { raise({kvq::errc::invalid_argument, std::move(message)}); }

void register_errors(nb::module_& m) {
  struct entry {
    kvq::errc code;
    const char* name;
    PyObject* builtin;  // a second base, so that `except ValueError` also catches a bad argument
    const char* doc;
  };
  PyObject* base = PyErr_NewExceptionWithDoc("kvq.Error", "Any error kvq reports; `code` names its kind.",
                                             PyExc_RuntimeError, nullptr);
  m.attr("Error") = nb::handle(base);
  error_types[0] = base;
  const entry entries[] = {
      {kvq::errc::invalid_argument, "InvalidArgument", PyExc_ValueError, "A bad shape, dtype, device, spec or value."},
      {kvq::errc::non_finite, "NonFinite", PyExc_ValueError, "NaN, Inf or beyond-fp16 values in K/V input."},
      {kvq::errc::out_of_budget, "OutOfBudget", nullptr, "The byte budget cannot hold the request."},
      {kvq::errc::not_found, "NotFound", PyExc_LookupError, "An unknown sequence id or missing item."},
      {kvq::errc::io_error, "IOError", PyExc_OSError, "A file could not be read or is corrupt."},
      {kvq::errc::cuda_error, "CudaError", nullptr, "A CUDA runtime call failed."},
      {kvq::errc::unsupported, "Unsupported", PyExc_NotImplementedError,
       "A valid request this build or backend cannot serve."},
      {kvq::errc::comm_error, "CommError", nullptr, "A collective between ranks failed."},
  };
  for (const entry& e : entries) {
    PyObject* bases = e.builtin ? PyTuple_Pack(2, base, e.builtin) : PyTuple_Pack(1, base);
    PyObject* type = PyErr_NewExceptionWithDoc((std::string("kvq.") + e.name).c_str(), e.doc, bases, nullptr);
    Py_DECREF(bases);
    m.attr(e.name) = nb::handle(type);
    error_types[size_t(e.code)] = type;
  }
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const kvq::error& e) {
      PyObject* type = error_types[size_t(e.code())] ? error_types[size_t(e.code())] : error_types[0];
      PyErr_SetString(type, e.what());
    }
  });
}

// ---- tensors: DLPack views checked against the cache ------------------------------------------

/// Inputs may be read-only (a numpy array with writeable=False); outputs may not (nanobind then
/// refuses the argument with a TypeError before kvq sees it).
using in_array = nb::ndarray<nb::ro>;
using out_array = nb::ndarray<>;

enum class where { cpu, cuda };

template <class A>
kvq::dtype dtype_of(const A& a, const char* name) {
  const nb::dlpack::dtype t = a.dtype();
  if (t.lanes == 1 && t.code == uint8_t(nb::dlpack::dtype_code::Float) && t.bits == 32) return kvq::dtype::f32;
  if (t.lanes == 1 && t.code == uint8_t(nb::dlpack::dtype_code::Float) && t.bits == 16) return kvq::dtype::f16;
  if (t.lanes == 1 && t.code == uint8_t(nb::dlpack::dtype_code::Bfloat) && t.bits == 16) return kvq::dtype::bf16;
  invalid(std::string(name) + ": dtype must be float32, float16 or bfloat16 (DLPack code " + std::to_string(t.code) +
          ", " + std::to_string(t.bits) + " bits)");
}

template <class A>
std::string shape_text(const A& a) {
  std::string s = "(";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

template <class A>
void check_device(const A& a, const char* name, where w, int device_id) {
  const int type = a.device_type();
  const bool on_cpu = type == nb::device::cpu::value || type == nb::device::cuda_host::value;
  if (w == where::cpu && !on_cpu)
    invalid(std::string(name) + ": the cache is on the cpu, the tensor on DLPack device type " + std::to_string(type) +
            " (move it with .cpu())");
  if (w == where::cuda) {
    if (type != nb::device::cuda::value && type != nb::device::cuda_managed::value)
      invalid(std::string(name) + ": the cache is on cuda:" + std::to_string(device_id) +
              ", the tensor is not on a CUDA device");
    if (a.device_id() != device_id)
      invalid(std::string(name) + ": the cache is on cuda:" + std::to_string(device_id) + ", the tensor on cuda:" +
              std::to_string(a.device_id()));
  }
}

/// [tokens][heads][head_dim]: heads and channels packed, tokens `token_stride` elements apart.
template <class View, class A, class Data>
View token_view(const A& a, const char* name, int heads, int head_dim, where w, int device_id,
                Data data) {
  check_device(a, name, w, device_id);
  const kvq::dtype t = dtype_of(a, name);
  if (a.ndim() != 3 || a.shape(1) != size_t(heads) || a.shape(2) != size_t(head_dim))
    invalid(std::string(name) + ": expected shape (tokens, " + std::to_string(heads) + ", " + std::to_string(head_dim) +
            "), got " + shape_text(a));
  const int64_t token_stride = a.shape(0) > 1 ? a.stride(0) : int64_t(heads) * head_dim;
  if ((head_dim > 1 && a.stride(2) != 1) || (heads > 1 && a.stride(1) != head_dim) ||
      token_stride < int64_t(heads) * head_dim)
    invalid(std::string(name) + ": heads and channels must be contiguous and tokens at least heads x head_dim "
            "elements apart (strides " +
            std::to_string(a.stride(0)) + ", " + std::to_string(a.stride(1)) + ", " + std::to_string(a.stride(2)) +
            "); pass a .contiguous() tensor");
  View v;
  v.data = data;
  v.type = t;
  v.tokens = int64_t(a.shape(0));
  v.heads = heads;
  v.head_dim = head_dim;
  v.token_stride = token_stride;
  return v;
}

kvq::tensor_view in_view(const in_array& a, const char* name, int heads, int head_dim, where w, int dev) {
  return token_view<kvq::tensor_view>(a, name, heads, head_dim, w, dev, static_cast<const void*>(a.data()));
}
kvq::tensor_mut out_view(const out_array& a, const char* name, int heads, int head_dim, where w, int dev) {
  return token_view<kvq::tensor_mut>(a, name, heads, head_dim, w, dev, const_cast<void*>(a.data()));
}

kvq::stream_ref stream_of(std::optional<uintptr_t> s) {
  return s ? kvq::stream_ref(reinterpret_cast<void*>(*s)) : kvq::stream_ref{};
}

kvq::role role_of(std::string_view r) {
  if (r == "k" || r == "K") return kvq::role::k;
  if (r == "v" || r == "V") return kvq::role::v;
  invalid("role must be 'k' or 'v', got '" + std::string(r) + "'");
}

kvq::format_id format_of(std::string_view spec) { return ok(kvq::parse_format(spec)); }

template <class A>
std::vector<float> host_floats(const A& a, const char* name) {
  if (a.device_type() != nb::device::cpu::value) invalid(std::string(name) + ": must be a host (cpu) array");
  if (dtype_of(a, name) != kvq::dtype::f32) invalid(std::string(name) + ": must be float32");
  size_t n = 1;
  for (size_t i = 0; i < a.ndim(); ++i) n *= a.shape(i);
  int64_t expect = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) > 1 && a.stride(i) != expect) invalid(std::string(name) + ": must be contiguous");
    expect *= int64_t(a.shape(i));
  }
  const float* p = static_cast<const float*>(a.data());
  return std::vector<float>(p, p + n);
}

nb::ndarray<nb::numpy, float> numpy_floats(std::vector<float>&& values, std::vector<size_t> shape) {
  auto* owner = new std::vector<float>(std::move(values));
  nb::capsule free_it(owner, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
  return nb::ndarray<nb::numpy, float>(owner->data(), shape.size(), shape.data(), free_it);
}

// ---- the cache ----------------------------------------------------------------------------------

/// Makes a CUDA cache's device current for one call and restores the caller's after it (torch's
/// current device may be another GPU): kernels launch and memory is touched where the cache lives.
/// -1 (a CPU cache) does nothing.
class device_guard {
 public:
  explicit device_guard(int device) {
#if KVQ_WITH_CUDA
    if (device >= 0 && cudaGetDevice(&prev_) == cudaSuccess && prev_ != device) set_ = cudaSetDevice(device) == cudaSuccess;
#endif
    (void)device;
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  ~device_guard() {
#if KVQ_WITH_CUDA
    if (set_) cudaSetDevice(prev_);
#endif
  }

 private:
  int prev_ = 0;
  bool set_ = false;
};

/// The cache of one call, its device current while the expression that uses it lasts.
struct on_device {
  device_guard guard;
  kvq::KVCache& cache;
  kvq::KVCache* operator->() const { return &cache; }
};

/// A KVCache with what Python needs to check its tensors: where it lives and its shape.
struct py_cache {
  std::unique_ptr<kvq::KVCache> cache;
  std::string config;  // the configuration string it was made from
  where w = where::cpu;
  int device_id = 0;

  int device() const { return w == where::cuda ? device_id : -1; }
  /// `c.use()->append(...)`: the cache with its device current for the call.
  on_device use() const { return {device_guard(device()), *cache}; }
  const kvq::cache_shape& shape() const { return cache->config().shape; }
  int q_heads() const { return shape().q_heads; }
  int kv_heads() const { return shape().kv_heads; }
  int head_dim() const { return shape().head_dim; }
  kvq::tensor_view kv(const in_array& a, const char* name) const {
    return in_view(a, name, kv_heads(), head_dim(), w, device_id);
  }
  kvq::tensor_view q(const in_array& a, const char* name) const {
    return in_view(a, name, q_heads(), head_dim(), w, device_id);
  }
  kvq::tensor_mut out(const out_array& a, const char* name) const {
    return out_view(a, name, q_heads(), head_dim(), w, device_id);
  }
};

/// The CUDA device index a device string names, -1 for "cpu"; refuses anything else by name.
int device_index(std::string_view device) {
  if (device == "cpu") return -1;
  if (device != "cuda" && !device.starts_with("cuda:"))
    invalid("device must be 'cpu', 'cuda' or 'cuda:<index>', got '" + std::string(device) + "'");
  int index = 0;
  if (device.starts_with("cuda:")) {
    const std::string digits(device.substr(5));
    if (digits.empty() || digits.size() > 4 || digits.find_first_not_of("0123456789") != std::string::npos)
      invalid("device '" + std::string(device) + "': the index is not a number");
    index = std::stoi(digits);
  }
#if KVQ_WITH_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    raise({kvq::errc::cuda_error, "device '" + std::string(device) + "': no CUDA device is visible"});
  }
  if (index >= count)
    invalid("device '" + std::string(device) + "': only " + std::to_string(count) + " CUDA devices are visible");
#else
  raise({kvq::errc::unsupported, "device '" + std::string(device) + "': this kvq was built without CUDA"});
#endif
  return index;
}

py_cache make_cache(int layers, int q_heads, int kv_heads, int head_dim, std::string_view config,
                    uint64_t budget_bytes, std::string_view device, int page_tokens, int window, int recent,
                    int max_sequences, int64_t max_tokens, float softmax_scale, bool check_values, int cpu_threads,
                    std::optional<uintptr_t> stream, uint64_t swap_bytes,
                    const std::vector<std::tuple<int, float, std::vector<float>>>& attention) {
  py_cache c;
  c.config = std::string(config);
  const int index = device_index(device);
  if (index >= 0) {
    c.w = where::cuda;
    c.device_id = index;
  }
  kvq::cache_config cfg;
  cfg.shape = {layers, q_heads, kv_heads, head_dim, page_tokens, window, recent};
  cfg.budget_bytes = budget_bytes;
  cfg.where = index >= 0 ? kvq::backend::cuda : kvq::backend::cpu;
  cfg.max_sequences = max_sequences;
  cfg.max_tokens = max_tokens;
  cfg.softmax_scale = softmax_scale;
  cfg.check_values = check_values;
  cfg.cpu_threads = cpu_threads;
  cfg.stream = stream ? reinterpret_cast<void*>(*stream) : nullptr;
  cfg.swap_bytes = swap_bytes;
  for (const auto& [w, cap, sinks] : attention) cfg.attention.push_back({w, cap, sinks});
  const kvq::cache_suffixes suffixes = ok(kvq::parse_cache_suffixes(config));
  suffixes.apply(cfg);
  auto pol = kvq::make_policy(suffixes.spec, cfg.shape, suffixes.rotated);
  if (!pol) raise({pol.error().code(), "configuration '" + std::string(config) + "': " + pol.error().message()});
  const device_guard on(c.device());  // the cache allocates on its device
  auto made = kvq::KVCache::create(cfg, std::move(pol).value());
  if (!made) raise({made.error().code(), "configuration '" + std::string(config) + "': " + made.error().message()});
  c.cache = std::make_unique<kvq::KVCache>(std::move(made).value());
  return c;
}

/// A replayable decode step (CUDA) and the cache it belongs to (kept alive by the binding).
struct py_step {
  py_cache* cache;
  kvq::decode_step step;
};

nb::dict stats_dict(const kvq::cache_stats& s, const kvq::cache_shape& shape) {
  nb::dict d;
  d["budget_bytes"] = s.budget_bytes;
  d["used_bytes"] = s.used_bytes;
  d["free_bytes"] = s.free_bytes;
  d["largest_free_block"] = s.largest_free_block;
  d["page_bytes"] = s.page_bytes;
  d["window_bytes"] = s.window_bytes;
  d["pages"] = s.pages;
  d["shared_pages"] = s.shared_pages;
  d["shared_saved_bytes"] = s.shared_saved_bytes;
  d["sequences"] = s.sequences;
  d["tokens"] = s.tokens;
  d["encoded_elements"] = s.encoded_elements;
  d["page_bits"] = s.page_bits();
  d["total_bits"] = s.total_bits(shape.kv_heads, shape.head_dim);
  nb::dict bytes, pages;
  for (size_t f = 0; f < kvq::format_count; ++f)
    if (s.pages_by_format[f]) {
      bytes[kvq::format_name(kvq::format_id(f)).c_str()] = s.bytes_by_format[f];
      pages[kvq::format_name(kvq::format_id(f)).c_str()] = s.pages_by_format[f];
    }
  d["bytes_by_format"] = bytes;
  d["pages_by_format"] = pages;
  nb::list map;
  for (const kvq::format_pair& p : s.format_map) map.append(kvq::format_pair_name(p));
  d["format_map"] = map;
  nb::dict over;
  over["device_tables"] = s.overhead.device_tables;
  over["device_workspace"] = s.overhead.device_workspace;
  over["pinned_host"] = s.overhead.pinned_host;
  d["overhead"] = over;
  d["swapped_sequences"] = s.swapped_sequences;
  d["swap_used_bytes"] = s.swap_used_bytes;
  d["swap_capacity_bytes"] = s.swap_capacity_bytes;
  d["swapped_out_bytes"] = s.swapped_out_bytes;
  d["swapped_in_bytes"] = s.swapped_in_bytes;
  return d;
}

/// A read-only, C-contiguous view of a bytes-like object (bytes, bytearray, memoryview, a numpy
/// uint8 array): the buffer protocol, released when the view goes.
class byte_view {
 public:
  explicit byte_view(nb::handle obj) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_C_CONTIGUOUS) != 0) {
      PyErr_Clear();
      invalid(std::string("blob: a bytes-like object (bytes, bytearray, memoryview, a contiguous uint8 array) is "
                          "needed, not ") + nb::inst_name(obj).c_str());
    }
  }
  byte_view(const byte_view&) = delete;
  byte_view& operator=(const byte_view&) = delete;
  ~byte_view() { PyBuffer_Release(&view_); }
  std::span<const uint8_t> bytes() const {
    return {static_cast<const uint8_t*>(view_.buf), size_t(view_.len)};
  }

 private:
  Py_buffer view_{};
};

nb::dict blob_dict(const kvq::blob_info& b) {
  nb::dict d;
  d["version"] = b.version;
  d["layers"] = b.shape.layers;
  d["q_heads"] = b.shape.q_heads;
  d["kv_heads"] = b.shape.kv_heads;
  d["head_dim"] = b.shape.head_dim;
  d["page_tokens"] = b.shape.page_tokens;
  d["window"] = b.shape.window;
  d["recent"] = b.shape.recent;
  d["sink_pages"] = b.sink_pages;
  d["rotated"] = b.rotation.any();
  d["rotation_seed"] = b.rotation.seed;
  nb::list seqs;
  for (const kvq::blob_sequence& s : b.sequences) {
    nb::dict q;
    q["id"] = s.id;
    nb::list n, pages;
    for (const kvq::blob_layer& l : s.layers) {
      n.append(l.n);
      pages.append(l.blocks.size());
    }
    q["tokens"] = n;
    q["pages"] = pages;
    seqs.append(q);
  }
  d["sequences"] = seqs;
  nb::dict formats;
  for (const kvq::blob_block& k : b.blocks)
    for (size_t j = 0; j < k.formats.size(); ++j) {
      const std::string name = kvq::format_name(k.formats[j]);
      formats[name.c_str()] = (formats.contains(name.c_str()) ? nb::cast<int64_t>(formats[name.c_str()]) : 0) + 1;
    }
  d["pages_by_format"] = formats;
  d["blocks"] = b.blocks.size();
  d["block_bytes"] = b.block_bytes();
  d["window_bytes"] = b.window_bytes();
  d["total_bytes"] = b.total_bytes();
  return d;
}

std::vector<kvq::attend_item> attend_items(const std::vector<int64_t>& seqs, const std::optional<std::vector<int>>& q_lens) {
  if (q_lens && q_lens->size() != seqs.size())
    invalid("q_lens has " + std::to_string(q_lens->size()) + " entries, seqs " + std::to_string(seqs.size()));
  std::vector<kvq::attend_item> items(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) items[i] = {seqs[i], q_lens ? (*q_lens)[i] : 1};
  return items;
}

}  // namespace

NB_MODULE(_kvq, m) {
  m.doc() = "kvq: quantized KV cache (the C++ library's binding; use the kvq package)";
  register_errors(m);
  m.attr("version") = std::to_string(KVQ_VERSION_MAJOR) + "." + std::to_string(KVQ_VERSION_MINOR) + "." +
                      std::to_string(KVQ_VERSION_PATCH);
#if KVQ_WITH_CUDA
  m.attr("cuda") = true;
#else
  m.attr("cuda") = false;
#endif

  m.def(
      "format_name", [](std::string_view spec) { return kvq::format_name(format_of(spec)); }, "spec"_a,
      "The canonical name of a format spec ('int4' -> 'sym4/g32'); raises InvalidArgument for an unknown one.");
  m.def(
      "bits_per_element",
      [](std::string_view spec, std::string_view r, int page_tokens, int head_dim) {
        const kvq::format_id f = format_of(spec);
        ok(kvq::check_shape(f, role_of(r), page_tokens, head_dim));
        return kvq::bits_per_element(kvq::traits_of(f), role_of(r), page_tokens, head_dim);
      },
      "spec"_a, "role"_a = "k", "page_tokens"_a = 64, "head_dim"_a = 128,
      "Bits per element of a page of this format, scales and zeros included.");
  m.def(
      "inspect_blob",
      [](nb::handle blob) {
        const byte_view view(blob);
        return blob_dict(ok(kvq::inspect_blob(view.bytes())));
      },
      "blob"_a,
      "Reads and checks a sequence blob (`Cache.export_sequences`); returns its shape, sequences, formats and sizes.");
  m.def(
      "policies",
      [] {
        std::vector<std::tuple<std::string, std::string, std::string>> out;
        for (const kvq::policy_entry& e : kvq::policy_registry()) out.emplace_back(e.name, e.syntax, e.help);
        return out;
      },
      "Every named policy: (name, syntax, help).");

  nb::class_<py_cache>(m, "_Cache")
      .def(nb::new_(&make_cache), "layers"_a, "q_heads"_a, "kv_heads"_a, "head_dim"_a, "config"_a = "fp16",
           "budget_bytes"_a, "device"_a = "cpu", "page_tokens"_a = 64, "window"_a = 128, "recent"_a = 64,
           "max_sequences"_a = 256, "max_tokens"_a = int64_t(1) << 17, "softmax_scale"_a = 0.f,
           "check_values"_a = true, "cpu_threads"_a = 1, "stream"_a = nb::none(), "swap_bytes"_a = 0,
           "attention"_a = std::vector<std::tuple<int, float, std::vector<float>>>{})
      .def_prop_ro("layers", [](const py_cache& c) { return c.shape().layers; })
      .def_prop_ro("q_heads", &py_cache::q_heads)
      .def_prop_ro("kv_heads", &py_cache::kv_heads)
      .def_prop_ro("head_dim", &py_cache::head_dim)
      .def_prop_ro("page_tokens", [](const py_cache& c) { return c.shape().page_tokens; })
      .def_prop_ro("window", [](const py_cache& c) { return c.shape().window; })
      .def_prop_ro("recent", [](const py_cache& c) { return c.shape().recent; })
      .def_prop_ro("config", [](const py_cache& c) { return c.config; })
      .def_prop_ro("device", [](const py_cache& c) {
        return c.w == where::cpu ? std::string("cpu") : "cuda:" + std::to_string(c.device_id);
      })
      .def_prop_ro("policy", [](const py_cache& c) { return c.use()->active_policy().name(); })
      .def_prop_ro("budget_bytes", [](const py_cache& c) { return c.use()->config().budget_bytes; })
      .def_prop_ro("softmax_scale", [](const py_cache& c) { return c.use()->config().softmax_scale; })
      .def_prop_ro("sink_pages", [](const py_cache& c) { return c.use()->config().sink_pages; })
      .def_prop_ro("max_sequences", [](const py_cache& c) { return c.use()->config().max_sequences; })
      .def_prop_ro("max_tokens", [](const py_cache& c) { return c.use()->config().max_tokens; })
      .def_prop_ro("rotated", [](const py_cache& c) { return !c.use()->config().rotation.heads.empty(); })
      .def_prop_ro("attention",
                   [](const py_cache& c) {
                     std::vector<std::tuple<int, float, std::vector<float>>> out;
                     for (const kvq::attention_variant& v : c.use()->config().attention)
                       out.emplace_back(v.window, v.softcap, v.sink_logits);
                     return out;
                   })
      .def(
          "create_sequence",
          [](py_cache& c, int64_t id, std::optional<uintptr_t> s) { ok(c.use()->create_sequence(id, stream_of(s))); },
          "seq"_a, "stream"_a = nb::none())
      .def(
          "release_sequence", [](py_cache& c, int64_t id) { ok(c.use()->release_sequence(id)); }, "seq"_a)
      .def(
          "has_sequence", [](const py_cache& c, int64_t id) { return c.use()->has_sequence(id); }, "seq"_a)
      .def(
          "length",
          [](const py_cache& c, int64_t id, int layer) {
            if (!c.use()->has_sequence(id)) raise({kvq::errc::not_found, "unknown sequence " + std::to_string(id)});
            if (layer < 0 || layer >= c.shape().layers)
              invalid("layer " + std::to_string(layer) + " is outside [0, " + std::to_string(c.shape().layers) + ")");
            return c.use()->length(id, layer);
          },
          "seq"_a, "layer"_a = 0)
      .def(
          "tokens_before_encode",
          [](const py_cache& c, int64_t id, int layer) {
            const int64_t n = c.use()->tokens_before_encode(id, layer);
            if (n < 0) raise({kvq::errc::not_found, "unknown sequence " + std::to_string(id) + " or layer " +
                                                        std::to_string(layer)});
            return n;
          },
          "seq"_a, "layer"_a = 0)
      .def(
          "fork",
          [](py_cache& c, int64_t src, int64_t dst, std::optional<uintptr_t> s) {
            ok(c.use()->fork(src, dst, stream_of(s)));
          },
          "src"_a, "dst"_a, "stream"_a = nb::none())
      .def(
          "truncate",
          [](py_cache& c, int64_t id, int64_t length, std::optional<uintptr_t> s) {
            ok(c.use()->truncate(id, length, stream_of(s)));
          },
          "seq"_a, "length"_a, "stream"_a = nb::none())
      .def(
          "bytes_for",
          [](const py_cache& c, int64_t tokens, std::optional<int64_t> seq) {
            return ok(c.use()->bytes_for(tokens, seq));
          },
          "tokens"_a, "seq"_a = nb::none())
      .def(
          "append",
          [](py_cache& c, int64_t id, int layer, in_array k, in_array v, std::optional<uintptr_t> s) {
            ok(c.use()->append(id, layer, c.kv(k, "k"), c.kv(v, "v"), stream_of(s)));
          },
          "seq"_a, "layer"_a, "k"_a, "v"_a, "stream"_a = nb::none())
      .def(
          "append_batch",
          [](py_cache& c, const std::vector<int64_t>& seqs, const std::vector<int64_t>& tokens, int layer,
             in_array k, in_array v, std::optional<uintptr_t> s) {
            if (tokens.size() != seqs.size())
              invalid("tokens has " + std::to_string(tokens.size()) + " entries, seqs " + std::to_string(seqs.size()));
            std::vector<kvq::append_item> items(seqs.size());
            for (size_t i = 0; i < seqs.size(); ++i) items[i] = {seqs[i], tokens[i]};
            ok(c.use()->append_batch(items, layer, c.kv(k, "k"), c.kv(v, "v"), stream_of(s)));
          },
          "seqs"_a, "tokens"_a, "layer"_a, "k"_a, "v"_a, "stream"_a = nb::none())
      .def(
          "attend",
          [](py_cache& c, const std::vector<int64_t>& seqs, std::optional<std::vector<int>> q_lens, int layer,
             in_array q, out_array o, std::optional<uintptr_t> s) {
            const std::vector<kvq::attend_item> items = attend_items(seqs, q_lens);
            ok(c.use()->attend(items, layer, c.q(q, "q"), c.out(o, "out"), stream_of(s)));
          },
          "seqs"_a, "q_lens"_a, "layer"_a, "q"_a, "out"_a, "stream"_a = nb::none())
      .def(
          "prefill",
          [](py_cache& c, int64_t id, int layer, in_array k, in_array v, in_array q, out_array o,
             std::optional<uintptr_t> s) {
            ok(c.use()->prefill(id, layer, c.kv(k, "k"), c.kv(v, "v"), c.q(q, "q"), c.out(o, "out"), stream_of(s)));
          },
          "seq"_a, "layer"_a, "k"_a, "v"_a, "q"_a, "out"_a, "stream"_a = nb::none())
      .def(
          "attend_prefix",
          [](py_cache& c, int64_t id, int layer, int64_t prefix, in_array q, out_array o, out_array lse,
             std::optional<uintptr_t> s) {
            const kvq::tensor_view qv = c.q(q, "q");
            check_device(lse, "lse", c.w, c.device_id);
            if (dtype_of(lse, "lse") != kvq::dtype::f32) invalid("lse: must be float32");
            if (lse.ndim() != 2 || lse.shape(0) != size_t(qv.tokens) || lse.shape(1) != size_t(c.q_heads()) ||
                (lse.shape(1) > 1 && lse.stride(1) != 1) || (lse.shape(0) > 1 && lse.stride(0) != c.q_heads()))
              invalid("lse: expected a contiguous float32 tensor of shape (" + std::to_string(qv.tokens) + ", " +
                      std::to_string(c.q_heads()) + "), got " + shape_text(lse));
            ok(c.use()->attend_prefix(id, layer, prefix, qv, c.out(o, "out"), static_cast<float*>(lse.data()),
                                      stream_of(s)));
          },
          "seq"_a, "layer"_a, "prefix"_a, "q"_a, "out"_a, "lse"_a, "stream"_a = nb::none())
      .def(
          "read",
          [](const py_cache& c, int64_t id, int layer, std::string_view r, std::optional<uintptr_t> s) {
            const int64_t n = c.use()->length(id, layer);
            if (n < 0) raise({kvq::errc::not_found, "unknown sequence " + std::to_string(id)});
            std::vector<float> out(size_t(n) * c.kv_heads() * c.head_dim());
            ok(c.use()->read(id, layer, role_of(r), out, stream_of(s)));
            return numpy_floats(std::move(out), {size_t(n), size_t(c.kv_heads()), size_t(c.head_dim())});
          },
          "seq"_a, "layer"_a, "role"_a, "stream"_a = nb::none())
      .def(
          "check", [](py_cache& c, std::optional<uintptr_t> s) { ok(c.use()->check(stream_of(s))); },
          "stream"_a = nb::none())
      .def(
          "set_clip_percentiles",
          [](py_cache& c, in_array percentiles) {
            ok(c.use()->set_clip_percentiles(host_floats(percentiles, "percentiles")));
          },
          "ratios"_a)
      .def(
          "set_codebook_levels",
          [](py_cache& c, std::string_view f, in_array levels) {
            ok(c.use()->set_codebook_levels(format_of(f), host_floats(levels, "levels")));
          },
          "format"_a, "levels"_a)
      .def(
          "codebook_levels",
          [](const py_cache& c, std::string_view f) {
            const kvq::format_id id = format_of(f);
            std::vector<float> lv = ok(c.use()->codebook_levels(id));
            const size_t per = size_t(1) << kvq::traits_of(id).bits;
            return numpy_floats(std::move(lv), {size_t(c.shape().layers), size_t(c.kv_heads()), 2, per});
          },
          "format"_a)
      .def(
          "freeze_policy",
          [](py_cache& c, bool frozen) {
            const on_device dev = c.use();
            auto* echo = dynamic_cast<kvq::echokv_policy*>(&dev->active_policy());
            if (!echo)
              raise({kvq::errc::unsupported,
                     "freeze_policy needs an echokv policy; this cache's is " + dev->active_policy().name()});
            ok(dev->sync_policy());  // the measurements in flight land before the switch
            if (frozen)
              echo->freeze();
            else
              echo->unfreeze();
          },
          "frozen"_a = true)
      .def("sync_policy", [](py_cache& c) { ok(c.use()->sync_policy()); })
      .def("flush_policy", [](py_cache& c) { ok(c.use()->flush_policy()); })
      .def("stats", [](const py_cache& c) { return stats_dict(c.use()->stats(), c.shape()); })
      .def(
          "export_sequences",
          [](const py_cache& c, const std::vector<int64_t>& ids, std::optional<uintptr_t> s) {
            const on_device dev = c.use();
            std::vector<kvq::seq_id> seqs(ids.begin(), ids.end());
            const uint64_t size = ok(dev->export_bytes(seqs));
            // written straight into the bytes object the caller gets
            PyObject* out = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(size));
            if (!out) throw nb::python_error();
            nb::object owned = nb::steal(out);
            auto* at = reinterpret_cast<uint8_t*>(PyBytes_AsString(out));
            {
              nb::gil_scoped_release quiet;
              ok(dev->export_sequences(seqs, std::span<uint8_t>(at, size_t(size)), stream_of(s)));
            }
            return owned;
          },
          "seqs"_a, "stream"_a = nb::none())
      .def(
          "export_into",
          [](const py_cache& c, const std::vector<int64_t>& ids, nb::handle out, std::optional<uintptr_t> s) {
            Py_buffer view{};
            if (PyObject_GetBuffer(out.ptr(), &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0) {
              PyErr_Clear();
              invalid(std::string("out: a writable, contiguous bytes-like object (bytearray, a uint8 array) is "
                                  "needed, not ") + nb::inst_name(out).c_str());
            }
            const on_device dev = c.use();
            std::vector<kvq::seq_id> seqs(ids.begin(), ids.end());
            std::optional<kvq::result<uint64_t>> wrote;
            {
              nb::gil_scoped_release quiet;
              wrote.emplace(dev->export_sequences(seqs, std::span<uint8_t>(static_cast<uint8_t*>(view.buf), size_t(view.len)),
                                            stream_of(s)));
            }
            PyBuffer_Release(&view);
            return ok(std::move(*wrote));
          },
          "seqs"_a, "out"_a, "stream"_a = nb::none())
      .def("export_bytes",
           [](const py_cache& c, const std::vector<int64_t>& ids) {
             return ok(c.use()->export_bytes(std::vector<kvq::seq_id>(ids.begin(), ids.end())));
           },
           "seqs"_a)
      .def(
          "import_sequences",
          [](py_cache& c, nb::handle blob, const std::vector<int64_t>& ids, std::optional<uintptr_t> s) {
            const byte_view view(blob);
            const on_device dev = c.use();
            std::vector<kvq::seq_id> seqs(ids.begin(), ids.end());
            ok(dev->import_sequences(view.bytes(), seqs, stream_of(s)));
#if KVQ_WITH_CUDA
            // the copies read the caller's buffer, which Python may free or reuse once this returns
            if (c.w == where::cuda) {
              void* st = s ? reinterpret_cast<void*>(*s) : dev->config().stream;
              if (cudaStreamSynchronize(static_cast<cudaStream_t>(st)) != cudaSuccess)
                raise({kvq::errc::cuda_error, std::string("import_sequences: cudaStreamSynchronize: ") +
                                                  cudaGetErrorString(cudaGetLastError())});
            }
#endif
          },
          "blob"_a, "seqs"_a, "stream"_a = nb::none())
      .def(
          "export_file",
          [](const py_cache& c, std::string path, const std::vector<int64_t>& ids, std::optional<uintptr_t> s) {
            std::vector<kvq::seq_id> seqs(ids.begin(), ids.end());
            ok(c.use()->export_file(path, seqs, stream_of(s)));
          },
          "path"_a, "seqs"_a, "stream"_a = nb::none())
      .def(
          "import_file",
          [](py_cache& c, std::string path, const std::vector<int64_t>& ids, std::optional<uintptr_t> s) {
            std::vector<kvq::seq_id> seqs(ids.begin(), ids.end());
            ok(c.use()->import_file(path, seqs, stream_of(s)));
          },
          "path"_a, "seqs"_a, "stream"_a = nb::none())
      .def(
          "swap_out", [](py_cache& c, int64_t id, std::optional<uintptr_t> s) { ok(c.use()->swap_out(id, stream_of(s))); },
          "seq"_a, "stream"_a = nb::none())
      .def(
          "swap_in", [](py_cache& c, int64_t id, std::optional<uintptr_t> s) { ok(c.use()->swap_in(id, stream_of(s))); },
          "seq"_a, "stream"_a = nb::none())
      .def("is_swapped", [](const py_cache& c, int64_t id) { return c.use()->is_swapped(id); }, "seq"_a)
      .def("swap_in_bytes", [](const py_cache& c, int64_t id) { return ok(c.use()->swap_in_bytes(id)); }, "seq"_a)
      .def(
          "_attend_loop",
          [](py_cache& c, const std::vector<int64_t>& seqs, std::optional<std::vector<int>> q_lens, int layer,
             in_array q, out_array o, std::optional<uintptr_t> s, int iters) {
            // The same attend issued `iters` times from C++ (bench/python_overhead.py compares the
            // host time per call with the Python calls'): seconds in all, without synchronizing.
            const std::vector<kvq::attend_item> items = attend_items(seqs, q_lens);
            const kvq::tensor_view qv = c.q(q, "q");
            const kvq::tensor_mut ov = c.out(o, "out");
            nb::gil_scoped_release unlocked;
            const auto t0 = std::chrono::steady_clock::now();
            const on_device dev = c.use();
            for (int i = 0; i < iters; ++i) ok(dev->attend(items, layer, qv, ov, stream_of(s)));
            return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          },
          "seqs"_a, "q_lens"_a, "layer"_a, "q"_a, "out"_a, "stream"_a, "iters"_a);

  nb::class_<py_step>(m, "_DecodeStep")
      .def(nb::new_([](py_cache& c, int max_batch, int64_t max_tokens) {
             const on_device dev = c.use();
             return py_step{&c, ok(kvq::decode_step::create(dev.cache, max_batch, max_tokens))};
           }),
           "cache"_a, "max_batch"_a, "max_tokens"_a, nb::keep_alive<0, 1>())
      .def(
          "prepare",
          [](py_step& st, const std::vector<int64_t>& seqs) {
            const on_device dev = st.cache->use();
            ok(st.step.prepare(seqs));
          },
          "seqs"_a)
      .def(
          "append",
          [](py_step& st, int layer, in_array k, in_array v) {
            const on_device dev = st.cache->use();
            ok(st.step.append(layer, st.cache->kv(k, "k"), st.cache->kv(v, "v")));
          },
          "layer"_a, "k"_a, "v"_a)
      .def(
          "attend",
          [](py_step& st, int layer, in_array q, out_array o) {
            const on_device dev = st.cache->use();
            ok(st.step.attend(layer, st.cache->q(q, "q"), st.cache->out(o, "out")));
          },
          "layer"_a, "q"_a, "out"_a)
      .def_prop_ro("max_batch", [](const py_step& st) { return st.step.max_batch(); })
      .def_prop_ro("max_tokens", [](const py_step& st) { return st.step.max_tokens(); })
      .def_prop_ro("batch", [](const py_step& st) { return st.step.batch(); })
      .def_prop_ro("descriptor_bytes", [](const py_step& st) { return st.step.descriptor_bytes(); });
}
