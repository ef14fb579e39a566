// The side channel's server and client (see side_channel.h and
// docs/formats/handshake.md).
//
// The server is one thread polling the listening socket, an eventfd that the
// destructor writes, and up to kMaxConnections non-blocking connections, each
// a small state machine with its own deadline. It reads exactly the bytes of
// the frame it expects (never more), so a peer cannot make it buffer beyond a
// Hello or a Proof. After its last frame it shuts down its sending side and
// reads until the client closes (bounded by the deadline): closing a socket
// with unread input sends a RST (RFC 1122 4.2.2.13), which could destroy a
// Reject before the client reads it.
//
// Sends use MSG_NOSIGNAL so a vanished peer is EPIPE, not SIGPIPE (send(2)).
#include "connector/side_channel.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <random>

#include "kvbridge/layout.h"

namespace kvbridge::connector {
namespace {

using Clock = std::chrono::steady_clock;

std::string errno_text(int e) { return std::strerror(e); }

std::string hex16(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// Peer text cut to 200 bytes with control bytes escaped.
std::string printable(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < 200; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) {
      char buf[5];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > 200) out += "...";
  return out;
}

int poll_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count() + 1;
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1000));
}

std::string sockaddr_text(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    return "[" + std::string(host) + "]:" + std::to_string(ntohs(a->sin6_port));
  }
  auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
  ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
  port = ntohs(a->sin_port);
  return std::string(host) + ":" + std::to_string(port);
}

Result<std::pair<std::string, std::string>> split_address(std::string_view address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == address.size()) {
    return Status::invalid_argument("side channel address '" + printable(address) + "' is not host:port");
  }
  std::string host(address.substr(0, colon));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return std::make_pair(host, std::string(address.substr(colon + 1)));
}

uint64_t realtime_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

}  // namespace

// --- Server.

struct SideChannelServer::Connection {
  enum class State { kReadHello, kReadProof, kWrite, kLinger, kClosed };
  int fd = -1;
  std::string peer;
  Clock::time_point deadline;
  State state = State::kReadHello;
  std::string in;          // the frame being read: header, then payload
  FrameHeader header;
  bool have_header = false;
  std::string out;         // the frame being written
  size_t out_pos = 0;
  size_t out_end = 0;      // < out.size() when a fault truncates it
  bool final = false;      // close (after lingering) once `out` is sent
  bool decided = false;    // served or rejected already counted
  Hello hello;
  Nonce server_nonce{};
};

Result<std::unique_ptr<SideChannelServer>> SideChannelServer::start(const SideChannelOptions& options,
                                                                    std::string identity, uint64_t hash,
                                                                    RankInfo info) {
  if (options.timeout.count() <= 0) return Status::invalid_argument("side channel: timeout must be positive");
  if (identity.size() > kMaxIdentityBytes) {
    return Status::invalid_argument("side channel: identity is " + std::to_string(identity.size()) +
                                    " bytes, more than " + std::to_string(kMaxIdentityBytes));
  }
  KVB_RETURN_IF_ERROR(check_rank_info(info));
  std::unique_ptr<SideChannelServer> s(new SideChannelServer());
  s->options_ = options;
  s->identity_ = std::move(identity);
  s->hash_ = hash;
  s->info_ = std::move(info);

  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(options.port);
  if (int rc = ::getaddrinfo(options.host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return Status::unavailable("side channel: cannot resolve '" + options.host + "': " + gai_strerror(rc));
  }
  Status last = Status::unavailable("side channel: no address for '" + options.host + "'");
  for (addrinfo* a = res; a != nullptr && s->listen_fd_ < 0; a = a->ai_next) {
    int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 64) == 0) {
      s->listen_fd_ = fd;
    } else {
      last = Status::unavailable("side channel: cannot listen on " + options.host + ":" + port + ": " +
                                 errno_text(errno));
      ::close(fd);
    }
  }
  ::freeaddrinfo(res);
  if (s->listen_fd_ < 0) return last;
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  ::getsockname(s->listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len);
  s->address_ = sockaddr_text(ss);
  s->wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (s->wake_fd_ < 0) return Status::io_error("side channel: eventfd: " + errno_text(errno));
  s->thread_ = std::thread([raw = s.get()] { raw->loop(); });
  return s;
}

