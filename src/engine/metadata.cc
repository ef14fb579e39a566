// Encoding and decoding of engine metadata (docs/formats/engine-metadata.md).
//
// Integers are little-endian and fixed width; strings are a u32 length then
// bytes. The decoder reads through a Reader that never indexes past the end,
// and checks each count against the bytes left before reserving, so a hostile
// count cannot make it allocate more than the input could describe.
#include "engine/metadata.h"

#include <algorithm>
#include <cstdio>
#include <set>
#include <unordered_map>

#include "common/checked.h"
#include "kvbridge/engine.h"
#include "net/wire.h"

namespace kvbridge::engine_internal {
namespace {

std::string at(std::string_view list, size_t i) { return std::string(list) + "[" + std::to_string(i) + "]"; }

Status check_string(const std::string& field, const std::string& s, size_t max_bytes, bool required) {
  if (required && s.empty()) return Status::invalid_argument("metadata: " + field + " is empty");
  if (s.size() > max_bytes) {
    return Status::resource_exhausted("metadata: " + field + " is " + std::to_string(s.size()) + " bytes, more than " +
                                      std::to_string(max_bytes));
  }
  return Status();
}

}  // namespace

const MetadataRegion* EngineMetadata::find_region(uint32_t id) const {
  for (const MetadataRegion& r : regions) {
    if (r.id == id) return &r;
  }
  return nullptr;
}

std::string peer_text(const EngineMetadata& m) {
  char instance[17];
  std::snprintf(instance, sizeof(instance), "%016llx", static_cast<unsigned long long>(m.instance));
  return "'" + m.name + "' (instance " + instance + ", pid " + std::to_string(m.pid) + " on " + m.hostname + ")";
}

Status check_metadata(const EngineMetadata& m) {
  if (m.version != kMetadataVersion) {
    return Status::incompatible("metadata: version is " + std::to_string(m.version) + " but this build reads " +
                                std::to_string(kMetadataVersion));
  }
  KVB_RETURN_IF_ERROR(check_string("name", m.name, kMaxNameBytes, true));
  if (m.instance == 0) return Status::invalid_argument("metadata: instance is 0");
  KVB_RETURN_IF_ERROR(check_string("hostname", m.hostname, kMaxNameBytes, true));
  KVB_RETURN_IF_ERROR(check_string("control_address", m.control_address, kMaxControlAddressBytes, true));
  if (m.transports.size() > kMaxTransports) {
    return Status::resource_exhausted("metadata: transports has " + std::to_string(m.transports.size()) +
                                      " entries, more than " + std::to_string(kMaxTransports));
  }
  std::set<std::string> names;
  for (size_t i = 0; i < m.transports.size(); ++i) {
    const MetadataTransport& t = m.transports[i];
    KVB_RETURN_IF_ERROR(check_string(at("transports", i) + ".name", t.name, kMaxTransportNameBytes, true));
    KVB_RETURN_IF_ERROR(check_string(at("transports", i) + ".address", t.address, kMaxBlobBytes, false));
    if (!names.insert(t.name).second) {
      return Status::invalid_argument("metadata: " + at("transports", i) + ".name '" + t.name + "' is listed twice");
    }
  }
  if (m.segments.size() > kMaxSegments) return Status::resource_exhausted("metadata: too many segments");
  if (m.regions.size() > kMaxRegions) return Status::resource_exhausted("metadata: too many regions");
  std::unordered_map<uint32_t, const MetadataSegment*> by_id;
  for (size_t i = 0; i < m.segments.size(); ++i) {
    const MetadataSegment& s = m.segments[i];
    const std::string f = at("segments", i);
    if (!by_id.emplace(s.id, &s).second)
      return Status::invalid_argument("metadata: " + f + ".id " + std::to_string(s.id) + " is used twice");
    uint64_t end = 0;
    if (s.bytes == 0) return Status::invalid_argument("metadata: " + f + ".bytes is 0");
    if (s.base == 0 || !checked_add(s.base, s.bytes, &end)) {
      return Status::invalid_argument("metadata: " + f + " range [base, base + bytes) is null or wraps around");
    }
    KVB_RETURN_IF_ERROR(check_string(f + ".memory", s.memory, kMaxMemoryKindBytes, true));
    if (s.access == 0 || s.access > 3) {
      return Status::invalid_argument("metadata: " + f + ".access is " + std::to_string(s.access) + ", not 1, 2 or 3");
    }
    if (s.keys.size() != m.transports.size()) {
      return Status::invalid_argument("metadata: " + f + ".keys has " + std::to_string(s.keys.size()) +
                                      " entries but there are " + std::to_string(m.transports.size()) + " transports");
    }
    for (size_t k = 0; k < s.keys.size(); ++k) {
      KVB_RETURN_IF_ERROR(check_string(f + at(".keys", k), s.keys[k], kMaxBlobBytes, false));
    }
  }
  std::set<uint32_t> ids;
  for (size_t i = 0; i < m.regions.size(); ++i) {
    const MetadataRegion& r = m.regions[i];
    const std::string f = at("regions", i);
    if (!ids.insert(r.id).second)
      return Status::invalid_argument("metadata: " + f + ".id " + std::to_string(r.id) + " is used twice");
    auto found = by_id.find(r.segment);
    const MetadataSegment* s = found == by_id.end() ? nullptr : found->second;
    if (s == nullptr) {
      return Status::invalid_argument("metadata: " + f + ".segment " + std::to_string(r.segment) + " is not listed");
    }
    uint64_t end = 0;
    if (r.bytes == 0) return Status::invalid_argument("metadata: " + f + ".bytes is 0");
    if (!checked_add(r.base, r.bytes, &end) || r.base < s->base || end > s->base + s->bytes) {
      return Status::invalid_argument("metadata: " + f + " [base, base + bytes) is not inside segment " +
                                      std::to_string(r.segment));
    }
  }
  return Status();
}

Result<std::string> encode_metadata(const EngineMetadata& m) {
  KVB_RETURN_IF_ERROR(check_metadata(m));
  net::WireWriter w;
  w.u32(kMetadataMagic);
  w.u16(m.version);
  w.u16(0);  // flags, reserved
  w.str(m.name);
  w.u64(m.instance);
  w.u64(m.pid);
  w.str(m.hostname);
  w.str(m.control_address);
  w.u16(static_cast<uint16_t>(m.transports.size()));
  for (const MetadataTransport& t : m.transports) {
    w.str(t.name);
    w.str(t.address);
  }
  w.u32(static_cast<uint32_t>(m.segments.size()));
  for (const MetadataSegment& s : m.segments) {
    w.u32(s.id);
    w.u64(s.base);
    w.u64(s.bytes);
    w.str(s.memory);
    w.u8(s.access);
    for (const std::string& k : s.keys) w.str(k);
  }
  w.u32(static_cast<uint32_t>(m.regions.size()));
  for (const MetadataRegion& r : m.regions) {
    w.u32(r.id);
    w.u32(r.segment);
    w.u64(r.base);
    w.u64(r.bytes);
  }
  std::string out = w.take();
  if (out.size() > kMaxEngineMetadataBytes) {
    return Status::resource_exhausted("metadata is " + std::to_string(out.size()) + " bytes, more than the " +
                                      std::to_string(kMaxEngineMetadataBytes) + " allowed");
  }
  return out;
}

Result<EngineMetadata> decode_metadata(std::string_view bytes) {
  if (bytes.size() > kMaxEngineMetadataBytes) {
    return Status::resource_exhausted("metadata is " + std::to_string(bytes.size()) + " bytes, more than the " +
                                      std::to_string(kMaxEngineMetadataBytes) + " allowed");
  }
  net::WireReader r(bytes, "metadata");
  EngineMetadata m;
  uint32_t magic = 0;
  uint16_t flags = 0;
  KVB_RETURN_IF_ERROR(r.u32("magic", &magic));
  if (magic != kMetadataMagic)
    return Status::invalid_argument("metadata: magic is not 'KVBM': not kvbridge engine metadata");
  KVB_RETURN_IF_ERROR(r.u16("version", &m.version));
  if (m.version != kMetadataVersion) {
    return Status::incompatible("metadata: version is " + std::to_string(m.version) + " but this build reads " +
                                std::to_string(kMetadataVersion));
  }
  KVB_RETURN_IF_ERROR(r.u16("flags", &flags));
  if (flags != 0)
    return Status::invalid_argument("metadata: flags is " + std::to_string(flags) + ", must be 0 in version 2");
  KVB_RETURN_IF_ERROR(r.str("name", kMaxNameBytes, &m.name));
  KVB_RETURN_IF_ERROR(r.u64("instance", &m.instance));
  KVB_RETURN_IF_ERROR(r.u64("pid", &m.pid));
  KVB_RETURN_IF_ERROR(r.str("hostname", kMaxNameBytes, &m.hostname));
  KVB_RETURN_IF_ERROR(r.str("control_address", kMaxControlAddressBytes, &m.control_address));
  uint16_t num_transports = 0;
  KVB_RETURN_IF_ERROR(r.u16("transports count", &num_transports));
  if (num_transports > kMaxTransports) {
    return Status::resource_exhausted("metadata: transports count is " + std::to_string(num_transports) +
                                      ", more than " + std::to_string(kMaxTransports));
  }
  m.transports.resize(num_transports);
  for (size_t i = 0; i < num_transports; ++i) {
    KVB_RETURN_IF_ERROR(r.str(at("transports", i) + ".name", kMaxTransportNameBytes, &m.transports[i].name));
    KVB_RETURN_IF_ERROR(r.str(at("transports", i) + ".address", kMaxBlobBytes, &m.transports[i].address));
  }
  uint32_t num_segments = 0;
  KVB_RETURN_IF_ERROR(r.u32("segments count", &num_segments));
  // Each segment takes at least 24 bytes (id, base, bytes, memory length).
  if (num_segments > kMaxSegments || num_segments > r.left() / 24) {
    return Status::invalid_argument("metadata: segments count " + std::to_string(num_segments) +
                                    " is more than the remaining bytes can hold");
  }
  m.segments.resize(num_segments);
  for (size_t i = 0; i < num_segments; ++i) {
    MetadataSegment& s = m.segments[i];
    const std::string f = at("segments", i);
    KVB_RETURN_IF_ERROR(r.u32(f + ".id", &s.id));
    KVB_RETURN_IF_ERROR(r.u64(f + ".base", &s.base));
    KVB_RETURN_IF_ERROR(r.u64(f + ".bytes", &s.bytes));
    KVB_RETURN_IF_ERROR(r.str(f + ".memory", kMaxMemoryKindBytes, &s.memory));
    KVB_RETURN_IF_ERROR(r.u8(f + ".access", &s.access));
    s.keys.resize(num_transports);
    for (size_t k = 0; k < num_transports; ++k) {
      KVB_RETURN_IF_ERROR(r.str(f + at(".keys", k), kMaxBlobBytes, &s.keys[k]));
    }
  }
  uint32_t num_regions = 0;
  KVB_RETURN_IF_ERROR(r.u32("regions count", &num_regions));
  if (num_regions > kMaxRegions || num_regions > r.left() / 24) {
    return Status::invalid_argument("metadata: regions count " + std::to_string(num_regions) +
                                    " is more than the remaining bytes can hold");
  }
  m.regions.resize(num_regions);
  for (size_t i = 0; i < num_regions; ++i) {
    MetadataRegion& g = m.regions[i];
    const std::string f = at("regions", i);
    KVB_RETURN_IF_ERROR(r.u32(f + ".id", &g.id));
    KVB_RETURN_IF_ERROR(r.u32(f + ".segment", &g.segment));
    KVB_RETURN_IF_ERROR(r.u64(f + ".base", &g.base));
    KVB_RETURN_IF_ERROR(r.u64(f + ".bytes", &g.bytes));
  }
  if (r.left() != 0) {
    return Status::invalid_argument("metadata: " + std::to_string(r.left()) + " trailing bytes after regions");
  }
  KVB_RETURN_IF_ERROR(check_metadata(m));
  return m;
}

}  // namespace kvbridge::engine_internal

namespace kvbridge {

Result<EngineLabel> describe_metadata(std::string_view metadata) {
  Result<engine_internal::EngineMetadata> m = engine_internal::decode_metadata(metadata);
  if (!m.ok()) return m.error();
  return EngineLabel{std::move(m->name), m->instance};
}

}  // namespace kvbridge
