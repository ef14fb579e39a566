// The side channel's client: fetch_rank_info() (see side_channel.h and
// docs/formats/handshake.md). One blocking-with-deadline connection per call:
// Hello, the Challenge/Proof exchange when either side has a secret, then the
// Metadata frame or a Reject, each frame read exactly and bounded before any
// allocation.
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
