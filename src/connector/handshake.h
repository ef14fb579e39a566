// connector/handshake.h: the side channel's wire codec.
//
// A decode rank fetches a prefill rank's metadata (RankInfo) over a side
// channel in two phases: first the handshake version, an optional mutual
// shared-secret proof and the layouts' compatibility hashes; then, only when
// all three pass, the metadata. This header holds the frames of that exchange
// and their encoders and decoders, the HMAC proofs and the bounds; it does no
// I/O (side_channel.h does). The format, byte by byte, with the state machine
// and every limit, is docs/formats/handshake.md.
//
// The decoders take peer bytes: they check every length against its bound
// before using it, copy only plain fields (strings stay opaque bytes: nothing
// is parsed or executed), reject trailing bytes, and never crash on any input
// (fuzz/handshake_fuzz.cc). Errors are kInvalidArgument naming the frame and
// the field.
//
// Thread-safety: pure functions and plain values.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/status.h"

namespace kvbridge::connector {

inline constexpr uint16_t kHandshakeVersion = 1;

// Bounds on what a peer may send (bytes unless named otherwise).
inline constexpr size_t kMaxLayoutJsonBytes = 16 << 20, kMaxIdentityBytes = 4 << 20, kMaxInstanceIdBytes = 256;
inline constexpr size_t kMaxEngineMetadataBytes = 1 << 20;
inline constexpr size_t kMaxTensors = 1 << 16;
inline constexpr size_t kMaxTensorNameBytes = 1024;
inline constexpr size_t kMaxRejectMessageBytes = 4096;
// The whole Metadata payload, whatever its fields hold.
inline constexpr size_t kMaxMetadataPayloadBytes = 24 << 20;

inline constexpr size_t kFrameHeaderBytes = 12;
inline constexpr uint32_t kHandshakeMagic = 0x4842564B;  // the bytes "KVBH", little-endian
inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kMacBytes = 32;  // HMAC-SHA256

using Nonce = std::array<uint8_t, kNonceBytes>;
using Mac = std::array<uint8_t, kMacBytes>;

enum class FrameType : uint8_t {
  kHello = 1,      // client -> server
  kChallenge = 2,  // server -> client, when the server has a secret
  kProof = 3,      // client -> server, answers a Challenge
  kMetadata = 4,   // server -> client: the RankInfo; ends the handshake
  kReject = 5,     // server -> client: the refusal; ends the handshake
};

// "Hello", ..., or "frame type 9" for a value outside the enum.
std::string frame_type_name(FrameType type);

// The largest payload a frame of `type` may have under kHandshakeVersion; 0
// for an unknown type.
size_t max_payload_bytes(FrameType type);

// Every version keeps this 12-byte header (magic, version first) and the
// Reject payload as they are, so that two versions can always say why they
// cannot talk.
struct FrameHeader {
  uint16_t version = kHandshakeVersion;
  FrameType type = FrameType::kHello;
  uint32_t payload_bytes = 0;
};

// Decodes a header; `bytes` must be exactly kFrameHeaderBytes. Checks the
// magic first. If the version is not `version`, returns the header as read
// without checking the rest, and the caller reports the mismatch (reading a
// Reject payload, which every version shares, if it wants to). Otherwise
// checks the type, the reserved byte and the payload length against
// max_payload_bytes() — before anything is allocated for it.
Result<FrameHeader> decode_header(std::string_view bytes, uint16_t version = kHandshakeVersion);

// Header plus payload. Requires payload.size() <= max_payload_bytes(type).
std::string encode_frame(FrameType type, std::string_view payload, uint16_t version = kHandshakeVersion);

// One whole frame split into header and payload (a view into `bytes`):
// kInvalidArgument on a bad header, a version other than `version`, a payload
// cut short, or bytes after it.
struct Frame {
  FrameHeader header;
  std::string_view payload;
};
Result<Frame> decode_frame(std::string_view bytes, uint16_t version = kHandshakeVersion);

// --- Payloads. encode_* returns the payload; decode_* takes exactly one.

// Phase 1, client: 41 bytes.
struct Hello {
  bool has_secret = false;  // the client will prove a shared secret
  Nonce nonce{};            // random, fresh per connection
  uint64_t hash = 0;        // the client's compatibility_hash()
};
std::string encode_hello(const Hello& hello);
Result<Hello> decode_hello(std::string_view payload);

// Server, when it has a secret: 64 bytes.
struct Challenge {
  Nonce nonce{};
  Mac mac{};  // server_mac(secret, client nonce, this nonce)
};
std::string encode_challenge(const Challenge& challenge);
Result<Challenge> decode_challenge(std::string_view payload);

// Client's answer: 32 bytes.
struct Proof {
  Mac mac{};  // client_mac(secret, server nonce, client nonce)
};
std::string encode_proof(const Proof& proof);
Result<Proof> decode_proof(std::string_view payload);

// Why the server refused. The codes are shared by every version.
enum class RejectCode : uint8_t {
  kVersion = 1,          // the versions differ
  kAuthRequired = 2,     // the server has a secret; the client offered none
  kAuthUnsupported = 3,  // the client offered a secret; the server has none
  kAuthFailed = 4,       // the client's proof is wrong
  kHashMismatch = 5,     // the layouts differ; `identity` and `hash` are the server's
  kMalformed = 6,        // the server could not decode the client's frame
  kUnavailable = 7,      // the server cannot serve its metadata (a bug or a bound)
};
std::string reject_code_name(RejectCode code);

struct Reject {
  RejectCode code = RejectCode::kMalformed;
  uint64_t hash = 0;     // kHashMismatch only, else 0
  std::string message;   // the server's words, <= kMaxRejectMessageBytes
  std::string identity;  // kHashMismatch only: identity_text(), <= kMaxIdentityBytes
};
// Requires the bounds above (the encoder cuts longer text to fit).
std::string encode_reject(const Reject& reject);
// Accepts any code value, so that a newer server's refusal still reads.
Result<Reject> decode_reject(std::string_view payload);

// The address and size of one registered tensor.
struct TensorRegion {
  std::string name;
  uint32_t region = 0;
  uint64_t base = 0;
  uint64_t bytes = 0;

