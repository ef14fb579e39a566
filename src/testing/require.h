// testing/require.h: skip a test for a capability this machine lacks, unless
// the run requires it.
//
// Some tests need what a machine may not offer: cma needs ptrace permission,
// ucx a build with UCX and a UCX that starts, netns root. Such a test skips
// with the reason, so a developer's machine stays green; CI sets
// KVB_REQUIRE to a comma-separated list of capabilities ("cma,ucx,netns",
// the same variable tests/demo_test.py reads), and a test that would skip
// for a listed one fails instead, so a broken CI image cannot pass by
// skipping. Header-only, for tests.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <string_view>

namespace kvbridge::testing {

// Whether KVB_REQUIRE names `capability` (exactly, as one of its
// comma-separated entries).
inline bool required(std::string_view capability) {
  const char* env = std::getenv("KVB_REQUIRE");
  std::string_view list = env ? env : "";
  while (!list.empty()) {
    const size_t comma = list.find(',');
    if (list.substr(0, comma) == capability) return true;
    if (comma == std::string_view::npos) break;
    list.remove_prefix(comma + 1);
  }
  return false;
}

}  // namespace kvbridge::testing

// Ends the current test (return from SetUp or the test body): skipped with
// `reason`, or failed when KVB_REQUIRE names `capability`.
#define KVB_SKIP_UNLESS_REQUIRED(capability, reason)                                \
  do {                                                                              \
    const std::string kvb_reason_ = (reason);                                       \
    if (::kvbridge::testing::required(capability)) {                                \
      GTEST_FAIL() << kvb_reason_ << ", and KVB_REQUIRE asks for " << (capability); \
    }                                                                               \
    GTEST_SKIP() << kvb_reason_;                                                    \
  } while (0)
