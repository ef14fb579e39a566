// Control connections: listener, inbound notification readers, outbound
// channels, all polled by one thread.
//
// Sockets are non-blocking. The control thread only reads; senders write
// their frames themselves under the channel's send lock, polling for
// POLLOUT until their deadline (poll(2)), and use MSG_NOSIGNAL so a peer that
// vanished gives EPIPE instead of killing the process (send(2)).
#include "engine/control.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "engine/metadata.h"

namespace kvbridge::engine_internal {
namespace {

enum FrameType : uint16_t { kHello = 1, kNotify = 2, kAck = 3 };

constexpr size_t kMaxInbound = 4096;

std::string errno_text(int e) { return std::string(std::strerror(e)); }

int poll_ms(Clock::time_point deadline) {
  if (deadline == Clock::time_point::max()) return -1;
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count() + 1;
  return static_cast<int>(std::clamp<int64_t>(left, 0, 60000));
}

void put(std::string& out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t get(std::string_view in, size_t pos, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= uint64_t{static_cast<uint8_t>(in[pos + i])} << (8 * i);
  return v;
}

struct Frame {
  uint16_t type = 0;
  uint64_t seq = 0;
  std::string_view payload;
};

// Parses the next frame from the front of `buf`. Returns 0 when more bytes
// are needed, -1 for a malformed frame, else the frame's size.
int64_t parse_frame(std::string_view buf, Frame* f) {
  if (buf.size() < kControlHeaderBytes) return 0;
  if (get(buf, 0, 4) != kControlMagic || get(buf, 4, 2) != kControlVersion) return -1;
  f->type = static_cast<uint16_t>(get(buf, 6, 2));
  f->seq = get(buf, 8, 8);
  const uint64_t len = get(buf, 16, 4);
  if (f->type < kHello || f->type > kAck || len > kMaxControlPayload) return -1;
  if (buf.size() < kControlHeaderBytes + len) return 0;
  f->payload = buf.substr(kControlHeaderBytes, len);
  return static_cast<int64_t>(kControlHeaderBytes + len);
}

// Reads what is available into `buf`. False on end of stream or error.
bool drain(int fd, std::string* buf) {
  char chunk[65536];
  while (true) {
    ssize_t n = ::recv(fd, chunk, sizeof(chunk), MSG_DONTWAIT);
    if (n > 0) {
      buf->append(chunk, static_cast<size_t>(n));
      if (buf->size() > 2 * (kControlHeaderBytes + kMaxControlPayload)) return false;
      continue;
    }
    if (n == 0) return false;
    if (errno == EINTR) continue;
    return errno == EAGAIN || errno == EWOULDBLOCK;
  }
}

Result<std::pair<std::string, std::string>> split_address(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    return Status::invalid_argument("control address '" + address + "' is not host:port");
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return std::make_pair(host, address.substr(colon + 1));
}

}  // namespace

Status write_frame(int fd, uint16_t type, uint64_t seq, std::string_view payload, Clock::time_point deadline,
                   std::string_view peer) {
  std::string header;
  put(header, kControlMagic, 4);
  put(header, kControlVersion, 2);
  put(header, type, 2);
  put(header, seq, 8);
  put(header, payload.size(), 4);
  size_t sent = 0;
  const size_t total = header.size() + payload.size();
  while (sent < total) {
    iovec iov[2];
    int n_iov = 0;
    if (sent < header.size()) iov[n_iov++] = {header.data() + sent, header.size() - sent};
    const size_t payload_sent = sent > header.size() ? sent - header.size() : 0;
    if (payload_sent < payload.size()) {
      iov[n_iov++] = {const_cast<char*>(payload.data()) + payload_sent, payload.size() - payload_sent};
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(n_iov);
    ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      return Status::io_error("control connection to peer " + std::string(peer) + ": send: " + errno_text(errno));
    }
    pollfd p{fd, POLLOUT, 0};
    int timeout = poll_ms(deadline);
    if (timeout == 0 || ::poll(&p, 1, timeout) == 0) {
      if (Clock::now() >= deadline) {
        return Status::timeout("control connection to peer " + std::string(peer) + ": send did not finish by the deadline");
      }
    }
  }
  return Status();
}

Channel::~Channel() { ::close(fd_); }

bool Channel::end(Status why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!gone_.ok()) return false;
  gone_ = std::move(why);
  cv_.notify_all();
  ::shutdown(fd_, SHUT_RDWR);
  return true;
}

Status Channel::health() const {
  std::lock_guard<std::mutex> lock(mu_);
  return gone_;
}

Status Channel::notify(std::string_view message, Clock::time_point deadline, bool drop) {
  if (message.size() > kMaxControlPayload) {
    return Status::resource_exhausted("notification is " + std::to_string(message.size()) + " bytes, more than " +
                                      std::to_string(kMaxControlPayload));
  }
  KVB_RETURN_IF_ERROR(health());
  uint64_t seq = 0;
  Status sent;
  {
    std::lock_guard<std::mutex> lock(send_mu_);
    seq = ++next_seq_;
    if (!drop) sent = write_frame(fd_, kNotify, seq, message, deadline, peer_);
  }
  if (!sent.ok()) {
    // A frame cut short leaves the stream unusable; a peer that stopped
    // reading is as good as gone.
    if (end(Status::io_error("peer " + peer_ + " is gone: " + sent.message())) && on_gone_) on_gone_(health());
    return sent;
  }
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_until(lock, deadline, [&] { return acked_seq_ >= seq || !gone_.ok(); });
  if (acked_seq_ >= seq) return Status();
  if (!gone_.ok()) return gone_;
  return Status::timeout("peer " + peer_ + " did not acknowledge the notification before the deadline");
}

struct Control::Inbound {
  int fd = -1;
  std::string in;
  std::string peer;  // from HELLO
  bool hello = false;
};

Result<std::unique_ptr<Control>> Control::create(const std::string& host, std::string self_name,
                                                 std::function<void(Notification)> on_notification) {
  std::unique_ptr<Control> c(new Control());
  c->self_name_ = std::move(self_name);
  c->on_notification_ = std::move(on_notification);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (int rc = ::getaddrinfo(host.c_str(), "0", &hints, &res); rc != 0) {
    return Status::unavailable("control listener: cannot resolve host '" + host + "': " + gai_strerror(rc));
  }
  Status last = Status::unavailable("control listener: no address for host '" + host + "'");
  for (addrinfo* a = res; a != nullptr && c->listen_fd_ < 0; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 128) == 0) {
      c->listen_fd_ = fd;
    } else {
      last = Status::unavailable("control listener on '" + host + "': " + errno_text(errno));
      ::close(fd);
    }
  }
  ::freeaddrinfo(res);
  if (c->listen_fd_ < 0) return last;
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  ::getsockname(c->listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len);
  const uint16_t port = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                                       : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  const bool v6 = ss.ss_family == AF_INET6 && host.find(':') != std::string::npos;
  c->address_ = (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
  c->wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (c->wake_fd_ < 0) return Status::io_error("control: eventfd: " + errno_text(errno));
  c->thread_ = std::thread([raw = c.get()] { raw->loop(); });
  return c;
}

