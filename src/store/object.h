// The 64-byte header of a store object (docs/formats/store-object.md): what
// the object is (group id, chained hash, hash block size), its size, and an
// optional XXH3-64 checksum of the payload, which objects carry when they go
// to a shared tier and which a reader checks when it takes one from there.
//
// Not a public header. Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <span>

#include "kvbridge/status.h"
#include "kvbridge/store_key.h"

namespace kvbridge::store_internal {

inline constexpr uint32_t kObjectVersion = 1;
inline constexpr uint32_t kFlagChecksum = 1;
// Assembled in the shared tier from the parts of several ranks; bytes
// 56..63 are the part bitmap. No rank has the whole payload, so the shared
// tier writes its checksum when the last part is in: kFlagAssembledChecksum,
// the first 8 bytes of SHA-1 of the payload at offset 40. An assembled
// object without it is not trusted (a miss).
inline constexpr uint32_t kFlagAssembled = 2;
inline constexpr uint32_t kFlagAssembledChecksum = 4;
// The part bitmap of an assembled object: header bytes [56, 64), part r is
// bit 0x80 >> (r % 8) of byte 56 + r / 8 (Redis SETBIT numbering), so at most
// 64 parts.
inline constexpr uint64_t kPartBitmapByte = 56;
inline constexpr uint32_t kMaxParts = 64;

// Writes the header into object[0, 64). With `checksum`, computes the payload
// checksum (object[64, object_bytes)).
void write_header(uint8_t* object, const ObjectKey& key, uint64_t object_bytes, uint64_t hash_block_tokens,
                  bool checksum);

// Writes the header of an object assembled from parts (kFlagAssembled, no
// checksum, an empty part bitmap). Ranks write object[0, kPartBitmapByte) of
// it, which is the same from every rank.
void write_part_header(uint8_t* object, const ObjectKey& key, uint64_t object_bytes, uint64_t hash_block_tokens);

// True when the header (at least 64 bytes) says the payload has a checksum.
bool has_checksum(const uint8_t* object);

// The first 8 bytes of SHA-1 of a payload, as an assembled object's header
// holds them (what the shared tier writes when it completes the object).
void assembled_checksum(const uint8_t* payload, uint64_t bytes, uint8_t out[8]);

// OK when `object` is the object `key` of `object_bytes` bytes for hash
// blocks of `hash_block_tokens`, with a matching checksum when it has one
// (an assembled object must have one); otherwise kInvalidArgument naming the
// field. `payload_hash`, when given, is
// the payload's checksum computed by the caller (as the bytes arrived).
Status check_object(std::span<const uint8_t> object, const ObjectKey& key, uint64_t object_bytes,
                    uint64_t hash_block_tokens, const uint64_t* payload_hash = nullptr);

}  // namespace kvbridge::store_internal
