#include "testing/engine_faults.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

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

// drop-done loses a connector done message and lets everything else through.
TEST(EngineFaultsTest, DropDoneDropsOnlyDoneMessages) {
  EngineOptions o;
  o.transports = {"local"};
  o.default_timeout = std::chrono::milliseconds(300);
  o.name = "faulty";
  Result<std::unique_ptr<Engine>> a = create_engine_with_faults(o, "drop-done=1");
  ASSERT_TRUE(a.ok()) << a.error().to_string();
  o.name = "plain";
  Result<std::unique_ptr<Engine>> b = Engine::create(o);
  ASSERT_TRUE(b.ok());
  Result<PeerId> peer = (*a)->connect((*b)->metadata());
  ASSERT_TRUE(peer.ok()) << peer.error().to_string();
  EXPECT_TRUE((*a)->notify(*peer, "kvb/1 hb 7").ok());
  EXPECT_EQ((*a)->notify(*peer, "kvb/1 done 7").code(), Code::kTimeout);  // lost: never acknowledged
  EXPECT_TRUE((*a)->notify(*peer, "kvb/1 done 8").ok());                  // one drop only
  std::vector<std::string> got;
  for (const Notification& n : (*b)->take_notifications()) got.push_back(n.message);
  EXPECT_EQ(got, (std::vector<std::string>{"kvb/1 hb 7", "kvb/1 done 8"}));
}

// skip-copies (benchmarks of a load's host cost): a read reports its bytes
// done and moves none of them.
TEST(EngineFaultsTest, SkipCopiesReportsBytesItNeverMoves) {
  EngineOptions o;
  o.transports = {"local"};
  o.name = "skipping";
  Result<std::unique_ptr<Engine>> a = create_engine_with_faults(o, "skip-copies=1");
  ASSERT_TRUE(a.ok()) << a.error().to_string();
  o.name = "plain";
  Result<std::unique_ptr<Engine>> b = Engine::create(o);
  ASSERT_TRUE(b.ok());
  std::vector<uint8_t> mine(8192, 0), theirs(8192, 7);
  Result<RegionId> rx = (*a)->register_memory(mine.data(), mine.size());
  Result<RegionId> ry = (*b)->register_memory(theirs.data(), theirs.size());
  ASSERT_TRUE(rx.ok() && ry.ok());
  Result<PeerId> peer = (*a)->connect((*b)->metadata());
  ASSERT_TRUE(peer.ok()) << peer.error().to_string();
  const TransferItem item{*rx, 0, *ry, 0, 8192};
  Result<TransferId> id = (*a)->submit(*peer, TransferOp::kRead, std::span<const TransferItem>(&item, 1));
  ASSERT_TRUE(id.ok()) << id.error().to_string();
  const TransferStatus s = (*a)->wait(*id, std::chrono::seconds(30));
  EXPECT_EQ(s.state, TransferState::kDone) << s.error.to_string();
  EXPECT_EQ(s.bytes_done, 8192u);
  EXPECT_EQ(std::count(mine.begin(), mine.end(), 0), 8192) << "a skipped copy moved bytes";
}

}  // namespace
}  // namespace kvbridge::testing
