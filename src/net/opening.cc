// The opening exchange (see opening.h and docs/formats/framing.md).
#include "net/opening.h"

#include <openssl/evp.h>
#include <poll.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "common/text.h"
#include "net/wire.h"

namespace kvbridge::net {
namespace {

constexpr uint8_t kHasSecret = 0x01;
constexpr size_t kOpenFixedBytes = 1 + kNonceBytes + 4;
constexpr size_t kChallengeBytes = kNonceBytes + kMacBytes;

std::string sha256(std::string_view a, std::string_view b) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  if (ctx == nullptr || EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr) != 1 ||
      EVP_DigestUpdate(ctx, a.data(), a.size()) != 1 || EVP_DigestUpdate(ctx, b.data(), b.size()) != 1 ||
      EVP_DigestFinal_ex(ctx, out, &len) != 1) {
    std::abort();  // OpenSSL cannot hash: nothing safe to do
  }
  EVP_MD_CTX_free(ctx);
  return std::string(reinterpret_cast<const char*>(out), len);
}

std::string protocol_byte(Protocol p) { return std::string(1, static_cast<char>(p)); }

Mac proof(std::string_view secret, std::string_view label, Protocol p, const Nonce& server_nonce,
          std::string_view transcript) {
  return hmac(secret, {label, protocol_byte(p), view(server_nonce), transcript});
}

std::string frame(const FrameHeader& h, std::string_view payload) {
  Session none;
  std::string out;
  append_frame(out, h, payload, none);
  return out;
}

}  // namespace

std::string refuse_code_name(RefuseCode code) {
  switch (code) {
    case RefuseCode::kVersion:
      return "version";
    case RefuseCode::kAuthRequired:
      return "auth_required";
    case RefuseCode::kAuthUnsupported:
      return "auth_unsupported";
    case RefuseCode::kAuthFailed:
      return "auth_failed";
    case RefuseCode::kMalformed:
      return "malformed";
    case RefuseCode::kBusy:
      return "busy";
    case RefuseCode::kStale:
      return "stale";
    case RefuseCode::kMismatch:
      return "mismatch";
    case RefuseCode::kDenied:
      return "denied";
    case RefuseCode::kUnavailable:
      return "unavailable";
  }
  return "code " + std::to_string(static_cast<unsigned>(code));
}

size_t opening_limit(uint8_t type, const OpeningLimits& limits) {
  switch (type) {
    case kOpen:
      return kOpenFixedBytes + limits.max_body;
    case kChallenge:
      return kChallengeBytes;
    case kProof:
      return kMacBytes;
    case kRefuse:
      return 1 + 4 + kMaxRefuseMessageBytes + 4 + limits.max_detail;
  }
  return 0;
}

std::string encode_refusal(const Refusal& r, size_t max_detail) {
  WireWriter w;
  w.u8(static_cast<uint8_t>(r.code));
  w.str(std::string_view(r.message).substr(0, kMaxRefuseMessageBytes));
  w.str(std::string_view(r.detail).substr(0, max_detail));
  return w.take();
}

Result<Refusal> decode_refusal(std::string_view payload, size_t max_detail) {
  WireReader r(payload, "Refuse frame");
  Refusal out;
  uint8_t code = 0;
  KVB_RETURN_IF_ERROR(r.u8("code", &code));
  out.code = static_cast<RefuseCode>(code);  // any value: a newer peer's code still reads
  KVB_RETURN_IF_ERROR(r.str("message", kMaxRefuseMessageBytes, &out.message));
  KVB_RETURN_IF_ERROR(r.str("detail", max_detail, &out.detail));
  KVB_RETURN_IF_ERROR(r.finish());
  return out;
}

Status refusal_status(const Refusal& r) {
  const std::string said = printable(r.message, kMaxRefuseMessageBytes);
  switch (r.code) {
    case RefuseCode::kVersion:
      return Status::incompatible(said);
    case RefuseCode::kMismatch:
      return Status::incompatible(said);
    case RefuseCode::kAuthRequired:
      return Status::permission_denied("authentication failed: peer requires a shared secret");
    case RefuseCode::kAuthUnsupported:
      return Status::permission_denied("authentication failed: this side has a shared secret but the peer has none");
    case RefuseCode::kAuthFailed:
      return Status::permission_denied("authentication failed: wrong shared secret");
    case RefuseCode::kDenied:
      return Status::permission_denied(said);
    case RefuseCode::kMalformed:
      return Status::invalid_argument("malformed: the peer says: " + said);
    case RefuseCode::kBusy:
    case RefuseCode::kStale:
    case RefuseCode::kUnavailable:
      return Status::unavailable(said);
  }
  return Status::unavailable("refused (" + refuse_code_name(r.code) + "): " + said);
}

