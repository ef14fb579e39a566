// The tcp transport's frame codec. Layout and rules: docs/formats/tcp-protocol.md.
#include "transport/tcp_protocol.h"

#include <cstdio>
#include <cstring>

#include "common/checked.h"

namespace kvbridge::transport::tcp {
namespace {

void put_u8(std::string& out, uint8_t v) { out.push_back(static_cast<char>(v)); }
void put_u16(std::string& out, uint16_t v) {
  for (int i = 0; i < 2; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
void put_u64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}

uint16_t get_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t get_u32(const uint8_t* p) {
  return uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
}
uint64_t get_u64(const uint8_t* p) { return uint64_t{get_u32(p)} | (uint64_t{get_u32(p + 4)} << 32); }

std::string type_name(uint8_t type) { return "frame type " + std::to_string(type); }

}  // namespace

void encode_header(const FrameHeader& header, std::string& out) {
  put_u32(out, kMagic);
  put_u8(out, static_cast<uint8_t>(header.type));
  put_u8(out, 0);
  put_u16(out, 0);
  put_u32(out, header.count);
  put_u32(out, header.payload_bytes);
}

void encode_hello(FrameType type, const Hello& hello, std::string& out) {
  std::string_view label = std::string_view(hello.label).substr(0, kMaxLabelBytes);
  encode_header({type, 0, static_cast<uint32_t>(kHelloFixedBytes + label.size())}, out);
  put_u16(out, hello.version_min);
  put_u16(out, hello.version_max);
  put_u32(out, static_cast<uint32_t>(label.size()));
  put_u64(out, hello.instance);
  out.append(label);
}

void encode_ranges_header(FrameType type, std::span<const Range> ranges, std::string& out) {
  encode_header({type, static_cast<uint32_t>(ranges.size()), static_cast<uint32_t>(ranges.size() * kRangeBytes)},
                out);
  for (const Range& r : ranges) {
    put_u32(out, r.segment);
    put_u32(out, 0);
    put_u64(out, r.address);
    put_u64(out, r.bytes);
  }
}

void encode_error(const Status& status, std::string& out) {
  std::string_view text = std::string_view(status.message()).substr(0, kMaxErrorText);
  encode_header({FrameType::kError, 0, static_cast<uint32_t>(4 + text.size())}, out);
  put_u32(out, static_cast<uint32_t>(status.code()));
  out.append(text);
}

Result<FrameHeader> decode_header(std::span<const uint8_t> bytes) {
  if (bytes.size() != kHeaderBytes) return Status::invalid_argument("tcp frame: short header");
  const uint8_t* p = bytes.data();
  if (get_u32(p) != kMagic) return Status::invalid_argument("tcp frame: bad magic");
  uint8_t raw_type = p[4];
  if (p[5] != 0 || get_u16(p + 6) != 0) return Status::invalid_argument("tcp frame: reserved bytes are not zero");
  FrameHeader h;
  h.count = get_u32(p + 8);
  h.payload_bytes = get_u32(p + 12);
  auto bad = [&](std::string_view what) {
    return Status::invalid_argument("tcp frame: " + type_name(raw_type) + ": " + std::string(what) + " (count " +
                                    std::to_string(h.count) + ", payload " + std::to_string(h.payload_bytes) + ")");
  };
  switch (raw_type) {
    case static_cast<uint8_t>(FrameType::kHello):
    case static_cast<uint8_t>(FrameType::kHelloOk):
      if (h.count != 0 || h.payload_bytes < kHelloFixedBytes || h.payload_bytes > kHelloFixedBytes + kMaxLabelBytes)
        return bad("bad hello size");
      break;
    case static_cast<uint8_t>(FrameType::kRead):
    case static_cast<uint8_t>(FrameType::kWrite):
      if (h.count == 0 || h.count > kMaxRangesPerFrame) return bad("range count out of bounds");
      if (uint64_t{h.payload_bytes} != uint64_t{h.count} * kRangeBytes) return bad("table size does not match count");
      break;
    case static_cast<uint8_t>(FrameType::kReadData):
    case static_cast<uint8_t>(FrameType::kWriteAck):
      if (h.count == 0 || h.count > kMaxRangesPerFrame || h.payload_bytes != 0) return bad("bad reply size");
      break;
    case static_cast<uint8_t>(FrameType::kError):
      if (h.count != 0 || h.payload_bytes < 4 || h.payload_bytes > 4 + kMaxErrorText) return bad("bad error size");
      break;
    default:
      return Status::invalid_argument("tcp frame: unknown " + type_name(raw_type));
  }
  h.type = static_cast<FrameType>(raw_type);
  return h;
}

Result<Hello> decode_hello(std::span<const uint8_t> payload) {
  if (payload.size() < kHelloFixedBytes || payload.size() > kHelloFixedBytes + kMaxLabelBytes)
    return Status::invalid_argument("tcp hello: bad size " + std::to_string(payload.size()));
  const uint8_t* p = payload.data();
  Hello h;
  h.version_min = get_u16(p);
  h.version_max = get_u16(p + 2);
  uint32_t label_bytes = get_u32(p + 4);
  h.instance = get_u64(p + 8);
  if (label_bytes != payload.size() - kHelloFixedBytes)
    return Status::invalid_argument("tcp hello: label length " + std::to_string(label_bytes) +
                                    " does not match the frame");
  if (h.version_min == 0 || h.version_min > h.version_max)
    return Status::invalid_argument("tcp hello: bad version range " + std::to_string(h.version_min) + ".." +
                                    std::to_string(h.version_max));
  h.label.assign(reinterpret_cast<const char*>(p + kHelloFixedBytes), label_bytes);
  for (char& c : h.label) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e) c = '?';
  }
  return h;
}

