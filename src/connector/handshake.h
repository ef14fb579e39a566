// connector/handshake.h: what the side channel serves, and its limits.
//
// A decode rank fetches a prefill rank's metadata (RankInfo) over the side
// channel (side_channel.h). The connection opens with the exchange every
// kvbridge connection shares (net/opening.h): version, optional shared
// secret; the client's Open body is its layout's compatibility hash. The
// server then answers with one Metadata frame (this RankInfo) when the
// hashes are equal, or a Refuse (code mismatch) whose detail is its hash and
// identity text, so the client can name the field that differs. This header
// holds the payload codecs and the bounds; it does no I/O. The format, byte
// by byte, is docs/formats/handshake.md.
//
// The decoders take peer bytes through net::WireReader: every length is
// checked against its bound before use, strings stay opaque bytes (nothing is
// parsed or executed), trailing bytes are rejected, and no input crashes them
// (fuzz/handshake_fuzz.cc). Errors are kInvalidArgument naming the field.
//
// Thread-safety: pure functions and plain values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/engine.h"
#include "kvbridge/status.h"

namespace kvbridge::connector {

inline constexpr uint16_t kHandshakeVersion = 2;

// Bounds on what a peer may send (bytes unless named otherwise).
inline constexpr size_t kMaxLayoutJsonBytes = 16 << 20, kMaxIdentityBytes = 4 << 20, kMaxInstanceIdBytes = 256;
inline constexpr size_t kMaxTensors = 1 << 16;
inline constexpr size_t kMaxTensorNameBytes = 1024;
// The whole Metadata payload, whatever its fields hold.
inline constexpr size_t kMaxMetadataPayloadBytes = 24 << 20;
// The client's Open body: its compatibility hash.
inline constexpr size_t kOpenBodyBytes = 8;
// A Refuse's detail: the server's hash and identity text.
inline constexpr size_t kMaxRefuseDetailBytes = 8 + kMaxIdentityBytes;

// The side channel's own frame type (after the shared opening types).
inline constexpr uint8_t kMetadataFrame = 16;

// The largest payload of a side channel frame type; 0 for an unknown one.
size_t max_payload_bytes(uint8_t type);

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
  std::string instance_id;  // e.g. "prefill-0", <= kMaxInstanceIdBytes
  uint32_t rank = 0;        // tp_rank, < tp_size
  uint32_t tp_size = 1;
  int32_t pid = 0;
  std::string layout_json;            // kvbridge::to_json(layout, -1), <= kMaxLayoutJsonBytes
  std::string engine_metadata;        // Engine::metadata() bytes (opaque here), <= kMaxEngineMetadataBytes
  std::vector<TensorRegion> tensors;  // per layout tensor, in layout order; <= kMaxTensors
  uint64_t clock_ns = 0;              // server CLOCK_REALTIME when it replied (filled by the server)

  bool operator==(const RankInfo&) const = default;
};

// The Metadata frame's payload.
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

// The Open body (the hash), and a Refuse detail (hash, identity).
std::string encode_open_body(uint64_t hash);
Result<uint64_t> decode_open_body(std::string_view body);
std::string encode_mismatch_detail(uint64_t hash, std::string_view identity);
Result<std::pair<uint64_t, std::string>> decode_mismatch_detail(std::string_view detail);

}  // namespace kvbridge::connector
