// The transport conformance suite: what every transport must do, seen
// through the engine. Instantiations are in instantiate_*.cc.
#include <algorithm>
#include <numeric>
#include <random>
#include <thread>

#include "conformance/conformance.h"
#include "conformance/pattern.h"

namespace kvbridge::conformance {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kSizes[] = {1, 4095, 4096, 4097, uint64_t{1} << 20};

TEST_P(TransportConformance, ReadsEverySizeExactly) {
  uint64_t local_offset = 0, remote_offset = 12345;
  for (uint64_t size : kSizes) {
    SCOPED_TRACE("size " + std::to_string(size));
    TransferStatus st = run(TransferOp::kRead, {item(local_offset + 1, remote_offset, size)});
    ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
    EXPECT_EQ(st.bytes_done, size);
    EXPECT_EQ(find_mismatch(local_.data() + local_offset + 1, size, kPeerSeed, remote_offset), -1);
    // The neighbours stay untouched.
    EXPECT_EQ(local_[local_offset], 0);
    EXPECT_EQ(local_[local_offset + 1 + size], 0);
    local_offset += size + 2;
    remote_offset += size + 3;
  }
  EXPECT_EQ(engine_->metrics().transfers_done, std::size(kSizes));
}

TEST_P(TransportConformance, WritesEverySizeExactly) {
  fill_pattern(local_.data(), local_.size(), 9, 0);
  uint64_t local_offset = 0, remote_offset = 12345;
  for (uint64_t size : kSizes) {
    SCOPED_TRACE("size " + std::to_string(size));
    TransferStatus st = run(TransferOp::kWrite, {item(local_offset, remote_offset, size)});
    ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
    EXPECT_TRUE(peer_->check(remote_offset, size, 9, local_offset));
    EXPECT_TRUE(peer_->check(remote_offset - 1, 1, kPeerSeed, remote_offset - 1));
    EXPECT_TRUE(peer_->check(remote_offset + size, 1, kPeerSeed, remote_offset + size));
    local_offset += size + 5;
    remote_offset += size + 7;
  }
  EXPECT_EQ(engine_->metrics().bytes_written, std::accumulate(std::begin(kSizes), std::end(kSizes), uint64_t{0}));
}

TEST_P(TransportConformance, ZeroLengthItemsAndEmptyBatchesAreRejected) {
  Result<TransferId> empty = engine_->submit(peer_id_, TransferOp::kRead, {});
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.error().code(), Code::kInvalidArgument);
  std::vector<TransferItem> items = {item(0, 0, 16), item(100, 100, 0)};
  Result<TransferId> zero = engine_->submit(peer_id_, TransferOp::kRead, items);
  ASSERT_FALSE(zero.ok());
  EXPECT_EQ(zero.error().code(), Code::kInvalidArgument);
  EXPECT_NE(zero.error().message().find("item 1"), std::string::npos) << zero.error().to_string();
  EXPECT_EQ(local_[0], 0) << "a rejected batch moved bytes";
  EXPECT_EQ(faults_->runs_started(), 0u);
}

// 10,000 descriptors of 256 bytes, remote blocks read into shuffled local
// blocks, then written back shuffled the other way.
TEST_P(TransportConformance, BatchesOfOneAndTenThousandDescriptors) {
  constexpr uint64_t kBlock = 256, kCount = 10000;
  std::vector<uint64_t> perm(kCount);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(42));
  std::vector<TransferItem> items;
  for (uint64_t k = 0; k < kCount; ++k) items.push_back(item(perm[k] * kBlock, k * kBlock, kBlock));
  TransferStatus st = run(TransferOp::kRead, items);
  ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
  for (uint64_t k = 0; k < kCount; ++k) {
    ASSERT_EQ(find_mismatch(local_.data() + perm[k] * kBlock, kBlock, kPeerSeed, k * kBlock), -1) << "block " << k;
  }
  // Write each local block to remote block (k + kCount) so the peer's first
  // half is untouched.
  items.clear();
  for (uint64_t k = 0; k < kCount; ++k) items.push_back(item(perm[k] * kBlock, (k + kCount) * kBlock, kBlock));
  st = run(TransferOp::kWrite, items);
  ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
  EXPECT_TRUE(peer_->check(kCount * kBlock, kCount * kBlock, kPeerSeed, 0));
  st = run(TransferOp::kRead, {item(0, 5, 1)});
  ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
  EXPECT_EQ(local_[0], pattern_byte(5, kPeerSeed));
  EXPECT_EQ(engine_->metrics().descriptors, 2 * kCount + 1);
}

