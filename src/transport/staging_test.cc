// Staging device memory through pinned host memory (staging.h): the chunk
// packing, the pool's slots and its refusals, and tcp moving the host
// fake's device memory between two transports of this process, staged on
// both sides, byte for byte. KVB_DEVICE=fake (CMakeLists.txt).
#include "transport/staging.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <thread>
#include <vector>

#include "common/random.h"
#include "device/device.h"
#include "testing/pattern.h"
#include "transport/transport.h"

namespace kvbridge::transport {
namespace {

using namespace std::chrono_literals;
using testing::pattern;

// Every byte of every copy is in exactly one piece, in order; chunks are
// full but the last; a piece's place in its chunk follows the one before.
TEST(PackChunksTest, CutsCopiesInOrderIntoFullChunks) {
  std::mt19937_64 rng(5);
  for (int round = 0; round < 200; ++round) {
    const uint64_t chunk = 1 + rng() % 5000;
    std::vector<Copy> copies(rng() % 40);
    uint64_t total = 0, at = 0;
    for (Copy& c : copies) {
      c.local = reinterpret_cast<uint8_t*>(uintptr_t{1} << 40) + at;
      c.remote = (uint64_t{7} << 40) + at * 3;
      c.bytes = rng() % 4 == 0 ? 0 : rng() % 9000;
      c.segment = static_cast<uint32_t>(rng() % 3);
      at += c.bytes + rng() % 100;
      total += c.bytes;
    }
    const std::vector<Chunk> chunks = pack_chunks(copies, chunk);
    ASSERT_EQ(chunks.size(), (total + chunk - 1) / chunk) << "round " << round;
    size_t c = 0;
    uint64_t into = 0;  // bytes of copies[c] already seen
    for (size_t k = 0; k < chunks.size(); ++k) {
      if (k + 1 < chunks.size()) {
        EXPECT_EQ(chunks[k].bytes, chunk);
      }
      uint64_t filled = 0;
      for (const ChunkPiece& p : chunks[k].pieces) {
        while (c < copies.size() && into == copies[c].bytes) ++c, into = 0;
        ASSERT_LT(c, copies.size());
        EXPECT_EQ(p.local, copies[c].local + into);
        EXPECT_EQ(p.remote, copies[c].remote + into);
        EXPECT_EQ(p.segment, copies[c].segment);
        EXPECT_EQ(p.at, filled);
        ASSERT_GT(p.bytes, 0u);
        ASSERT_LE(into + p.bytes, copies[c].bytes);
        into += p.bytes;
        filled += p.bytes;
      }
      EXPECT_EQ(filled, chunks[k].bytes);
    }
    while (c < copies.size() && into == copies[c].bytes) ++c, into = 0;
    EXPECT_EQ(c, copies.size()) << "every byte packed";
  }
}

TEST(StagingOptionsTest, RefusesChunksOutOfRangeAndAPoolOfFewerThanTwo) {
  EXPECT_TRUE(check_staging_options({}).ok());
  Status small = check_staging_options({uint64_t{64} << 20, 4096});
  EXPECT_EQ(small.code(), Code::kInvalidArgument);
  EXPECT_NE(small.message().find("staging_chunk_bytes"), std::string::npos) << small.to_string();
  Status one = check_staging_options({uint64_t{6} << 20, uint64_t{4} << 20});
  EXPECT_EQ(one.code(), Code::kInvalidArgument);
  EXPECT_NE(one.message().find("at least three chunks"), std::string::npos) << one.to_string();
  auto t = make_tcp_transport("127.0.0.1", 1, "", {}, {uint64_t{1} << 20, uint64_t{1} << 20});
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.error().message().find("at least three chunks"), std::string::npos) << t.error().to_string();
}

// Slots are pinned (a kernel may use them: the fake refuses unpinned host
// memory), come back when their lease goes, and a pool with none free
// refuses by its deadline (naming its size) or at a cancel.
TEST(StagingPoolTest, LendsPinnedSlotsAndRefusesWhenAllAreBusy) {
  const size_t pinned_before = device::fake_pinned_count();
  {
    StagingPool pool(device::fake(), {uint64_t{2} << 20, uint64_t{1} << 20});
    EXPECT_EQ(pool.slots(), 2u);
    EXPECT_EQ(device::fake_pinned_count(), pinned_before) << "pinned at first use, not before";
    auto a = pool.acquire(Clock::now() + 1s, nullptr, "test");
    auto b = pool.acquire(Clock::now() + 1s, nullptr, "test");
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(device::fake_pinned_count(), pinned_before + 1);
    EXPECT_NE(a->data(), b->data());
    const Clock::time_point start = Clock::now();
    auto c = pool.acquire(Clock::now() + 50ms, nullptr, "test run");
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.error().code(), Code::kResourceExhausted);
    EXPECT_NE(c.error().message().find("all 2 slots of 1048576 bytes busy"), std::string::npos)
        << c.error().to_string();
    EXPECT_GE(Clock::now() - start, 50ms);
    std::atomic<bool> cancel{true};
    EXPECT_EQ(pool.acquire(Clock::now() + 1s, &cancel, "test").error().code(), Code::kCancelled);
    // A slot freed while one waits goes to it.
    std::thread freer([&] {
      std::this_thread::sleep_for(20ms);
      a->reset();
    });
    auto d = pool.acquire(Clock::now() + 5s, nullptr, "test");
    freer.join();
    EXPECT_TRUE(d.ok()) << d.error().to_string();
  }
  EXPECT_EQ(device::fake_pinned_count(), pinned_before) << "unpinned with the pool";
}

