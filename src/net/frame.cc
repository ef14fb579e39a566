// The shared frame header (see frame.h and docs/formats/framing.md).
#include "net/frame.h"

#include "common/text.h"
#include "net/wire.h"

namespace kvbridge::net {

std::string protocol_name(Protocol protocol) {
  switch (protocol) {
    case Protocol::kSideChannel:
      return "side channel";
    case Protocol::kControl:
      return "control";
    case Protocol::kTcp:
      return "tcp";
  }
  return "protocol " + std::to_string(static_cast<unsigned>(protocol));
}

void encode_header(const FrameHeader& h, std::string& out) {
  WireWriter w;
  w.u32(kFrameMagic);
  w.u8(static_cast<uint8_t>(h.protocol));
  w.u8(h.type);
  w.u16(h.version);
  w.u32(h.payload_bytes);
  w.u32(h.tagged ? kFlagTagged : 0);
  out.append(w.out());
}

bool legacy_header(std::string_view bytes, Protocol* protocol, uint16_t* version) {
  if (bytes.size() < 6) return false;
  WireReader r(bytes, "header");
  uint32_t magic = 0;
  uint16_t v = 0;
  (void)r.u32("magic", &magic);
  (void)r.u16("version", &v);
  if (magic == 0x4842564b) {  // "KVBH"
    *protocol = Protocol::kSideChannel;
  } else if (magic == 0x4342564b) {  // "KVBC"
    *protocol = Protocol::kControl;
  } else if (magic == 0x5442564b) {  // "KVBT": no version field; it was 1
    *protocol = Protocol::kTcp;
    v = 1;
  } else {
    return false;
  }
  *version = v;
  return true;
}

Result<FrameHeader> decode_header(std::string_view bytes, Protocol protocol, uint16_t version,
                                  const PayloadLimit& limit) {
  if (bytes.size() != kFrameHeaderBytes) {
    return Status::invalid_argument("frame header is " + std::to_string(bytes.size()) + " bytes, not 16");
  }
  WireReader r(bytes, "frame header");
  uint32_t magic = 0, length = 0, flags = 0;
  uint8_t proto = 0, type = 0;
  uint16_t v = 0;
  KVB_RETURN_IF_ERROR(r.u32("magic", &magic));
  KVB_RETURN_IF_ERROR(r.u8("protocol", &proto));
  KVB_RETURN_IF_ERROR(r.u8("type", &type));
  KVB_RETURN_IF_ERROR(r.u16("version", &v));
  KVB_RETURN_IF_ERROR(r.u32("length", &length));
  KVB_RETURN_IF_ERROR(r.u32("flags", &flags));
  if (magic != kFrameMagic) {
    Protocol old = Protocol::kSideChannel;
    uint16_t old_version = 0;
    if (legacy_header(bytes, &old, &old_version)) {
      return Status::incompatible(protocol_name(old) + " version mismatch: local " + std::to_string(version) +
                                  ", peer " + std::to_string(old_version));
    }
    return Status::invalid_argument("bad magic " + q(printable(bytes.substr(0, 4))) + " (not a kvbridge " +
                                    protocol_name(protocol) + ")");
  }
  if (proto != static_cast<uint8_t>(protocol)) {
    return Status::invalid_argument("a " + protocol_name(static_cast<Protocol>(proto)) + " frame on a " +
                                    protocol_name(protocol) + " connection");
  }
  if ((flags & ~kFlagTagged) != 0) return Status::invalid_argument("unknown frame flags " + std::to_string(flags));
  FrameHeader h{protocol, type, v, length, (flags & kFlagTagged) != 0};
  if (v != version) {
    if (type == kRefuse) return h;
    return Status::incompatible(protocol_name(protocol) + " version mismatch: local " + std::to_string(version) +
                                ", peer " + std::to_string(v));
  }
  const size_t max = limit(type);
  if (max == 0) {
    return Status::invalid_argument("unknown " + protocol_name(protocol) + " frame type " + std::to_string(type));
  }
  if (length > max) {
    return Status::invalid_argument(protocol_name(protocol) + " frame type " + std::to_string(type) + " length " +
                                    std::to_string(length) + " exceeds " + std::to_string(max));
  }
  return h;
}

size_t FrameReader::wanted() const { return total_ - buf_.size(); }

Status FrameReader::feed(std::string_view bytes) {
  if (bytes.size() > wanted()) return Status::internal("FrameReader::feed: more bytes than wanted");
  buf_.append(bytes);
  if (!have_header_ && buf_.size() == kFrameHeaderBytes) {
    // The limit of a Refuse of another version is this version's: its
    // payload format is shared.
    KVB_ASSIGN_OR_RETURN(header_, decode_header(buf_, protocol_, version_, limit_));
    if (header_.version != version_ && header_.payload_bytes > limit_(kRefuse)) {
      return Status::invalid_argument("Refuse frame length " + std::to_string(header_.payload_bytes) + " exceeds " +
                                      std::to_string(limit_(kRefuse)));
    }
    have_header_ = true;
    total_ = kFrameHeaderBytes + header_.payload_bytes + (header_.tagged ? kTagBytes : 0);
  }
  return Status();
}

std::string_view FrameReader::tag() const {
  if (!header_.tagged) return {};
  return std::string_view(buf_).substr(kFrameHeaderBytes + header_.payload_bytes, kTagBytes);
}

void FrameReader::next() {
  buf_.clear();
  have_header_ = false;
  total_ = kFrameHeaderBytes;
}

}  // namespace kvbridge::net
