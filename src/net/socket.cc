// Non-blocking sockets with deadlines (see socket.h).
#include "net/socket.h"

#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <fstream>

#include "common/text.h"

namespace kvbridge::net {

Status check_limits(const IoLimits& limits, std::string_view what) {
  if (limits.cancel && limits.cancel->load(std::memory_order_relaxed))
    return Status::cancelled(std::string(what) + ": cancelled");
  if (limits.abort && limits.abort->load(std::memory_order_relaxed))
    return Status::cancelled(std::string(what) + ": aborted");
  if (Clock::now() >= limits.deadline) return Status::timeout(std::string(what) + ": deadline passed");
  return Status();
}

int poll_timeout_ms(Clock::time_point deadline, int cap_ms) {
  if (deadline == Clock::time_point::max() && cap_ms < 0) return -1;
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count() + 1;
  const int64_t cap = cap_ms < 0 ? INT_MAX : cap_ms;
  return static_cast<int>(std::clamp<int64_t>(left, 0, cap));
}

Status wait_fd(int fd, short events, const IoLimits& limits, std::string_view what) {
  for (;;) {
    KVB_RETURN_IF_ERROR(check_limits(limits, what));
    // Without a flag there is nothing to look at between slices.
    const int cap = (limits.cancel || limits.abort) ? static_cast<int>(kCancelSlice.count()) : 1000;
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, poll_timeout_ms(limits.deadline, cap));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::io_error(std::string(what) + ": poll: " + errno_text(errno));
    }
    if (n == 0) continue;
    if (p.revents & (POLLERR | POLLNVAL)) {
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      return Status::io_error(std::string(what) + ": connection failed: " + (err ? errno_text(err) : "socket error"));
    }
    if (p.revents & (events | POLLHUP)) return Status();
  }
}

namespace {
constexpr std::string_view kClosedByPeer = ": connection closed by the peer";
}  // namespace

bool closed_by_peer(const Status& s) { return s.code() == Code::kIoError && s.message().ends_with(kClosedByPeer); }

Result<size_t> send_step(int fd, IovCursor& cursor, std::string_view who) {
  int count = 0;
  iovec* iov = cursor.current(&count);
  if (!iov) return size_t{0};
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = static_cast<size_t>(count);
  for (;;) {
    const ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) {
      cursor.advance(static_cast<size_t>(n));
      return static_cast<size_t>(n);
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return size_t{0};
    return Status::io_error(std::string(who) + ": send: " + errno_text(errno));
  }
}

Result<size_t> recv_step(int fd, IovCursor& cursor, std::string_view who) {
  int count = 0;
  iovec* iov = cursor.current(&count);
  if (!iov) return size_t{0};
  for (;;) {
    const ssize_t n = ::readv(fd, iov, count);
    if (n > 0) {
      cursor.advance(static_cast<size_t>(n));
      return static_cast<size_t>(n);
    }
    if (n == 0) return Status::io_error(std::string(who) + std::string(kClosedByPeer));
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return size_t{0};
    return Status::io_error(std::string(who) + ": receive: " + errno_text(errno));
  }
}

Status send_all(int fd, IovCursor& cursor, const IoLimits& limits, std::string_view who) {
  while (!cursor.done()) {
    KVB_ASSIGN_OR_RETURN(size_t n, send_step(fd, cursor, who));
    if (n == 0) KVB_RETURN_IF_ERROR(wait_fd(fd, POLLOUT, limits, who));
  }
  return Status();
}

Status recv_all(int fd, IovCursor& cursor, const IoLimits& limits, std::string_view who) {
  while (!cursor.done()) {
    KVB_ASSIGN_OR_RETURN(size_t n, recv_step(fd, cursor, who));
    if (n == 0) KVB_RETURN_IF_ERROR(wait_fd(fd, POLLIN, limits, who));
  }
  return Status();
}

Status send_bytes(int fd, const void* data, size_t len, const IoLimits& limits, std::string_view who) {
  IovCursor c;
  c.push(const_cast<void*>(data), len);
  return send_all(fd, c, limits, who);
}

Status recv_bytes(int fd, void* data, size_t len, const IoLimits& limits, std::string_view who) {
  IovCursor c;
  c.push(data, len);
  return recv_all(fd, c, limits, who);
}