TEST_P(TransportConformance, NotificationsArriveAfterTheBytesAndInOrder) {
  fill_pattern(local_.data(), local_.size(), 11, 0);
  for (int i = 0; i < 5; ++i) {
    TransferStatus st = run(TransferOp::kWrite, {item(i * 4096, i * 4096, 4096)}, "n" + std::to_string(i));
    ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
  }
  // notify() on its own goes after every earlier transfer, even one still
  // running on a slow link.
  faults_->set_delay(20ms);
  std::vector<TransferItem> slow;
  for (int k = 0; k < 10; ++k) slow.push_back(item(65536 + k * 1024, 65536 + k * 1024, 1024));
  Result<TransferId> id = engine_->submit(peer_id_, TransferOp::kWrite, slow);
  ASSERT_TRUE(id.ok()) << id.error().to_string();
  ASSERT_TRUE(engine_->notify(peer_id_, "after-slow").ok());
  std::vector<Notification> got = await_notifications(*peer_, 6, 30s);
  ASSERT_EQ(got.size(), 6u) << "notifications did not all arrive within 30 s";
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(got[i].message, "n" + std::to_string(i));
    EXPECT_EQ(got[i].peer, "engine-under-test");
  }
  EXPECT_EQ(got[5].message, "after-slow");
  EXPECT_EQ(engine_->status(*id).state, TransferState::kDone);
  EXPECT_TRUE(peer_->check(0, 5 * 4096, 11, 0));
  EXPECT_TRUE(peer_->check(65536, 10 * 1024, 11, 65536));
  EXPECT_EQ(engine_->metrics().notifications_sent, 6u);
}

TEST_P(TransportConformance, ReadNotificationArrivesAfterTheReadEnds) {
  TransferStatus st = run(TransferOp::kRead, {item(0, 0, 65536)}, "read-done");
  ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
  std::vector<Notification> got = await_notifications(*peer_, 1, 30s);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].message, "read-done");
}

TEST_P(TransportConformance, DeadlinePassesAsTimeoutAndStopsTheLink) {
  faults_->set_delay(20ms);
  std::vector<TransferItem> items;
  for (int k = 0; k < 100; ++k) items.push_back(item(k * 4096, k * 4096, 4096));
  const auto start = Clock::now();
  TransferStatus st = run(TransferOp::kRead, items, "", 150ms);
  const auto took = Clock::now() - start;
  ASSERT_EQ(st.state, TransferState::kFailed);
  EXPECT_EQ(st.error.code(), Code::kTimeout) << st.error.to_string();
  EXPECT_LT(st.bytes_done, st.bytes_total);
  EXPECT_LT(took, 5s) << "the deadline of 150 ms was enforced late";
  EXPECT_EQ(faults_->runs_active(), 0u) << "a run was still executing after the transfer ended";
  EngineMetrics m = engine_->metrics();
  EXPECT_EQ(m.transfers_failed, 1u);
  EXPECT_EQ(m.transfers_done, 0u);
}

TEST_P(TransportConformance, CancelMeansNoFurtherByteLands) {
  // A slow link that also takes 200 ms to notice a cancel: the engine must
  // wait for it, not return early.
  faults_->set_delay(5ms);
  faults_->set_cancel_linger(200ms);
  std::vector<TransferItem> items;
  for (int k = 0; k < 400; ++k) items.push_back(item(k * 4096, k * 4096, 4096));
  Result<TransferId> id = engine_->submit(peer_id_, TransferOp::kRead, items);
  ASSERT_TRUE(id.ok()) << id.error().to_string();
  ASSERT_TRUE(await_progress(*id));
  ASSERT_TRUE(engine_->cancel(*id).ok());
  EXPECT_EQ(faults_->runs_active(), 0u) << "cancel() returned while a run was executing";
  const std::vector<uint8_t> snapshot = local_;
  std::this_thread::sleep_for(300ms);
  EXPECT_TRUE(snapshot == local_) << "bytes landed in local memory after cancel() returned";
  TransferStatus st = engine_->status(*id);
  EXPECT_EQ(st.state, TransferState::kCancelled);
  EXPECT_EQ(st.error.code(), Code::kCancelled);
  EXPECT_LT(st.bytes_done, st.bytes_total);
  EXPECT_TRUE(engine_->cancel(*id).ok()) << "a second cancel is OK";
  EXPECT_EQ(engine_->status(*id).state, TransferState::kCancelled);
  EXPECT_TRUE(engine_->deregister_memory(local_region_).ok()) << "the region was still held after cancel";
  EngineMetrics m = engine_->metrics();
  EXPECT_EQ(m.transfers_cancelled, 1u);
  EXPECT_EQ(m.transfers_failed + m.transfers_done, 0u);
}

