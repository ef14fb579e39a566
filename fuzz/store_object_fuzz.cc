// libFuzzer target: the store's object check (src/store/object.h) over bytes
// as a shared tier (Redis) may return them: any object, of any size, for any
// expected key and size. It must reject what does not match, never crash, and
// accept an object only when its header names the expected key and size.
// The same bytes, as the text of an error reply, go through the parser of
// Redis Cluster redirects (MOVED/ASK/CLUSTERDOWN/TRYAGAIN), which must accept
// only a slot below 16384, a non-empty host and a port in 1..65535.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <vector>

#include "store/object.h"
#include "store/redis_tier.h"

using namespace kvbridge;
using namespace kvbridge::store_internal;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Redirect redirect;
  if (parse_redirect(std::string_view(reinterpret_cast<const char*>(data), size), &redirect) &&
      redirect.kind != Redirect::kRetry && (redirect.slot > 16383 || redirect.host.empty() || redirect.port == 0)) {
    __builtin_trap();
  }
  if (size < 25) return 0;
  // The first 25 bytes choose what the reader expects; the rest is the object.
  ObjectKey key;
  std::memcpy(&key.hash.lo, data, 8);
  std::memcpy(&key.hash.hi, data + 8, 8);
  std::memcpy(&key.group, data + 16, 4);
  const uint64_t hash_block_tokens = 1 + (data[20] % 64);
  const bool use_size = data[21] & 1;
  uint32_t declared = 0;
  std::memcpy(&declared, data + 21, 4);
  std::span<const uint8_t> object(data + 25, size - 25);
  const uint64_t object_bytes = use_size ? object.size() : declared;
  Status s = check_object(object, key, object_bytes, hash_block_tokens);
  if (s.ok() && object.size() != object_bytes) __builtin_trap();  // accepted an object of the wrong size
  // A well-formed object of the same key must pass, and a flipped payload byte
  // must fail when it carries a checksum.
  if (object.size() >= 64 && object.size() <= 4096) {
    std::vector<uint8_t> copy(object.begin(), object.end());
    write_header(copy.data(), key, copy.size(), hash_block_tokens, true);
    if (!check_object(copy, key, copy.size(), hash_block_tokens).ok()) __builtin_trap();
    if (copy.size() > 64) {
      copy[64 + data[24] % (copy.size() - 64)] ^= 0x5a;
      if (check_object(copy, key, copy.size(), hash_block_tokens).ok()) __builtin_trap();
    }
    // Assembled from parts: untrusted until the shared tier's checksum is in
    // (as the completing script writes it); then a flipped byte fails too.
    write_part_header(copy.data(), key, copy.size(), hash_block_tokens);
    if (check_object(copy, key, copy.size(), hash_block_tokens).ok()) __builtin_trap();
    assembled_checksum(copy.data() + 64, copy.size() - 64, copy.data() + 40);
    copy[48] |= kFlagAssembledChecksum;
    if (!check_object(copy, key, copy.size(), hash_block_tokens).ok()) __builtin_trap();
    if (copy.size() > 64) {
      copy[64 + data[23] % (copy.size() - 64)] ^= 0x21;
      if (check_object(copy, key, copy.size(), hash_block_tokens).ok()) __builtin_trap();
    }
  }
  return 0;
}
