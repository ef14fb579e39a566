// Faults injected under the engine (transport/fault.h): every failure
// surfaces as an error carrying its first cause, within the deadline, and the
// transfer ends exactly once.
#include <thread>

#include "conformance/conformance.h"
#include "conformance/pattern.h"

namespace kvbridge::conformance {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

void expect_ended_once(const Engine& engine, uint64_t done, uint64_t failed, uint64_t cancelled) {
  EngineMetrics m = engine.metrics();
  EXPECT_EQ(m.transfers_done, done);
  EXPECT_EQ(m.transfers_failed, failed);
  EXPECT_EQ(m.transfers_cancelled, cancelled);
  uint64_t latencies = 0;
  for (uint64_t b : m.latency_us_buckets) latencies += b;
  EXPECT_EQ(latencies, done + failed + cancelled) << "a transfer was counted twice in the latency histogram";
}

TEST_P(FaultInjection, FailedRunSurfacesItsCauseOnce) {
  faults_->fail_run(1, Status::io_error("injected: the wire is cut"));
  TransferStatus st = run(TransferOp::kRead, {item(0, 0, 4096)}, "never-sent");
  ASSERT_EQ(st.state, TransferState::kFailed);
  EXPECT_EQ(st.error.code(), Code::kIoError);
  EXPECT_NE(st.error.message().find("injected: the wire is cut"), std::string::npos) << st.error.to_string();
  EXPECT_EQ(st.bytes_done, 0u);
  EXPECT_EQ(local_[0], 0);
  // The fault was one-shot: the next transfer goes through.
  st = run(TransferOp::kRead, {item(0, 0, 4096)});
  EXPECT_EQ(st.state, TransferState::kDone) << st.error.to_string();
  expect_ended_once(*engine_, 1, 1, 0);
  EXPECT_TRUE(await_notifications(*peer_, 1, 200ms).empty()) << "a failed transfer sent its notification";
}

TEST_P(FaultInjection, TruncatedRunReportsPartialBytesThenTheError) {
  faults_->truncate_run(1, 1000, Status::io_error("injected: short read"));
  TransferStatus st = run(TransferOp::kRead, {item(0, 0, 4096)});
  ASSERT_EQ(st.state, TransferState::kFailed);
  EXPECT_NE(st.error.message().find("injected: short read"), std::string::npos) << st.error.to_string();
  EXPECT_EQ(st.bytes_done, 1000u);
  EXPECT_EQ(st.bytes_total, 4096u);
  EXPECT_EQ(find_mismatch(local_.data(), 1000, kPeerSeed, 0), -1);
  EXPECT_EQ(local_[1000], 0);
  expect_ended_once(*engine_, 0, 1, 0);
}

TEST_P(FaultInjection, FirstErrorOfManyChunksWinsAndOtherChunksStop) {
  // 8 MiB in 2 MiB items splits into one chunk per worker thread; the second
  // run fails, the other must stop rather than finish.
  if (GetParam().peer_memory != "host") {
    GTEST_SKIP() << "a transfer of device memory is one run (one batched copy): it has no other chunk to stop";
  }
  faults_->set_delay(20ms);
  faults_->fail_run(2, Status::io_error("injected: chunk failure"));
  std::vector<TransferItem> items;
  for (uint64_t k = 0; k < 64; ++k) items.push_back(item(k * 131072, k * 131072, 131072));
  const auto start = Clock::now();
  TransferStatus st = run(TransferOp::kRead, items);
  ASSERT_EQ(st.state, TransferState::kFailed);
  EXPECT_NE(st.error.message().find("injected: chunk failure"), std::string::npos) << st.error.to_string();
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_EQ(faults_->runs_active(), 0u);
  expect_ended_once(*engine_, 0, 1, 0);
}

TEST_P(FaultInjection, DroppedNotificationFailsByTheDeadline) {
  faults_->drop_notifications(1);
  const auto start = Clock::now();
  TransferStatus st = run(TransferOp::kWrite, {item(0, 0, 4096)}, "lost", 300ms);
  ASSERT_EQ(st.state, TransferState::kFailed);
  EXPECT_EQ(st.error.code(), Code::kTimeout) << st.error.to_string();
  EXPECT_NE(st.error.message().find("acknowledge"), std::string::npos) << st.error.to_string();
  EXPECT_LT(Clock::now() - start, 5s);
  expect_ended_once(*engine_, 0, 1, 0);
  // The channel still works: the next notification arrives.
  st = run(TransferOp::kWrite, {item(0, 0, 4096)}, "kept");
  EXPECT_EQ(st.state, TransferState::kDone) << st.error.to_string();
  std::vector<Notification> got = await_notifications(*peer_, 1, 30s);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].message, "kept");
}

TEST_P(FaultInjection, SlowLinkWithinTheDeadlineCompletes) {
  faults_->set_delay(5ms);
  std::vector<TransferItem> items;
  for (int k = 0; k < 20; ++k) items.push_back(item(k * 100, k * 100, 100));
  TransferStatus st = run(TransferOp::kRead, items, "", 30s);
  ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
  EXPECT_EQ(find_mismatch(local_.data(), 2000, kPeerSeed, 0), -1);
  expect_ended_once(*engine_, 1, 0, 0);
}

TEST_P(FaultInjection, RegionInUseCannotBeDeregisteredUntilTheTransferEnds) {
  faults_->set_delay(10ms);
  std::vector<TransferItem> items;
  for (int k = 0; k < 50; ++k) items.push_back(item(k * 100, k * 100, 100));
  Result<TransferId> id = engine_->submit(peer_id_, TransferOp::kRead, items);
  ASSERT_TRUE(id.ok()) << id.error().to_string();
  Status busy = engine_->deregister_memory(local_region_);
  EXPECT_EQ(busy.code(), Code::kUnavailable) << busy.to_string();
  EXPECT_EQ(engine_->release(*id).code(), Code::kUnavailable) << "released a transfer in progress";
  TransferStatus st = engine_->wait(*id, kWaitLimit);
  EXPECT_EQ(st.state, TransferState::kDone) << st.error.to_string();
  EXPECT_TRUE(engine_->deregister_memory(local_region_).ok());
  EXPECT_TRUE(engine_->release(*id).ok());
  EXPECT_EQ(engine_->status(*id).error.code(), Code::kNotFound);
}

TEST_P(FaultInjection, DestroyingTheEngineCancelsTransfersInProgress) {
  faults_->set_delay(10ms);
  faults_->set_cancel_linger(50ms);
  std::vector<TransferItem> items;
  for (int k = 0; k < 200; ++k) items.push_back(item(k * 4096, k * 4096, 4096));
  Result<TransferId> id = engine_->submit(peer_id_, TransferOp::kRead, items);
  ASSERT_TRUE(id.ok()) << id.error().to_string();
  ASSERT_TRUE(await_progress(*id));
  const auto start = Clock::now();
  engine_.reset();
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_EQ(faults_->runs_active(), 0u) << "the engine was destroyed while a run executed";
  const std::vector<uint8_t> snapshot = local_;
  std::this_thread::sleep_for(100ms);
  EXPECT_TRUE(snapshot == local_);
}

}  // namespace
}  // namespace kvbridge::conformance