TEST_P(TransportConformance, CancelWhileWaitRunsTheTransfer) {
  // wait() runs a transfer's queued chunks on the calling thread; a cancel()
  // from another thread must still wait for that run, and the transfer ends
  // once, as kCancelled.
  faults_->set_delay(5ms);
  faults_->set_cancel_linger(200ms);
  std::vector<TransferItem> items;
  for (int k = 0; k < 400; ++k) items.push_back(item(k * 4096, k * 4096, 4096));
  Result<TransferId> id = engine_->submit(peer_id_, TransferOp::kRead, items);
  ASSERT_TRUE(id.ok()) << id.error().to_string();
  bool cancel_ok = false;
  uint64_t active_after_cancel = 1;
  std::vector<uint8_t> snapshot;
  std::thread canceller([&] {
    EXPECT_TRUE(await_progress(*id));
    cancel_ok = engine_->cancel(*id).ok();
    active_after_cancel = faults_->runs_active();
    snapshot = local_;
  });
  TransferStatus st = engine_->wait(*id, kWaitLimit);
  canceller.join();
  EXPECT_TRUE(cancel_ok);
  EXPECT_EQ(active_after_cancel, 0u) << "cancel() returned while a run was executing";
  EXPECT_EQ(st.state, TransferState::kCancelled) << st.error.to_string();
  std::this_thread::sleep_for(300ms);
  EXPECT_TRUE(snapshot == local_) << "bytes landed in local memory after cancel() returned";
  EXPECT_TRUE(engine_->release(*id).ok());
  EXPECT_TRUE(engine_->deregister_memory(local_region_).ok()) << "the region was still held after cancel";
  EngineMetrics m = engine_->metrics();
  EXPECT_EQ(m.transfers_cancelled, 1u);
  EXPECT_EQ(m.transfers_failed + m.transfers_done, 0u);
}

TEST_P(TransportConformance, OutOfBoundsIsRejectedAndNothingMoves) {
  auto expect_rejected = [&](std::vector<TransferItem> items, Code code, const std::string& fragment) {
    Result<TransferId> id = engine_->submit(peer_id_, TransferOp::kWrite, items);
    ASSERT_FALSE(id.ok()) << "accepted a batch that should fail with '" << fragment << "'";
    EXPECT_EQ(id.error().code(), code) << id.error().to_string();
    EXPECT_NE(id.error().message().find(fragment), std::string::npos) << id.error().to_string();
  };
  fill_pattern(local_.data(), local_.size(), 13, 0);
  expect_rejected({item(0, 0, 4096), item(0, kBytes - 100, 101)}, Code::kOutOfRange, "item 1: remote range");
  expect_rejected({item(0, 0, 4096), item(0, kBytes - 100, 101)}, Code::kOutOfRange,
                  "region " + std::to_string(peer_->region()));
  expect_rejected({item(kBytes, 0, 1)}, Code::kOutOfRange, "item 0: local range");
  expect_rejected({item(0, UINT64_MAX, 2)}, Code::kOutOfRange, "item 0");
  TransferItem unknown_remote = item(0, 0, 1);
  unknown_remote.remote = 999;
  expect_rejected({item(0, 0, 1), unknown_remote}, Code::kNotFound, "item 1: peer 'peer-a' advertises no region 999");
  TransferItem unknown_local = item(0, 0, 1);
  unknown_local.local = 999;
  expect_rejected({unknown_local}, Code::kNotFound, "local region 999");
  Result<TransferId> bad_peer = engine_->submit(77, TransferOp::kRead, std::vector<TransferItem>{item(0, 0, 1)});
  EXPECT_EQ(bad_peer.error().code(), Code::kNotFound);
  EXPECT_TRUE(peer_->check(0, kBytes, kPeerSeed, 0)) << "a rejected write moved bytes";
  EXPECT_EQ(faults_->runs_started(), 0u);
  EXPECT_EQ(engine_->metrics().transfers_submitted, 0u);
}

