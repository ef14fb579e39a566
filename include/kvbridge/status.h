// kvbridge/status.h: the error value used by every layer.
//
// A Status is a small closed code plus a message that names what is wrong (the
// group, layer and component of a layout; the field that differs between two
// peers; the peer). Result<T> holds either a T or a non-OK Status and is shaped
// like std::expected, so code reads the same once C++23 is available. No
// exception crosses the library boundary: fallible functions return one of
// these, and fallible construction is a static `create` returning Result.
//
// Thread-safety: values; copying and reading from several threads is safe.
#pragma once

#include <cassert>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace kvbridge {

// The closed set of error kinds. Keep in sync with code_name() and the Python
// exception map.
enum class Code : uint8_t {
  kOk = 0,
  kInvalidArgument,    // malformed input: bad JSON, bad field, bad option
  kOutOfRange,         // an index, offset or size outside what it refers to
  kIncompatible,       // two valid things that cannot work together (identity)
  kNotFound,           // a named thing (group, tensor, peer) does not exist
  kAlreadyExists,      // a name or id is used twice
  kResourceExhausted,  // a bound on size or count was exceeded
  kUnavailable,        // a transport or peer cannot be used here, and why
  kTimeout,            // a deadline passed
  kCancelled,          // the operation was cancelled
  kIoError,            // the OS or the network failed
  kInternal,           // a broken invariant: a bug in kvbridge
  kPermissionDenied,   // authentication failed (a missing or wrong secret), or an access not granted
};

// The lower-case name of a code ("invalid_argument"), stable for tools.
std::string_view code_name(Code code);

class [[nodiscard]] Status {
 public:
  // An OK status.
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status invalid_argument(std::string m) { return {Code::kInvalidArgument, std::move(m)}; }
  static Status out_of_range(std::string m) { return {Code::kOutOfRange, std::move(m)}; }
  static Status incompatible(std::string m) { return {Code::kIncompatible, std::move(m)}; }
  static Status not_found(std::string m) { return {Code::kNotFound, std::move(m)}; }
  static Status already_exists(std::string m) { return {Code::kAlreadyExists, std::move(m)}; }
  static Status resource_exhausted(std::string m) { return {Code::kResourceExhausted, std::move(m)}; }
  static Status unavailable(std::string m) { return {Code::kUnavailable, std::move(m)}; }
  static Status timeout(std::string m) { return {Code::kTimeout, std::move(m)}; }
  static Status cancelled(std::string m) { return {Code::kCancelled, std::move(m)}; }
  static Status io_error(std::string m) { return {Code::kIoError, std::move(m)}; }
  static Status internal(std::string m) { return {Code::kInternal, std::move(m)}; }
  static Status permission_denied(std::string m) { return {Code::kPermissionDenied, std::move(m)}; }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

  // "invalid_argument: group 'full' layer 'layers.0' component 'k': ...", or "ok".
  std::string to_string() const;

  // Returns a copy whose message is `context + ": " + message()`. OK stays OK.
  Status with_context(std::string_view context) const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

// Either a value or a non-OK Status. Requires: a Result is never built from an
// OK Status (asserted), so has_value() is exactly "no error".
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT: implicit like std::expected
  Result(Status status) : v_(std::move(status)) {  // NOLINT
    assert(!std::get<Status>(v_).ok() && "Result built from an OK Status");
  }

  bool has_value() const { return v_.index() == 0; }
  bool ok() const { return has_value(); }
  explicit operator bool() const { return has_value(); }

  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  // The error. Requires !has_value().
  const Status& error() const { return std::get<Status>(v_); }
  // OK when a value is held, else the error.
  Status status() const { return has_value() ? Status() : error(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace kvbridge

// Returns the Status from the enclosing function if `expr` is not OK.
#define KVB_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::kvbridge::Status kvb_status_ = (expr);   \
    if (!kvb_status_.ok()) return kvb_status_; \
  } while (0)

#define KVB_CONCAT_INNER_(a, b) a##b
#define KVB_CONCAT_(a, b) KVB_CONCAT_INNER_(a, b)
// `KVB_ASSIGN_OR_RETURN(auto x, f());` binds the value or returns the error.
#define KVB_ASSIGN_OR_RETURN(decl, expr)                                                                  \
  auto KVB_CONCAT_(kvb_result_, __LINE__) = (expr);                                                       \
  if (!KVB_CONCAT_(kvb_result_, __LINE__).has_value()) return KVB_CONCAT_(kvb_result_, __LINE__).error(); \
  decl = std::move(KVB_CONCAT_(kvb_result_, __LINE__)).value()
