// net/session.h: what a shared secret buys a connection: proof at opening,
// and a tag on every frame after it.
//
// The opening exchange (opening.h) ends with both sides holding a session
// key derived from the secret and both nonces. A keyed Session tags every
// frame it sends: the first 16 bytes of HMAC-SHA256(key, direction | seq |
// header | payload), seq counting frames per direction from 0. The receiver
// recomputes it, so a frame that was forged, changed, replayed, reordered or
// taken from another connection fails; tags are compared in constant time.
// A Session without a key (no secret) tags nothing. Bulk data that follows a
// frame (tcp reads and writes) is not tagged: the secret authenticates who
// talks and what they ask for, it does not protect or hide KV bytes
// (docs/security.md).
//
// Thread-safety: tag() and check() keep separate counters and may run on two
// threads at once (a sender and a receiver); each one from one thread at a
// time.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace kvbridge::net {

inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kMacBytes = 32;
using Nonce = std::array<uint8_t, kNonceBytes>;
using Mac = std::array<uint8_t, kMacBytes>;
static_assert(kNonceBytes == kMacBytes, "Nonce and Mac are one type");

Nonce random_nonce();

// HMAC-SHA256(key, parts...) in one call.
Mac hmac(std::string_view key, std::initializer_list<std::string_view> parts);
// The bytes of a nonce or a MAC (one type: 32 bytes).
std::string_view view(const Mac& m);
// Constant time (CRYPTO_memcmp).
bool equal_constant_time(std::string_view a, std::string_view b);

class Session {
 public:
  // No secret: nothing is tagged.
  Session();
  // `key` from the opening exchange; `client` says which side this is, so
  // the two directions tag with different labels.
  Session(const Mac& key, bool client);
  ~Session();
  Session(Session&&) noexcept;
  Session& operator=(Session&&) noexcept;

  bool keyed() const { return keyed_; }
  // The tag of the next frame this side sends (header and payload as sent).
  std::array<uint8_t, 16> tag(std::string_view header, std::string_view payload);
  // Whether `tag` is right for the next frame received.
  bool check(std::string_view header, std::string_view payload, std::string_view tag);

 private:
  struct Keys;
  bool keyed_ = false;
  std::unique_ptr<Keys> keys_;
  uint64_t send_seq_ = 0;
  uint64_t recv_seq_ = 0;
};

// Appends one frame: header (flagged tagged when the session is keyed),
// payload, then its tag.
struct FrameHeader;
void append_frame(std::string& out, const FrameHeader& header, std::string_view payload, Session& session);

}  // namespace kvbridge::net
