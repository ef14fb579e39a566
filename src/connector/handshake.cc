// The side channel's codec (docs/formats/handshake.md).
//
// Decoding goes through one bounded cursor: each read first checks the bytes
// left, and each length-prefixed field checks its bound and the bytes left
// before a string is built, so no peer-chosen number sizes an allocation.
#include "connector/handshake.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <algorithm>

namespace kvbridge::connector {
namespace {

constexpr size_t kHelloBytes = 1 + kNonceBytes + 8;
constexpr size_t kChallengeBytes = kNonceBytes + kMacBytes;
constexpr size_t kProofBytes = kMacBytes;
constexpr size_t kRejectMaxBytes = 1 + 8 + 4 + kMaxRejectMessageBytes + 4 + kMaxIdentityBytes;
constexpr size_t kTensorFixedBytes = 4 + 4 + 8 + 8;  // name length, region, base, bytes
constexpr uint8_t kHelloHasSecret = 0x01;

void put(std::string& out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void put_bytes(std::string& out, std::string_view s) {
  put(out, s.size(), 4);
  out.append(s);
}
template <size_t N>
void put_array(std::string& out, const std::array<uint8_t, N>& a) {
  out.append(reinterpret_cast<const char*>(a.data()), N);
}

// A bounded cursor over one payload.
class Reader {
 public:
  Reader(std::string_view in, std::string frame) : in_(in), frame_(std::move(frame)) {}

  Status uint(std::string_view field, int n, uint64_t* v) {
    KVB_RETURN_IF_ERROR(need(field, static_cast<size_t>(n)));
    *v = 0;
    for (int i = 0; i < n; ++i) *v |= uint64_t{static_cast<uint8_t>(in_[pos_ + i])} << (8 * i);
    pos_ += static_cast<size_t>(n);
    return Status();
  }
  template <size_t N>
  Status array(std::string_view field, std::array<uint8_t, N>* a) {
    KVB_RETURN_IF_ERROR(need(field, N));
    std::copy_n(reinterpret_cast<const uint8_t*>(in_.data() + pos_), N, a->begin());
    pos_ += N;
    return Status();
  }
  // A u32 length, checked against `max` and the bytes left, then the bytes.
  Status bytes(std::string_view field, size_t max, std::string* out) {
    uint64_t len = 0;
    KVB_RETURN_IF_ERROR(uint(std::string(field) + " length", 4, &len));
    if (len > max) return error(std::string(field) + " length " + std::to_string(len) + " exceeds " + std::to_string(max));
    KVB_RETURN_IF_ERROR(need(field, len));
    out->assign(in_.data() + pos_, len);
    pos_ += len;
    return Status();
  }
  size_t left() const { return in_.size() - pos_; }
  Status finish() const {
    if (pos_ == in_.size()) return Status();
    return error(std::to_string(in_.size() - pos_) + " trailing bytes");
  }
  Status error(const std::string& what) const { return Status::invalid_argument(frame_ + " frame: " + what); }

 private:
  Status need(std::string_view field, uint64_t n) const {
    if (n <= left()) return Status();
    return error("truncated at " + std::string(field) + " (needs " + std::to_string(n) + " bytes, " +
                 std::to_string(left()) + " left)");
  }

  std::string_view in_;
  std::string frame_;
  size_t pos_ = 0;
};

Status limit(std::string_view field, size_t size, size_t max) {
  if (size <= max) return Status();
  return Status::invalid_argument("rank info: " + std::string(field) + " is " + std::to_string(size) +
                                  " bytes, more than " + std::to_string(max));
}

Mac hmac(std::string_view secret, std::string_view label, const Nonce& a, const Nonce& b) {
  std::string data(label);
  data.append(reinterpret_cast<const char*>(a.data()), a.size());
  data.append(reinterpret_cast<const char*>(b.data()), b.size());
  Mac mac{};
  unsigned int len = 0;
  // HMAC(3): the one-shot form, not deprecated in OpenSSL 3.
  ::HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), reinterpret_cast<const uint8_t*>(data.data()),
         data.size(), mac.data(), &len);
  return mac;
}

}  // namespace

std::string frame_type_name(FrameType type) {
  switch (type) {
    case FrameType::kHello: return "Hello";
    case FrameType::kChallenge: return "Challenge";
    case FrameType::kProof: return "Proof";
    case FrameType::kMetadata: return "Metadata";
    case FrameType::kReject: return "Reject";
  }
  return "frame type " + std::to_string(static_cast<unsigned>(type));
}

