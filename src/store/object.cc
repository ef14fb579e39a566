// Store object header: see object.h.
#include "store/object.h"

#include <openssl/sha.h>

#include <xxhash.h>

#include <cstring>
#include <string>

#include "store/canonical.h"

namespace kvbridge::store_internal {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'B', 'S', 'T', 'O', 'R', '1'};

void put_le(uint8_t* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

uint64_t get_le(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{p[i]} << (8 * i);
  return v;
}

}  // namespace

void write_header(uint8_t* o, const ObjectKey& key, uint64_t object_bytes, uint64_t H, bool checksum) {
  std::memset(o, 0, kHeaderBytes);
  std::memcpy(o, kMagic, 8);
  put_le(o + 8, kObjectVersion, 4);
  put_le(o + 12, key.group, 4);
  put_le(o + 16, key.hash.lo, 8);
  put_le(o + 24, key.hash.hi, 8);
  put_le(o + 32, object_bytes, 8);
  if (checksum) {
    put_le(o + 40, XXH3_64bits(o + kHeaderBytes, object_bytes - kHeaderBytes), 8);
    put_le(o + 48, kFlagChecksum, 4);
  }
  put_le(o + 52, H, 4);
}

void write_part_header(uint8_t* o, const ObjectKey& key, uint64_t object_bytes, uint64_t H) {
  write_header(o, key, object_bytes, H, false);
  put_le(o + 48, kFlagAssembled, 4);
}

bool has_checksum(const uint8_t* o) { return (get_le(o + 48, 4) & kFlagChecksum) != 0; }

void assembled_checksum(const uint8_t* payload, uint64_t bytes, uint8_t out[8]) {
  uint8_t digest[SHA_DIGEST_LENGTH];
  ::SHA1(payload, bytes, digest);
  std::memcpy(out, digest, 8);
}

Status check_object(std::span<const uint8_t> o, const ObjectKey& key, uint64_t object_bytes, uint64_t H,
                    const uint64_t* payload_hash) {
  auto bad = [&](const std::string& what) {
    return Status::invalid_argument("store object " + key.text("") + ": " + what);
  };
  if (o.size() != object_bytes) {
    return bad("size " + std::to_string(o.size()) + ", expected " + std::to_string(object_bytes));
  }
  if (o.size() < kHeaderBytes || std::memcmp(o.data(), kMagic, 8) != 0) return bad("bad magic");
  if (get_le(o.data() + 8, 4) != kObjectVersion) return bad("version " + std::to_string(get_le(o.data() + 8, 4)));
  if (get_le(o.data() + 12, 4) != key.group || get_le(o.data() + 16, 8) != key.hash.lo ||
      get_le(o.data() + 24, 8) != key.hash.hi) {
    return bad("header names another object");
  }
  if (get_le(o.data() + 32, 8) != object_bytes) return bad("header size differs");
  if (get_le(o.data() + 52, 4) != (H & 0xffffffffu)) return bad("hash_block_tokens differs");
  const uint64_t flags = get_le(o.data() + 48, 4);
  if (flags & kFlagChecksum) {
    const uint64_t sum =
        payload_hash ? *payload_hash : XXH3_64bits(o.data() + kHeaderBytes, object_bytes - kHeaderBytes);
    if (sum != get_le(o.data() + 40, 8)) return bad("payload checksum mismatch");
  } else if (flags & kFlagAssembled) {
    if (!(flags & kFlagAssembledChecksum)) return bad("assembled without its checksum");
    uint8_t sum[8];
    assembled_checksum(o.data() + kHeaderBytes, object_bytes - kHeaderBytes, sum);
    if (std::memcmp(sum, o.data() + 40, 8) != 0) return bad("assembled payload checksum mismatch");
  }
  return Status();
}

}  // namespace kvbridge::store_internal
