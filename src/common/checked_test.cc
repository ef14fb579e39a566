#include "common/checked.h"

#include <gtest/gtest.h>

#include <limits>

namespace kvbridge {
namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

TEST(CheckedTest, AddDetectsOverflow) {
  uint64_t out = 0;
  EXPECT_TRUE(checked_add(kMax - 1, 1, &out));
  EXPECT_EQ(out, kMax);
  EXPECT_FALSE(checked_add(kMax, 1, &out));
}

TEST(CheckedTest, MulDetectsOverflow) {
  uint64_t out = 0;
  EXPECT_TRUE(checked_mul(uint64_t{1} << 31, uint64_t{1} << 32, &out));
  EXPECT_EQ(out, uint64_t{1} << 63);
  EXPECT_FALSE(checked_mul(uint64_t{1} << 32, uint64_t{1} << 32, &out));
}

TEST(CheckedTest, MulAddDetectsOverflowInEitherStep) {
  uint64_t out = 0;
  EXPECT_TRUE(checked_mul_add(3, 5, 7, &out));
  EXPECT_EQ(out, 22u);
  EXPECT_FALSE(checked_mul_add(kMax / 2, 2, 2, &out));
  EXPECT_FALSE(checked_mul_add(kMax, 2, 0, &out));
}

}  // namespace
}  // namespace kvbridge
