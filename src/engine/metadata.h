// engine/metadata.h: the bytes an engine publishes so that a peer can reach it.
//
// EngineMetadata is what Engine::metadata() encodes and Engine::connect()
// decodes: who the engine is (name, pid, hostname), where its control
// listener is, the transports it offers with their address blobs, the merged
// segments the transports know (with one key blob per transport), and the
// registrations (regions) that items address, each inside one segment. The
// wire format is specified in docs/formats/engine-metadata.md; this file and
// that one change together, and a new field means a new version.
//
// The decoder trusts nothing: every length and count is bounded, every
// region must lie inside its segment, ids are unique, and trailing bytes are
// an error. Errors name the field ("metadata: segments[2].bytes: ...").
//
// Thread-safety: pure functions on values.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/status.h"

namespace kvbridge::engine_internal {

inline constexpr uint32_t kMetadataMagic = 0x4d42564b;  // "KVBM" little-endian
inline constexpr uint16_t kMetadataVersion = 2;

// Bounds enforced by both encode_metadata() and decode_metadata().
inline constexpr size_t kMaxNameBytes = 256;  // engine name, hostname
inline constexpr size_t kMaxControlAddressBytes = 256;
inline constexpr size_t kMaxTransportNameBytes = 32;
inline constexpr size_t kMaxMemoryKindBytes = 32;
inline constexpr size_t kMaxBlobBytes = 4096;  // address and key blobs
inline constexpr size_t kMaxTransports = 16;
inline constexpr size_t kMaxSegments = 65536;
inline constexpr size_t kMaxRegions = 65536;

struct MetadataTransport {
  std::string name;     // "local", "cma", "tcp", "ucx"
  std::string address;  // the transport's address blob
  bool operator==(const MetadataTransport&) const = default;
};

struct MetadataSegment {
  uint32_t id = 0;
  uint64_t base = 0;  // virtual address in the publishing process
  uint64_t bytes = 0;
  std::string memory = "host";
  uint8_t access = 3;             // RemoteAccess bits granted to peers: 1 read, 2 write (never 0)
  std::vector<std::string> keys;  // one per transport, in transports' order
  bool operator==(const MetadataSegment&) const = default;
};

struct MetadataRegion {
  uint32_t id = 0;       // the RegionId that items name
  uint32_t segment = 0;  // the segment that contains it
  uint64_t base = 0;
  uint64_t bytes = 0;
  bool operator==(const MetadataRegion&) const = default;
};

struct EngineMetadata {
  uint16_t version = kMetadataVersion;
  std::string name;
  // Random, never 0, fixed for the engine's life: two engines (in one
  // process, or a restarted one) never share it, so a peer is (name,
  // instance), never a name alone.
  uint64_t instance = 0;
  uint64_t pid = 0;
  std::string hostname;
  std::string control_address;  // "host:port" of the control listener
  std::vector<MetadataTransport> transports;
  std::vector<MetadataSegment> segments;
  std::vector<MetadataRegion> regions;
  bool operator==(const EngineMetadata&) const = default;

  const MetadataRegion* find_region(uint32_t id) const;
};

// "'name' (instance 1a2b3c4d5e6f7081, pid 123 on host)": how errors name a
// peer, so that two engines with one name are told apart.
std::string peer_text(const EngineMetadata& metadata);

// Checks the invariants the decoder enforces (bounds, unique ids, regions
// inside their segments, one key per transport). kInvalidArgument naming the
// field, or kResourceExhausted for a bound.
Status check_metadata(const EngineMetadata& metadata);

// Encodes after check_metadata(); kResourceExhausted when the result would
// exceed kMaxEngineMetadataBytes.
Result<std::string> encode_metadata(const EngineMetadata& metadata);

// Decodes and checks. kInvalidArgument for malformed bytes (naming the field),
// kIncompatible for an unknown version, kResourceExhausted past a bound.
Result<EngineMetadata> decode_metadata(std::string_view bytes);

}  // namespace kvbridge::engine_internal
