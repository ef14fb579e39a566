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

#include "connector/side_channel_util.h"
#include "kvbridge/layout.h"
namespace kvbridge::connector {

using namespace side_channel_detail;

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

}  // namespace kvbridge::connector
