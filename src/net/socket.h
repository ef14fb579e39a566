// net/socket.h: non-blocking TCP sockets with deadlines: listen, dial, and
// moving bytes with a cursor over iovecs.
//
// Every wait is a poll(2) bounded by a deadline and, when a cancel or abort
// flag is given, sliced so the flag is seen within kCancelSlice: nothing here
// blocks forever. Sockets are non-blocking and close-on-exec; sends use
// MSG_NOSIGNAL, so a vanished peer is EPIPE, not SIGPIPE (send(2)).
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

#include "common/iov.h"
#include "kvbridge/status.h"
#include "net/address.h"
#include "net/fd.h"

namespace kvbridge::net {

using Clock = std::chrono::steady_clock;

inline constexpr std::chrono::milliseconds kCancelSlice{5};

// What may end a wait early. `cancel` and `abort` may be null.
struct IoLimits {
  Clock::time_point deadline = Clock::time_point::max();
  const std::atomic<bool>* cancel = nullptr;
  const std::atomic<bool>* abort = nullptr;  // e.g. a sibling stream failed
};

// OK, or kCancelled / kTimeout (with `what` in the message) when a limit hit.
Status check_limits(const IoLimits& limits, std::string_view what);

// Milliseconds from now to `deadline` for poll(2), rounded up, within
// [0, cap_ms]; -1 (wait without limit) for time_point::max() when cap_ms < 0.
int poll_timeout_ms(Clock::time_point deadline, int cap_ms);

// Waits until `fd` reports one of `events` (POLLIN, POLLOUT). kIoError on
// POLLERR/POLLNVAL; POLLHUP counts as readable so that recv sees the EOF.
Status wait_fd(int fd, short events, const IoLimits& limits, std::string_view what);

using IovCursor = ::kvbridge::IovCursor;  // common/iov.h

// One non-blocking sendmsg/readv step. Returns bytes moved, 0 on EAGAIN,
// kIoError naming `who` on error or (for recv) on EOF.
Result<size_t> send_step(int fd, IovCursor& cursor, std::string_view who);
Result<size_t> recv_step(int fd, IovCursor& cursor, std::string_view who);
// Whether `s` is recv_step's (or recv_bytes') error for an orderly close by
// the peer: its end of the stream arrived (no reset, no other error).
bool closed_by_peer(const Status& s);

// Moves every byte, waiting within `limits`.
Status send_all(int fd, IovCursor& cursor, const IoLimits& limits, std::string_view who);
Status recv_all(int fd, IovCursor& cursor, const IoLimits& limits, std::string_view who);
Status send_bytes(int fd, const void* data, size_t len, const IoLimits& limits, std::string_view who);
Status recv_bytes(int fd, void* data, size_t len, const IoLimits& limits, std::string_view who);

// Sets O_NONBLOCK and TCP_NODELAY; with `bulk`, large socket buffers where
// the system allows them (see socket.cc).
void tune_socket(int fd, bool bulk);

// Who is on the other end of accepted connection `fd`, as a bound on
// connections can count it whatever the client claims: for a client on this
// host (a loopback address), the user that owns its socket, asked of the
// kernel (sock_diag): "uid 1000 on this host"; for any other, its address:
// "host 10.0.0.7". A loopback client whose owner the kernel does not say is
// "loopback". Costs one netlink round trip for a loopback client.
std::string connection_source(int fd);

struct Listening {
  Fd fd;           // non-blocking
  HostPort bound;  // the host as given, the port the kernel chose for port 0
};
// Binds `at` (port 0: ephemeral) and listens with `backlog`. kUnavailable
// naming `what` and the address when it cannot.
Result<Listening> listen_on(const HostPort& at, int backlog, std::string_view what);

// Connects within `limits`; returns a tuned, non-blocking fd. kUnavailable
// when nothing listens there (ECONNREFUSED) or the host does not resolve,
// kIoError for other failures, kTimeout/kCancelled, each naming `who`.
Result<Fd> dial(const HostPort& to, const IoLimits& limits, std::string_view who, bool bulk = false);

// Whether an accept(2) errno means the process or system is out of a
// resource (EMFILE, ENFILE, ENOBUFS, ENOMEM): a listener must back off, not
// retry at once.
bool is_resource_errno(int err);

}  // namespace kvbridge::net