size_t max_payload_bytes(FrameType type) {
  switch (type) {
    case FrameType::kHello: return kHelloBytes;
    case FrameType::kChallenge: return kChallengeBytes;
    case FrameType::kProof: return kProofBytes;
    case FrameType::kMetadata: return kMaxMetadataPayloadBytes;
    case FrameType::kReject: return kRejectMaxBytes;
  }
  return 0;
}

Result<FrameHeader> decode_header(std::string_view bytes, uint16_t version) {
  if (bytes.size() != kFrameHeaderBytes) {
    return Status::invalid_argument("frame header is " + std::to_string(bytes.size()) + " bytes, not " +
                                    std::to_string(kFrameHeaderBytes));
  }
  Reader r(bytes, "header");
  uint64_t magic = 0, v = 0, type = 0, reserved = 0, length = 0;
  KVB_RETURN_IF_ERROR(r.uint("magic", 4, &magic));
  if (magic != kHandshakeMagic) return Status::invalid_argument("bad magic (not a kvbridge side channel)");
  KVB_RETURN_IF_ERROR(r.uint("version", 2, &v));
  KVB_RETURN_IF_ERROR(r.uint("type", 1, &type));
  KVB_RETURN_IF_ERROR(r.uint("reserved", 1, &reserved));
  KVB_RETURN_IF_ERROR(r.uint("length", 4, &length));
  FrameHeader h{static_cast<uint16_t>(v), static_cast<FrameType>(type), static_cast<uint32_t>(length)};
  if (h.version != version) return h;
  const size_t max = max_payload_bytes(h.type);
  if (max == 0) return Status::invalid_argument("unknown frame type " + std::to_string(type));
  if (reserved != 0) return Status::invalid_argument(frame_type_name(h.type) + " frame: reserved byte is not 0");
  if (length > max) {
    return Status::invalid_argument(frame_type_name(h.type) + " frame length " + std::to_string(length) +
                                    " exceeds " + std::to_string(max));
  }
  return h;
}

std::string encode_frame(FrameType type, std::string_view payload, uint16_t version) {
  std::string out;
  out.reserve(kFrameHeaderBytes + payload.size());
  put(out, kHandshakeMagic, 4);
  put(out, version, 2);
  put(out, static_cast<uint8_t>(type), 1);
  put(out, 0, 1);
  put(out, payload.size(), 4);
  out.append(payload);
  return out;
}

Result<Frame> decode_frame(std::string_view bytes, uint16_t version) {
  if (bytes.size() < kFrameHeaderBytes) {
    return Status::invalid_argument("truncated frame header: " + std::to_string(bytes.size()) + " of " +
                                    std::to_string(kFrameHeaderBytes) + " bytes");
  }
  KVB_ASSIGN_OR_RETURN(FrameHeader h, decode_header(bytes.substr(0, kFrameHeaderBytes), version));
  if (h.version != version) {
    return Status::invalid_argument("handshake version " + std::to_string(h.version) + ", expected " +
                                    std::to_string(version));
  }
  const size_t have = bytes.size() - kFrameHeaderBytes;
  if (have < h.payload_bytes) {
    return Status::invalid_argument("truncated " + frame_type_name(h.type) + " frame: " + std::to_string(have) +
                                    " of " + std::to_string(h.payload_bytes) + " payload bytes");
  }
  if (have > h.payload_bytes) {
    return Status::invalid_argument(std::to_string(have - h.payload_bytes) + " trailing bytes after the " +
                                    frame_type_name(h.type) + " frame");
  }
  return Frame{h, bytes.substr(kFrameHeaderBytes)};
}

std::string encode_hello(const Hello& hello) {
  std::string out;
  put(out, hello.has_secret ? kHelloHasSecret : 0, 1);
  put_array(out, hello.nonce);
  put(out, hello.hash, 8);
  return out;
}

Result<Hello> decode_hello(std::string_view payload) {
  Reader r(payload, "Hello");
  Hello h;
  uint64_t flags = 0;
  KVB_RETURN_IF_ERROR(r.uint("flags", 1, &flags));
  if (flags & ~uint64_t{kHelloHasSecret}) return r.error("unknown flags " + std::to_string(flags));
  h.has_secret = flags & kHelloHasSecret;
  KVB_RETURN_IF_ERROR(r.array("nonce", &h.nonce));
  KVB_RETURN_IF_ERROR(r.uint("hash", 8, &h.hash));
  KVB_RETURN_IF_ERROR(r.finish());
  return h;
}

