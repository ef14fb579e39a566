// transport/tcp_protocol.h: the tcp transport's own frames, on the shared
// framing of net/frame.h.
//
// The format is docs/formats/tcp-protocol.md (version 2). A stream opens with
// the shared exchange (net/opening.h): the client's Open body names the
// server transport instance it wants (from the address blob) and who it is;
// the server answers Accept. Then the client sends Read and Write request
// frames and the server answers each, in order, with ReadData (followed by
// the bytes), WriteAck or Error. Write's bulk data follows its frame; so does
// ReadData's. On a connection that proved a shared secret every frame carries
// a tag; the bulk data does not. This file holds the pure encoding and
// decoding: no I/O, no threads, so the decoders can be fuzzed
// (fuzz/tcp_frame_fuzz.cc).
//
// Every decoder treats its input as hostile: lengths are checked against the
// bytes present, counts and sizes against the bounds below, and sums against
// overflow. A range is accepted only when it lies inside a segment of the
// caller's SegmentLookup that grants the access the request needs (a read
// needs remote read access, a write remote write access).
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/status.h"

namespace kvbridge::transport::tcp {

inline constexpr uint16_t kVersion = 2;
inline constexpr size_t kRangeBytes = 24;
inline constexpr size_t kMaxLabelBytes = 512;  // an engine name (256) and its instance
inline constexpr size_t kMaxErrorText = 1024;
// Bounds a peer may not exceed (the decoder rejects larger numbers).
inline constexpr uint32_t kMaxRangesPerFrame = 65536;
inline constexpr uint64_t kMaxFrameDataBytes = uint64_t{1} << 30;

// The tcp protocol's frame types (after the shared opening types).
inline constexpr uint8_t kAccept = 16, kRead = 17, kWrite = 18, kReadData = 19, kWriteAck = 20, kError = 21;
// The content check (Link::digest): Digest carries a range table like Read;
// the server answers DigestData, the content hash (copies.h) of each range's bytes as they
// are, in order (a u32 count, then a u64 per range), or Error. A range may
// be hashed where the client may read it, or write it (inside a grant to
// its label, for a segment that takes writes only by grant).
inline constexpr uint8_t kDigest = 22, kDigestData = 23;

// The largest payload of a frame type; 0 for an unknown type.
size_t payload_limit(uint8_t type);

// One range of a request: `bytes` at the server's virtual address `address`
// inside its segment `segment`.
struct Range {
  uint32_t segment = 0;
  uint64_t address = 0;
  uint64_t bytes = 0;
};

// Remote access bits a segment grants (RemoteAccess in engine.h).
inline constexpr uint8_t kAccessRead = 1, kAccessWrite = 2;
// Writes land only inside a write grant to the writing stream's label.
inline constexpr uint8_t kAccessByGrant = 4;
// Reads are served only inside a read grant to the reading stream's label.
inline constexpr uint8_t kAccessReadByGrant = 8;

// The segment's [base, base + bytes) and access when `id` is registered.
struct SegmentSpan {
  uint64_t base = 0;
  uint64_t bytes = 0;
  uint8_t access = kAccessRead | kAccessWrite;
  int device = -1;  // device memory of this ordinal (staged), or -1: host memory
};
using SegmentLookup = std::function<std::optional<SegmentSpan>(uint32_t id)>;

// The Open body: the server transport's instance the client wants, and a
// label naming the client in the server's messages.
std::string encode_open_body(uint64_t instance, std::string_view label);
Status decode_open_body(std::string_view body, uint64_t* instance, std::string* label);

// Request payloads: the range table.
std::string encode_ranges(std::span<const Range> ranges);
// Decodes a table and checks each range against `lookup` and the access a
// `write` (or read) needs: kOutOfRange naming the range when it is empty or
// not inside one registered segment, kPermissionDenied when its segment
// does not grant the access, kInvalidArgument for a malformed table,
// kResourceExhausted when the sum exceeds kMaxFrameDataBytes. On success
// `*total_bytes` is the sum.
Status decode_ranges(std::string_view payload, const SegmentLookup& lookup, bool write, std::vector<Range>* ranges,
                     uint64_t* total_bytes);

// The data bytes a range table announces (the sum of its ranges' lengths),
// whatever its segments: what follows a Write that is refused, which the
// server reads and drops to keep the stream in step. kInvalidArgument for a
// malformed table, kResourceExhausted past kMaxFrameDataBytes.
Result<uint64_t> announced_bytes(std::string_view payload);

// ReadData / WriteAck payloads: the count of ranges answered.
std::string encode_count(uint32_t count);
Result<uint32_t> decode_count(std::string_view payload);

// DigestData payloads: the hashes of a Digest's ranges, in order.
std::string encode_hashes(std::span<const uint64_t> hashes);
// kIoError unless the payload holds exactly `expected` hashes.
Status decode_hashes(std::string_view payload, uint32_t expected, std::vector<uint64_t>* hashes);

// Error payloads carry a Status (unknown codes become kIoError; never OK).
std::string encode_error(const Status& status);
Status decode_error(std::string_view payload);

// Checks one request frame's type and payload as the server would: the fuzz
// target's entry point. Returns whether it is a write, or the first problem.
Result<bool> decode_request(uint8_t type, std::string_view payload, const SegmentLookup& lookup,
                            std::vector<Range>* ranges, uint64_t* total_bytes);

}  // namespace kvbridge::transport::tcp
