#include "kvbridge/status.h"

namespace kvbridge {

std::string_view code_name(Code code) {
  switch (code) {
    case Code::kOk:
      return "ok";
    case Code::kInvalidArgument:
      return "invalid_argument";
    case Code::kOutOfRange:
      return "out_of_range";
    case Code::kIncompatible:
      return "incompatible";
    case Code::kNotFound:
      return "not_found";
    case Code::kAlreadyExists:
      return "already_exists";
    case Code::kResourceExhausted:
      return "resource_exhausted";
    case Code::kUnavailable:
      return "unavailable";
    case Code::kTimeout:
      return "timeout";
    case Code::kCancelled:
      return "cancelled";
    case Code::kIoError:
      return "io_error";
    case Code::kInternal:
      return "internal";
    case Code::kPermissionDenied:
      return "permission_denied";
  }
  return "unknown";
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  std::string s(code_name(code_));
  s += ": ";
  s += message_;
  return s;
}

Status Status::with_context(std::string_view context) const {
  if (ok()) return *this;
  std::string m(context);
  m += ": ";
  m += message_;
  return Status(code_, std::move(m));
}

}  // namespace kvbridge