SideChannelServer::~SideChannelServer() {
  stop_ = true;
  if (wake_fd_ >= 0) {
    uint64_t one = 1;
    ssize_t n = ::write(wake_fd_, &one, sizeof(one));
    (void)n;  // A full counter already wakes the loop.
  }
  if (thread_.joinable()) thread_.join();
  for (auto& c : connections_) ::close(c->fd);
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

std::string SideChannelServer::address() const { return address_; }

void SideChannelServer::set_info(RankInfo info) {
  std::lock_guard<std::mutex> lock(mu_);
  info_ = std::move(info);
}

std::string SideChannelServer::last_rejection() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_rejection_;
}

void SideChannelServer::record_rejection(const Connection& c, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    last_rejection_ = "client " + c.peer + ": " + why;
  }
  rejected_.fetch_add(1);
}

void SideChannelServer::loop() {
  std::vector<pollfd> fds;
  while (!stop_.load()) {
    fds.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    fds.push_back({listen_fd_, static_cast<short>(connections_.size() < kMaxConnections ? POLLIN : 0), 0});
    Clock::time_point next = Clock::now() + std::chrono::seconds(1);
    for (auto& c : connections_) {
      fds.push_back({c->fd, static_cast<short>(c->state == Connection::State::kWrite ? POLLOUT : POLLIN), 0});
      next = std::min(next, c->deadline);
    }
    int n = ::poll(fds.data(), fds.size(), poll_ms(next));
    if (n < 0 && errno != EINTR) break;  // Only EFAULT/EINVAL/ENOMEM: nothing to retry.
    if (stop_.load()) break;
    if (n > 0 && (fds[1].revents & POLLIN)) accept_all();
    for (size_t i = 0; n > 0 && i + 2 < fds.size(); ++i) {
      if (fds[i + 2].revents != 0) step(*connections_[i], fds[i + 2].revents);
    }
    const Clock::time_point now = Clock::now();
    for (auto& c : connections_) {
      if (c->state != Connection::State::kClosed && now >= c->deadline) {
        abandon(*c, "handshake did not finish within " + std::to_string(options_.timeout.count()) + " ms");
      }
    }
    std::erase_if(connections_, [](const std::unique_ptr<Connection>& c) {
      if (c->state != Connection::State::kClosed) return false;
      ::close(c->fd);
      return true;
    });
  }
}

void SideChannelServer::accept_all() {
  while (connections_.size() < kMaxConnections) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;  // EAGAIN, or a connection that died in the backlog
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    auto c = std::make_unique<Connection>();
    c->fd = fd;
    c->peer = sockaddr_text(ss);
    c->deadline = Clock::now() + options_.timeout;
    connections_.push_back(std::move(c));
  }
}

// Ends a connection without a reply (deadline, error, the client left).
void SideChannelServer::abandon(Connection& c, const std::string& why) {
  if (!c.decided) record_rejection(c, why);
  c.decided = true;
  c.state = Connection::State::kClosed;
}

