// Errors are values. Every function that reads untrusted input (files, JSON,
// command-line strings) returns a Status or a Result<T>; only cli/ turns one into
// an exit code. Programmer errors use RS_CHECK (check.h) instead.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace rs {

enum class ErrorCode : std::uint8_t {
  kOk,
  kInvalidArgument,     // malformed input the caller gave: bad layout string, bad option
  kNotFound,            // a named file, tensor or field does not exist
  kAlreadyExists,       // refusing to overwrite something
  kFailedPrecondition,  // the request is well-formed but the state does not allow it
  kOutOfRange,          // an index or box outside a tensor
  kDataLoss,            // corruption: checksum mismatch, truncated file, inconsistent metadata
  kVersionMismatch,     // a file written by a format version this build does not read
  kIoError,             // the operating system refused (open, read, write, rename, fsync)
  kUnimplemented,
  kInternal,
  kUnavailable,  // a peer process or the transport between processes failed
};

std::string_view ErrorCodeName(ErrorCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }
  bool ok() const { return code_ == ErrorCode::kOk; }
  ErrorCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "DataLoss: <message>"
  std::string ToString() const;
  // Returns a copy whose message is "<context>: <message>".
  Status WithContext(std::string_view context) const;

 private:
  ErrorCode code_ = ErrorCode::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) { return {ErrorCode::kInvalidArgument, std::move(m)}; }
inline Status NotFound(std::string m) { return {ErrorCode::kNotFound, std::move(m)}; }
inline Status AlreadyExists(std::string m) { return {ErrorCode::kAlreadyExists, std::move(m)}; }
inline Status FailedPrecondition(std::string m) { return {ErrorCode::kFailedPrecondition, std::move(m)}; }
inline Status OutOfRange(std::string m) { return {ErrorCode::kOutOfRange, std::move(m)}; }
inline Status DataLoss(std::string m) { return {ErrorCode::kDataLoss, std::move(m)}; }
inline Status VersionMismatch(std::string m) { return {ErrorCode::kVersionMismatch, std::move(m)}; }
inline Status IoError(std::string m) { return {ErrorCode::kIoError, std::move(m)}; }
inline Status Unimplemented(std::string m) { return {ErrorCode::kUnimplemented, std::move(m)}; }
inline Status Internal(std::string m) { return {ErrorCode::kInternal, std::move(m)}; }
inline Status Unavailable(std::string m) { return {ErrorCode::kUnavailable, std::move(m)}; }

// A value or the Status that explains why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}         // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {}  // NOLINT(google-explicit-constructor)

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOkStatus;
    return ok() ? kOkStatus : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace rs

#define RS_CONCAT_INNER_(a, b) a##b
#define RS_CONCAT_(a, b) RS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (a Status) is not ok.
#define RS_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::rs::Status rs_status_ = (expr);        \
    if (!rs_status_.ok()) return rs_status_; \
  } while (0)

// `RS_ASSIGN_OR_RETURN(auto x, F());` declares x from a Result or returns its Status.
#define RS_ASSIGN_OR_RETURN(lhs, expr) RS_ASSIGN_OR_RETURN_IMPL_(RS_CONCAT_(rs_result_, __LINE__), lhs, expr)
#define RS_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()