Control::~Control() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake();
  if (thread_.joinable()) thread_.join();
  for (auto& in : inbound_) ::close(in->fd);
  for (auto& ch : channels_) ch->end(Status::io_error("engine is shutting down"));
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void Control::wake() {
  uint64_t one = 1;
  ssize_t n = ::write(wake_fd_, &one, sizeof(one));
  (void)n;  // A full counter already means "wake up".
}

Result<std::shared_ptr<Channel>> Control::connect(const std::string& address, const std::string& peer,
                                                  std::function<void(const Status&)> on_gone,
                                                  Clock::time_point deadline) {
  KVB_ASSIGN_OR_RETURN(auto host_port, split_address(address));
  const std::string who = "control connection to peer " + peer + " at " + address;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (int rc = ::getaddrinfo(host_port.first.c_str(), host_port.second.c_str(), &hints, &res); rc != 0) {
    return Status::unavailable(who + ": " + gai_strerror(rc));
  }
  int fd = -1;
  Status last = Status::unavailable(who + ": no address");
  for (addrinfo* a = res; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      rc = ::poll(&p, 1, poll_ms(deadline)) == 1 ? 0 : -1;
      int err = rc == 0 ? 0 : ETIMEDOUT;
      socklen_t len = sizeof(err);
      if (rc == 0) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      errno = err;
      rc = err == 0 ? 0 : -1;
    }
    if (rc != 0) {
      last = Status::unavailable(who + ": " + errno_text(errno));
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(res);
  if (fd < 0) return last;
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  std::shared_ptr<Channel> ch(new Channel(fd, peer, std::move(on_gone)));
  Status hello = write_frame(fd, kHello, 0, self_name_, deadline, peer);
  if (!hello.ok()) return Status::unavailable(who + ": " + hello.message());
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return Status::unavailable("engine is shutting down");
    channels_.push_back(ch);
  }
  wake();
  return ch;
}

