// The side channel's payload codecs (see handshake.h and
// docs/formats/handshake.md). Decoding goes through net::WireReader, so no
// peer-chosen number sizes an allocation.
#include "connector/handshake.h"

#include <algorithm>

#include "net/opening.h"
#include "net/wire.h"

namespace kvbridge::connector {
namespace {

constexpr size_t kTensorFixedBytes = 4 + 4 + 8 + 8;  // name length, region, base, bytes

Status limit(std::string_view field, size_t size, size_t max) {
  if (size <= max) return Status();
  return Status::invalid_argument("rank info: " + std::string(field) + " is " + std::to_string(size) +
                                  " bytes, more than " + std::to_string(max));
}

}  // namespace

size_t max_payload_bytes(uint8_t type) {
  if (type == kMetadataFrame) return kMaxMetadataPayloadBytes;
  return net::opening_limit(type, net::OpeningLimits{kOpenBodyBytes, kMaxRefuseDetailBytes});
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
  size_t total =
      8 + 8 + 4 + 4 + 4 + 4 * 4 + info.instance_id.size() + info.layout_json.size() + info.engine_metadata.size();
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
  net::WireWriter w;
  w.u64(metadata.hash);
  w.u64(info.clock_ns);
  w.u32(info.rank);
  w.u32(info.tp_size);
  w.u32(static_cast<uint32_t>(info.pid));
  w.str(info.instance_id);
  w.str(info.layout_json);
  w.str(info.engine_metadata);
  w.u32(static_cast<uint32_t>(info.tensors.size()));
  for (const TensorRegion& t : info.tensors) {
    w.str(t.name);
    w.u32(t.region);
    w.u64(t.base);
    w.u64(t.bytes);
  }
  return w.take();
}

Result<Metadata> decode_metadata(std::string_view payload) {
  net::WireReader r(payload, "Metadata frame");
  Metadata m;
  RankInfo& info = m.info;
  uint32_t pid = 0, count = 0;
  KVB_RETURN_IF_ERROR(r.u64("hash", &m.hash));
  KVB_RETURN_IF_ERROR(r.u64("clock_ns", &info.clock_ns));
  KVB_RETURN_IF_ERROR(r.u32("rank", &info.rank));
  KVB_RETURN_IF_ERROR(r.u32("tp_size", &info.tp_size));
  KVB_RETURN_IF_ERROR(r.u32("pid", &pid));
  if (info.tp_size == 0) return r.error("tp_size is 0");
  if (info.rank >= info.tp_size) {
    return r.error("rank " + std::to_string(info.rank) + " is not below tp_size " + std::to_string(info.tp_size));
  }
  info.pid = static_cast<int32_t>(pid);
  KVB_RETURN_IF_ERROR(r.str("instance_id", kMaxInstanceIdBytes, &info.instance_id));
  KVB_RETURN_IF_ERROR(r.str("layout_json", kMaxLayoutJsonBytes, &info.layout_json));
  KVB_RETURN_IF_ERROR(r.str("engine_metadata", kMaxEngineMetadataBytes, &info.engine_metadata));
  // Each tensor takes at least kTensorFixedBytes, so the bytes left bound the
  // count before anything is reserved for it.
  KVB_RETURN_IF_ERROR(r.count("tensor count", kMaxTensors, kTensorFixedBytes, &count));
  info.tensors.resize(count);
  for (TensorRegion& t : info.tensors) {
    KVB_RETURN_IF_ERROR(r.str("tensor name", kMaxTensorNameBytes, &t.name));
    KVB_RETURN_IF_ERROR(r.u32("tensor region", &t.region));
    KVB_RETURN_IF_ERROR(r.u64("tensor base", &t.base));
    KVB_RETURN_IF_ERROR(r.u64("tensor bytes", &t.bytes));
  }
  KVB_RETURN_IF_ERROR(r.finish());
  return m;
}

std::string encode_open_body(uint64_t hash) {
  net::WireWriter w;
  w.u64(hash);
  return w.take();
}

Result<uint64_t> decode_open_body(std::string_view body) {
  net::WireReader r(body, "Open body");
  uint64_t hash = 0;
  KVB_RETURN_IF_ERROR(r.u64("hash", &hash));
  KVB_RETURN_IF_ERROR(r.finish());
  return hash;
}

std::string encode_mismatch_detail(uint64_t hash, std::string_view identity) {
  net::WireWriter w;
  w.u64(hash);
  w.raw(identity.substr(0, kMaxIdentityBytes));
  return w.take();
}

Result<std::pair<uint64_t, std::string>> decode_mismatch_detail(std::string_view detail) {
  net::WireReader r(detail, "Refuse detail");
  uint64_t hash = 0;
  KVB_RETURN_IF_ERROR(r.u64("hash", &hash));
  std::string_view rest;
  KVB_RETURN_IF_ERROR(r.raw("identity", r.left(), &rest));
  return std::make_pair(hash, std::string(rest));
}

}  // namespace kvbridge::connector
