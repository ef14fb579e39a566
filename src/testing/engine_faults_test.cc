#include "testing/engine_faults.h"
#include "testing/require.h"

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
  std::vector<uint8_t> mine(8192, 0), theirs(8192, 7);  // outlive the engines
  o.name = "skipping";
  Result<std::unique_ptr<Engine>> a = create_engine_with_faults(o, "skip-copies=1");
  ASSERT_TRUE(a.ok()) << a.error().to_string();
  o.name = "plain";
  Result<std::unique_ptr<Engine>> b = Engine::create(o);
  ASSERT_TRUE(b.ok());
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

// The content check (SubmitOptions::verify_content), over transports that
// read back into scratch memory (local, cma, ucx) and one whose server
// hashes its own memory (tcp), for reads and writes: a link that reports
// bytes it never moved ends done without it, and fails naming the bytes with
// it; honest transfers of copies larger than the check's scratch memory pass.
TEST(EngineFaultsTest, TheContentCheckFailsWhatALyingLinkReportsAndPassesWhatLanded) {
  constexpr uint64_t kBytes = uint64_t{6} << 20;
  std::string missing;  // a transport this machine cannot run, and why
  for (const char* transport : {"local", "tcp", "cma", "ucx"}) {
    EngineOptions o;
    o.transports = {transport};
    if (Result<std::unique_ptr<Engine>> probe = Engine::create(o); !probe.ok()) {
      if (missing.empty()) missing = std::string(transport) + ": " + probe.error().to_string();
      continue;
    }
    for (TransferOp op : {TransferOp::kRead, TransferOp::kWrite}) {
      SCOPED_TRACE(std::string(transport) + (op == TransferOp::kRead ? " read" : " write"));
      // Before the engines, so they outlive them: a peer's server may still
      // be sending from its memory when a transfer that skipped its copies
      // has ended (ASan saw the tcp server read freed memory).
      std::vector<uint8_t> mine(kBytes), theirs(kBytes);
      o.name = "skipping";
      Result<std::unique_ptr<Engine>> a = create_engine_with_faults(o, "skip-copies=1");
      ASSERT_TRUE(a.ok()) << a.error().to_string();
      o.name = "plain";
      Result<std::unique_ptr<Engine>> b = Engine::create(o);
      Result<std::unique_ptr<Engine>> c = Engine::create(o);
      ASSERT_TRUE(b.ok() && c.ok());
      for (uint64_t i = 0; i < kBytes; ++i) {
        mine[i] = static_cast<uint8_t>(i * 7 + 1);
        theirs[i] = static_cast<uint8_t>(i * 13 + 5);
      }
      Result<RegionId> rx = (*a)->register_memory(mine.data(), mine.size());
      Result<RegionId> ry = (*b)->register_memory(theirs.data(), theirs.size());
      Result<RegionId> rz = (*c)->register_memory(mine.data(), mine.size());
      ASSERT_TRUE(rx.ok() && ry.ok() && rz.ok());
      Result<PeerId> peer = (*a)->connect((*b)->metadata());
      Result<PeerId> honest = (*c)->connect((*b)->metadata());
      ASSERT_TRUE(peer.ok() && honest.ok());
      // One copy past the check's 4 MiB of scratch memory, and two small ones.
      const std::vector<TransferItem> items{{*rx, 0, *ry, 0, 5u << 20},
                                            {*rx, 5u << 20, *ry, 5u << 20, 4096},
                                            {*rx, (5u << 20) + 4096, *ry, (5u << 20) + 4096, (1u << 20) - 4096}};
      auto run = [&](Engine& e, PeerId p, bool verify) {
        SubmitOptions so;
        so.verify_content = verify;
        Result<TransferId> id = e.submit(p, op, items, std::move(so));
        EXPECT_TRUE(id.ok()) << id.error().to_string();
        return id.ok() ? e.wait(*id, std::chrono::seconds(30)) : TransferStatus{};
      };
      TransferStatus s = run(**a, *peer, false);
      EXPECT_EQ(s.state, TransferState::kDone) << s.error.to_string();
      EXPECT_NE(mine, theirs) << "the lying link moved bytes";
      s = run(**a, *peer, true);
      EXPECT_EQ(s.state, TransferState::kFailed);
      EXPECT_EQ(s.error.code(), Code::kIoError) << s.error.to_string();
      // Named as the engine's threads cut the copies: their bytes, the peer's address and segment.
      EXPECT_NE(s.error.message().find("content check failed: the "), std::string::npos) << s.error.to_string();
      EXPECT_NE(s.error.message().find(" bytes at address 0x"), std::string::npos) << s.error.to_string();
      EXPECT_NE(s.error.message().find(op == TransferOp::kRead ? "differ from what landed here"
                                                               : "differ from what was written there"),
                std::string::npos)
          << s.error.to_string();
      EXPECT_GE((*a)->metrics().content_check_failures, 1u);
      EXPECT_EQ((*a)->metrics().bytes_content_checked, 0u);
      // The same transfer through an honest engine lands and passes the check.
      s = run(**c, *honest, true);
      EXPECT_EQ(s.state, TransferState::kDone) << s.error.to_string();
      EXPECT_EQ(mine, theirs);
      EXPECT_EQ((*c)->metrics().bytes_content_checked, kBytes);
      EXPECT_EQ((*c)->metrics().content_check_failures, 0u);
    }
  }
  if (!missing.empty()) {
    const std::string capability = missing.substr(0, missing.find(':'));
    KVB_SKIP_UNLESS_REQUIRED(capability, "the other transports passed; not run over " + missing);
  }
}

}  // namespace
}  // namespace kvbridge::testing