void Control::close(const std::shared_ptr<Channel>& channel) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    channels_.erase(std::remove(channels_.begin(), channels_.end(), channel), channels_.end());
  }
  channel->end(Status::unavailable("connection to peer " + channel->peer() + " was closed"));
  wake();
}

void Control::accept_all() {
  while (true) {
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;  // EAGAIN, or a transient error; poll tells us again.
    if (inbound_.size() >= kMaxInbound) {
      ::close(fd);  // Bounded: one connection per peer engine is the norm.
      continue;
    }
    auto in = std::make_unique<Inbound>();
    in->fd = fd;
    inbound_.push_back(std::move(in));
  }
}

bool Control::read_inbound(Inbound& in) {
  const bool open = drain(in.fd, &in.in);
  size_t pos = 0;
  Frame f;
  int64_t n = 0;
  while ((n = parse_frame(std::string_view(in.in).substr(pos), &f)) > 0) {
    pos += static_cast<size_t>(n);
    if (f.type == kHello) {
      if (in.hello || f.payload.empty() || f.payload.size() > kMaxNameBytes) return false;
      in.peer.assign(f.payload);
      in.hello = true;
    } else if (f.type == kNotify) {
      if (!in.hello) return false;
      on_notification_(Notification{in.peer, std::string(f.payload)});
      std::string ack;
      put(ack, kControlMagic, 4);
      put(ack, kControlVersion, 2);
      put(ack, kAck, 2);
      put(ack, f.seq, 8);
      put(ack, 0, 4);
      // An ack is 20 bytes; a peer whose socket cannot take it is not reading.
      if (::send(in.fd, ack.data(), ack.size(), MSG_NOSIGNAL | MSG_DONTWAIT) != static_cast<ssize_t>(ack.size())) {
        return false;
      }
    } else {
      return false;
    }
  }
  if (n < 0) return false;
  in.in.erase(0, pos);
  return open;
}

bool Control::read_channel(Channel& ch) {
  const bool open = drain(ch.fd_, &ch.in_);
  size_t pos = 0;
  Frame f;
  int64_t n = 0;
  while ((n = parse_frame(std::string_view(ch.in_).substr(pos), &f)) > 0) {
    pos += static_cast<size_t>(n);
    if (f.type != kAck || !f.payload.empty()) return false;
    std::lock_guard<std::mutex> lock(ch.mu_);
    ch.acked_seq_ = std::max(ch.acked_seq_, f.seq);
    ch.cv_.notify_all();
  }
  if (n < 0) return false;
  ch.in_.erase(0, pos);
  return open;
}

void Control::loop() {
  std::vector<pollfd> fds;
  std::vector<std::shared_ptr<Channel>> channels;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      channels = channels_;
    }
    fds.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    for (auto& in : inbound_) fds.push_back({in->fd, POLLIN, 0});
    for (auto& ch : channels) fds.push_back({ch->fd_, POLLIN, 0});
    if (::poll(fds.data(), fds.size(), -1) < 0) continue;  // EINTR
    if (fds[0].revents) {
      uint64_t v;
      ssize_t n = ::read(wake_fd_, &v, sizeof(v));
      (void)n;
    }
    // Inbound connections accepted below join the next round's poll set.
    const size_t num_inbound = fds.size() - 2 - channels.size();
    for (size_t i = num_inbound; i-- > 0;) {
      if (fds[2 + i].revents == 0 || read_inbound(*inbound_[i])) continue;
      ::close(inbound_[i]->fd);
      inbound_.erase(inbound_.begin() + static_cast<ptrdiff_t>(i));
    }
    for (size_t j = 0; j < channels.size(); ++j) {
      if (fds[2 + num_inbound + j].revents == 0) continue;
      Channel& ch = *channels[j];
      if (read_channel(ch)) continue;
      Status why = Status::io_error("peer " + ch.peer_ + " is gone: its control connection closed");
      {
        std::lock_guard<std::mutex> lock(mu_);
        channels_.erase(std::remove(channels_.begin(), channels_.end(), channels[j]), channels_.end());
      }
      if (ch.end(why) && ch.on_gone_) ch.on_gone_(why);
    }
    if (fds[1].revents) accept_all();
  }
}

}  // namespace kvbridge::engine_internal