namespace {

// The largest SO_SNDBUF/SO_RCVBUF we ask for. Setting either fixes the size and
// turns off the kernel's autotuning (tcp(7)), which on its own grows buffers
// up to net.ipv4.tcp_{w,r}mem[2]; so we only set them when the system cap
// (net.core.{w,r}mem_max) lets us reach the full size, else autotuning does
// better than a small fixed buffer.
constexpr int kSocketBufferBytes = 4 << 20;

int read_sysctl(const char* path) {
  std::ifstream in(path);
  long v = 0;
  if (!(in >> v)) return 0;
  return static_cast<int>(std::min<long>(v, INT_MAX));
}

struct Resolved {
  addrinfo* list = nullptr;
  ~Resolved() {
    if (list) ::freeaddrinfo(list);
  }
};

}  // namespace

void tune_socket(int fd, bool bulk) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (!bulk) return;
  static const bool big_send = read_sysctl("/proc/sys/net/core/wmem_max") >= kSocketBufferBytes;
  static const bool big_recv = read_sysctl("/proc/sys/net/core/rmem_max") >= kSocketBufferBytes;
  int size = kSocketBufferBytes;
  if (big_send) ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
  if (big_recv) ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
}

Result<Listening> listen_on(const HostPort& at, int backlog, std::string_view what) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  Resolved res;
  const std::string port_text = std::to_string(at.port);
  if (int rc = ::getaddrinfo(at.host.c_str(), port_text.c_str(), &hints, &res.list); rc != 0) {
    return Status::unavailable(std::string(what) + ": cannot resolve host " + q(at.host) + ": " + gai_strerror(rc));
  }
  std::string last_error = "no address";
  for (addrinfo* ai = res.list; ai; ai = ai->ai_next) {
    Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol));
    if (!fd) {
      last_error = errno_text(errno);
      continue;
    }
    int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd.get(), backlog) != 0) {
      last_error = errno_text(errno);
      continue;
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
    const uint16_t port = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                                         : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    return Listening{std::move(fd), HostPort{at.host, port}};
  }
  return Status::unavailable(std::string(what) + ": cannot listen on " + format_host_port(at) + ": " + last_error);
}

Result<Fd> dial(const HostPort& to, const IoLimits& limits, std::string_view who, bool bulk) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  Resolved res;
  const std::string port_text = std::to_string(to.port);
  if (int rc = ::getaddrinfo(to.host.c_str(), port_text.c_str(), &hints, &res.list); rc != 0) {
    return Status::unavailable(std::string(who) + ": cannot resolve " + q(to.host) + ": " + gai_strerror(rc));
  }
  Status last = Status::io_error(std::string(who) + ": no address for " + q(to.host));
  for (addrinfo* ai = res.list; ai; ai = ai->ai_next) {
    Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!fd) {
      last = Status::io_error(std::string(who) + ": socket: " + errno_text(errno));
      continue;
    }
    tune_socket(fd.get(), bulk);
    if (::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) == 0 || errno == EINPROGRESS) {
      // connect(2): a non-blocking connect completes when the socket turns
      // writable (or reports an error); SO_ERROR then says how. (Not
      // wait_fd: it reads SO_ERROR itself, which clears it.)
      Status s;
      while (true) {
        s = check_limits(limits, std::string(who) + ": connect");
        if (!s.ok()) break;
        const int cap = (limits.cancel || limits.abort) ? static_cast<int>(kCancelSlice.count()) : 1000;
        pollfd p{fd.get(), POLLOUT, 0};
        const int n = ::poll(&p, 1, poll_timeout_ms(limits.deadline, cap));
        if (n > 0 || (n < 0 && errno != EINTR)) break;
      }
      if (!s.ok()) {
        last = s;
      } else {
        int err = 0;
        socklen_t len = sizeof err;
        if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0) return fd;
        // Nothing listens there: unavailable rather than an I/O failure.
        last = Status(err == ECONNREFUSED ? Code::kUnavailable : Code::kIoError,
                      std::string(who) + ": connect: " + errno_text(err));
      }
    } else {
      last = Status(errno == ECONNREFUSED ? Code::kUnavailable : Code::kIoError,
                    std::string(who) + ": connect: " + errno_text(errno));
    }
    if (last.code() == Code::kCancelled || last.code() == Code::kTimeout) break;
  }
  return last;
}

bool is_resource_errno(int err) { return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM; }

}  // namespace kvbridge::net
