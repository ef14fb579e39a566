// The scheduler roles: leases release each request exactly once, for the
// right reason; the decode side applies the failure policy.
#include <gtest/gtest.h>

#include "kvbridge/connector.h"

namespace kvbridge {
namespace {

using std::chrono::milliseconds;
const SteadyTime t0 = SteadyTime{} + std::chrono::hours(1);

TEST(PrefillSchedulerTest, ReleasesWhenEveryReaderIsDoneOnce) {
  PrefillScheduler s(milliseconds(1000));
  ASSERT_TRUE(s.hold("7", {"d/r0", "d/r1"}, t0).ok());
  EXPECT_EQ(s.hold("7", {"d/r0"}, t0).code(), Code::kAlreadyExists);
  s.reader_done("7", "d/r0", t0);
  s.reader_done("7", "d/r0", t0);      // twice: counted once
  s.reader_done("7", "stranger", t0);  // not expected: ignored
  EXPECT_TRUE(s.take_releases(t0).empty());
  s.reader_done("7", "d/r1", t0);
  std::vector<Release> r = s.take_releases(t0);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].request, "7");
  EXPECT_EQ(r[0].reason, ReleaseReason::kRead);
  EXPECT_EQ(r[0].readers_done, (std::vector<std::string>{"d/r0", "d/r1"}));
  s.reader_done("7", "d/r1", t0);  // late: nothing more
  EXPECT_TRUE(s.take_releases(t0 + milliseconds(5000)).empty());
  EXPECT_EQ(s.held(), 0u);
}

TEST(PrefillSchedulerTest, LeaseExpiresWithoutReadersAndHeartbeatsRenewIt) {
  PrefillScheduler s(milliseconds(1000));
  ASSERT_TRUE(s.hold("1", {"a"}, t0).ok());
  ASSERT_TRUE(s.hold("2", {"a"}, t0).ok());
  s.heartbeat("2", "a", t0 + milliseconds(900));
  EXPECT_TRUE(s.take_releases(t0 + milliseconds(999)).empty());
  std::vector<Release> r = s.take_releases(t0 + milliseconds(1000));
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].request, "1");
  EXPECT_EQ(r[0].reason, ReleaseReason::kLeaseExpired);
  EXPECT_EQ(r[0].readers_missing, std::vector<std::string>{"a"});
  EXPECT_EQ(s.next_expiry(), t0 + milliseconds(1900));
  r = s.take_releases(t0 + milliseconds(1900));
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].request, "2");
}

TEST(PrefillSchedulerTest, AbortWaitsForAReaderThatStartedAndFreesAnUnreadRequestAfterTheGrace) {
  PrefillScheduler s(milliseconds(1000), milliseconds(100));
  ASSERT_TRUE(s.hold("1", {"a"}, t0).ok());
  ASSERT_TRUE(s.hold("2", {"a", "b"}, t0).ok());
  s.heartbeat("2", "a", t0);
  ASSERT_TRUE(s.abort("1", t0).ok());
  ASSERT_TRUE(s.abort("2", t0).ok());
  EXPECT_EQ(s.abort("3", t0).code(), Code::kNotFound);
  // A reader that started just before the abort may not have been heard
  // yet: the unread request is held for the grace, not freed at once.
  EXPECT_TRUE(s.take_releases(t0 + milliseconds(99)).empty());
  std::vector<Release> r = s.take_releases(t0 + milliseconds(100));
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].request, "1");
  EXPECT_EQ(r[0].reason, ReleaseReason::kAborted);
  s.reader_done("2", "a", t0);
  s.reader_done("2", "b", t0);
  r = s.take_releases(t0);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].request, "2");
  EXPECT_EQ(r[0].reason, ReleaseReason::kAborted);
  EXPECT_EQ(s.hold("5", {}, t0).code(), Code::kInvalidArgument);
}

// Held by count (the readers are not known at request_finished): any N
// distinct engines' done messages release it; one engine twice counts once.
TEST(PrefillSchedulerTest, HeldByCountReleasesAfterThatManyDistinctReaders) {
  PrefillScheduler s(milliseconds(1000));
  ASSERT_TRUE(s.hold("r", 2, t0).ok());
  EXPECT_EQ(s.hold("r", 1, t0).code(), Code::kAlreadyExists);
  EXPECT_EQ(s.hold("z", 0, t0).code(), Code::kInvalidArgument);
  s.heartbeat("r", "decode-1/r0", t0 + milliseconds(900));  // anyone may renew it
  EXPECT_EQ(s.next_expiry(), t0 + milliseconds(1900));
  s.reader_done("r", "decode-1/r0", t0 + milliseconds(900));
  s.reader_done("r", "decode-1/r0", t0 + milliseconds(900));  // twice: once
  EXPECT_TRUE(s.take_releases(t0 + milliseconds(900)).empty());
  s.reader_done("r", "decode-1/r1", t0 + milliseconds(950));
  std::vector<Release> r = s.take_releases(t0 + milliseconds(950));
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].request, "r");
  EXPECT_EQ(r[0].reason, ReleaseReason::kRead);
  EXPECT_EQ(r[0].missing_count, 0u);
  // Expiry says how many never reported.
  ASSERT_TRUE(s.hold("q", 3, t0).ok());
  s.reader_done("q", "a", t0);
  r = s.take_releases(t0 + milliseconds(1000));
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].reason, ReleaseReason::kLeaseExpired);
  EXPECT_EQ(r[0].missing_count, 2u);
  EXPECT_TRUE(r[0].readers_missing.empty());
  // Aborted before anyone read: freed after the abort grace.
  ASSERT_TRUE(s.hold("p", 2, t0).ok());
  ASSERT_TRUE(s.abort("p", t0).ok());
  r = s.take_releases(t0 + milliseconds(2000));
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].reason, ReleaseReason::kAborted);
  EXPECT_EQ(r[0].missing_count, 2u);
}

