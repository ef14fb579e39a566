// Batches of submits (Engine::begin_batch, SubmitBatch): the engine's
// threads are woken for a batch's first transfer at once, then a few
// times, not once per transfer; every transfer lands; batches nest.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

#include "kvbridge/engine.h"
#include "testing/run_transfer.h"

namespace kvbridge {
namespace {

using namespace std::chrono_literals;

struct BatchPair {
  BatchPair() {
    EngineOptions o;
    o.transports = {"local"};
    o.threads = 2;
    o.inline_bytes = 0;  // every transfer goes to the engine's threads
    o.name = "reader";
    a = std::move(*Engine::create(o));
    o.name = "source";
    b = std::move(*Engine::create(o));
    x.assign(kBytes, 0);
    y.resize(kBytes);
    for (uint64_t i = 0; i < kBytes; ++i) y[i] = static_cast<uint8_t>(i * 7 + i / 4093 + 1);
    rx = *a->register_memory(x.data(), kBytes);
    ry = *b->register_memory(y.data(), kBytes);
    peer = *a->connect(b->metadata());
  }
  // Transfer k reads bytes [k * 4096, (k + 1) * 4096) of the source.
  Result<TransferId> read(uint64_t k) {
    const TransferItem item{rx, k * 4096, ry, k * 4096, 4096};
    return a->submit(peer, TransferOp::kRead, {&item, 1}, SubmitOptions{});
  }
  static constexpr uint64_t kBytes = 64 * 4096;
  std::unique_ptr<Engine> a, b;
  std::vector<uint8_t> x, y;
  RegionId rx = 0, ry = 0;
  PeerId peer = 0;
};

// Until both of the engine's threads sleep (no transfer of theirs runs):
// a submit then has someone to wake.
void settle() { std::this_thread::sleep_for(50ms); }

TEST(BatchTest, ABatchWakesTheEnginesThreadsAFewTimesNotOncePerTransfer) {
  BatchPair p;
  settle();
  const uint64_t before = p.a->metrics().worker_wakeups;
  std::vector<TransferId> ids;
  {
    const SubmitBatch batch(*p.a);
    for (uint64_t k = 0; k < 64; ++k) {
      Result<TransferId> id = p.read(k);
      ASSERT_TRUE(id.ok()) << id.error().to_string();
      ids.push_back(*id);
    }
  }
  for (TransferId id : ids) {
    const TransferStatus st = p.a->wait(id, 10s);
    ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
    ASSERT_TRUE(p.a->release(id).ok());
  }
  EXPECT_EQ(p.x, p.y);
  // 64 chunks: the first, one per 16 queued without a wake-up, the end.
  const uint64_t woken = p.a->metrics().worker_wakeups - before;
  EXPECT_GE(woken, 1u);
  EXPECT_LE(woken, 1u + 64 / 16 + 1);
}

TEST(BatchTest, ABatchsFirstTransferStartsBeforeTheBatchEnds) {
  BatchPair p;
  settle();
  const SubmitBatch batch(*p.a);
  Result<TransferId> id = p.read(0);
  ASSERT_TRUE(id.ok()) << id.error().to_string();
  // A wait shorter than the transfer's deadline does not run its chunks
  // on this thread: a worker must have been woken for it.
  const TransferStatus st = p.a->wait(*id, 5s);
  EXPECT_EQ(st.state, TransferState::kDone) << st.error.to_string();
  ASSERT_TRUE(p.a->release(*id).ok());
  EXPECT_TRUE(std::equal(p.x.begin(), p.x.begin() + 4096, p.y.begin()));
}

TEST(BatchTest, BatchesNestAndTheOutermostEndWakesTheRest) {
  BatchPair p;
  settle();
  std::vector<TransferId> ids;
  p.a->begin_batch();
  for (int outer = 0; outer < 3; ++outer) {
    const SubmitBatch inner(*p.a);
    for (uint64_t k = 0; k < 5; ++k) {
      Result<TransferId> id = p.read(outer * 5 + k);
      ASSERT_TRUE(id.ok()) << id.error().to_string();
      ids.push_back(*id);
    }
  }
  p.a->end_batch();
  // An end_batch() without its begin_batch() changes nothing.
  p.a->end_batch();
  for (TransferId id : ids) {
    const TransferStatus st = p.a->wait(id, 10s);
    ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
    ASSERT_TRUE(p.a->release(id).ok());
  }
  EXPECT_TRUE(std::equal(p.x.begin(), p.x.begin() + 15 * 4096, p.y.begin()));
}

}  // namespace
}  // namespace kvbridge