std::string encode_challenge(const Challenge& challenge) {
  std::string out;
  put_array(out, challenge.nonce);
  put_array(out, challenge.mac);
  return out;
}

Result<Challenge> decode_challenge(std::string_view payload) {
  Reader r(payload, "Challenge");
  Challenge c;
  KVB_RETURN_IF_ERROR(r.array("nonce", &c.nonce));
  KVB_RETURN_IF_ERROR(r.array("mac", &c.mac));
  KVB_RETURN_IF_ERROR(r.finish());
  return c;
}

std::string encode_proof(const Proof& proof) {
  std::string out;
  put_array(out, proof.mac);
  return out;
}

Result<Proof> decode_proof(std::string_view payload) {
  Reader r(payload, "Proof");
  Proof p;
  KVB_RETURN_IF_ERROR(r.array("mac", &p.mac));
  KVB_RETURN_IF_ERROR(r.finish());
  return p;
}

std::string reject_code_name(RejectCode code) {
  switch (code) {
    case RejectCode::kVersion: return "version";
    case RejectCode::kAuthRequired: return "auth_required";
    case RejectCode::kAuthUnsupported: return "auth_unsupported";
    case RejectCode::kAuthFailed: return "auth_failed";
    case RejectCode::kHashMismatch: return "hash_mismatch";
    case RejectCode::kMalformed: return "malformed";
    case RejectCode::kUnavailable: return "unavailable";
  }
  return "code " + std::to_string(static_cast<unsigned>(code));
}

std::string encode_reject(const Reject& reject) {
  std::string out;
  put(out, static_cast<uint8_t>(reject.code), 1);
  put(out, reject.hash, 8);
  put_bytes(out, std::string_view(reject.message).substr(0, kMaxRejectMessageBytes));
  put_bytes(out, std::string_view(reject.identity).substr(0, kMaxIdentityBytes));
  return out;
}

Result<Reject> decode_reject(std::string_view payload) {
  Reader r(payload, "Reject");
  Reject j;
  uint64_t code = 0;
  KVB_RETURN_IF_ERROR(r.uint("code", 1, &code));
  j.code = static_cast<RejectCode>(code);
  KVB_RETURN_IF_ERROR(r.uint("hash", 8, &j.hash));
  KVB_RETURN_IF_ERROR(r.bytes("message", kMaxRejectMessageBytes, &j.message));
  KVB_RETURN_IF_ERROR(r.bytes("identity", kMaxIdentityBytes, &j.identity));
  KVB_RETURN_IF_ERROR(r.finish());
  return j;
}

Status check_rank_info(const RankInfo& info) {
  KVB_RETURN_IF_ERROR(limit("instance_id", info.instance_id.size(), kMaxInstanceIdBytes));
  KVB_RETURN_IF_ERROR(limit("layout_json", info.layout_json.size(), kMaxLayoutJsonBytes));
  KVB_RETURN_IF_ERROR(limit("engine_metadata", info.engine_metadata.size(), kMaxEngineMetadataBytes));
  if (info.tp_size == 0) return Status::invalid_argument("rank info: tp_size is 0");
  if (info.rank >= info.tp_size) {
    return Status::invalid_argument("rank info: rank " + std::to_string(info.rank) + " is not below tp_size " +
                                    std::to_string(info.tp_size));
  }
  if (info.tensors.size() > kMaxTensors) {
    return Status::invalid_argument("rank info: " + std::to_string(info.tensors.size()) + " tensors, more than " +
                                    std::to_string(kMaxTensors));
  }
  size_t total = 8 + 8 + 4 + 4 + 4 + 4 * 4 + info.instance_id.size() + info.layout_json.size() +
                 info.engine_metadata.size();
  for (const TensorRegion& t : info.tensors) {
    KVB_RETURN_IF_ERROR(limit("tensor name '" + t.name.substr(0, 64) + "'", t.name.size(), kMaxTensorNameBytes));
    total += kTensorFixedBytes + t.name.size();
  }
  if (total > kMaxMetadataPayloadBytes) {
    return Status::resource_exhausted("rank info encodes to " + std::to_string(total) + " bytes, more than " +
                                      std::to_string(kMaxMetadataPayloadBytes));
  }
  return Status();
}

