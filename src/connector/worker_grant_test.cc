// Read grants (WorkerOptions::remote_access = kGrantedRead, hand_off()): a
// pull-mode prefill rank serves a reader only the blocks handed off for a
// request that reader heartbeats, while they are held, over tcp (the
// transport that serves reads itself).
#include <gtest/gtest.h>

#include <thread>

#include "connector/worker_test_util.h"

namespace kvbridge {
namespace {

using namespace std::chrono_literals;
using namespace worker_test;

struct Granting {
  std::vector<std::unique_ptr<Rank>> prefill, decode;
  Granting() {
    InstanceOptions p = opts("prefill", 1);
    p.transport = "tcp";
    p.worker.secret = "s3cret";
    p.worker.remote_access = RemoteAccess::kGrantedRead;
    InstanceOptions d = opts("decode", 1);
    d.transport = "tcp";
    d.worker.secret = "s3cret";
    d.worker.remote_access = RemoteAccess::kNone;
    d.worker.transfer_timeout = 800ms;
    prefill = instance(p);
    decode = instance(d);
    for (auto& r : prefill) EXPECT_TRUE(fill_request(r->layout, request(), RequestSide::kRemote, 0, 11, r->spans).ok());
    EXPECT_TRUE(decode[0]->worker->add_remote("prefill", addresses(prefill)).ok());
  }
  ConnectorWorker& p() { return *prefill[0]->worker; }
  ConnectorWorker& d() { return *decode[0]->worker; }
  // No cell of the request at the decode rank holds what the prefill's do.
  bool nothing_landed() {
    Result<ContentReport> c = check_request(decode[0]->layout, request(), RequestSide::kLocal, 0, 11, decode[0]->spans);
    return c.ok() && c->cells > 0 && c->bad_cells == c->cells;
  }
};

const std::map<std::string, std::vector<int64_t>> kHandedOff{{"full", {4, 5, 6}}};

TEST(WorkerReadGrantTest, AReaderReadsTheBlocksHandedOffWhetherItsHeartbeatOrTheHandOffComesFirst) {
  Granting g;
  ASSERT_TRUE(g.p().hand_off("1", kHandedOff).ok());
  ASSERT_TRUE(g.d().start_load("1", "prefill", request()).ok());
  LoadResult r = wait_one(g.d());
  ASSERT_TRUE(r.error.ok()) << r.error.to_string();
  EXPECT_EQ(bad_cells(*g.decode[0], request(), {}, 11), 0u);
  g.p().blocks_released("1");
  // The reader first: its reads are refused until the hand-off comes, then land.
  for (auto& m : g.decode[0]->mem) std::fill(m.begin(), m.end(), 0xa5);
  ASSERT_TRUE(g.d().start_load("2", "prefill", request()).ok());
  std::this_thread::sleep_for(100ms);
  ASSERT_TRUE(g.p().hand_off("2", kHandedOff).ok());
  r = wait_one(g.d());
  ASSERT_TRUE(r.error.ok()) << r.error.to_string();
  EXPECT_EQ(bad_cells(*g.decode[0], request(), {}, 11), 0u);
  EXPECT_GT(g.d().stats().reads_refused, 0u) << "the reads came before the hand-off";
  EXPECT_EQ(g.p().hand_off("2", kHandedOff).code(), Code::kAlreadyExists);
}

// Params that steer a reader to blocks the prefill did not hand off for
// that request (another request's, or free ones) read nothing: the reads
// are refused until the load's deadline, and the load fails naming why.
TEST(WorkerReadGrantTest, AReadOfBlocksNotHandedOffForTheRequestIsRefusedAndLandsNothing) {
  Granting g;
  ASSERT_TRUE(g.p().hand_off("1", {{"full", {0, 1, 2}}}).ok());
  ASSERT_TRUE(g.d().start_load("1", "prefill", request()).ok());  // reads blocks 4, 5, 6
  LoadResult r = wait_one(g.d());
  ASSERT_FALSE(r.error.ok()) << "a read of blocks not handed off was served";
  EXPECT_EQ(r.error.code(), Code::kPermissionDenied) << r.error.to_string();
  EXPECT_NE(r.error.message().find("not inside a read grant"), std::string::npos) << r.error.to_string();
  EXPECT_EQ(r.first_bad_token, 0u);
  EXPECT_TRUE(g.nothing_landed()) << "bytes of blocks not handed off landed";
  // Released blocks are refused too.
  ASSERT_TRUE(g.p().hand_off("2", kHandedOff).ok());
  g.p().blocks_released("2");
  ASSERT_TRUE(g.d().start_load("2", "prefill", request()).ok());
  r = wait_one(g.d());
  EXPECT_FALSE(r.error.ok()) << "a read of released blocks was served";
  EXPECT_TRUE(g.nothing_landed());
}

TEST(WorkerReadGrantTest, AHandOffNamesItsGroupsAndBlocks) {
  Granting g;
  Status s = g.p().hand_off("1", {{"nope", {1}}});
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("the layout has no group 'nope'"), std::string::npos) << s.to_string();
  s = g.p().hand_off("1", {{"full", {8}}});
  EXPECT_EQ(s.code(), Code::kOutOfRange);
  EXPECT_NE(s.message().find("block 8 is not below 8 blocks"), std::string::npos) << s.to_string();
  EXPECT_EQ(g.p().hand_off("a b", kHandedOff).code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace kvbridge