ServerOpening::Step ServerOpening::refuse(RefuseCode code, std::string message) {
  Step s;
  s.kind = Step::Kind::kRefuse;
  s.refusal = Refusal{code, std::move(message), {}};
  state_ = State::kDone;
  return s;
}

std::string ServerOpening::refuse_frame(const Refusal& refusal) {
  std::string out;
  FrameHeader h{config_.protocol, kRefuse, config_.version, 0, false};
  append_frame(out, h, encode_refusal(refusal, config_.limits.max_detail), session_);
  return out;
}

ServerOpening::Step ServerOpening::on_frame(const FrameHeader& h, std::string_view raw_header,
                                            std::string_view payload) {
  if (state_ == State::kOpen) {
    if (h.type != kOpen)
      return refuse(RefuseCode::kMalformed, "expected an Open frame, got frame type " + std::to_string(h.type));
    if (h.tagged) return refuse(RefuseCode::kMalformed, "an Open frame cannot carry a tag");
    WireReader r(payload, "Open frame");
    uint8_t flags = 0;
    Nonce client_nonce{};
    Status s = r.u8("flags", &flags);
    if (s.ok() && (flags & ~kHasSecret) != 0) s = r.error("unknown flags " + std::to_string(flags));
    if (s.ok()) s = r.array("nonce", &client_nonce);
    if (s.ok()) s = r.str("body", config_.limits.max_body, &body_);
    if (s.ok()) s = r.finish();
    if (!s.ok()) return refuse(RefuseCode::kMalformed, "malformed: " + s.message());
    transcript_ = sha256(raw_header, payload);
    const bool client_secret = (flags & kHasSecret) != 0;
    if (config_.secret.empty()) {
      if (client_secret) {
        return refuse(RefuseCode::kAuthUnsupported,
                      "authentication failed: the client has a shared secret but this side has none");
      }
      state_ = State::kDone;
      return Step{Step::Kind::kOpened, {}, {}};
    }
    if (!client_secret)
      return refuse(RefuseCode::kAuthRequired, "authentication failed: the client offered no shared secret");
    server_nonce_ = random_nonce();
    const Mac mac = proof(config_.secret, "kvbridge server", config_.protocol, server_nonce_, transcript_);
    WireWriter w;
    w.array(server_nonce_);
    w.array(mac);
    state_ = State::kProof;
    return Step{Step::Kind::kSend, frame({config_.protocol, kChallenge, config_.version, 0, false}, w.out()), {}};
  }
  if (state_ == State::kProof) {
    if (h.type != kProof)
      return refuse(RefuseCode::kMalformed, "expected a Proof frame, got frame type " + std::to_string(h.type));
    if (h.tagged || payload.size() != kMacBytes) return refuse(RefuseCode::kMalformed, "malformed Proof frame");
    const Mac want = proof(config_.secret, "kvbridge client", config_.protocol, server_nonce_, transcript_);
    if (!equal_constant_time(payload, view(want))) {
      return refuse(RefuseCode::kAuthFailed, "authentication failed: wrong shared secret");
    }
    session_ = Session(proof(config_.secret, "kvbridge session", config_.protocol, server_nonce_, transcript_), false);
    state_ = State::kDone;
    return Step{Step::Kind::kOpened, {}, {}};
  }
  return refuse(RefuseCode::kMalformed, "a frame after the opening exchange ended");
}

ClientOpening::ClientOpening(OpeningConfig config, std::string body) : config_(std::move(config)) {
  nonce_ = random_nonce();
  WireWriter w;
  w.u8(config_.secret.empty() ? 0 : kHasSecret);
  w.array(nonce_);
  w.str(body);
  open_ = frame({config_.protocol, kOpen, config_.version, 0, false}, w.out());
  transcript_ =
      sha256(std::string_view(open_).substr(0, kFrameHeaderBytes), std::string_view(open_).substr(kFrameHeaderBytes));
}

