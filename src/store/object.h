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

// Writes the header into object[0, 64). With `checksum`, computes the payload
// checksum (object[64, object_bytes)).
void write_header(uint8_t* object, const ObjectKey& key, uint64_t object_bytes, uint64_t hash_block_tokens,
                  bool checksum);

// OK when `object` is the object `key` of `object_bytes` bytes for hash
// blocks of `hash_block_tokens`, with a matching checksum when it has one;
// otherwise kInvalidArgument naming the field.
Status check_object(std::span<const uint8_t> object, const ObjectKey& key, uint64_t object_bytes,
                    uint64_t hash_block_tokens);

}  // namespace kvbridge::store_internal