Status decode_ranges(std::span<const uint8_t> payload, uint32_t count, const SegmentLookup& lookup,
                     std::vector<Range>* ranges, uint64_t* total_bytes) {
  if (count == 0 || count > kMaxRangesPerFrame || payload.size() != uint64_t{count} * kRangeBytes)
    return Status::invalid_argument("tcp request: range table of " + std::to_string(payload.size()) +
                                    " bytes for " + std::to_string(count) + " ranges");
  ranges->clear();
  ranges->reserve(count);
  uint64_t total = 0;
  for (uint32_t i = 0; i < count; ++i) {
    const uint8_t* p = payload.data() + size_t{i} * kRangeBytes;
    Range r{get_u32(p), get_u64(p + 8), get_u64(p + 16)};
    std::string where = "tcp request: range " + std::to_string(i) + " (segment " + std::to_string(r.segment) +
                        ", address 0x";
    auto describe = [&] {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%llx, %llu bytes)", static_cast<unsigned long long>(r.address),
                    static_cast<unsigned long long>(r.bytes));
      return where + buf;
    };
    if (get_u32(p + 4) != 0) return Status::invalid_argument(describe() + ": reserved bytes are not zero");
    if (r.bytes == 0) return Status::out_of_range(describe() + ": empty range");
    std::optional<SegmentSpan> seg = lookup(r.segment);
    if (!seg) return Status::out_of_range(describe() + ": no such segment registered here");
    uint64_t end = 0, seg_end = 0;
    if (!checked_add(r.address, r.bytes, &end) || !checked_add(seg->base, seg->bytes, &seg_end) ||
        r.address < seg->base || end > seg_end)
      return Status::out_of_range(describe() + ": outside the segment");
    if (!checked_add(total, r.bytes, &total) || total > kMaxFrameDataBytes)
      return Status::resource_exhausted(describe() + ": frame carries more than " +
                                        std::to_string(kMaxFrameDataBytes) + " bytes");
    ranges->push_back(r);
  }
  *total_bytes = total;
  return Status();
}

Status decode_error(std::span<const uint8_t> payload) {
  if (payload.size() < 4 || payload.size() > 4 + kMaxErrorText)
    return Status::io_error("tcp: malformed error frame");
  uint32_t raw = get_u32(payload.data());
  std::string text(reinterpret_cast<const char*>(payload.data() + 4), payload.size() - 4);
  for (char& c : text) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e) c = '?';
  }
  Code code = Code::kIoError;
  if (raw > static_cast<uint32_t>(Code::kOk) && raw <= static_cast<uint32_t>(Code::kInternal))
    code = static_cast<Code>(raw);
  return Status(code, std::move(text));
}

Result<FrameHeader> decode_request(std::span<const uint8_t> bytes, const SegmentLookup& lookup,
                                   std::vector<Range>* ranges, uint64_t* total_bytes) {
  if (bytes.size() < kHeaderBytes) return Status::invalid_argument("tcp frame: short header");
  KVB_ASSIGN_OR_RETURN(FrameHeader h, decode_header(bytes.first(kHeaderBytes)));
  std::span<const uint8_t> rest = bytes.subspan(kHeaderBytes);
  if (rest.size() < h.payload_bytes) return Status::invalid_argument("tcp frame: truncated payload");
  std::span<const uint8_t> payload = rest.first(h.payload_bytes);
  *total_bytes = 0;
  ranges->clear();
  switch (h.type) {
    case FrameType::kHello: {
      KVB_ASSIGN_OR_RETURN(Hello hello, decode_hello(payload));
      (void)hello;
      break;
    }
    case FrameType::kRead:
    case FrameType::kWrite:
      KVB_RETURN_IF_ERROR(decode_ranges(payload, h.count, lookup, ranges, total_bytes));
      break;
    default:
      return Status::invalid_argument("tcp frame: a client may not send " + type_name(static_cast<uint8_t>(h.type)));
  }
  return h;
}

}  // namespace kvbridge::transport::tcp