  bool operator==(const TensorRegion&) const = default;
};

// What one rank serves.
struct RankInfo {
  std::string instance_id;             // e.g. "prefill-0", <= kMaxInstanceIdBytes
  uint32_t rank = 0;                   // tp_rank, < tp_size
  uint32_t tp_size = 1;
  int32_t pid = 0;
  std::string layout_json;             // kvbridge::to_json(layout, -1), <= kMaxLayoutJsonBytes
  std::string engine_metadata;         // Engine::metadata() bytes (opaque here), <= kMaxEngineMetadataBytes
  std::vector<TensorRegion> tensors;   // per layout tensor, in layout order; <= kMaxTensors
  uint64_t clock_ns = 0;               // server CLOCK_REALTIME when it replied (filled by the server)

  bool operator==(const RankInfo&) const = default;
};

// Phase 2, server.
struct Metadata {
  uint64_t hash = 0;  // the server's compatibility_hash(), equal to the client's
  RankInfo info;
};
// kInvalidArgument naming the field that exceeds its bound or breaks a rule
// (rank >= tp_size, tp_size 0); kResourceExhausted when the whole payload
// would exceed kMaxMetadataPayloadBytes.
Result<std::string> encode_metadata(const Metadata& metadata);
Result<Metadata> decode_metadata(std::string_view payload);

// Ok when `info` would encode; the same checks as encode_metadata().
Status check_rank_info(const RankInfo& info);

// --- Proofs (HMAC-SHA256 keyed by the shared secret).

// A fresh random nonce (RAND_bytes); kInternal if the generator fails.
Result<Nonce> random_nonce();
// HMAC(secret, "kvbridge-server" | client_nonce | server_nonce).
Mac server_mac(std::string_view secret, const Nonce& client_nonce, const Nonce& server_nonce);
// HMAC(secret, "kvbridge-client" | server_nonce | client_nonce).
Mac client_mac(std::string_view secret, const Nonce& server_nonce, const Nonce& client_nonce);
// Constant-time comparison (CRYPTO_memcmp).
bool mac_equal(const Mac& a, const Mac& b);

}  // namespace kvbridge::connector
