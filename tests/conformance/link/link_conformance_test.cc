// The Link conformance suite: the contract of transport.h's Link, written
// once and run against every transport that crosses processes, by each path
// a run can take (link_harness.h). The peer is a link_peer child process.
//
// ctest runs every instantiation (ucx with UCX's default selection), then
// the ucx ones again with UCX_TLS=tcp and UCX_TLS=shm; see CMakeLists.txt.
#include <algorithm>
#include <numeric>
#include <random>
#include <thread>

#include "conformance/link/link_harness.h"
#include "conformance/pattern.h"

namespace kvbridge::conformance {
namespace {

using transport::Clock;
using transport::Copy;
using transport::RunControl;
using namespace std::chrono_literals;

constexpr uint64_t kSizes[] = {1, 4095, 4096, 4097, uint64_t{1} << 20, uint64_t{64} << 20};

// 0 .. count-1 in an order that is the same on every run.
std::vector<uint64_t> shuffled(uint64_t count) {
  std::vector<uint64_t> order(count);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(42));
  return order;
}

// Every size lands exactly where it was aimed: the bytes before and after
// the destination keep their values.
TEST_P(LinkConformance, ReadsEverySizeExactlyAndLeavesItsNeighboursAlone) {
  for (uint64_t size : kSizes) {
    std::fill(local_.begin(), local_.begin() + static_cast<ptrdiff_t>(size + 16), uint8_t{0});
    ASSERT_TRUE(run(TransferOp::kRead, {copy(5, 3, size)}).ok()) << size << " bytes";
    ASSERT_EQ(find_mismatch(local_.data() + 5, size, kPeerSeed, 3), -1) << size << " bytes";
    EXPECT_EQ(local_[4], 0) << size << " bytes";
    EXPECT_EQ(local_[5 + size], 0) << size << " bytes";
  }
}

TEST_P(LinkConformance, WritesEverySizeExactlyAndLeavesItsNeighboursAlone) {
  fill_pattern(local_.data(), kBytes, kLocalSeed, 0);
  // Ascending sizes: each write covers the last, so the peer byte after the
  // destination has never been written.
  for (uint64_t size : kSizes) {
    // OK means in the peer's memory: checked at once.
    ASSERT_TRUE(run(TransferOp::kWrite, {copy(11, 9, size)}).ok()) << size << " bytes";
    ASSERT_TRUE(peer_->check(9, size, kLocalSeed, 11)) << size << " bytes";
    EXPECT_TRUE(peer_->check(8, 1, kPeerSeed, 8)) << size << " bytes";
    EXPECT_TRUE(peer_->check(9 + size, 1, kPeerSeed, 9 + size)) << size << " bytes";
  }
}

// The shape that plans produce: many small copies, the peer's side in no
// order.
TEST_P(LinkConformance, MovesABatchOf10000ShuffledCopiesBothWays) {
  constexpr uint64_t kBlock = 2048, kCount = 10000;
  const std::vector<uint64_t> order = shuffled(kCount);
  std::vector<Copy> copies;
  for (uint64_t i = 0; i < kCount; ++i) copies.push_back(copy(i * kBlock, order[i] * kBlock, kBlock));

  ASSERT_TRUE(run(TransferOp::kRead, copies).ok());
  for (uint64_t i = 0; i < kCount; ++i) {
    ASSERT_EQ(find_mismatch(local_.data() + i * kBlock, kBlock, kPeerSeed, order[i] * kBlock), -1) << "copy " << i;
  }
  EXPECT_EQ(local_[kCount * kBlock], 0);

  fill_pattern(local_.data(), kCount * kBlock, kLocalSeed, 0);
  ASSERT_TRUE(run(TransferOp::kWrite, copies).ok());
  for (uint64_t i = 0; i < kCount; ++i) {
    ASSERT_TRUE(peer_->check(order[i] * kBlock, kBlock, kLocalSeed, i * kBlock)) << "copy " << i;
  }
  EXPECT_TRUE(peer_->check(kCount * kBlock, 4096, kPeerSeed, kCount * kBlock));
}

// More runs at once than a tcp link has streams, reads and writes mixed,
// each on its own bytes, each large enough that cma splits it over threads
// of its own and tcp over several streams.
TEST_P(LinkConformance, ConcurrentRunsOnOneLinkEachMoveTheirOwnBytes) {
  constexpr int kThreads = 6, kRounds = 3;
  constexpr uint64_t kRegion = uint64_t{10} << 20, kRunBytes = uint64_t{9} << 20;
  fill_pattern(local_.data(), kThreads * kRegion, kLocalSeed, 0);
  std::vector<Status> results(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const uint64_t at = static_cast<uint64_t>(t) * kRegion;
      const TransferOp op = t % 2 == 0 ? TransferOp::kRead : TransferOp::kWrite;
      for (int round = 0; round < kRounds && results[t].ok(); ++round) {
        results[t] = run(op, {copy(at, at + 17, kRunBytes + round)});
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_TRUE(results[t].ok()) << "thread " << t << ": " << results[t].to_string();
    const uint64_t at = static_cast<uint64_t>(t) * kRegion, bytes = kRunBytes + kRounds - 1;
    if (t % 2 == 0) {
      EXPECT_EQ(find_mismatch(local_.data() + at, bytes, kPeerSeed, at + 17), -1) << "thread " << t << " (read)";
    } else {
      EXPECT_TRUE(peer_->check(at + 17, bytes, kLocalSeed, at)) << "thread " << t << " (write)";
    }
  }
}

TEST_P(LinkConformance, ARunCancelledBeforeItStartsMovesNothing) {
  std::fill(local_.begin(), local_.begin() + 4096, uint8_t{0x11});
  for (TransferOp op : {TransferOp::kRead, TransferOp::kWrite}) {
    RunControl control;
    control.cancel.store(true);
    control.deadline = Clock::now() + 20s;
    std::vector<Copy> copies{copy(0, 0, 4096)};
    Status s = launch(op, copies, control)->wait();
    EXPECT_EQ(s.code(), Code::kCancelled) << s.to_string();
    EXPECT_EQ(control.bytes_done.load(), 0u);
  }
  EXPECT_TRUE(std::all_of(local_.begin(), local_.begin() + 4096, [](uint8_t b) { return b == 0x11; }))
      << "a cancelled read landed";
  EXPECT_TRUE(peer_->check(0, 4096, kPeerSeed, 0)) << "a cancelled write landed";
}

// When the run ends as cancelled (run() returns, done fires), no byte of it
// lands any more, and the link serves the next run.
TEST_P(LinkConformance, CancelEndsARunAndNothingLandsAfterItEnded) {
  const Interrupted r = interrupt_long_run(TransferOp::kRead, [](RunControl& c) { c.cancel.store(true); });
  EXPECT_EQ(r.status.code(), Code::kCancelled) << r.status.to_string();
  EXPECT_LT(r.bytes_done, r.bytes_total) << "the run finished before the cancel";
  EXPECT_TRUE(nothing_lands_after(kBytes));

  std::fill(local_.begin(), local_.end(), uint8_t{0});
  ASSERT_TRUE(run(TransferOp::kRead, {copy(0, 1, 5 << 20)}).ok()) << "the link serves a run after a cancel";
  EXPECT_EQ(find_mismatch(local_.data(), 5 << 20, kPeerSeed, 1), -1);
}

// The other half of the contract: after a cancelled write ended, no byte
// leaves local memory. Bytes already sent may still arrive (a tcp frame in
// the socket), but none that local memory held only after the end.
TEST_P(LinkConformance, ACancelledWriteSendsNoByteWrittenLocallyAfterItEnded) {
  ASSERT_TRUE(peer_->fill(0, kBytes, 0).ok());  // zeros: no byte is 0xee yet
  std::fill(local_.begin(), local_.end(), uint8_t{0x11});
  const Interrupted r = interrupt_long_run(TransferOp::kWrite, [](RunControl& c) { c.cancel.store(true); });
  EXPECT_EQ(r.status.code(), Code::kCancelled) << r.status.to_string();
  std::fill(local_.begin(), local_.end(), uint8_t{0xee});
  std::this_thread::sleep_for(100ms);
  Result<uint64_t> late = peer_->count(0, kBytes, 0xee);
  ASSERT_TRUE(late.ok()) << late.error().to_string();
  EXPECT_EQ(*late, 0u) << "bytes written locally after the run ended reached the peer";
  Result<uint64_t> sent = peer_->count(0, kBytes, 0x11);
  ASSERT_TRUE(sent.ok()) << sent.error().to_string();
  EXPECT_GT(*sent, 0u) << "the write moved nothing before the cancel, so the check above proves nothing";

  ASSERT_TRUE(run(TransferOp::kWrite, {copy(0, 0, 4096)}).ok()) << "the link serves a run after a cancel";
  Result<uint64_t> fresh = peer_->count(0, 4096, 0xee);
  ASSERT_TRUE(fresh.ok()) << fresh.error().to_string();
  EXPECT_EQ(*fresh, 4096u);
}

TEST_P(LinkConformance, ADeadlineThatCannotBeMetEndsTheRunAsATimeoutQuickly) {
  const Clock::time_point start = Clock::now();
  const Status s = run(TransferOp::kRead, long_copies(), 100ms);
  EXPECT_EQ(s.code(), Code::kTimeout) << s.to_string();
  EXPECT_LT(Clock::now() - start, 2s);
  EXPECT_TRUE(nothing_lands_after(kBytes));

  std::fill(local_.begin(), local_.end(), uint8_t{0});
  ASSERT_TRUE(run(TransferOp::kRead, {copy(0, 0, 4096)}).ok()) << "the link serves a run after a timeout";
  EXPECT_EQ(find_mismatch(local_.data(), 4096, kPeerSeed, 0), -1);
}

// How a run fails once its peer is gone: with the first error, which sticks
// (cma: the pid is gone; ucx: the endpoint's error), or, for a link that
// closes a broken stream and dials afresh (tcp), refused.
Code next_run_after_peer_gone(const std::string& transport) {
  return transport == "tcp" || staged_tcp(transport) ? Code::kUnavailable : Code::kIoError;
}

// SIGKILL mid-run: the run ends as kIoError naming the peer within seconds
// (not at its deadline), nothing lands after, and the next run fails at once.
TEST_P(LinkConformance, APeerKilledMidTransferIsAnIoErrorNamingThePeer) {
  const Interrupted r = interrupt_long_run(TransferOp::kRead, [&](RunControl&) { peer_->kill(); });
  EXPECT_EQ(r.status.code(), Code::kIoError) << r.status.to_string();
  EXPECT_NE(r.status.message().find("'" + peer_name() + "'"), std::string::npos) << r.status.to_string();
  EXPECT_LT(r.took, 5s) << r.status.to_string();
  EXPECT_TRUE(nothing_lands_after(kBytes));

  const Clock::time_point again = Clock::now();
  const Status next = run(TransferOp::kRead, {copy(0, 0, 4096)}, 5s);
  EXPECT_EQ(next.code(), next_run_after_peer_gone(GetParam().transport)) << next.to_string();
  EXPECT_NE(next.message().find("'" + peer_name() + "'"), std::string::npos) << next.to_string();
  EXPECT_LT(Clock::now() - again, 2s) << "the next run waited for a peer that is gone";
}

TEST_P(LinkConformance, AZeroByteRunIsOk) {
  for (TransferOp op : {TransferOp::kRead, TransferOp::kWrite}) {
    Status s = run(op, {});
    EXPECT_TRUE(s.ok()) << "no copies: " << s.to_string();
    s = run(op, {copy(0, 0, 0)});
    EXPECT_TRUE(s.ok()) << "one copy of zero bytes: " << s.to_string();
  }
  EXPECT_EQ(local_[0], 0);
  EXPECT_TRUE(peer_->check(0, 16, kPeerSeed, 0));
}

INSTANTIATE_TEST_SUITE_P(Cma, LinkConformance, ::testing::Values(LinkParam{"cma_run", "cma", RunPath::kRun}),
                         link_param_name);
INSTANTIATE_TEST_SUITE_P(Tcp, LinkConformance,
                         ::testing::Values(LinkParam{"tcp_run", "tcp", RunPath::kRun},
                                           LinkParam{"tcp_start", "tcp", RunPath::kStart}),
                         link_param_name);
// cuda_ipc over the host fake's device memory (KVB_DEVICE=fake, set for
// this suite by CMakeLists.txt): the peer's buffer is fake device memory,
// opened through its handle; local memory is host memory.
INSTANTIATE_TEST_SUITE_P(CudaIpc, LinkConformance,
                         ::testing::Values(LinkParam{"cuda_ipc_run", "cuda_ipc", RunPath::kRun}), link_param_name);
// tcp staging device memory through pinned host memory on both sides
// (staging.h), over the host fake's device memory.
INSTANTIATE_TEST_SUITE_P(TcpStaged, LinkConformance,
                         ::testing::Values(LinkParam{"tcp_device_run", "tcp_device", RunPath::kRun},
                                           LinkParam{"tcp_device_start", "tcp_device", RunPath::kStart},
                                           LinkParam{"tcp_device_host_run", "tcp_device_host", RunPath::kRun},
                                           LinkParam{"tcp_host_device_run", "tcp_host_device", RunPath::kRun}),
                         link_param_name);
INSTANTIATE_TEST_SUITE_P(Ucx, LinkConformance,
                         ::testing::Values(LinkParam{"ucx_run", "ucx", RunPath::kRun},
                                           LinkParam{"ucx_start", "ucx", RunPath::kStart},
                                           LinkParam{"ucx_device_host_run", "ucx_device_host", RunPath::kRun}),
                         link_param_name);

}  // namespace
}  // namespace kvbridge::conformance
