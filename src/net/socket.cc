// Non-blocking sockets with deadlines (see socket.h).
#include "net/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>

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

namespace {

bool is_loopback(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&a);
    return (ntohl(v4->sin_addr.s_addr) >> 24) == 127;
  }
  if (a.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&a);
    if (IN6_IS_ADDR_LOOPBACK(&v6->sin6_addr)) return true;
    return IN6_IS_ADDR_V4MAPPED(&v6->sin6_addr) && v6->sin6_addr.s6_addr[12] == 127;
  }
  return false;
}

// The uid owning the socket whose source is `peer` and destination `local`
// (the client's end of an accepted loopback connection), from the kernel's
// sock_diag: an exact lookup of one TCP socket.
std::optional<uint32_t> socket_owner(const sockaddr_storage& peer, const sockaddr_storage& local) {
  struct {
    nlmsghdr header;
    inet_diag_req_v2 request;
  } ask{};
  ask.header.nlmsg_len = sizeof ask;
  ask.header.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  ask.header.nlmsg_flags = NLM_F_REQUEST;
  ask.request.sdiag_family = static_cast<uint8_t>(peer.ss_family);
  ask.request.sdiag_protocol = IPPROTO_TCP;
  ask.request.idiag_states = ~0u;
  inet_diag_sockid& id = ask.request.id;
  if (peer.ss_family == AF_INET) {
    const auto* p = reinterpret_cast<const sockaddr_in*>(&peer);
    const auto* l = reinterpret_cast<const sockaddr_in*>(&local);
    id.idiag_sport = p->sin_port;
    id.idiag_dport = l->sin_port;
    std::memcpy(id.idiag_src, &p->sin_addr, 4);
    std::memcpy(id.idiag_dst, &l->sin_addr, 4);
  } else {
    const auto* p = reinterpret_cast<const sockaddr_in6*>(&peer);
    const auto* l = reinterpret_cast<const sockaddr_in6*>(&local);
    id.idiag_sport = p->sin6_port;
    id.idiag_dport = l->sin6_port;
    std::memcpy(id.idiag_src, &p->sin6_addr, 16);
    std::memcpy(id.idiag_dst, &l->sin6_addr, 16);
  }
  id.idiag_cookie[0] = id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  Fd nl(::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG));
  if (!nl) return std::nullopt;
  timeval wait{0, 200000};  // the kernel answers at once; never hang on it
  ::setsockopt(nl.get(), SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  if (::sendto(nl.get(), &ask, sizeof ask, 0, reinterpret_cast<sockaddr*>(&kernel), sizeof kernel) !=
      static_cast<ssize_t>(sizeof ask)) {
    return std::nullopt;
  }
  alignas(nlmsghdr) char buf[4096];
  const ssize_t n = ::recv(nl.get(), buf, sizeof buf, 0);
  if (n < static_cast<ssize_t>(sizeof(nlmsghdr))) return std::nullopt;
  const auto* h = reinterpret_cast<const nlmsghdr*>(buf);
  if (!NLMSG_OK(h, static_cast<size_t>(n)) || h->nlmsg_type != SOCK_DIAG_BY_FAMILY ||
      h->nlmsg_len < NLMSG_LENGTH(sizeof(inet_diag_msg))) {
    return std::nullopt;
  }
  return static_cast<const inet_diag_msg*>(NLMSG_DATA(h))->idiag_uid;
}

}  // namespace

std::string connection_source(int fd) {
  sockaddr_storage peer{}, local{};
  socklen_t pl = sizeof peer, ll = sizeof local;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll) != 0) {
    return "unknown";
  }
  if (peer.ss_family != AF_INET && peer.ss_family != AF_INET6) return "unknown";
  if (is_loopback(peer)) {
    if (peer.ss_family != local.ss_family) return "loopback";
    const std::optional<uint32_t> uid = socket_owner(peer, local);
    return uid ? "uid " + std::to_string(*uid) + " on this host" : "loopback";
  }
  char text[INET6_ADDRSTRLEN] = {};
  const void* addr = peer.ss_family == AF_INET
                         ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(&peer)->sin_addr)
                         : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(&peer)->sin6_addr);
  ::inet_ntop(peer.ss_family, addr, text, sizeof text);
  return std::string("host ") + text;
}

}  // namespace kvbridge::net
