// transport/tcp_socket.h: non-blocking socket I/O with deadlines, for the tcp
// transport.
//
// Every wait is a poll() bounded by a deadline and sliced so that a cancel
// flag is seen within kCancelSlice: nothing here blocks forever. Sockets are
// non-blocking; sends use MSG_NOSIGNAL (a dead peer is an error, not SIGPIPE).
//
// Thread-safety: functions are reentrant; an fd is used by one thread at a
// time (the caller's contract).
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/status.h"
#include "transport/transport.h"

namespace kvbridge::transport::tcp {

inline constexpr std::chrono::milliseconds kCancelSlice{5};

// What may end a wait early. `cancel` and `abort` may be null.
struct IoLimits {
  Clock::time_point deadline = Clock::time_point::max();
  const std::atomic<bool>* cancel = nullptr;
  const std::atomic<bool>* abort = nullptr;  // a sibling stream failed or the server stops
};

// OK, or kCancelled / kTimeout (with `what` in the message) when a limit hit.
Status check_limits(const IoLimits& limits, std::string_view what);

// Waits until `fd` reports one of `events` (POLLIN, POLLOUT). kIoError on
// POLLERR/POLLNVAL; POLLHUP counts as readable so that recv sees the EOF.
Status wait_fd(int fd, short events, const IoLimits& limits, std::string_view what);

// A cursor over a list of iovecs that a partial readv/writev advances.
class IovCursor {
 public:
  IovCursor() = default;
  explicit IovCursor(std::vector<iovec> iov) : iov_(std::move(iov)) {}
  void push(void* base, size_t len);
  bool done() const { return index_ == iov_.size(); }
  // Up to IOV_MAX entries starting at the cursor (the first one adjusted).
  iovec* current(int* count);
  void advance(size_t bytes);
  uint64_t remaining() const;

 private:
  std::vector<iovec> iov_;
  size_t index_ = 0;
  size_t offset_ = 0;  // into iov_[index_]
};

// One non-blocking sendmsg/readv step. Returns bytes moved, 0 on EAGAIN,
// kIoError on error or (for recv) on EOF.
Result<size_t> send_step(int fd, IovCursor& cursor, std::string_view who);
Result<size_t> recv_step(int fd, IovCursor& cursor, std::string_view who);

// Moves every byte, waiting within `limits`.
Status send_all(int fd, IovCursor& cursor, const IoLimits& limits, std::string_view who);
Status recv_all(int fd, IovCursor& cursor, const IoLimits& limits, std::string_view who);
Status send_bytes(int fd, const void* data, size_t len, const IoLimits& limits, std::string_view who);
Status recv_bytes(int fd, void* data, size_t len, const IoLimits& limits, std::string_view who);

// Sets O_NONBLOCK, TCP_NODELAY, and large socket buffers where the system
// allows them (see tcp_socket.cc).
void tune_socket(int fd);

// "host:port" with a numeric or named host; "[v6]:port" for IPv6.
struct HostPort {
  std::string host;
  uint16_t port = 0;
};
Result<HostPort> parse_host_port(std::string_view text);
std::string format_host_port(const HostPort& hp);

// A listening socket bound to host:port (0 = ephemeral). Returns the fd and
// sets *bound_port.
Result<int> listen_on(const std::string& host, uint16_t port, uint16_t* bound_port);
// Connects within `limits`; returns a tuned, non-blocking fd.
Result<int> dial(const HostPort& to, const IoLimits& limits, std::string_view who);

std::string errno_text(int err);

}  // namespace kvbridge::transport::tcp
