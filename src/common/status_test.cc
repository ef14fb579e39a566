#include "kvbridge/status.h"

#include <gtest/gtest.h>

#include <set>

namespace kvbridge {
namespace {

Result<int> half(int x) {
  if (x % 2 != 0) return Status::invalid_argument("odd value " + std::to_string(x));
  return x / 2;
}

Result<int> quarter(int x) {
  KVB_ASSIGN_OR_RETURN(int h, half(x));
  KVB_ASSIGN_OR_RETURN(int q, half(h));
  return q;
}

Status check_even(int x) {
  KVB_RETURN_IF_ERROR(half(x).status());
  return Status();
}

TEST(StatusTest, DefaultIsOk) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.to_string(), "ok");
}

TEST(StatusTest, ToStringNamesCodeAndMessage) {
  Status s = Status::out_of_range("block 9 past num_blocks 8");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), Code::kOutOfRange);
  EXPECT_EQ(s.to_string(), "out_of_range: block 9 past num_blocks 8");
}

TEST(StatusTest, WithContextPrefixesTheMessageAndKeepsTheCode) {
  Status s = Status::invalid_argument("bad stride").with_context("layer 'layers.0'");
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_EQ(s.message(), "layer 'layers.0': bad stride");
  EXPECT_TRUE(Status().with_context("x").ok());
}

TEST(StatusTest, EveryCodeHasADistinctName) {
  std::set<std::string_view> names;
  for (int c = 0; c <= static_cast<int>(Code::kPermissionDenied); ++c) names.insert(code_name(static_cast<Code>(c)));
  EXPECT_EQ(names.size(), static_cast<size_t>(Code::kPermissionDenied) + 1);
}

TEST(ResultTest, HoldsAValueOrAnError) {
  Result<int> a = half(4);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(*a, 2);
  Result<int> b = half(3);
  ASSERT_FALSE(b.has_value());
  EXPECT_EQ(b.error().message(), "odd value 3");
}

TEST(ResultTest, AssignOrReturnPropagatesTheFirstError) {
  EXPECT_EQ(*quarter(8), 2);
  Result<int> r = quarter(6);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().message(), "odd value 3");
  EXPECT_TRUE(check_even(2).ok());
  EXPECT_EQ(check_even(1).code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace kvbridge
