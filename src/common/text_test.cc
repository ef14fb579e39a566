#include "common/text.h"

#include <gtest/gtest.h>

namespace kvbridge {
namespace {

TEST(TextTest, HexRoundTripsEveryByteAndRefusesAnyOtherSpelling) {
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  const std::string hex = to_hex(all);
  ASSERT_EQ(hex.size(), 512u);
  EXPECT_EQ(hex.substr(0, 6), "000102");
  EXPECT_EQ(hex.substr(506), "fdfeff");
  EXPECT_EQ(from_hex(hex), all);
  EXPECT_EQ(from_hex(""), std::string());
  for (std::string_view bad : {"0", "abc", "0G", "AB", " 0", "0x"}) EXPECT_FALSE(from_hex(bad)) << bad;
}

}  // namespace
}  // namespace kvbridge
