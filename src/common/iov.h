// common/iov.h: one cursor over a list of iovecs, consumed from the front as
// the kernel reports progress: readv/sendmsg on sockets (net/socket.h) and
// process_vm_readv/writev windows (transport cma).
//
// The first kInline entries live in the object, so the common small run (a
// few blocks) allocates nothing. push() merges a range contiguous with the
// last one.
//
// Thread-safety: a value; one thread at a time.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvbridge {

class IovCursor {
 public:
  static constexpr size_t kInline = 16;

  IovCursor() = default;
  IovCursor(const IovCursor& o) { *this = o; }
  IovCursor& operator=(const IovCursor& o);

  // Appends [base, base + len), merged with the last entry when contiguous
  // (unless that entry is partly consumed already). Empty ranges are skipped.
  void push(void* base, size_t len);
  bool done() const { return index_ == size_; }
  // The entries from the cursor on, at most IOV_MAX (the first adjusted for
  // what was consumed of it): for readv(2) and sendmsg(2).
  iovec* current(int* count);
  // Copies the next entries into `out`, at most `max_entries` of them and
  // `max_bytes` in all (the last one cut); returns how many, their bytes in
  // `*bytes`. For process_vm_readv(2) windows.
  size_t window(uint64_t max_bytes, size_t max_entries, iovec* out, uint64_t* bytes) const;
  // Consumes `bytes` from the front.
  void advance(uint64_t bytes);
  uint64_t remaining() const;

 private:
  iovec* data() { return more_.empty() ? inline_ : more_.data(); }
  const iovec* data() const { return more_.empty() ? inline_ : more_.data(); }

  iovec inline_[kInline];
  std::vector<iovec> more_;  // all entries, once there are more than kInline
  size_t size_ = 0;
  size_t index_ = 0;
  size_t offset_ = 0;  // consumed of data()[index_]
};

}  // namespace kvbridge
