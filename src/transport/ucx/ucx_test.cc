// What is particular to the ucx transport, with two transports in this
// process (each with its own worker): the bounds of its address and key
// blobs, refresh() of the peer's segments, and that a cancelled write leaves
// the peer's memory as it was when run() returned. What every Link must do
// (sizes, batches, concurrency, cancel, deadlines, a killed peer) is the
// Link conformance suite's (tests/conformance/link/), against a peer in a
// child process.
//
// ctest runs the binary once per UCX_TLS (tcp, shm); see CMakeLists.txt.
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "testing/pattern.h"
#include "testing/peer_info.h"
#include "testing/require.h"
#include "transport/transport.h"

namespace kvbridge::transport {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kBytes = uint64_t{32} << 20;

using testing::pattern;

class UcxTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Tests keep UCX's log to errors.
    ::setenv("UCX_LOG_LEVEL", "error", 0);
    auto client = make_ucx_transport("127.0.0.1");
    if (!client.ok()) KVB_SKIP_UNLESS_REQUIRED("ucx", "ucx cannot run here: " + client.error().to_string());
    client_ = std::move(*client);
    local_.assign(kBytes, 0);
    ASSERT_TRUE(client_->add_segment(Segment{9, local_.data(), kBytes, "host"}).ok());
    auto server = make_ucx_transport("127.0.0.1");
    ASSERT_TRUE(server.ok()) << server.error().to_string();
    server_ = std::move(*server);
    remote_.resize(kBytes);
    for (uint64_t i = 0; i < kBytes; ++i) remote_[i] = pattern(i);
    auto key = server_->add_segment(Segment{1, remote_.data(), kBytes, "host"});
    ASSERT_TRUE(key.ok()) << key.error().to_string();
    key_ = *key;
    auto link = client_->connect(peer());
    ASSERT_TRUE(link.ok()) << link.error().to_string();
    link_ = std::move(*link);
  }

  void TearDown() override { link_.reset(); }

  // The server as the engine would describe it. Its pid and host matter:
  // with UCX_TLS=shm the endpoint watches the peer's pid instead of UCX's
  // peer failure handling, which shared memory lacks (ucx_worker.h).
  PeerInfo peer() const {
    return testing::peer_on_this_host("server", ::getpid(), server_->address(),
                                      {1, reinterpret_cast<uint64_t>(remote_.data()), kBytes, key_});
  }

  Copy copy(uint64_t local_offset, uint64_t remote_offset, uint64_t bytes) {
    return Copy{local_.data() + local_offset, reinterpret_cast<uint64_t>(remote_.data()) + remote_offset, bytes, 1};
  }

  Status run(TransferOp op, const std::vector<Copy>& copies, std::chrono::milliseconds timeout = 30s) {
    RunControl control;
    control.deadline = Clock::now() + timeout;
    return link_->run(op, copies, control);
  }

  // The link still reads exactly.
  void expect_a_read_works() {
    std::fill(local_.begin(), local_.end(), uint8_t{0});
    ASSERT_TRUE(run(TransferOp::kRead, {copy(5, 3, 1 << 20)}).ok());
    EXPECT_TRUE(std::equal(local_.begin() + 5, local_.begin() + 5 + (1 << 20), remote_.begin() + 3));
    EXPECT_EQ(local_[4], 0);
  }

  // Memory first: it outlives the transports.
  std::vector<uint8_t> local_, remote_;
  std::unique_ptr<Transport> client_, server_;
  std::string key_;
  std::unique_ptr<Link> link_;
};

TEST_F(UcxTest, AddressAndKeysAreBoundedBlobs) {
  EXPECT_GT(client_->address().size(), 0u);
  EXPECT_LE(client_->address().size(), 4096u) << "worker address over 4 KiB";
  EXPECT_LE(key_.size(), 4096u);
  std::printf("[ info ] UCX_TLS=%s: worker address %zu bytes, rkey %zu bytes\n",
              std::getenv("UCX_TLS") ? std::getenv("UCX_TLS") : "(default)", client_->address().size(), key_.size());
  PeerInfo bad = peer();
  bad.address.clear();
  EXPECT_EQ(client_->can_reach(bad).code(), Code::kInvalidArgument);
  EXPECT_EQ(client_->add_segment(Segment{3, local_.data(), 16, "cuda:0"}).error().code(), Code::kInvalidArgument);
  EXPECT_EQ(client_->remove_segment(12345).code(), Code::kNotFound);
}

// Stronger than the Link contract (no byte leaves local memory after the
// end): ucx waits for, or cancels, every posted put before run() returns,
// so the peer's memory does not change at all afterwards.
TEST_F(UcxTest, CancelledWriteSendsNothingAfterReturn) {
  std::fill(local_.begin(), local_.end(), uint8_t{0x11});
  std::vector<Copy> copies;  // 4 GiB of 1 MiB writes: long enough to stop mid-way
  for (size_t i = 0; i < 4096; ++i) copies.push_back(copy((i % 16) << 20, (i % 16) << 20, 1 << 20));
  RunControl control;
  control.deadline = Clock::now() + 60s;
  Status result;
  std::thread runner([&] { result = link_->run(TransferOp::kWrite, copies, control); });
  while (control.bytes_done.load() == 0) std::this_thread::sleep_for(100us);
  control.cancel.store(true);
  runner.join();
  EXPECT_EQ(result.code(), Code::kCancelled) << result.to_string();
  std::vector<uint8_t> before = remote_;
  std::fill(local_.begin(), local_.end(), uint8_t{0xee});
  std::this_thread::sleep_for(300ms);
  EXPECT_TRUE(before == remote_) << "a byte left after run() returned";
}

TEST_F(UcxTest, RefreshUnpacksNewSegmentsAndDropsRemovedOnes) {
  std::vector<uint8_t> extra(1 << 16);
  for (size_t i = 0; i < extra.size(); ++i) extra[i] = static_cast<uint8_t>(i * 7 + 1);
  auto key = server_->add_segment(Segment{2, extra.data(), extra.size(), "host"});
  ASSERT_TRUE(key.ok()) << key.error().to_string();
  PeerInfo info = peer();
  info.segments.push_back({2, reinterpret_cast<uint64_t>(extra.data()), extra.size(), *key});
  ASSERT_TRUE(link_->refresh(info).ok());
  Copy c{local_.data(), reinterpret_cast<uint64_t>(extra.data()) + 100, 1000, 2};
  ASSERT_TRUE(run(TransferOp::kRead, {c}).ok());
  EXPECT_TRUE(std::equal(local_.begin(), local_.begin() + 1000, extra.begin() + 100));
  // Dropped: a copy naming it is refused, nothing moves.
  ASSERT_TRUE(link_->refresh(peer()).ok());
  ASSERT_TRUE(server_->remove_segment(2).ok());
  Status s = run(TransferOp::kRead, {c});
  EXPECT_EQ(s.code(), Code::kNotFound) << s.to_string();
  expect_a_read_works();
}

}  // namespace
}  // namespace kvbridge::transport