ReaderEvent event(ReaderEvent::Kind kind, RequestId request, std::string reader, uint32_t readers) {
  return ReaderEvent{kind, std::move(request), std::move(reader), readers};
}

// The count is the readers' own word (their instance's rank count), not a
// number the caller configures: prefill TP 4 read by decode TP 2 is held
// until both decode ranks said done, whichever prefill rank heard them.
TEST(PrefillSchedulerTest, ADerivedHoldWaitsForAsManyReadersAsTheySay) {
  using K = ReaderEvent::Kind;
  PrefillScheduler s(milliseconds(1000));
  ASSERT_TRUE(s.hold("r", t0).ok());
  EXPECT_EQ(s.hold("r", t0).code(), Code::kAlreadyExists);
  EXPECT_EQ(s.hold("a b", t0).code(), Code::kInvalidArgument);
  s.on_event(event(K::kHeartbeat, "r", "decode/r0", 2), t0 + milliseconds(500));
  EXPECT_EQ(s.next_expiry(), t0 + milliseconds(1500));
  s.on_event(event(K::kDone, "r", "decode/r0", 2), t0 + milliseconds(600));
  s.on_event(event(K::kDone, "r", "decode/r0", 2), t0 + milliseconds(600));  // heard twice (two prefill ranks)
  s.on_event(event(K::kHeartbeat, "r", "decode/r0", 2), t0 + milliseconds(600));
  EXPECT_TRUE(s.take_releases(t0 + milliseconds(600)).empty());
  s.on_event(event(K::kDone, "r", "decode/r1", 2), t0 + milliseconds(700));
  std::vector<Release> r = s.take_releases(t0 + milliseconds(700));
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].reason, ReleaseReason::kRead);
  EXPECT_EQ(r[0].disagreement, "");
  // Both readers' reads ended before their first done: their dones that
  // reach other prefill ranks later are answered held.
  EXPECT_EQ(r[0].readers_done, (std::vector<std::string>{"decode/r0", "decode/r1"}));
  // Nobody heard: it waits for the lease, and says nobody came.
  ASSERT_TRUE(s.hold("q", t0).ok());
  EXPECT_TRUE(s.take_releases(t0 + milliseconds(999)).empty());
  r = s.take_releases(t0 + milliseconds(1000));
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].reason, ReleaseReason::kLeaseExpired);
  EXPECT_TRUE(r[0].readers_done.empty());
}

// Readers that disagree (a misconfigured or hostile one) never shorten the
// hold once a larger count was said: it waits for the largest, and the
// release names them all.
TEST(PrefillSchedulerTest, ReadersThatDisagreeOnTheirCountHoldForTheLargestAndAreNamed) {
  using K = ReaderEvent::Kind;
  PrefillScheduler s(milliseconds(1000));
  ASSERT_TRUE(s.hold("r", t0).ok());
  s.on_event(event(K::kHeartbeat, "r", "d/r1", 3), t0);
  s.on_event(event(K::kDone, "r", "d/r0", 1), t0);
  EXPECT_TRUE(s.take_releases(t0).empty());  // 1 is not the largest count said
  s.on_event(event(K::kDone, "r", "d/r1", 3), t0);
  s.on_event(event(K::kDone, "r", "d/r2", 3), t0);
  std::vector<Release> r = s.take_releases(t0);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].reason, ReleaseReason::kRead);
  EXPECT_EQ(r[0].disagreement, "readers disagree on how many they are: 'd/r0' says 1, 'd/r1' says 3, 'd/r2' says 3");
  // Aborted while one reader reads: freed once it is done and the grace
  // for a reader on its way passed (the other one never came).
  PrefillScheduler g(milliseconds(1000), milliseconds(100));
  ASSERT_TRUE(g.hold("x", t0).ok());
  g.on_event(event(K::kHeartbeat, "x", "d/r0", 2), t0);
  ASSERT_TRUE(g.abort("x", t0).ok());
  g.on_event(event(K::kDone, "x", "d/r0", 2), t0 + milliseconds(50));
  EXPECT_TRUE(g.take_releases(t0 + milliseconds(99)).empty());
  r = g.take_releases(t0 + milliseconds(100));
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].reason, ReleaseReason::kAborted);
  EXPECT_EQ(r[0].missing_count, 1u);
  // Still reading at the grace: held until its done.
  ASSERT_TRUE(g.hold("y", t0).ok());
  g.on_event(event(K::kHeartbeat, "y", "d/r0", 1), t0);
  ASSERT_TRUE(g.abort("y", t0).ok());
  EXPECT_TRUE(g.take_releases(t0 + milliseconds(500)).empty());
  g.on_event(event(K::kDone, "y", "d/r0", 1), t0 + milliseconds(600));
  r = g.take_releases(t0 + milliseconds(600));
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].reason, ReleaseReason::kAborted);
}

