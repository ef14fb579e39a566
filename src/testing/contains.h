// Test-only: a GoogleTest assertion that a text contains a part, printing
// both when it does not: EXPECT_TRUE(testing::Contains(error, "layers.3")).
#pragma once

#include <gtest/gtest.h>

#include <string>

namespace kvbridge::testing {

inline ::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\" does not contain \"" << part << "\"";
}

}  // namespace kvbridge::testing
