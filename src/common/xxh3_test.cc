// common/xxh3.h against libxxhash: the portable XXH3-64 that device code
// runs equals XXH3_64bits() at every length up to 2 KiB (every branch of
// XXH3: 0-16, 17-128, 129-240 bytes, and the long loop over blocks and
// its last partial stripe), at larger lengths around block boundaries and
// a content leaf, and at every alignment.
#include "common/xxh3.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <random>
#include <vector>

namespace kvbridge {
namespace {

TEST(Xxh3Test, ThePortableHashEqualsLibxxhashAtEveryLengthAndAlignment) {
  std::mt19937_64 rng(7);
  std::vector<uint8_t> data(xxh3::kContentLeafBytes + 4096);
  for (uint8_t& b : data) b = static_cast<uint8_t>(rng());
  std::vector<size_t> lengths;
  for (size_t n = 0; n <= 2048; ++n) lengths.push_back(n);
  for (size_t n : {1023, 1024, 1025, 4095, 4096, 4097, 8191, 8193, 65535, 65536}) lengths.push_back(n);
  for (int i = 0; i < 40; ++i) lengths.push_back(2049 + rng() % (xxh3::kContentLeafBytes - 2048));
  for (size_t n : lengths) {
    for (size_t at : {size_t{0}, size_t{1}, size_t{3}, size_t{7}}) {
      ASSERT_EQ(xxh3::hash64(data.data() + at, n), XXH3_64bits(data.data() + at, n)) << n << " bytes at offset " << at;
    }
  }
}

}  // namespace
}  // namespace kvbridge
