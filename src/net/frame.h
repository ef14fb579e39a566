// net/frame.h: the one frame format of every kvbridge protocol.
//
// Every message on every kvbridge connection (the side channel's handshake,
// the engine's control channel, the tcp transport's streams) is a frame: a
// 16-byte header, a payload, and, on a connection whose opening exchange
// proved a shared secret, a 16-byte tag (session.h). Bulk data that a frame
// announces (tcp reads and writes) follows the frame and is not part of it.
// The byte layout is docs/formats/framing.md.
//
//   u32 magic "KVBN" | u8 protocol | u8 type | u16 version | u32 payload bytes | u32 flags
//
// Types 1-4 are the opening exchange every protocol shares (opening.h);
// protocols number their own frames from 16. A protocol bounds each type's
// payload (PayloadLimit) and the decoder checks the length before anything
// is allocated. A header of another version is returned as read only for a
// Refuse (whose payload every version keeps), so two versions can always say
// why they cannot talk; any other type of another version is an error.
//
// Thread-safety: pure functions; a FrameReader is one connection's, used by
// one thread at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "kvbridge/status.h"

namespace kvbridge::net {

enum class Protocol : uint8_t { kSideChannel = 1, kControl = 2, kTcp = 3 };
std::string protocol_name(Protocol protocol);  // "side channel", "control", "tcp"

inline constexpr uint32_t kFrameMagic = 0x4e42564b;  // the bytes "KVBN"
inline constexpr size_t kFrameHeaderBytes = 16;
inline constexpr size_t kTagBytes = 16;
inline constexpr uint32_t kFlagTagged = 1;

// Frame types of the opening exchange, shared by every protocol.
inline constexpr uint8_t kOpen = 1, kChallenge = 2, kProof = 3, kRefuse = 4;
inline constexpr uint8_t kFirstProtocolType = 16;

struct FrameHeader {
  Protocol protocol = Protocol::kSideChannel;
  uint8_t type = 0;
  uint16_t version = 0;
  uint32_t payload_bytes = 0;
  bool tagged = false;
};

// The largest payload of `type` for this side's protocol version, or 0 for a
// type it does not know. Covers the opening types too (opening_limit()).
using PayloadLimit = std::function<size_t(uint8_t type)>;

void encode_header(const FrameHeader& header, std::string& out);

// Decodes exactly kFrameHeaderBytes. Errors (kInvalidArgument unless named):
// a bad magic (a kvbridge frame of the format before this header is named as
// such, kIncompatible), another protocol, unknown flags; for `version`: an
// unknown type, a payload over its limit. A header of another version is
// returned unchecked when its type is a Refuse; otherwise kIncompatible
// "<protocol> version mismatch: local V, peer W".
Result<FrameHeader> decode_header(std::string_view bytes, Protocol protocol, uint16_t version,
                                  const PayloadLimit& limit);

// The protocol and version a frame of the format before this header
// announces (magic "KVBH", "KVBC" or "KVBT" with a u16 version after it), for
// answering such a peer in its own words; false for anything else.
bool legacy_header(std::string_view bytes, Protocol* protocol, uint16_t* version);

// Reads one frame at a time from a non-blocking byte stream: header, then
// payload and tag. It asks for no more bytes than the current frame has
// (wanted()), so a peer can never make it buffer beyond one bounded frame.
class FrameReader {
 public:
  FrameReader(Protocol protocol, uint16_t version, PayloadLimit limit)
      : protocol_(protocol), version_(version), limit_(std::move(limit)) {}

  // Bytes to read next (0 once a frame is ready).
  size_t wanted() const;
  // Takes at most wanted() bytes. A bad header is an error (the stream is
  // then unusable).
  Status feed(std::string_view bytes);
  bool ready() const { return have_header_ && buf_.size() == total_; }
  // The ready frame; valid until next().
  const FrameHeader& header() const { return header_; }
  std::string_view raw_header() const { return std::string_view(buf_).substr(0, kFrameHeaderBytes); }
  std::string_view payload() const { return std::string_view(buf_).substr(kFrameHeaderBytes, header_.payload_bytes); }
  std::string_view tag() const;
  // Bytes received of the current frame (for messages about cut frames).
  size_t buffered() const { return buf_.size(); }
  void next();

 private:
  Protocol protocol_;
  uint16_t version_;
  PayloadLimit limit_;
  std::string buf_;
  FrameHeader header_;
  bool have_header_ = false;
  size_t total_ = kFrameHeaderBytes;
};

}  // namespace kvbridge::net