// Two tcp transports of this process, each with a device segment (device 0
// here, device 1 at the peer) and a host one: reads and writes between every
// pair of memory kinds land byte for byte, through staging on both sides
// (the chunk counter moves by both sides' chunks).
TEST(StagedTcpTest, MovesEveryPairOfMemoryKindsThroughStagingOnBothSides) {
  device::Device& dev = device::fake();
  constexpr uint64_t kBytes = uint64_t{12} << 20, kChunk = uint64_t{1} << 20;
  const StagingOptions staging{uint64_t{8} << 20, kChunk};
  auto server = make_tcp_transport("127.0.0.1", 2, "", {}, staging);
  auto client = make_tcp_transport("127.0.0.1", 2, "", {}, staging);
  ASSERT_TRUE(server.ok() && client.ok());
  ASSERT_TRUE((*server)->serves("cuda:1") && (*server)->moves(true, true));
  auto remote_dev = dev.allocate(1, kBytes);
  auto local_dev = dev.allocate(0, kBytes);
  ASSERT_TRUE(remote_dev.ok() && local_dev.ok());
  std::vector<uint8_t> remote_host(kBytes), local_host(kBytes);
  auto* rd = static_cast<uint8_t*>(*remote_dev);
  auto* ld = static_cast<uint8_t*>(*local_dev);
  ASSERT_TRUE((*server)->add_segment(Segment{1, rd, kBytes, "cuda:1", 3}).ok());
  ASSERT_TRUE((*server)->add_segment(Segment{2, remote_host.data(), kBytes, "host", 3}).ok());
  ASSERT_TRUE((*client)->add_segment(Segment{5, ld, kBytes, "cuda:0", 3}).ok());
  auto link = (*client)->connect(PeerInfo{"server", 0, "", (*server)->address(), {}});
  ASSERT_TRUE(link.ok()) << link.error().to_string();

  struct Side {
    uint8_t* p;
    uint32_t segment;
  };
  const Side remotes[] = {{rd, 1}, {remote_host.data(), 2}};
  uint8_t* const locals[] = {ld, local_host.data()};
  std::mt19937_64 rng(11);
  for (const Side& r : remotes) {
    for (uint8_t* l : locals) {
      for (TransferOp op : {TransferOp::kRead, TransferOp::kWrite}) {
        // Many small copies across chunk boundaries, at shuffled places.
        for (uint64_t i = 0; i < kBytes; ++i) (op == TransferOp::kRead ? r.p : l)[i] = pattern(i + rng() % 2);
        std::fill(op == TransferOp::kRead ? l : r.p, (op == TransferOp::kRead ? l : r.p) + kBytes, 0);
        std::vector<Copy> copies;
        for (uint64_t at = 0; at + 40000 <= kBytes; at += 40000) {
          const uint64_t to = kBytes - 40000 - at;  // reversed order on the peer
          copies.push_back(Copy{l + at, reinterpret_cast<uint64_t>(r.p) + to, 40000 - at % 3000, r.segment});
        }
        const uint64_t chunks_before = staged_chunks();
        RunControl control;
        control.deadline = Clock::now() + 20s;
        Status s = (*link)->run(op, copies, control);
        ASSERT_TRUE(s.ok()) << s.to_string();
        uint64_t total = 0, wrong = 0;
        for (const Copy& c : copies) {
          total += c.bytes;
          const uint8_t* peer = reinterpret_cast<const uint8_t*>(c.remote);
          wrong += !std::equal(c.local, c.local + c.bytes, peer);
        }
        EXPECT_EQ(wrong, 0u) << (op == TransferOp::kRead ? "read" : "write") << " into segment " << r.segment;
        EXPECT_EQ(control.bytes_done.load(), total);
        const uint64_t sides = (r.segment == 1) + (l == ld);
        EXPECT_GE(staged_chunks() - chunks_before, sides * (total / kChunk))
            << "each device side stages every chunk (segment " << r.segment << ")";
        if (sides == 0) {
          EXPECT_EQ(staged_chunks(), chunks_before) << "host to host is not staged";
        }
      }
    }
  }
  link->reset();
  EXPECT_TRUE(dev.free(ld).ok() && dev.free(rd).ok());
}

