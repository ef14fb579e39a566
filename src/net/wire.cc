// The bounded wire reader (see wire.h).
#include "net/wire.h"

namespace kvbridge::net {

Status WireReader::error(std::string_view message) const {
  return Status::invalid_argument(what_ + ": " + std::string(message) + " (offset " + std::to_string(pos_) + " of " +
                                  std::to_string(in_.size()) + ")");
}

Status WireReader::need(std::string_view field, uint64_t n) const {
  if (n <= left()) return Status();
  return error("truncated at " + std::string(field) + " (needs " + std::to_string(n) + " bytes, " +
               std::to_string(left()) + " left)");
}

Status WireReader::raw(std::string_view field, size_t n, std::string_view* out) {
  KVB_RETURN_IF_ERROR(need(field, n));
  *out = in_.substr(pos_, n);
  pos_ += n;
  return Status();
}

Status WireReader::str_view(std::string_view field, size_t max, std::string_view* out) {
  uint32_t n = 0;
  KVB_RETURN_IF_ERROR(u32(std::string(field) + " length", &n));
  if (n > max) {
    return Status::resource_exhausted(what_ + ": " + std::string(field) + " is " + std::to_string(n) +
                                      " bytes, more than " + std::to_string(max) + " (offset " +
                                      std::to_string(pos_ - 4) + ")");
  }
  return raw(field, n, out);
}

Status WireReader::str(std::string_view field, size_t max, std::string* out) {
  std::string_view v;
  KVB_RETURN_IF_ERROR(str_view(field, max, &v));
  out->assign(v);
  return Status();
}

Status WireReader::count(std::string_view field, size_t max, size_t min_entry_bytes, uint32_t* out) {
  uint32_t n = 0;
  KVB_RETURN_IF_ERROR(u32(field, &n));
  if (n > max) {
    return Status::resource_exhausted(what_ + ": " + std::string(field) + " " + std::to_string(n) + " is more than " +
                                      std::to_string(max));
  }
  if (min_entry_bytes > 0 && n > left() / min_entry_bytes) {
    return error(std::string(field) + " " + std::to_string(n) + " is more than the " + std::to_string(left()) +
                 " bytes left can hold");
  }
  *out = n;
  return Status();
}

Status WireReader::finish() const {
  if (pos_ == in_.size()) return Status();
  return error(std::to_string(in_.size() - pos_) + " trailing bytes");
}

}  // namespace kvbridge::net