void SideChannelServer::step(Connection& c, short revents) {
  using State = Connection::State;
  if (c.state == State::kWrite) {
    while (c.out_pos < c.out_end) {
      ssize_t n = ::send(c.fd, c.out.data() + c.out_pos, c.out_end - c.out_pos, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n < 0) return abandon(c, "send: " + errno_text(errno));
      c.out_pos += static_cast<size_t>(n);
    }
    c.out.clear();
    if (!c.final) {
      c.state = State::kReadProof;
      return;
    }
    ::shutdown(c.fd, SHUT_WR);
    c.state = State::kLinger;
    return;
  }
  if (c.state == State::kLinger) {
    char sink[4096];
    ssize_t n = ::recv(c.fd, sink, sizeof(sink), MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) c.state = State::kClosed;
    return;
  }
  if (revents & (POLLERR | POLLNVAL)) return abandon(c, "connection failed");
  // Read no further than the end of the expected frame.
  const size_t want = c.have_header ? kFrameHeaderBytes + c.header.payload_bytes : kFrameHeaderBytes;
  char buf[256];
  ssize_t n = ::recv(c.fd, buf, std::min(sizeof(buf), want - c.in.size()), MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  const char* expected = c.state == State::kReadHello ? "Hello" : "Proof";
  if (n == 0) {
    return abandon(c, std::string("client closed the connection ") +
                          (c.in.empty() ? "before its " + std::string(expected)
                                        : "in the middle of its " + std::string(expected) + " (after " +
                                              std::to_string(c.in.size()) + " bytes)"));
  }
  if (n < 0) return abandon(c, "receive: " + errno_text(errno));
  c.in.append(buf, static_cast<size_t>(n));
  if (!c.have_header && c.in.size() == kFrameHeaderBytes) {
    Result<FrameHeader> h = decode_header(c.in, options_.advertise_version);
    if (!h.ok()) return reject(c, RejectCode::kMalformed, "malformed handshake: " + h.error().message());
    if (h->version != options_.advertise_version) {
      return reject(c, RejectCode::kVersion,
                    "handshake version mismatch: local " + std::to_string(options_.advertise_version) + ", peer " +
                        std::to_string(h->version));
    }
    const FrameType want_type = c.state == State::kReadHello ? FrameType::kHello : FrameType::kProof;
    if (h->type != want_type) {
      return reject(c, RejectCode::kMalformed,
                    "malformed handshake: expected a " + std::string(expected) + " frame, got " +
                        frame_type_name(h->type));
    }
    c.header = *h;
    c.have_header = true;
  }
  if (c.have_header && c.in.size() == kFrameHeaderBytes + c.header.payload_bytes) on_frame(c);
}

void SideChannelServer::on_frame(Connection& c) {
  std::string_view payload = std::string_view(c.in).substr(kFrameHeaderBytes);
  if (c.state == Connection::State::kReadHello) {
    Result<Hello> hello = decode_hello(payload);
    if (!hello.ok()) return reject(c, RejectCode::kMalformed, "malformed handshake: " + hello.error().message());
    c.hello = *hello;
    c.in.clear();
    c.have_header = false;
    if (options_.secret.empty()) {
      if (c.hello.has_secret) {
        return reject(c, RejectCode::kAuthUnsupported,
                      "authentication failed: the client has a shared secret but this side has none");
      }
      return after_auth(c);
    }
    if (!c.hello.has_secret) {
      return reject(c, RejectCode::kAuthRequired, "authentication failed: the client offered no shared secret");
    }
    Result<Nonce> nonce = random_nonce();
    if (!nonce.ok()) return reject(c, RejectCode::kUnavailable, nonce.error().message());
    c.server_nonce = *nonce;
    Challenge challenge{c.server_nonce, server_mac(options_.secret, c.hello.nonce, c.server_nonce)};
    std::string frame = encode_frame(FrameType::kChallenge, encode_challenge(challenge), options_.advertise_version);
    if (options_.reply_fault == SideChannelOptions::ReplyFault::kGarbage) return send_final(c, std::move(frame), false);
    c.out = std::move(frame);
    c.out_pos = 0;
    c.out_end = c.out.size();
    c.state = Connection::State::kWrite;
    return step(c, POLLOUT);
  }
  Result<Proof> proof = decode_proof(payload);
  if (!proof.ok()) return reject(c, RejectCode::kMalformed, "malformed handshake: " + proof.error().message());
  if (!mac_equal(proof->mac, client_mac(options_.secret, c.server_nonce, c.hello.nonce))) {
    return reject(c, RejectCode::kAuthFailed, "authentication failed: wrong shared secret");
  }
  after_auth(c);
}

// Version and authentication have passed: compare the hashes, then serve.
void SideChannelServer::after_auth(Connection& c) {
  if (c.hello.hash != hash_) {
    // The client learns our identity only now, so that it can name the field.
    return reject(c, RejectCode::kHashMismatch,
                  "compatibility hash mismatch (local " + hex16(hash_) + ", peer " + hex16(c.hello.hash) + ")", hash_,
                  identity_);
  }
  Result<std::string> payload = Status::internal("unset");
  {
    std::lock_guard<std::mutex> lock(mu_);
    info_.clock_ns = realtime_ns();
    payload = encode_metadata({hash_, info_});
  }
  if (!payload.ok()) {
    return reject(c, RejectCode::kUnavailable, "cannot serve the rank info: " + payload.error().message());
  }
  send_final(c, encode_frame(FrameType::kMetadata, *payload, options_.advertise_version), true);
}

void SideChannelServer::reject(Connection& c, RejectCode code, const std::string& why, uint64_t hash,
                               std::string identity) {
  if (!c.decided) record_rejection(c, why);
  c.decided = true;
  send_final(c, encode_frame(FrameType::kReject, encode_reject({code, hash, why, std::move(identity)}),
                             options_.advertise_version),
             false);
}

void SideChannelServer::send_final(Connection& c, std::string frame, bool metadata) {
  using Fault = SideChannelOptions::ReplyFault;
  c.out = std::move(frame);
  c.out_pos = 0;
  c.out_end = c.out.size();
  const bool first_frame = c.state == Connection::State::kReadHello;
  if (options_.reply_fault == Fault::kGarbage && first_frame) {
    std::minstd_rand random(std::random_device{}());
    for (char& ch : c.out) ch = static_cast<char>(random());
    abandon(c, "fault injection: garbage instead of the first reply");
  } else if (options_.reply_fault == Fault::kTruncate && metadata) {
    c.out_end = c.out.size() / 2;
    abandon(c, "fault injection: Metadata frame cut after " + std::to_string(c.out_end) + " of " +
                   std::to_string(c.out.size()) + " bytes");
  } else if (metadata && !c.decided) {
    served_.fetch_add(1);
    c.decided = true;
  }
  c.final = true;
  c.state = Connection::State::kWrite;
  step(c, POLLOUT);
}

// --- Client.

namespace {

// One client connection: a non-blocking socket and the handshake's deadline.
class ClientConnection {
 public:
  ClientConnection(std::string_view address, std::chrono::milliseconds timeout)
      : address_(address), timeout_(timeout), deadline_(Clock::now() + timeout) {}
  ~ClientConnection() {
    if (fd_ >= 0) ::close(fd_);
  }

  // Every error the client returns: "side channel <address>: <why>".
  Status fail(Code code, const std::string& why) const {
    return Status(code, "side channel " + printable(address_) + ": " + why);
  }

  Status connect() {
    KVB_ASSIGN_OR_RETURN(auto hp, split_address(address_));
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* res = nullptr;
    if (int rc = ::getaddrinfo(hp.first.c_str(), hp.second.c_str(), &hints, &res); rc != 0) {
      return fail(Code::kUnavailable, std::string("cannot resolve the address: ") + gai_strerror(rc));
    }
    Status last = fail(Code::kUnavailable, "no address to connect to");
    for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
      int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (fd < 0) continue;
      if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
        last = fail(errno == ECONNREFUSED ? Code::kUnavailable : Code::kIoError, "connect: " + errno_text(errno));
        ::close(fd);
        continue;
      }
      // connect(2): a non-blocking connect completes when the socket turns
      // writable; SO_ERROR then says how.
      Status s = wait(fd, POLLOUT, "connecting");
      int err = 0;
      socklen_t len = sizeof(err);
      if (s.ok()) ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (s.ok() && err == 0) {
        int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        fd_ = fd;
        ::freeaddrinfo(res);
        return Status();
      }
      ::close(fd);
      last = s.ok() ? fail(err == ECONNREFUSED ? Code::kUnavailable : Code::kIoError, "connect: " + errno_text(err)) : s;
      if (last.code() == Code::kTimeout) break;
    }
    ::freeaddrinfo(res);
    return last;
  }

  Status send(const std::string& frame, const char* what) {
    size_t sent = 0;
    while (sent < frame.size()) {
      ssize_t n = ::send(fd_, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n >= 0) {
        sent += static_cast<size_t>(n);
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        KVB_RETURN_IF_ERROR(wait(fd_, POLLOUT, std::string("sending its ") + what));
      } else if (errno != EINTR) {
        return fail(Code::kIoError, std::string("sending the ") + what + ": " + errno_text(errno));
      }
    }
    return Status();
  }

  // Reads the next frame; `waiting_for` names it in errors. A frame of
  // another version yields its header (and a Reject's payload, which every
  // version shares) for the caller to report.
  Result<Frame> read_frame(const std::string& waiting_for) {
    buffer_.assign(kFrameHeaderBytes, '\0');
    size_t got = 0;
    Status s = read(buffer_.data(), kFrameHeaderBytes, &got, waiting_for);
    if (!s.ok()) {
      if (s.code() != Code::kIoError || got == 0) return s;
      return fail(Code::kInvalidArgument, "malformed handshake: truncated frame header: peer closed after " +
                                               std::to_string(got) + " of " + std::to_string(kFrameHeaderBytes) +
                                               " bytes");
    }
    Result<FrameHeader> h = decode_header(buffer_);
    if (!h.ok()) return fail(Code::kInvalidArgument, "malformed handshake: " + h.error().message());
    if (h->version != kHandshakeVersion &&
        (h->type != FrameType::kReject || h->payload_bytes > max_payload_bytes(FrameType::kReject))) {
      return Frame{*h, {}};
    }
    buffer_.resize(kFrameHeaderBytes + h->payload_bytes);
    got = 0;
    s = read(buffer_.data() + kFrameHeaderBytes, h->payload_bytes, &got, waiting_for);
    if (!s.ok()) {
      if (s.code() != Code::kIoError) return s;
      return fail(Code::kInvalidArgument, "malformed handshake: truncated " + frame_type_name(h->type) +
                                               " frame: peer closed after " + std::to_string(got) + " of " +
                                               std::to_string(h->payload_bytes) + " payload bytes");
    }
    return Frame{*h, std::string_view(buffer_).substr(kFrameHeaderBytes)};
  }

 private:
  Status wait(int fd, short events, const std::string& doing) {
    for (;;) {
      if (Clock::now() >= deadline_) {
        return fail(Code::kTimeout, "handshake did not finish within " + std::to_string(timeout_.count()) +
                                        " ms (" + doing + ")");
      }
      pollfd p{fd, events, 0};
      int n = ::poll(&p, 1, poll_ms(deadline_));
      if (n < 0 && errno != EINTR) return fail(Code::kIoError, "poll: " + errno_text(errno));
      if (n > 0) return Status();
    }
  }

  // kIoError when the peer closes first; *got says how far it came.
  Status read(char* data, size_t len, size_t* got, const std::string& waiting_for) {
    while (*got < len) {
      ssize_t n = ::recv(fd_, data + *got, len - *got, MSG_DONTWAIT);
      if (n > 0) {
        *got += static_cast<size_t>(n);
      } else if (n == 0) {
        return fail(Code::kIoError, "connection closed by the peer while waiting for its " + waiting_for);
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        KVB_RETURN_IF_ERROR(wait(fd_, POLLIN, "waiting for the peer's " + waiting_for));
      } else if (errno != EINTR) {
        return fail(Code::kIoError, "receive: " + errno_text(errno));
      }
    }
    return Status();
  }

  std::string address_;
  std::chrono::milliseconds timeout_;
  Clock::time_point deadline_;
  int fd_ = -1;
  std::string buffer_;
};

