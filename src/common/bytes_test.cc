#include "common/bytes.h"

#include <gtest/gtest.h>

#include <vector>

namespace kvbridge {
namespace {

TEST(OtherBytesTest, CountsAndLocatesEveryOtherByteAcrossPages) {
  std::vector<uint8_t> b(3 * 4096 + 100, 0xa5);
  OtherBytes clean = other_bytes(b, 0xa5);
  EXPECT_EQ(clean.count, 0u);
  EXPECT_EQ(clean.first, b.size());
  // One at the very start of a page, two in the middle of another, the last
  // byte of the short tail.
  b[4096] = 0;
  b[2 * 4096 + 7] = 1;
  b[2 * 4096 + 8] = 0xa4;
  b.back() = 3;
  OtherBytes dirty = other_bytes(b, 0xa5);
  EXPECT_EQ(dirty.count, 4u);
  EXPECT_EQ(dirty.first, 4096u);
  EXPECT_EQ(other_bytes(b, 0).count, b.size() - 1);
  EXPECT_EQ(other_bytes(std::span<const uint8_t>(b).first(4096), 0xa5).count, 0u);
  EXPECT_EQ(other_bytes(std::span<const uint8_t>(b).last(1), 0xa5).first, 0u);
  EXPECT_EQ(other_bytes({}, 0xa5).count, 0u);
}

}  // namespace
}  // namespace kvbridge
