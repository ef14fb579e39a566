// The iovec cursor (see iov.h).
#include "common/iov.h"

#include <limits.h>

#include <algorithm>

namespace kvbridge {

IovCursor& IovCursor::operator=(const IovCursor& o) {
  if (this == &o) return *this;
  std::copy(o.inline_, o.inline_ + kInline, inline_);
  more_ = o.more_;
  size_ = o.size_;
  index_ = o.index_;
  offset_ = o.offset_;
  return *this;
}

void IovCursor::push(void* base, size_t len) {
  if (len == 0) return;
  if (size_ > 0 && (size_ - 1 > index_ || offset_ == 0)) {
    iovec& last = data()[size_ - 1];
    if (static_cast<uint8_t*>(last.iov_base) + last.iov_len == base) {
      last.iov_len += len;
      return;
    }
  }
  if (size_ < kInline) {
    inline_[size_++] = iovec{base, len};
    return;
  }
  if (more_.empty()) more_.assign(inline_, inline_ + kInline);
  more_.push_back(iovec{base, len});
  ++size_;
}

iovec* IovCursor::current(int* count) {
  *count = static_cast<int>(std::min<size_t>(size_ - index_, IOV_MAX));
  if (*count == 0) return nullptr;
  // advance() shifts the first entry in place, so it is ready to use.
  return data() + index_;
}

size_t IovCursor::window(uint64_t max_bytes, size_t max_entries, iovec* out, uint64_t* bytes) const {
  size_t n = 0;
  *bytes = 0;
  const iovec* v = data();
  for (size_t i = index_; i < size_ && n < max_entries && max_bytes > 0; ++i) {
    iovec e = v[i];
    e.iov_len = std::min<uint64_t>(e.iov_len, max_bytes);
    max_bytes -= e.iov_len;
    *bytes += e.iov_len;
    out[n++] = e;
  }
  return n;
}

void IovCursor::advance(uint64_t bytes) {
  iovec* v = data();
  while (bytes > 0 && index_ < size_) {
    iovec& e = v[index_];
    if (bytes < e.iov_len) {
      e.iov_base = static_cast<uint8_t*>(e.iov_base) + bytes;
      e.iov_len -= bytes;
      offset_ += bytes;
      return;
    }
    bytes -= e.iov_len;
    ++index_;
    offset_ = 0;
  }
}

uint64_t IovCursor::remaining() const {
  uint64_t n = 0;
  const iovec* v = data();
  for (size_t i = index_; i < size_; ++i) n += v[i].iov_len;
  return n;
}

}  // namespace kvbridge
