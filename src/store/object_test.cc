// The store object header, and the seeds of fuzz/store_object_fuzz.cc
// (testing/corpus.h).
#include "store/object.h"
#include "store/redis_tier.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "testing/corpus.h"

namespace kvbridge::store_internal {
namespace {

ObjectKey key_of(uint64_t lo, uint32_t group) {
  ObjectKey k;
  k.hash.lo = lo;
  k.hash.hi = ~lo;
  k.group = group;
  return k;
}

// A fuzz input: 25 bytes that choose what the reader expects (key, hash
// block size, declared size), then the object.
std::string input(const ObjectKey& key, uint8_t hash_block_byte, uint32_t declared, bool use_size,
                  const std::vector<uint8_t>& object) {
  std::string s(25, '\0');
  std::memcpy(s.data(), &key.hash.lo, 8);
  std::memcpy(s.data() + 8, &key.hash.hi, 8);
  std::memcpy(s.data() + 16, &key.group, 4);
  s[20] = static_cast<char>(hash_block_byte);
  std::memcpy(s.data() + 21, &declared, 4);
  s[21] = static_cast<char>((static_cast<uint8_t>(s[21]) & ~1) | (use_size ? 1 : 0));
  s.append(object.begin(), object.end());
  return s;
}

TEST(StoreObjectTest, AWrittenHeaderChecksAndAChangedByteFails) {
  const ObjectKey key = key_of(42, 3);
  std::vector<uint8_t> object(64 + 256, 0x11);
  write_header(object.data(), key, object.size(), 16, true);
  EXPECT_TRUE(check_object(object, key, object.size(), 16).ok());
  object[100] ^= 1;
  EXPECT_FALSE(check_object(object, key, object.size(), 16).ok());
  EXPECT_FALSE(check_object(object, key_of(43, 3), object.size(), 16).ok());
}

TEST(StoreObjectTest, AnAssembledObjectIsTrustedOnlyWithTheSharedTiersChecksum) {
  const ObjectKey key = key_of(7, 0);
  std::vector<uint8_t> object(64 + 300, 0x42);
  write_part_header(object.data(), key, object.size(), 16);
  Status s = check_object(object, key, object.size(), 16);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.to_string().find("assembled without its checksum"), std::string::npos) << s.to_string();
  // What the completing script writes: SHA-1's first 8 bytes, flag bit 2.
  assembled_checksum(object.data() + 64, object.size() - 64, object.data() + 40);
  object[48] |= kFlagAssembledChecksum;
  EXPECT_TRUE(check_object(object, key, object.size(), 16).ok());
  // SHA-1 of 300 bytes of 0x42, as Redis's redis.sha1hex and Python's
  // hashlib give it: 3e71285c3d3ef255...
  const uint8_t expected[8] = {0x3e, 0x71, 0x28, 0x5c, 0x3d, 0x3e, 0xf2, 0x55};
  EXPECT_EQ(std::memcmp(object.data() + 40, expected, 8), 0);
  object[64 + 299] ^= 0x04;
  s = check_object(object, key, object.size(), 16);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.to_string().find("assembled payload checksum mismatch"), std::string::npos) << s.to_string();
}

TEST(StoreObjectTest, SeedCorpusObjectsCheck) {
  const ObjectKey key = key_of(0x691fb1bfc4fd924bull, 1);
  std::vector<uint8_t> checksummed(64 + 512, 0x5a);
  write_header(checksummed.data(), key, checksummed.size(), 16, true);
  std::vector<uint8_t> assembled(64 + 128, 0x33);
  write_part_header(assembled.data(), key, assembled.size(), 16);
  assembled_checksum(assembled.data() + 64, assembled.size() - 64, assembled.data() + 40);
  assembled[48] |= kFlagAssembledChecksum;
  const kvbridge::testing::Seeds seeds = {
      {"checksummed.bin", input(key, 15, 0, true, checksummed)},
      {"assembled.bin", input(key, 15, 0, true, assembled)},
      {"wrong_size.bin", input(key, 15, 100, false, checksummed)},
      // Error replies of a Redis Cluster, for the redirect parser.
      {"redirect-moved", "MOVED 3999 127.0.0.1:6381"},
      {"redirect-ask", "ASK 12182 10.0.0.7:7002"},
  };
  const kvbridge::testing::Seeds checked_in = kvbridge::testing::seed_corpus("store_object", seeds);
  EXPECT_GE(checked_in.size(), seeds.size());
  for (const auto& [name, bytes] : checked_in) {
    Redirect r;
    if (name.rfind("redirect-", 0) == 0) {
      EXPECT_TRUE(parse_redirect(bytes, &r)) << name;
    } else {
      EXPECT_GE(bytes.size(), 25u + 64) << name;
    }
  }
}

}  // namespace
}  // namespace kvbridge::store_internal