// The client's words for a Reject (the server's own are its side of it).
Status reject_status(const ClientConnection& conn, const Frame& frame, std::string_view local_identity,
                     uint64_t local_hash) {
  Result<Reject> r = decode_reject(frame.payload);
  if (frame.header.version != kHandshakeVersion || (r.ok() && r->code == RejectCode::kVersion)) {
    return conn.fail(Code::kIncompatible, "handshake version mismatch: local " + std::to_string(kHandshakeVersion) +
                                              ", peer " + std::to_string(frame.header.version));
  }
  if (!r.ok()) return conn.fail(Code::kInvalidArgument, "malformed handshake: " + r.error().message());
  switch (r->code) {
    case RejectCode::kAuthRequired:
      return conn.fail(Code::kPermissionDenied, "authentication failed: peer requires a shared secret");
    case RejectCode::kAuthUnsupported:
      return conn.fail(Code::kPermissionDenied, "authentication failed: this side has a shared secret but the peer has none");
    case RejectCode::kAuthFailed:
      return conn.fail(Code::kPermissionDenied, "authentication failed: wrong shared secret");
    case RejectCode::kHashMismatch: {
      Status diff = compare_identity_text(local_identity, r->identity);
      return conn.fail(Code::kIncompatible,
                       "compatibility hash mismatch (local " + hex16(local_hash) + ", peer " + hex16(r->hash) +
                           "): " + (diff.ok() ? "the identity texts are equal" : diff.message()));
    }
    case RejectCode::kMalformed:
      return conn.fail(Code::kInvalidArgument, "peer refused the handshake as malformed: " + printable(r->message));
    default:
      return conn.fail(Code::kUnavailable, "peer refused the handshake (" + reject_code_name(r->code) +
                                               "): " + printable(r->message));
  }
}

}  // namespace

