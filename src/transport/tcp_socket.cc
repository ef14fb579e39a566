// Non-blocking socket helpers for the tcp transport (see tcp_socket.h).
#include "transport/tcp_socket.h"

#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

namespace kvbridge::transport::tcp {

std::string errno_text(int err) { return std::string(std::strerror(err)); }

Status check_limits(const IoLimits& limits, std::string_view what) {
  if (limits.cancel && limits.cancel->load(std::memory_order_relaxed))
    return Status::cancelled(std::string(what) + ": cancelled");
  if (limits.abort && limits.abort->load(std::memory_order_relaxed))
    return Status::cancelled(std::string(what) + ": aborted");
  if (Clock::now() >= limits.deadline) return Status::timeout(std::string(what) + ": deadline passed");
  return Status();
}

Status wait_fd(int fd, short events, const IoLimits& limits, std::string_view what) {
  for (;;) {
    KVB_RETURN_IF_ERROR(check_limits(limits, what));
    auto left = limits.deadline - Clock::now();
    auto slice = std::chrono::duration_cast<std::chrono::milliseconds>(left) + std::chrono::milliseconds(1);
    // Without a cancel flag there is nothing to look at between slices.
    if (limits.cancel || limits.abort) slice = std::min<std::chrono::milliseconds>(slice, kCancelSlice);
    slice = std::min<std::chrono::milliseconds>(slice, std::chrono::milliseconds(1000));
    pollfd p{fd, events, 0};
    int n = ::poll(&p, 1, static_cast<int>(std::max<int64_t>(slice.count(), 0)));
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

void IovCursor::push(void* base, size_t len) {
  if (len == 0) return;
  // Merges with the last entry when contiguous, unless that entry is partly
  // consumed already.
  if (!iov_.empty() && (iov_.size() - 1 > index_ || offset_ == 0)) {
    iovec& last = iov_.back();
    if (static_cast<uint8_t*>(last.iov_base) + last.iov_len == base) {
      last.iov_len += len;
      return;
    }
  }
  iov_.push_back({base, len});
}

iovec* IovCursor::current(int* count) {
  *count = static_cast<int>(std::min<size_t>(iov_.size() - index_, IOV_MAX));
  if (*count == 0) return nullptr;
  // advance() shifts the first entry in place, so it is ready to use.
  return &iov_[index_];
}

void IovCursor::advance(size_t bytes) {
  while (bytes > 0 && index_ < iov_.size()) {
    iovec& v = iov_[index_];
    if (bytes < v.iov_len) {
      v.iov_base = static_cast<uint8_t*>(v.iov_base) + bytes;
      v.iov_len -= bytes;
      offset_ += bytes;
      return;
    }
    bytes -= v.iov_len;
    ++index_;
    offset_ = 0;
  }
}

uint64_t IovCursor::remaining() const {
  uint64_t n = 0;
  for (size_t i = index_; i < iov_.size(); ++i) n += iov_[i].iov_len;
  return n;
}

Result<size_t> send_step(int fd, IovCursor& cursor, std::string_view who) {
  int count = 0;
  iovec* iov = cursor.current(&count);
  if (!iov) return size_t{0};
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = static_cast<size_t>(count);
  for (;;) {
    ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
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
    ssize_t n = ::readv(fd, iov, count);
    if (n > 0) {
      cursor.advance(static_cast<size_t>(n));
      return static_cast<size_t>(n);
    }
    if (n == 0) return Status::io_error(std::string(who) + ": connection closed by the peer");
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

}  // namespace

void tune_socket(int fd) {
  static const bool big_send = read_sysctl("/proc/sys/net/core/wmem_max") >= kSocketBufferBytes;
  static const bool big_recv = read_sysctl("/proc/sys/net/core/rmem_max") >= kSocketBufferBytes;
  int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  int size = kSocketBufferBytes;
  if (big_send) ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
  if (big_recv) ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
}

Result<HostPort> parse_host_port(std::string_view text) {
  HostPort hp;
  std::string_view port_text;
  if (!text.empty() && text[0] == '[') {
    size_t close = text.find(']');
    if (close == std::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':')
      return Status::invalid_argument("tcp address '" + std::string(text) + "': expected [host]:port");
    hp.host = std::string(text.substr(1, close - 1));
    port_text = text.substr(close + 2);
  } else {
    size_t colon = text.rfind(':');
    if (colon == std::string_view::npos || colon == 0)
      return Status::invalid_argument("tcp address '" + std::string(text) + "': expected host:port");
    hp.host = std::string(text.substr(0, colon));
    port_text = text.substr(colon + 1);
  }
  if (port_text.empty() || port_text.size() > 5 ||
      !std::all_of(port_text.begin(), port_text.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return Status::invalid_argument("tcp address '" + std::string(text) + "': bad port");
  unsigned long port = std::stoul(std::string(port_text));
  if (port == 0 || port > 65535)
    return Status::invalid_argument("tcp address '" + std::string(text) + "': port out of range");
  hp.port = static_cast<uint16_t>(port);
  return hp;
}

std::string format_host_port(const HostPort& hp) {
  if (hp.host.find(':') != std::string::npos) return "[" + hp.host + "]:" + std::to_string(hp.port);
  return hp.host + ":" + std::to_string(hp.port);
}

Result<int> listen_on(const std::string& host, uint16_t port, uint16_t* bound_port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  std::string port_text = std::to_string(port);
  int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port_text.c_str(), &hints, &res);
  if (rc != 0) return Status::unavailable("tcp: cannot resolve listen host '" + host + "': " + gai_strerror(rc));
  std::string last_error = "no address";
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last_error = errno_text(errno);
      continue;
    }
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, 128) == 0) {
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
      *bound_port = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                                   : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
      ::freeaddrinfo(res);
      int flags = ::fcntl(fd, F_GETFL, 0);
      ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
      return fd;
    }
    last_error = errno_text(errno);
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return Status::unavailable("tcp: cannot listen on " + format_host_port({host, port}) + ": " + last_error);
}

Result<int> dial(const HostPort& to, const IoLimits& limits, std::string_view who) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  std::string port_text = std::to_string(to.port);
  int rc = ::getaddrinfo(to.host.c_str(), port_text.c_str(), &hints, &res);
  if (rc != 0) return Status::io_error(std::string(who) + ": cannot resolve '" + to.host + "': " + gai_strerror(rc));
  Status last = Status::io_error(std::string(who) + ": no address for '" + to.host + "'");
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last = Status::io_error(std::string(who) + ": socket: " + errno_text(errno));
      continue;
    }
    tune_socket(fd);
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 || errno == EINPROGRESS) {
      Status s = wait_fd(fd, POLLOUT, limits, std::string(who) + ": connect");
      int err = 0;
      socklen_t len = sizeof err;
      if (s.ok() && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0) {
        ::freeaddrinfo(res);
        return fd;
      }
      last = s.ok() ? Status::io_error(std::string(who) + ": connect: " + errno_text(err)) : s;
    } else {
      last = Status::io_error(std::string(who) + ": connect: " + errno_text(errno));
    }
    ::close(fd);
    if (last.code() == Code::kCancelled || last.code() == Code::kTimeout) break;
  }
  ::freeaddrinfo(res);
  return last;
}

}  // namespace kvbridge::transport::tcp