// A write grant on a device segment: a staged write outside every grant is
// refused, its bytes dropped, and nothing of it lands; inside, it lands;
// once revoked, refused again. (A run is refused frame by frame: chunks of
// a run inside a grant land before one outside is refused.)
TEST(StagedTcpTest, AWriteOutsideAGrantToADeviceSegmentLandsNothing) {
  device::Device& dev = device::fake();
  auto server = make_tcp_transport("127.0.0.1", 1, "", {}, {uint64_t{4} << 20, uint64_t{1} << 20});
  auto client = make_tcp_transport("127.0.0.1", 1, "", {}, {uint64_t{4} << 20, uint64_t{1} << 20});
  ASSERT_TRUE(server.ok() && client.ok());
  (*client)->set_local_identity("prefill/r0", 1);
  constexpr uint64_t kBytes = uint64_t{3} << 20;
  auto remote = dev.allocate(0, kBytes);
  auto local = dev.allocate(0, kBytes);
  ASSERT_TRUE(remote.ok() && local.ok());
  auto* rd = static_cast<uint8_t*>(*remote);
  auto* ld = static_cast<uint8_t*>(*local);
  std::fill(rd, rd + kBytes, 7);
  std::fill(ld, ld + kBytes, 9);
  ASSERT_TRUE((*server)->add_segment(Segment{1, rd, kBytes, "cuda:0", 1 | 2 | 4}).ok());
  ASSERT_TRUE((*client)->add_segment(Segment{1, ld, kBytes, "cuda:0", 3}).ok());
  auto link = (*client)->connect(PeerInfo{"server", 0, "", (*server)->address(), {}});
  ASSERT_TRUE(link.ok());
  const uint64_t base = reinterpret_cast<uint64_t>(rd);
  auto write = [&](uint64_t bytes) {
    RunControl control;
    control.deadline = Clock::now() + 5s;
    return (*link)->run(TransferOp::kWrite, std::vector<Copy>{{ld, base, bytes, 1}}, control);
  };
  (*server)->grant(1, engine_label("prefill/r0", 1), grant_of({{1, base, uint64_t{2} << 20}}), false);
  {
    RunControl control;
    control.deadline = Clock::now() + 5s;
    const uint64_t past = uint64_t{2} << 20;
    Status s = (*link)->run(TransferOp::kWrite, std::vector<Copy>{{ld, base + past, kBytes - past, 1}}, control);
    EXPECT_EQ(s.code(), Code::kPermissionDenied) << s.to_string();
  }
  EXPECT_EQ(std::count(rd, rd + kBytes, 7), static_cast<long>(kBytes)) << "a refused write landed";
  ASSERT_TRUE(write(uint64_t{2} << 20).ok());
  EXPECT_EQ(std::count(rd, rd + kBytes, 9), static_cast<long>(uint64_t{2} << 20));
  (*server)->revoke(1);
  std::fill(rd, rd + kBytes, 7);
  EXPECT_EQ(write(uint64_t{1} << 20).code(), Code::kPermissionDenied);
  EXPECT_EQ(std::count(rd, rd + kBytes, 7), static_cast<long>(kBytes));
  link->reset();
  EXPECT_TRUE(dev.free(ld).ok() && dev.free(rd).ok());
}

}  // namespace
}  // namespace kvbridge::transport