LoadResult ok(RequestId id) {
  LoadResult r;
  r.request = id;
  return r;
}

LoadResult bad(RequestId id, uint64_t token) {
  LoadResult r;
  r.request = id;
  r.error = Status::io_error("peer gone");
  r.first_bad_token = token;
  return r;
}

TEST(DecodeSchedulerTest, FinishesWhenEveryRankReported) {
  DecodeScheduler s(2, FailurePolicy::kFail);
  ASSERT_TRUE(s.expect("1", 0, t0 + milliseconds(10)).ok());
  ASSERT_TRUE(s.rank_result(0, ok("1")).ok());
  EXPECT_EQ(s.rank_result(0, ok("1")).code(), Code::kInvalidArgument);
  EXPECT_EQ(s.rank_result(5, ok("1")).code(), Code::kInvalidArgument);
  EXPECT_TRUE(s.take_outcomes(t0).empty());
  ASSERT_TRUE(s.rank_result(1, ok("1")).ok());
  std::vector<RequestOutcome> o = s.take_outcomes(t0);
  ASSERT_EQ(o.size(), 1u);
  EXPECT_EQ(o[0].outcome, Outcome::kFinished);
  EXPECT_EQ(s.rank_result(1, ok("1")).code(), Code::kNotFound);
}

TEST(DecodeSchedulerTest, PolicyDecidesBetweenFailAndRecomputeFromTheFirstBadToken) {
  for (FailurePolicy policy : {FailurePolicy::kFail, FailurePolicy::kRecompute}) {
    DecodeScheduler s(2, policy);
    ASSERT_TRUE(s.expect("1", 16, t0 + milliseconds(10)).ok());
    ASSERT_TRUE(s.rank_result(1, bad("1", 64)).ok());
    ASSERT_TRUE(s.rank_result(0, bad("1", 32)).ok());
    std::vector<RequestOutcome> o = s.take_outcomes(t0);
    ASSERT_EQ(o.size(), 1u);
    EXPECT_EQ(o[0].outcome, policy == FailurePolicy::kFail ? Outcome::kFailed : Outcome::kRecompute);
    EXPECT_EQ(o[0].recompute_from, 32u);
    EXPECT_NE(o[0].error.message().find("decode rank 0"), std::string::npos) << o[0].error.to_string();
    EXPECT_NE(o[0].error.message().find("peer gone"), std::string::npos);
  }
}

TEST(DecodeSchedulerTest, LostRanksAndDeadlinesEndRequestsOnce) {
  DecodeScheduler s(2, FailurePolicy::kFail);
  ASSERT_TRUE(s.expect("1", 0, t0 + milliseconds(10)).ok());
  ASSERT_TRUE(s.expect("2", 0, t0 + milliseconds(10)).ok());
  ASSERT_TRUE(s.expect("3", 0, t0 + milliseconds(10)).ok());
  ASSERT_TRUE(s.rank_result(1, ok("1")).ok());
  s.rank_lost(0, Status::io_error("exited with signal 9"));
  std::vector<RequestOutcome> o = s.take_outcomes(t0);
  EXPECT_EQ(o.size(), 1u);  // request 1: rank 0 lost, rank 1 reported
  EXPECT_NE(o[0].error.message().find("decode rank 0 is gone"), std::string::npos) << o[0].error.to_string();
  ASSERT_TRUE(s.abort("2").ok());
  o = s.take_outcomes(t0 + milliseconds(10));  // 2 aborted, 3 past its deadline
  ASSERT_EQ(o.size(), 2u);
  EXPECT_EQ(o[0].outcome, Outcome::kAborted);
  EXPECT_EQ(o[1].request, "3");
  EXPECT_EQ(o[1].error.code(), Code::kTimeout);
  EXPECT_NE(o[1].error.message().find("decode rank(s) 1"), std::string::npos) << o[1].error.to_string();
  EXPECT_EQ(s.waiting(), 0u);
}

}  // namespace
}  // namespace kvbridge
