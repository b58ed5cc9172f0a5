#pragma once
/// \file
/// Error handling of every fallible host call: `kvq::status` (a code and a readable message) and
/// `kvq::result<T>` (a value or a status). Nothing here throws; `kvq::check` is the throwing
/// convenience layer for callers who prefer exceptions.

#include <kvq/config.hpp>

#include <stdexcept>
#include <string>
#include <utility>
#include <variant>

KVQ_NAMESPACE_BEGIN

/// What went wrong, coarsely; the message says exactly what.
enum class errc {
  ok = 0,
  invalid_argument,  ///< bad shape, bad spec, unsupported value
  non_finite,        ///< NaN or Inf in K/V input
  out_of_budget,     ///< the byte budget cannot hold the request
  not_found,         ///< unknown sequence id, missing tensor, ...
  io_error,          ///< a file could not be read or is corrupt
  cuda_error,        ///< a CUDA runtime call failed
  unsupported,       ///< a valid request this build cannot serve (e.g. no CUDA)
  comm_error,        ///< a collective between ranks failed, timed out or was aborted
};

/// Readable name of an error code.
constexpr const char* errc_name(errc c) {
  switch (c) {
    case errc::ok: return "ok";
    case errc::invalid_argument: return "invalid argument";
    case errc::non_finite: return "non-finite input";
    case errc::out_of_budget: return "out of budget";
    case errc::not_found: return "not found";
    case errc::io_error: return "io error";
    case errc::cuda_error: return "cuda error";
    case errc::unsupported: return "unsupported";
    case errc::comm_error: return "communication error";
  }
  return "unknown";
}

/// Result of a fallible call without a value: `ok()` or a code with a message naming the problem.
class [[nodiscard]] status {
 public:
  status() = default;
  status(errc code, std::string message) : code_(code), message_(std::move(message)) {}
  static status success() { return {}; }

  bool ok() const { return code_ == errc::ok; }
  explicit operator bool() const { return ok(); }
  errc code() const { return code_; }
  const std::string& message() const { return message_; }
  /// "out of budget: append of 64 tokens to sequence 3 needs 5120 bytes, 1024 free"
  std::string to_string() const {
    return ok() ? std::string("ok") : std::string(errc_name(code_)) + ": " + message_;
  }

 private:
  errc code_ = errc::ok;
  std::string message_;
};

/// Exception thrown by the convenience layer (`check`, `value_or_throw`).
class error : public std::runtime_error {
 public:
  explicit error(const status& s) : std::runtime_error(s.to_string()), code_(s.code()) {}
  errc code() const { return code_; }

 private:
  errc code_;
};

/// Throws `kvq::error` if `s` is not ok.
inline void check(const status& s) {
  if (!s.ok()) throw error(s);
}

/// A value or the status that explains its absence.
template <class T>
class [[nodiscard]] result {
 public:
  result(T value) : v_(std::move(value)) {}
  result(status s) : v_(std::move(s)) {}

  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }
  const T& value() const& { return std::get<0>(v_); }
  T& value() & { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  const T& operator*() const { return value(); }
  const T* operator->() const { return &value(); }
  status error() const { return ok() ? status{} : std::get<1>(v_); }
  /// The value, or throws `kvq::error`.
  T value_or_throw() && {
    if (!ok()) throw kvq::error(std::get<1>(v_));
    return std::get<0>(std::move(v_));
  }

 private:
  std::variant<T, status> v_;
};

/// Returns the status of `expr` from the enclosing function if it is not ok.
#define KVQ_TRY(expr)             \
  do {                            \
    ::kvq::status kvq_s_ = (expr); \
    if (!kvq_s_.ok()) return kvq_s_; \
  } while (0)

KVQ_NAMESPACE_END