TEST_P(TransportConformance, PeerGoneMidTransferFailsOnceAndOthersStillWork) {
  faults_->set_delay(10ms);
  std::vector<TransferItem> items;
  for (int k = 0; k < 1000; ++k) items.push_back(item(k * 4096, k * 4096, 4096));
  Result<TransferId> id = engine_->submit(peer_id_, TransferOp::kRead, items, "", 20s);
  ASSERT_TRUE(id.ok()) << id.error().to_string();
  ASSERT_TRUE(await_progress(*id));
  const auto killed = Clock::now();
  peer_->kill();
  TransferStatus st = engine_->wait(*id, kWaitLimit);
  const auto took = Clock::now() - killed;
  ASSERT_EQ(st.state, TransferState::kFailed) << transfer_state_name(st.state) << " " << st.error.to_string();
  EXPECT_EQ(st.error.code(), Code::kIoError) << st.error.to_string();
  EXPECT_NE(st.error.message().find("peer-a"), std::string::npos) << st.error.to_string();
  EXPECT_LT(took, 10s) << "the dead peer was noticed late";
  EXPECT_EQ(faults_->runs_active(), 0u);
  // New work to the dead peer fails at once; the engine serves others.
  Result<TransferId> again = engine_->submit(peer_id_, TransferOp::kRead, std::vector<TransferItem>{item(0, 0, 1)});
  EXPECT_FALSE(again.ok() && engine_->wait(*again, kWaitLimit).state == TransferState::kDone);
  faults_->clear();
  Result<std::unique_ptr<Peer>> other = start_peer("peer-b");
  ASSERT_TRUE(other.ok()) << other.error().to_string();
  Result<PeerId> other_id = engine_->connect((*other)->metadata());
  if (!other_id.ok() && ucx_over_shared_memory_only()) {
    // UCX over shared memory alone has no peer failure detection: a peer
    // killed while writing into this worker's receive queue blocks it for
    // good (UCX 1.13), so no new peer can answer the wireup. The engine must
    // say so within the wireup's limit, naming both peers, and not hang.
    const std::string why = other_id.error().to_string();
    EXPECT_EQ(other_id.error().code(), Code::kUnavailable) << why;
    EXPECT_NE(why.find("ucx peer 'peer-b': no answer to the endpoint wireup"), std::string::npos) << why;
    EXPECT_NE(why.find("peer 'peer-a' exited while connected"), std::string::npos) << why;
    return;
  }
  ASSERT_TRUE(other_id.ok()) << other_id.error().to_string();
  TransferItem ok_item{local_region_, 0, (*other)->region(), 100, 4096};
  Result<TransferId> ok = engine_->submit(*other_id, TransferOp::kRead, std::vector<TransferItem>{ok_item});
  ASSERT_TRUE(ok.ok()) << ok.error().to_string();
  TransferStatus ok_st = engine_->wait(*ok, kWaitLimit);
  EXPECT_EQ(ok_st.state, TransferState::kDone) << ok_st.error.to_string();
  EXPECT_EQ(find_mismatch(local_.data(), 4096, kPeerSeed, 100), -1);
  EngineMetrics m = engine_->metrics();
  EXPECT_EQ(m.transfers_failed, again.ok() ? 2u : 1u) << "the failure was counted more than once";
  EXPECT_EQ(m.transfers_done, 1u);
}

TEST_P(TransportConformance, ConnectingAgainReusesThePeerAndRefreshesRegions) {
  Result<PeerId> again = engine_->connect(peer_->metadata());
  ASSERT_TRUE(again.ok()) << again.error().to_string();
  EXPECT_EQ(*again, peer_id_);
  TransferStatus st = run(TransferOp::kRead, {item(0, 0, 4096)});
  EXPECT_EQ(st.state, TransferState::kDone) << st.error.to_string();
}

