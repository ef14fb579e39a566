// net/opening.h: the opening exchange every kvbridge connection starts with.
//
// The client sends Open {flags, nonce, body}: the body is the protocol's
// own (the side channel's compatibility hash, the control channel's and tcp's
// engine identities). The server answers with
//   - Refuse {code, message, detail} and closes, or
//   - when both sides have a secret, Challenge {nonce, server proof}; the
//     client checks the server's proof and sends Proof {client proof}; the
//     server checks it;
//   - then its first protocol frame (type >= 16), its answer to the body.
// Proofs are HMAC-SHA256 keyed by the secret over a label, the server nonce
// and a hash of the whole Open frame (so the body the client claims, its
// identity included, is bound to the proof), and the session key (session.h)
// is derived the same way. With a secret on both sides, every frame from the
// server's first answer on is tagged. A side with a secret never talks to one
// without: that is a Refuse, never a silent downgrade. Format, codes and
// messages: docs/formats/framing.md.
//
// ServerOpening and ClientOpening are pure state machines (no I/O): the
// listener (listener.h) and open_client() drive them over sockets, and the
// fuzz target drives them over any bytes.
//
// Thread-safety: values; one connection's, one thread at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "kvbridge/status.h"
#include "net/frame.h"
#include "net/session.h"
#include "net/socket.h"

namespace kvbridge::net {

inline constexpr size_t kMaxRefuseMessageBytes = 4096;

// Why a server refused. The codes are shared by every protocol and version.
enum class RefuseCode : uint8_t {
  kVersion = 1,          // the versions differ
  kAuthRequired = 2,     // the server has a secret; the client offered none
  kAuthUnsupported = 3,  // the client has a secret; the server has none
  kAuthFailed = 4,       // the client's proof is wrong
  kMalformed = 5,        // the server could not decode the client's frame
  kBusy = 6,             // a connection limit is reached; try again later
  kStale = 7,            // the client asked for another engine instance
  kMismatch = 8,         // the protocol's check of the body failed (detail says how)
  kDenied = 9,           // the client may not do what it asked
  kUnavailable = 10,     // the server cannot serve (a bug or a bound)
};
std::string refuse_code_name(RefuseCode code);

struct Refusal {
  RefuseCode code = RefuseCode::kMalformed;
  std::string message;  // the server's words, at most kMaxRefuseMessageBytes
  std::string detail;   // protocol-defined (side channel: its identity on kMismatch)
};

// What a protocol allows in the opening frames: the largest Open body and
// Refuse detail. opening_limit() gives the limits of types 1-4; a
// protocol's PayloadLimit returns it for those.
struct OpeningLimits {
  size_t max_body = 4096;
  size_t max_detail = 0;
};
size_t opening_limit(uint8_t type, const OpeningLimits& limits);

struct OpeningConfig {
  Protocol protocol = Protocol::kSideChannel;
  uint16_t version = 1;
  std::string secret;  // empty: none
  OpeningLimits limits;
};

// Encodes a Refuse payload (message and detail cut to their bounds).
std::string encode_refusal(const Refusal& refusal, size_t max_detail);
Result<Refusal> decode_refusal(std::string_view payload, size_t max_detail);

class ServerOpening {
 public:
  explicit ServerOpening(OpeningConfig config) : config_(std::move(config)) {}

  struct Step {
    enum class Kind { kSend, kOpened, kRefuse } kind = Kind::kSend;
    std::string bytes;  // kSend: the frame to send (a Challenge)
    Refusal refusal;    // kRefuse: send it (encode_refuse_frame) and close
  };
  // The next frame from the client (its header, raw header bytes, payload
  // and tag). kOpened: body() and take_session() are ready, and the server
  // answers with its first protocol frame.
  Step on_frame(const FrameHeader& header, std::string_view raw_header, std::string_view payload);
  // A Refuse frame for a header error or a refusal, for this connection.
  std::string refuse_frame(const Refusal& refusal);

  const std::string& body() const { return body_; }
  bool authenticated() const { return session_.keyed(); }
  Session take_session() { return std::move(session_); }

 private:
  Step refuse(RefuseCode code, std::string message);
  OpeningConfig config_;
  enum class State { kOpen, kProof, kDone } state_ = State::kOpen;
  std::string transcript_;  // SHA-256 of the Open frame
  Nonce server_nonce_{};
  std::string body_;
  Session session_;
};

class ClientOpening {
 public:
  ClientOpening(OpeningConfig config, std::string body);
  // The Open frame to send first.
  const std::string& open_frame() const { return open_; }

  struct Step {
    enum class Kind { kSend, kOpened, kFailed } kind = Kind::kSend;
    std::string bytes;  // kSend: the Proof
    Status error;       // kFailed: what went wrong, in the client's words
    Refusal refusal;    // kFailed by a Refuse: the server's
    bool refused = false;
  };
  // The next frame from the server. kOpened: the frame is the server's first
  // protocol frame (its tag already checked); take_session() is ready.
  Step on_frame(const FrameHeader& header, std::string_view raw_header, std::string_view payload, std::string_view tag);
  Session take_session() { return std::move(session_); }

 private:
  OpeningConfig config_;
  Nonce nonce_{};
  std::string open_;
  std::string transcript_;
  bool challenged_ = false;
  Session session_;
};

// The error a client reports for a refusal: kIncompatible (version,
// mismatch), kPermissionDenied (authentication, denied), kInvalidArgument
// (malformed), kUnavailable (busy, stale, unavailable), with the server's
// message.
Status refusal_status(const Refusal& refusal);

// The client side over a connected socket, blocking within `limits`: sends
// Open, answers a Challenge, and returns the server's first protocol frame
// with the session. `limit` is the protocol's PayloadLimit; `who` names the
// server in errors ("side channel 127.0.0.1:5000"). On a Refuse, the error is
// refusal_status() and *refusal (when given) holds the server's words.
struct Opened {
  Session session;
  FrameHeader header;  // of the first protocol frame
  std::string payload;
};
Result<Opened> open_client(int fd, const OpeningConfig& config, std::string body, const PayloadLimit& limit,
                           const IoLimits& limits, std::string_view who, Refusal* refusal = nullptr);

// A connection opened by dial_and_open().
struct Dialed {
  Fd fd;
  Opened opened;
};

// dial() and open_client(), tried again when the listener closed or reset
// the connection before the opening completed: what a listener does, under
// a flood of idle connections, to a newcomer that has not yet written its
// Open, or to a connection that got least far (listener.h), at any round
// of the exchange. Up to 8 tries, 5 ms apart doubling to 160 ms, within
// `limits`; the last try's error otherwise. A refusal or a failed proof is
// never retried. `bulk` as for dial().
Result<Dialed> dial_and_open(const HostPort& to, const OpeningConfig& config, std::string body,
                             const PayloadLimit& limit, const IoLimits& limits, std::string_view who,
                             Refusal* refusal = nullptr, bool bulk = false);

// Reads one whole frame from a blocking-with-deadline socket and checks its
// tag against `session`. Errors name `who`.
Status read_frame(int fd, FrameReader& reader, Session& session, const IoLimits& limits, std::string_view who);

}  // namespace kvbridge::net
