// transport/tcp_protocol.h: the framed wire protocol of the tcp transport.
//
// The format is specified in docs/formats/tcp-protocol.md (version 1). A
// stream opens with HELLO (client) and HELLO_OK (server); then the client
// sends READ and WRITE request frames and the server answers each, in order,
// with READ_DATA (followed by the bytes), WRITE_ACK or ERROR. Every integer is
// little-endian. This file holds the pure encoding and decoding: no I/O, no
// threads, so the decoders can be fuzzed (fuzz/tcp_frame_fuzz.cc).
//
// Every decoder treats its input as hostile: lengths are checked against the
// bytes present, counts and sizes against the bounds below, and sums against
// overflow. A range is accepted only when it lies inside a segment of the
// caller's SegmentLookup.
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

inline constexpr uint32_t kMagic = 0x5442564B;  // "KVBT" read as little-endian bytes
inline constexpr uint16_t kVersion = 1;
inline constexpr size_t kHeaderBytes = 16;
inline constexpr size_t kRangeBytes = 24;
inline constexpr size_t kHelloFixedBytes = 16;
inline constexpr size_t kMaxLabelBytes = 256;
inline constexpr size_t kMaxErrorText = 1024;
// Bounds a peer may not exceed (the decoder rejects larger numbers).
inline constexpr uint32_t kMaxRangesPerFrame = 65536;
inline constexpr uint64_t kMaxFrameDataBytes = uint64_t{1} << 30;
inline constexpr uint32_t kMaxPayloadBytes = kMaxRangesPerFrame * kRangeBytes;

enum class FrameType : uint8_t {
  kHello = 1,
  kHelloOk = 2,
  kRead = 3,
  kWrite = 4,
  kReadData = 5,
  kWriteAck = 6,
  kError = 7,
};

// The 16-byte header of every frame. `count` is the number of ranges (READ,
// WRITE, and echoed by READ_DATA and WRITE_ACK), `payload_bytes` the bytes
// after the header that belong to the frame itself (hello body, range table,
// error body); bulk data (WRITE, READ_DATA) follows the payload and its length
// is the sum of the ranges' lengths.
struct FrameHeader {
  FrameType type = FrameType::kError;
  uint32_t count = 0;
  uint32_t payload_bytes = 0;
};

// One range of a request: `bytes` at the server's virtual address `address`
// inside its segment `segment`.
struct Range {
  uint32_t segment = 0;
  uint64_t address = 0;
  uint64_t bytes = 0;
};

struct Hello {
  uint16_t version_min = kVersion;  // HELLO_OK: the chosen version in both
  uint16_t version_max = kVersion;
  uint64_t instance = 0;  // the server transport's random instance id
  std::string label;      // who is speaking, for error messages
};

// Returns the segment's [base, base + bytes) when `id` is registered.
struct SegmentSpan {
  uint64_t base = 0;
  uint64_t bytes = 0;
};
using SegmentLookup = std::function<std::optional<SegmentSpan>(uint32_t id)>;

// Encoders append to `out`.
void encode_header(const FrameHeader& header, std::string& out);
void encode_hello(FrameType type, const Hello& hello, std::string& out);
void encode_ranges_header(FrameType type, std::span<const Range> ranges, std::string& out);
void encode_error(const Status& status, std::string& out);

// Decodes a header from exactly kHeaderBytes. kInvalidArgument for a bad
// magic, an unknown type, non-zero reserved bytes, or a payload or count
// outside the bounds for the type.
Result<FrameHeader> decode_header(std::span<const uint8_t> bytes);
// Decodes a HELLO or HELLO_OK body of header.payload_bytes.
Result<Hello> decode_hello(std::span<const uint8_t> payload);
// Decodes `count` ranges and checks each against `lookup`: kOutOfRange
// naming the range when it is empty or not inside one registered segment,
// kInvalidArgument for a malformed table, kResourceExhausted when the sum
// exceeds kMaxFrameDataBytes. On success `*total_bytes` is the sum.
Status decode_ranges(std::span<const uint8_t> payload, uint32_t count, const SegmentLookup& lookup,
                     std::vector<Range>* ranges, uint64_t* total_bytes);
// Decodes an ERROR body into the Status it carries (unknown codes become
// kIoError; never OK).
Status decode_error(std::span<const uint8_t> payload);

// Decodes one complete request frame (header, table) as the server would and
// validates it: the fuzz target's entry point. Returns the header or the
// first problem.
Result<FrameHeader> decode_request(std::span<const uint8_t> bytes, const SegmentLookup& lookup,
                                   std::vector<Range>* ranges, uint64_t* total_bytes);

}  // namespace kvbridge::transport::tcp
