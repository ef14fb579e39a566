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

TEST(TextTest, JsonNestingIsCountedOutsideStringsAndNamesWhereItWentTooDeep) {
  EXPECT_EQ(json_nesting_past(R"({"a": [1, {"b": 2}]})", 3), std::nullopt);
  EXPECT_EQ(json_nesting_past(R"({"a": [1, {"b": 2}]})", 2), 10u);  // the third level's '{'
  // Brackets inside strings, escaped quotes included, do not count.
  EXPECT_EQ(json_nesting_past(R"(["[[[{{{", "\"[[[", {}])", 2), std::nullopt);
  EXPECT_EQ(json_nesting_past(R"(["\\", [[]]])", 2), 8u);  // an escaped backslash ends before the quote
  // Closing brackets with nothing open are left to the parser.
  EXPECT_EQ(json_nesting_past("]]]][[", 1), 5u);
  EXPECT_EQ(json_nesting_past(std::string(100000, '['), 64), 64u);
  EXPECT_EQ(json_nesting_past("", 0), std::nullopt);
}

}  // namespace
}  // namespace kvbridge
