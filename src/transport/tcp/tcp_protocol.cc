// The tcp transport's frame payloads. Layout and rules: docs/formats/tcp-protocol.md.
#include "transport/tcp/tcp_protocol.h"

#include "common/checked.h"
#include "net/opening.h"
#include "net/wire.h"

namespace kvbridge::transport::tcp {

size_t payload_limit(uint8_t type) {
  switch (type) {
    case kAccept:
      return 4 + kMaxLabelBytes;
    case kRead:
    case kWrite:
    case kDigest:
      return size_t{kMaxRangesPerFrame} * kRangeBytes;
    case kDigestData:
      return 4 + size_t{kMaxRangesPerFrame} * 8;
    case kReadData:
    case kWriteAck:
      return 4;
    case kError:
      return 4 + 4 + kMaxErrorText;
  }
  return net::opening_limit(type, net::OpeningLimits{8 + 4 + kMaxLabelBytes, 0});
}

std::string encode_open_body(uint64_t instance, std::string_view label) {
  net::WireWriter w;
  w.u64(instance);
  w.str(label.substr(0, kMaxLabelBytes));
  return w.take();
}

Status decode_open_body(std::string_view body, uint64_t* instance, std::string* label) {
  net::WireReader r(body, "tcp Open body");
  KVB_RETURN_IF_ERROR(r.u64("instance", instance));
  KVB_RETURN_IF_ERROR(r.str("label", kMaxLabelBytes, label));
  return r.finish();
}

std::string encode_ranges(std::span<const Range> ranges) {
  net::WireWriter w;
  for (const Range& r : ranges) {
    w.u32(r.segment);
    w.u32(0);
    w.u64(r.address);
    w.u64(r.bytes);
  }
  return w.take();
}

Status decode_ranges(std::string_view payload, const SegmentLookup& lookup, bool write, std::vector<Range>* ranges,
                     uint64_t* total_bytes) {
  if (payload.empty() || payload.size() % kRangeBytes != 0 || payload.size() / kRangeBytes > kMaxRangesPerFrame) {
    return Status::invalid_argument("tcp request: a range table of " + std::to_string(payload.size()) +
                                    " bytes is not 1 to " + std::to_string(kMaxRangesPerFrame) + " ranges of 24 bytes");
  }
  const size_t count = payload.size() / kRangeBytes;
  net::WireReader r(payload, "tcp range table");
  ranges->clear();
  ranges->reserve(count);
  uint64_t total = 0;
  for (size_t i = 0; i < count; ++i) {
    Range range;
    uint32_t reserved = 0;
    KVB_RETURN_IF_ERROR(r.u32("segment", &range.segment));
    KVB_RETURN_IF_ERROR(r.u32("reserved", &reserved));
    KVB_RETURN_IF_ERROR(r.u64("address", &range.address));
    KVB_RETURN_IF_ERROR(r.u64("bytes", &range.bytes));
    const std::string what = "tcp request: range " + std::to_string(i);
    if (reserved != 0) return Status::invalid_argument(what + ": reserved field is not 0");
    std::optional<SegmentSpan> seg = lookup(range.segment);
    uint64_t end = 0;
    if (range.bytes == 0) return Status::out_of_range(what + " is empty");
    if (!seg) return Status::out_of_range(what + ": segment " + std::to_string(range.segment) + " is not registered");
    if (!checked_add(range.address, range.bytes, &end) || range.address < seg->base || end > seg->base + seg->bytes) {
      return Status::out_of_range(what + " [" + std::to_string(range.address) + ", +" + std::to_string(range.bytes) +
                                  ") is outside segment " + std::to_string(range.segment));
    }
    const uint8_t needs = write ? kAccessWrite : kAccessRead;
    if ((seg->access & needs) == 0) {
      return Status::permission_denied(what + ": segment " + std::to_string(range.segment) + " does not allow remote " +
                                       (write ? "writes" : "reads"));
    }
    if (!checked_add(total, range.bytes, &total) || total > kMaxFrameDataBytes) {
      return Status::resource_exhausted("tcp request: more than " + std::to_string(kMaxFrameDataBytes) +
                                        " bytes in one frame");
    }
    ranges->push_back(range);
  }
  *total_bytes = total;
  return Status();
}

Result<uint64_t> announced_bytes(std::string_view payload) {
  if (payload.size() % kRangeBytes != 0 || payload.size() / kRangeBytes > kMaxRangesPerFrame) {
    return Status::invalid_argument("tcp request: a range table of " + std::to_string(payload.size()) +
                                    " bytes is not up to " + std::to_string(kMaxRangesPerFrame) +
                                    " ranges of 24 bytes");
  }
  net::WireReader r(payload, "tcp range table");
  uint64_t total = 0;
  while (r.left() > 0) {
    uint32_t segment = 0, reserved = 0;
    uint64_t address = 0, bytes = 0;
    KVB_RETURN_IF_ERROR(r.u32("segment", &segment));
    KVB_RETURN_IF_ERROR(r.u32("reserved", &reserved));
    KVB_RETURN_IF_ERROR(r.u64("address", &address));
    KVB_RETURN_IF_ERROR(r.u64("bytes", &bytes));
    if (!checked_add(total, bytes, &total) || total > kMaxFrameDataBytes) {
      return Status::resource_exhausted("tcp request: more than " + std::to_string(kMaxFrameDataBytes) +
                                        " bytes in one frame");
    }
  }
  return total;
}

std::string encode_count(uint32_t count) {
  net::WireWriter w;
  w.u32(count);
  return w.take();
}

std::string encode_hashes(std::span<const uint64_t> hashes) {
  net::WireWriter w;
  w.u32(static_cast<uint32_t>(hashes.size()));
  for (uint64_t h : hashes) w.u64(h);
  return w.take();
}

Status decode_hashes(std::string_view payload, uint32_t expected, std::vector<uint64_t>* hashes) {
  net::WireReader r(payload, "tcp digest reply");
  uint32_t count = 0;
  KVB_RETURN_IF_ERROR(r.u32("count", &count));
  if (count != expected) {
    return Status::io_error("tcp digest reply: " + std::to_string(count) + " hashes for " + std::to_string(expected) +
                            " ranges");
  }
  hashes->resize(count);
  for (uint32_t i = 0; i < count; ++i) KVB_RETURN_IF_ERROR(r.u64("hash", &(*hashes)[i]));
  return r.finish();
}

Result<uint32_t> decode_count(std::string_view payload) {
  net::WireReader r(payload, "tcp reply");
  uint32_t count = 0;
  KVB_RETURN_IF_ERROR(r.u32("count", &count));
  KVB_RETURN_IF_ERROR(r.finish());
  return count;
}

std::string encode_error(const Status& status) {
  net::WireWriter w;
  w.u32(static_cast<uint32_t>(status.code()));
  w.str(std::string_view(status.message()).substr(0, kMaxErrorText));
  return w.take();
}

Status decode_error(std::string_view payload) {
  net::WireReader r(payload, "tcp Error frame");
  uint32_t code = 0;
  std::string text;
  Status s = r.u32("code", &code);
  if (s.ok()) s = r.str("message", kMaxErrorText, &text);
  if (s.ok()) s = r.finish();
  if (!s.ok()) return Status::io_error("tcp: malformed error frame: " + s.message());
  if (code == 0 || code > static_cast<uint32_t>(Code::kPermissionDenied)) return Status::io_error(text);
  return Status(static_cast<Code>(code), text);
}

Result<bool> decode_request(uint8_t type, std::string_view payload, const SegmentLookup& lookup,
                            std::vector<Range>* ranges, uint64_t* total_bytes) {
  if (type != kRead && type != kWrite) {
    return Status::invalid_argument("tcp: frame type " + std::to_string(type) + " is not a request");
  }
  KVB_RETURN_IF_ERROR(decode_ranges(payload, lookup, type == kWrite, ranges, total_bytes));
  return type == kWrite;
}

}  // namespace kvbridge::transport::tcp
