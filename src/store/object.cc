// Store object header: see object.h.
#include "store/object.h"

#include <openssl/sha.h>

#include <xxhash.h>

#include <cstring>
#include <string>
#include <string_view>

#include "net/wire.h"
#include "store/canonical.h"

namespace kvbridge::store_internal {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'B', 'S', 'T', 'O', 'R', '1'};

// The header's fields before the part bitmap (docs/formats/store-object.md),
// in their order: net/wire.h's little-endian codec writes and reads them.
struct Header {
  std::string_view magic;
  uint32_t version = 0, group = 0;
  uint64_t hash_lo = 0, hash_hi = 0, object_bytes = 0, checksum = 0;
  uint32_t flags = 0, hash_block_tokens = 0;
};
constexpr uint64_t kChecksumByte = 40;
static_assert(8 + 4 + 4 + 8 + 8 + 8 + 8 + 4 + 4 == kPartBitmapByte);

void put(uint8_t* o, const Header& h) {
  net::WireWriter w;
  w.raw(h.magic);
  w.u32(h.version);
  w.u32(h.group);
  w.u64(h.hash_lo);
  w.u64(h.hash_hi);
  w.u64(h.object_bytes);
  w.u64(h.checksum);
  w.u32(h.flags);
  w.u32(h.hash_block_tokens);
  std::memset(o, 0, kHeaderBytes);
  std::memcpy(o, w.out().data(), w.out().size());
}

// The header of an object of at least kHeaderBytes bytes.
Header get(const uint8_t* o) {
  net::WireReader r(std::string_view(reinterpret_cast<const char*>(o), kPartBitmapByte), "store object header");
  Header h;
  // The reads cannot fail: the view holds exactly the fields.
  (void)r.raw("magic", 8, &h.magic);
  (void)r.u32("version", &h.version);
  (void)r.u32("group", &h.group);
  (void)r.u64("hash.lo", &h.hash_lo);
  (void)r.u64("hash.hi", &h.hash_hi);
  (void)r.u64("object_bytes", &h.object_bytes);
  (void)r.u64("checksum", &h.checksum);
  (void)r.u32("flags", &h.flags);
  (void)r.u32("hash_block_tokens", &h.hash_block_tokens);
  return h;
}

Header header_of(const ObjectKey& key, uint64_t object_bytes, uint64_t H) {
  Header h;
  h.magic = std::string_view(kMagic, 8);
  h.version = kObjectVersion;
  h.group = key.group;
  h.hash_lo = key.hash.lo;
  h.hash_hi = key.hash.hi;
  h.object_bytes = object_bytes;
  h.hash_block_tokens = static_cast<uint32_t>(H);
  return h;
}

}  // namespace

void write_header(uint8_t* o, const ObjectKey& key, uint64_t object_bytes, uint64_t H, bool checksum) {
  Header h = header_of(key, object_bytes, H);
  if (checksum) {
    h.checksum = XXH3_64bits(o + kHeaderBytes, object_bytes - kHeaderBytes);
    h.flags = kFlagChecksum;
  }
  put(o, h);
}

void write_part_header(uint8_t* o, const ObjectKey& key, uint64_t object_bytes, uint64_t H) {
  Header h = header_of(key, object_bytes, H);
  h.flags = kFlagAssembled;
  put(o, h);
}

bool has_checksum(const uint8_t* o) { return (get(o).flags & kFlagChecksum) != 0; }

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
  if (o.size() < kHeaderBytes) return bad("bad magic");
  const Header h = get(o.data());
  if (h.magic != std::string_view(kMagic, 8)) return bad("bad magic");
  if (h.version != kObjectVersion) return bad("version " + std::to_string(h.version));
  if (h.group != key.group || h.hash_lo != key.hash.lo || h.hash_hi != key.hash.hi) {
    return bad("header names another object");
  }
  if (h.object_bytes != object_bytes) return bad("header size differs");
  if (h.hash_block_tokens != (H & 0xffffffffu)) return bad("hash_block_tokens differs");
  if (h.flags & kFlagChecksum) {
    const uint64_t sum =
        payload_hash ? *payload_hash : XXH3_64bits(o.data() + kHeaderBytes, object_bytes - kHeaderBytes);
    if (sum != h.checksum) return bad("payload checksum mismatch");
  } else if (h.flags & kFlagAssembled) {
    if (!(h.flags & kFlagAssembledChecksum)) return bad("assembled without its checksum");
    uint8_t sum[8];
    assembled_checksum(o.data() + kHeaderBytes, object_bytes - kHeaderBytes, sum);
    if (std::memcmp(sum, o.data() + kChecksumByte, 8) != 0) return bad("assembled payload checksum mismatch");
  }
  return Status();
}

}  // namespace kvbridge::store_internal