ClientOpening::Step ClientOpening::on_frame(const FrameHeader& h, std::string_view raw_header, std::string_view payload,
                                            std::string_view tag) {
  auto failed = [](Status error) {
    Step s;
    s.kind = Step::Kind::kFailed;
    s.error = std::move(error);
    return s;
  };
  // A Refuse may come untagged even after the proofs (a server that
  // refused before it derived the key); anything else must carry the tag.
  if (session_.keyed() && (h.tagged || h.type != kRefuse)) {
    if (!h.tagged || !session_.check(raw_header, payload, tag)) {
      return failed(Status::permission_denied("authentication failed: a frame from the peer has a wrong tag"));
    }
  } else if (!session_.keyed() && h.tagged) {
    return failed(Status::invalid_argument("malformed: a tagged frame before any secret was proven"));
  }
  if (h.type == kRefuse) {
    Result<Refusal> r = decode_refusal(payload, config_.limits.max_detail);
    if (!r.ok()) return failed(Status::invalid_argument("malformed: " + r.error().message()));
    Step s = failed(refusal_status(*r));
    if (r->code == RefuseCode::kVersion || h.version != config_.version) {
      s.error = Status::incompatible(protocol_name(config_.protocol) + " version mismatch: local " +
                                     std::to_string(config_.version) + ", peer " + std::to_string(h.version));
    }
    s.refused = true;
    s.refusal = std::move(*r);
    return s;
  }
  if (h.type == kChallenge) {
    if (config_.secret.empty() || challenged_)
      return failed(Status::invalid_argument("malformed: an unexpected Challenge"));
    WireReader r(payload, "Challenge frame");
    Nonce server_nonce{};
    Mac server_proof{};
    Status st = r.array("nonce", &server_nonce);
    if (st.ok()) st = r.array("proof", &server_proof);
    if (st.ok()) st = r.finish();
    if (!st.ok()) return failed(Status::invalid_argument("malformed: " + st.message()));
    const Mac want = proof(config_.secret, "kvbridge server", config_.protocol, server_nonce, transcript_);
    if (!equal_constant_time(view(server_proof), view(want))) {
      return failed(Status::permission_denied("authentication failed: wrong shared secret"));
    }
    challenged_ = true;
    const Mac mine = proof(config_.secret, "kvbridge client", config_.protocol, server_nonce, transcript_);
    session_ = Session(proof(config_.secret, "kvbridge session", config_.protocol, server_nonce, transcript_), true);
    Step s;
    s.kind = Step::Kind::kSend;
    s.bytes = frame({config_.protocol, kProof, config_.version, 0, false}, view(mine));
    return s;
  }
  if (h.type >= kFirstProtocolType) {
    if (!config_.secret.empty() && !challenged_) {
      return failed(Status::permission_denied(
          "authentication failed: this side has a shared secret but the peer answered without proving one"));
    }
    Step s;
    s.kind = Step::Kind::kOpened;
    return s;
  }
  return failed(Status::invalid_argument("malformed: unexpected frame type " + std::to_string(h.type)));
}

namespace {

// One frame into `reader`, reading no more than the bytes it asks for and
// feeding them as they come (so a frame cut short says how much arrived).
Status read_raw(int fd, FrameReader& reader, const IoLimits& limits, std::string_view who) {
  reader.next();
  std::string buf;
  while (!reader.ready()) {
    buf.resize(std::min<size_t>(reader.wanted(), 1 << 16));
    IovCursor cursor;
    cursor.push(buf.data(), buf.size());
    Result<size_t> n = recv_step(fd, cursor, who);
    if (!n.ok()) {
      if (n.error().code() == Code::kIoError && reader.buffered() > 0) {
        return Status::invalid_argument(std::string(who) + ": malformed: truncated frame: peer closed after " +
                                        std::to_string(reader.buffered()) + " bytes of a frame of " +
                                        std::to_string(reader.buffered() + reader.wanted()));
      }
      return n.error();
    }
    if (*n == 0) {
      KVB_RETURN_IF_ERROR(wait_fd(fd, POLLIN, limits, who));
      continue;
    }
    Status fed = reader.feed(std::string_view(buf.data(), *n));
    if (!fed.ok()) return Status(fed.code(), std::string(who) + ": " + fed.message());
  }
  return Status();
}

}  // namespace

