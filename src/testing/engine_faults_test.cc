#include "testing/engine_faults.h"

#include <gtest/gtest.h>

namespace kvbridge::testing {
namespace {

TEST(EngineFaultsTest, ParsesKnownFaultsAndNamesWhatIsWrong) {
  EngineOptions o;
  o.transports = {"local"};
  Result<std::unique_ptr<Engine>> ok = create_engine_with_faults(o, "delay=1,drop-notifications=2");
  ASSERT_TRUE(ok.ok()) << ok.error().to_string();
  Result<std::unique_ptr<Engine>> bad = create_engine_with_faults(o, "delay=soon");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code(), Code::kInvalidArgument);
  EXPECT_NE(bad.error().message().find("'delay=soon' needs a number"), std::string::npos) << bad.error().to_string();
  bad = create_engine_with_faults(o, "explode=1");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message().find("unknown fault 'explode'"), std::string::npos) << bad.error().to_string();
}

}  // namespace
}  // namespace kvbridge::testing