// Two engines under one name are two peers: each id reads its own engine's
// bytes and its notifications reach that engine alone, whatever the order
// of connects and transfers (A, B, then A again).
TEST_P(TransportConformance, TwoEnginesWithOneNameAreTwoPeers) {
  constexpr uint32_t kOtherSeed = 11;
  Result<std::unique_ptr<Peer>> b = start_peer("peer-a", kOtherSeed);
  ASSERT_TRUE(b.ok()) << b.error().to_string();
  Result<PeerId> b_id = engine_->connect((*b)->metadata());
  ASSERT_TRUE(b_id.ok()) << b_id.error().to_string();
  ASSERT_NE(*b_id, peer_id_) << "a second engine named 'peer-a' took the first one's peer id";
  auto read_from = [&](PeerId peer, RegionId region, uint64_t local_offset) {
    TransferItem it{local_region_, local_offset, region, 0, 4096};
    Result<TransferId> id = engine_->submit(peer, TransferOp::kRead, std::vector<TransferItem>{it});
    if (!id.ok()) return id.error();
    TransferStatus st = engine_->wait(*id, kWaitLimit);
    (void)engine_->release(*id);
    return st.state == TransferState::kDone ? Status() : Status::internal(st.error.to_string());
  };
  ASSERT_TRUE(read_from(peer_id_, peer_->region(), 0).ok());
  ASSERT_TRUE(read_from(*b_id, (*b)->region(), 4096).ok());
  ASSERT_TRUE(read_from(peer_id_, peer_->region(), 8192).ok());
  EXPECT_EQ(find_mismatch(local_.data(), 4096, kPeerSeed, 0), -1) << "the first read came from the wrong engine";
  EXPECT_EQ(find_mismatch(local_.data() + 4096, 4096, kOtherSeed, 0), -1)
      << "the second read came from the wrong engine";
  EXPECT_EQ(find_mismatch(local_.data() + 8192, 4096, kPeerSeed, 0), -1) << "the third read came from the wrong engine";
  ASSERT_TRUE(engine_->notify(peer_id_, "done 3").ok());
  ASSERT_TRUE(engine_->notify(*b_id, "done 4").ok());
  std::vector<Notification> to_a = await_notifications(*peer_, 1, 10s);
  std::vector<Notification> to_b = await_notifications(**b, 1, 10s);
  ASSERT_EQ(to_a.size(), 1u);
  ASSERT_EQ(to_b.size(), 1u);
  EXPECT_EQ(to_a[0].message, "done 3");
  EXPECT_EQ(to_b[0].message, "done 4");
  // Connecting again to either returns its own id.
  Result<PeerId> a_again = engine_->connect(peer_->metadata());
  Result<PeerId> b_again = engine_->connect((*b)->metadata());
  ASSERT_TRUE(a_again.ok() && b_again.ok());
  EXPECT_EQ(*a_again, peer_id_);
  EXPECT_EQ(*b_again, *b_id);
}

// A restarted engine under a known name is a new peer; the old id fails,
// naming the old engine and the one that holds the name now.
TEST_P(TransportConformance, ARestartedPeerIsANewPeerAndTheOldIdFailsNamingBoth) {
  if (!GetParam().child_peer) GTEST_SKIP() << "restarting needs a peer in a child process";
  peer_->kill();
  const auto deadline = Clock::now() + kWaitLimit;
  while (Clock::now() < deadline) {
    Result<TransferId> probe = engine_->submit(peer_id_, TransferOp::kRead, std::vector<TransferItem>{item(0, 0, 1)});
    if (!probe.ok()) break;
    (void)engine_->wait(*probe, kWaitLimit);
    (void)engine_->release(*probe);
    std::this_thread::sleep_for(5ms);
  }
  Result<std::unique_ptr<Peer>> again = start_peer("peer-a", 13);
  ASSERT_TRUE(again.ok()) << again.error().to_string();
  Result<PeerId> new_id = engine_->connect((*again)->metadata());
  ASSERT_TRUE(new_id.ok()) << new_id.error().to_string();
  EXPECT_NE(*new_id, peer_id_);
  Result<TransferId> old = engine_->submit(peer_id_, TransferOp::kRead, std::vector<TransferItem>{item(0, 0, 16)});
  ASSERT_FALSE(old.ok()) << "a transfer to the old engine's id was accepted";
  EXPECT_NE(old.error().message().find("the name now belongs to"), std::string::npos) << old.error().to_string();
  EXPECT_NE(old.error().message().find("peer " + std::to_string(*new_id)), std::string::npos)
      << old.error().to_string();
  TransferItem it{local_region_, 0, (*again)->region(), 0, 4096};
  Result<TransferId> ok = engine_->submit(*new_id, TransferOp::kRead, std::vector<TransferItem>{it});
  ASSERT_TRUE(ok.ok()) << ok.error().to_string();
  EXPECT_EQ(engine_->wait(*ok, kWaitLimit).state, TransferState::kDone);
  EXPECT_EQ(find_mismatch(local_.data(), 4096, 13, 0), -1);
}

}  // namespace
}  // namespace kvbridge::conformance