Status read_frame(int fd, FrameReader& reader, Session& session, const IoLimits& limits, std::string_view who) {
  KVB_RETURN_IF_ERROR(read_raw(fd, reader, limits, who));
  const FrameHeader& h = reader.header();
  if (h.tagged != session.keyed()) {
    return Status::permission_denied(std::string(who) + ": a frame " + (h.tagged ? "with" : "without") +
                                     " a tag on a connection that " + (session.keyed() ? "proved" : "has no") +
                                     " shared secret");
  }
  if (session.keyed() && !session.check(reader.raw_header(), reader.payload(), reader.tag())) {
    return Status::permission_denied(std::string(who) + ": authentication failed: a frame has a wrong tag");
  }
  return Status();
}

namespace {

// open_client(), saying in `unanswered` whether it failed on an I/O error
// (the connection closed or reset) before the opening completed: the
// listener may close a connection still opening (for a newer one under a
// flood) at any round of the exchange, and a new one, with fresh nonces,
// is safe to try. A refusal or a failed proof is an answer.
Result<Opened> open_client_once(int fd, const OpeningConfig& config, std::string body, const PayloadLimit& limit,
                                const IoLimits& limits, std::string_view who, Refusal* refusal, bool* unanswered) {
  ClientOpening opening(config, std::move(body));
  *unanswered = false;
  Status sent = send_bytes(fd, opening.open_frame().data(), opening.open_frame().size(), limits, who);
  if (!sent.ok()) {
    *unanswered = sent.code() == Code::kIoError;
    return sent;
  }
  FrameReader reader(config.protocol, config.version, limit);
  for (;;) {
    Status s = read_raw(fd, reader, limits, who);
    if (!s.ok() && s.code() == Code::kIoError) *unanswered = true;
    if (!s.ok() && s.code() == Code::kIoError && s.message().find("closed by the peer") != std::string::npos) {
      return Status::io_error(std::string(who) + ": the peer closed the connection during the opening exchange");
    }
    KVB_RETURN_IF_ERROR(s);
    ClientOpening::Step step = opening.on_frame(reader.header(), reader.raw_header(), reader.payload(), reader.tag());
    switch (step.kind) {
      case ClientOpening::Step::Kind::kSend: {
        Status proof = send_bytes(fd, step.bytes.data(), step.bytes.size(), limits, who);
        if (!proof.ok()) {
          *unanswered = proof.code() == Code::kIoError;
          return proof;
        }
        break;
      }
      case ClientOpening::Step::Kind::kFailed:
        if (refusal != nullptr && step.refused) *refusal = std::move(step.refusal);
        return Status(step.error.code(), std::string(who) + ": " + step.error.message());
      case ClientOpening::Step::Kind::kOpened:
        return Opened{opening.take_session(), reader.header(), std::string(reader.payload())};
    }
  }
}

}  // namespace

Result<Opened> open_client(int fd, const OpeningConfig& config, std::string body, const PayloadLimit& limit,
                           const IoLimits& limits, std::string_view who, Refusal* refusal) {
  bool unanswered = false;
  return open_client_once(fd, config, std::move(body), limit, limits, who, refusal, &unanswered);
}

Result<Dialed> dial_and_open(const HostPort& to, const OpeningConfig& config, std::string body,
                             const PayloadLimit& limit, const IoLimits& limits, std::string_view who, Refusal* refusal,
                             bool bulk) {
  constexpr int kTries = 8;
  std::chrono::milliseconds pause{5};
  for (int attempt = 1;; ++attempt) {
    KVB_ASSIGN_OR_RETURN(Fd fd, dial(to, limits, who, bulk));
    bool unanswered = false;
    Result<Opened> opened = open_client_once(fd.get(), config, body, limit, limits, who, refusal, &unanswered);
    if (opened.ok()) return Dialed{std::move(fd), std::move(*opened)};
    if (!unanswered || attempt == kTries || Clock::now() + pause >= limits.deadline) return opened.error();
    std::this_thread::sleep_for(pause);
    KVB_RETURN_IF_ERROR(check_limits(limits, std::string(who) + ": opening again"));
    pause = std::min<std::chrono::milliseconds>(pause * 2, std::chrono::milliseconds(160));
  }
}

}  // namespace kvbridge::net