Result<std::string> encode_metadata(const Metadata& metadata) {
  const RankInfo& info = metadata.info;
  KVB_RETURN_IF_ERROR(check_rank_info(info));
  std::string out;
  put(out, metadata.hash, 8);
  put(out, info.clock_ns, 8);
  put(out, info.rank, 4);
  put(out, info.tp_size, 4);
  put(out, static_cast<uint32_t>(info.pid), 4);
  put_bytes(out, info.instance_id);
  put_bytes(out, info.layout_json);
  put_bytes(out, info.engine_metadata);
  put(out, info.tensors.size(), 4);
  for (const TensorRegion& t : info.tensors) {
    put_bytes(out, t.name);
    put(out, t.region, 4);
    put(out, t.base, 8);
    put(out, t.bytes, 8);
  }
  return out;
}

Result<Metadata> decode_metadata(std::string_view payload) {
  Reader r(payload, "Metadata");
  Metadata m;
  RankInfo& info = m.info;
  uint64_t rank = 0, tp_size = 0, pid = 0, count = 0;
  KVB_RETURN_IF_ERROR(r.uint("hash", 8, &m.hash));
  KVB_RETURN_IF_ERROR(r.uint("clock_ns", 8, &info.clock_ns));
  KVB_RETURN_IF_ERROR(r.uint("rank", 4, &rank));
  KVB_RETURN_IF_ERROR(r.uint("tp_size", 4, &tp_size));
  KVB_RETURN_IF_ERROR(r.uint("pid", 4, &pid));
  if (tp_size == 0) return r.error("tp_size is 0");
  if (rank >= tp_size) return r.error("rank " + std::to_string(rank) + " is not below tp_size " + std::to_string(tp_size));
  info.rank = static_cast<uint32_t>(rank);
  info.tp_size = static_cast<uint32_t>(tp_size);
  info.pid = static_cast<int32_t>(static_cast<uint32_t>(pid));
  KVB_RETURN_IF_ERROR(r.bytes("instance_id", kMaxInstanceIdBytes, &info.instance_id));
  KVB_RETURN_IF_ERROR(r.bytes("layout_json", kMaxLayoutJsonBytes, &info.layout_json));
  KVB_RETURN_IF_ERROR(r.bytes("engine_metadata", kMaxEngineMetadataBytes, &info.engine_metadata));
  KVB_RETURN_IF_ERROR(r.uint("tensor count", 4, &count));
  // Each tensor takes at least kTensorFixedBytes, so the bytes left bound the
  // count before anything is reserved for it.
  if (count > kMaxTensors || count > r.left() / kTensorFixedBytes) {
    return r.error("tensor count " + std::to_string(count) + " exceeds " +
                   std::to_string(std::min(kMaxTensors, r.left() / kTensorFixedBytes)));
  }
  info.tensors.resize(count);
  for (TensorRegion& t : info.tensors) {
    uint64_t region = 0;
    KVB_RETURN_IF_ERROR(r.bytes("tensor name", kMaxTensorNameBytes, &t.name));
    KVB_RETURN_IF_ERROR(r.uint("tensor region", 4, &region));
    t.region = static_cast<uint32_t>(region);
    KVB_RETURN_IF_ERROR(r.uint("tensor base", 8, &t.base));
    KVB_RETURN_IF_ERROR(r.uint("tensor bytes", 8, &t.bytes));
  }
  KVB_RETURN_IF_ERROR(r.finish());
  return m;
}

Result<Nonce> random_nonce() {
  Nonce n{};
  if (::RAND_bytes(n.data(), static_cast<int>(n.size())) != 1) {
    return Status::internal("side channel: RAND_bytes failed to make a nonce");
  }
  return n;
}

Mac server_mac(std::string_view secret, const Nonce& client_nonce, const Nonce& server_nonce) {
  return hmac(secret, "kvbridge-server", client_nonce, server_nonce);
}

Mac client_mac(std::string_view secret, const Nonce& server_nonce, const Nonce& client_nonce) {
  return hmac(secret, "kvbridge-client", server_nonce, client_nonce);
}

bool mac_equal(const Mac& a, const Mac& b) { return ::CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }

}  // namespace kvbridge::connector