Result<RankInfo> fetch_rank_info(std::string_view address, std::string_view local_identity, uint64_t local_hash,
                                 const SideChannelOptions& options) {
  ClientConnection conn(address, options.timeout);
  KVB_RETURN_IF_ERROR(conn.connect());
  const bool has_secret = !options.secret.empty();
  KVB_ASSIGN_OR_RETURN(Nonce nonce, random_nonce());
  KVB_RETURN_IF_ERROR(conn.send(encode_frame(FrameType::kHello, encode_hello({has_secret, nonce, local_hash})), "Hello"));
  KVB_ASSIGN_OR_RETURN(Frame frame, conn.read_frame(has_secret ? "Challenge" : "Metadata"));
  if (frame.header.version != kHandshakeVersion || frame.header.type == FrameType::kReject) {
    return reject_status(conn, frame, local_identity, local_hash);
  }
  if (has_secret) {
    // We asked for proof: anything but a Challenge means the peer skipped it.
    if (frame.header.type != FrameType::kChallenge) {
      return conn.fail(Code::kPermissionDenied,
                       "authentication failed: this side has a shared secret but the peer has none (it sent " +
                           frame_type_name(frame.header.type) + ")");
    }
    Result<Challenge> challenge = decode_challenge(frame.payload);
    if (!challenge.ok()) return conn.fail(Code::kInvalidArgument, "malformed handshake: " + challenge.error().message());
    if (!mac_equal(challenge->mac, server_mac(options.secret, nonce, challenge->nonce))) {
      // Sending no proof to a peer that could not prove itself.
      return conn.fail(Code::kPermissionDenied, "authentication failed: wrong shared secret");
    }
    Proof proof{client_mac(options.secret, challenge->nonce, nonce)};
    KVB_RETURN_IF_ERROR(conn.send(encode_frame(FrameType::kProof, encode_proof(proof)), "Proof"));
    KVB_ASSIGN_OR_RETURN(frame, conn.read_frame("Metadata"));
    if (frame.header.version != kHandshakeVersion || frame.header.type == FrameType::kReject) {
      return reject_status(conn, frame, local_identity, local_hash);
    }
  }
  if (frame.header.type != FrameType::kMetadata) {
    return conn.fail(Code::kInvalidArgument, "malformed handshake: expected a Metadata frame, got " +
                                                 frame_type_name(frame.header.type));
  }
  Result<Metadata> metadata = decode_metadata(frame.payload);
  if (!metadata.ok()) return conn.fail(Code::kInvalidArgument, "malformed handshake: " + metadata.error().message());
  if (metadata->hash != local_hash) {
    return conn.fail(Code::kIncompatible, "compatibility hash mismatch (local " + hex16(local_hash) + ", peer " +
                                              hex16(metadata->hash) + "): the peer sent its metadata anyway");
  }
  return std::move(metadata->info);
}

}  // namespace kvbridge::connector
