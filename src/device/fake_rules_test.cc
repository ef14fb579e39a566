// The fake fails where CUDA fails (device.h): several devices per process
// named by UUID, a mapping that belongs to the device it was opened on, an
// event recorded on another device's stream, a kernel that touches memory
// its device cannot reach, host memory pinned once, an event never
// recorded. And the gather/scatter kernel's own code (gather.h), which the
// fake runs lane by lane, copies every alignment and size exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "device/device.h"
#include "device/gather.h"

namespace kvbridge::device {
namespace {

using namespace std::chrono_literals;

bool finish(Device& d, Event e) {
  const auto end = std::chrono::steady_clock::now() + 5s;
  while (std::chrono::steady_clock::now() < end) {
    Result<bool> done = d.done(e);
    if (!done.ok()) return false;
    if (*done) return true;
    std::this_thread::yield();
  }
  return false;
}

// A stream of each device and an event of each, for run().
struct Streams {
  explicit Streams(Device& d) : d(d) {
    for (int i = 0; i < 2; ++i) {
      stream[i] = *d.create_stream(i);
      event[i] = *d.create_event(i, false);
    }
  }
  ~Streams() {
    for (int i = 0; i < 2; ++i) {
      d.destroy_event(event[i]);
      d.destroy_stream(stream[i]);
    }
  }
  Device& d;
  Stream stream[2];
  Event event[2];
};

// Runs `copies` on a stream of `device` by `method` and waits.
Status run(Device& d, int device, const std::vector<DeviceCopy>& copies, CopyMethod method) {
  static Streams* streams = new Streams(d);  // the process's, like the engine's pool
  Status st = d.copy(streams->stream[device], copies, method);
  if (st.ok()) st = d.record(streams->event[device], streams->stream[device]);
  if (st.ok() && !finish(d, streams->event[device])) st = Status::timeout("the copy did not finish");
  return st;
}

TEST(FakeRulesTest, DevicesHaveUuidsAndEventsStayOnTheirDevice) {
  Device& d = fake();
  Result<std::string> u0 = d.uuid(0), u1 = d.uuid(1);
  ASSERT_TRUE(u0.ok() && u1.ok());
  EXPECT_EQ(u0->size(), 16u);
  EXPECT_NE(*u0, *u1);
  EXPECT_EQ(*ordinal_of(d, *u1), 1);
  EXPECT_EQ(*ordinal_of(d, std::string(16, 'x')), -1) << "a device this process does not see";
  EXPECT_EQ(d.uuid(2).error().code(), Code::kInvalidArgument);

  Result<Stream> s1 = d.create_stream(1);
  Result<Event> e0 = d.create_event(0, false);
  ASSERT_TRUE(s1.ok() && e0.ok());
  Status st = d.record(*e0, *s1);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("an event of device 0 cannot be recorded on a stream of device 1"), std::string::npos)
      << st.to_string();
  Result<bool> never = d.done(*e0);
  ASSERT_FALSE(never.ok());
  EXPECT_NE(never.error().message().find("never recorded"), std::string::npos) << never.error().to_string();
  d.destroy_event(*e0);
  d.destroy_stream(*s1);
}

// A kernel on device 0 reaches device 1's memory only after peer access;
// a mapping only from the device it was opened on (opened on each device
// apart, once per device); host memory only pinned. The copy engines move
// all of it.
TEST(FakeRulesTest, AKernelTouchesOnlyWhatItsDeviceReaches) {
  Device& d = fake();
  const uint64_t n = 8192;
  Result<void*> a = d.allocate(0, n), b = d.allocate(1, n);
  ASSERT_TRUE(a.ok() && b.ok());
  std::memset(*a, 0, n);
  std::memset(*b, 0x42, n);
  const std::vector<DeviceCopy> cross{{*a, *b, n}};
  Status st = run(d, 0, cross, CopyMethod::kKernel);
  EXPECT_EQ(st.code(), Code::kUnavailable) << st.to_string();
  EXPECT_NE(st.message().find("is memory of device 1, to which this one has no peer access"), std::string::npos)
      << st.to_string();
  EXPECT_NE(st.message().find("cudaErrorIllegalAddress"), std::string::npos) << st.to_string();
  EXPECT_NE(st.message().find("restart the process"), std::string::npos) << "CUDA's illegal address is sticky";
  EXPECT_EQ(static_cast<uint8_t*>(*a)[0], 0) << "nothing copied";
  EXPECT_TRUE(run(d, 0, cross, CopyMethod::kCopyEngine).ok()) << "the copy engines reach any device";
  EXPECT_EQ(static_cast<uint8_t*>(*a)[n - 1], 0x42);
  std::memset(*a, 0, n);
  ASSERT_TRUE(d.enable_peer_access(0, 1).ok());
  EXPECT_TRUE(run(d, 0, cross, CopyMethod::kKernel).ok()) << "with peer access the kernel reaches it";
  EXPECT_EQ(static_cast<uint8_t*>(*a)[n - 1], 0x42);

  // A mapping belongs to the device it was opened on.
  Result<std::string> h = d.export_memory(*b);
  ASSERT_TRUE(h.ok());
  Result<void*> on1 = d.open_memory(*h, 1);
  ASSERT_TRUE(on1.ok()) << on1.error().to_string();
  EXPECT_EQ(d.pointer_info(*on1)->device, 1) << "a mapping is of the device it was opened on";
  EXPECT_EQ(d.open_memory(*h, 1).error().code(), Code::kAlreadyExists);
  st = run(d, 0, {{*a, *on1, n}}, CopyMethod::kKernel);
  EXPECT_NE(st.message().find("is a mapping opened on device 1, not on this one"), std::string::npos) << st.to_string();
  Result<void*> on0 = d.open_memory(*h, 0);
  ASSERT_TRUE(on0.ok()) << "the same handle opens on another device too";
  std::memset(*a, 0, n);
  EXPECT_TRUE(run(d, 0, {{*a, *on0, n}}, CopyMethod::kKernel).ok());
  EXPECT_EQ(static_cast<uint8_t*>(*a)[7], 0x42);
  EXPECT_TRUE(d.close_memory(*on0).ok());
  EXPECT_TRUE(d.close_memory(*on1).ok());

  // Host memory: pinned, once.
  std::vector<uint8_t> host(n, 0);
  st = run(d, 0, {{host.data(), *a, n}}, CopyMethod::kKernel);
  EXPECT_NE(st.message().find("is host memory that is not pinned"), std::string::npos) << st.to_string();
  EXPECT_TRUE(run(d, 0, {{host.data(), *a, n}}, CopyMethod::kCopyEngine).ok());
  const size_t pinned = fake_pinned_count();
  ASSERT_TRUE(d.register_host(host.data(), n).ok());
  EXPECT_EQ(fake_pinned_count(), pinned + 1);
  EXPECT_EQ(d.register_host(host.data() + 100, 10).code(), Code::kAlreadyExists) << "overlaps a pinned range";
  std::memset(host.data(), 0, n);
  EXPECT_TRUE(run(d, 0, {{host.data(), *a, n}}, CopyMethod::kKernel).ok());
  EXPECT_EQ(host[n - 1], 0x42);
  EXPECT_TRUE(d.unregister_host(host.data()).ok());
  EXPECT_EQ(d.unregister_host(host.data()).code(), Code::kInvalidArgument) << "unpinned already";
  EXPECT_EQ(fake_pinned_count(), pinned);

  // Past the end of an allocation.
  st = run(d, 0, {{*a, static_cast<uint8_t*>(*b) + 16, n}}, CopyMethod::kKernel);
  EXPECT_NE(st.message().find("runs past the end of its allocation"), std::string::npos) << st.to_string();
  EXPECT_TRUE(d.free(*a).ok());
  EXPECT_TRUE(d.free(*b).ok());
}

// The kernel's cut and per-lane copy (gather.h), as the fake runs them: for
// every offset of source and destination modulo 16 and sizes from none to
// several pieces, every byte lands and no byte around it changes.
TEST(FakeRulesTest, TheKernelsCodeCopiesEveryAlignmentAndSizeExactly) {
  Device& d = fake();
  const uint64_t area = 3 * gather::kPieceBytes + 4096;
  Result<void*> src = d.allocate(0, area), dst = d.allocate(0, area);
  ASSERT_TRUE(src.ok() && dst.ok());
  auto* s = static_cast<uint8_t*>(*src);
  auto* t = static_cast<uint8_t*>(*dst);
  for (uint64_t i = 0; i < area; ++i) s[i] = static_cast<uint8_t>(i * 131 + (i >> 9));
  std::mt19937_64 rng(7);
  const uint64_t sizes[] = {0,
                            1,
                            15,
                            16,
                            17,
                            31,
                            100,
                            511,
                            512,
                            4096 + 3,
                            gather::kPieceBytes - 1,
                            gather::kPieceBytes,
                            gather::kPieceBytes + 17,
                            2 * gather::kPieceBytes + 1000};
  for (uint64_t bytes : sizes) {
    for (uint64_t so = 0; so < 16; ++so) {
      for (uint64_t dofs = 0; dofs < 16; dofs += (bytes > 4096 ? 5 : 1)) {
        const uint64_t at = 64 + dofs, from = 64 + so + (rng() % 8) * 16;
        std::memset(t + at - 64, 0xee, bytes + 128);
        ASSERT_TRUE(run(d, 0, {{t + at, s + from, bytes}}, CopyMethod::kKernel).ok());
        ASSERT_EQ(std::memcmp(t + at, s + from, bytes), 0) << bytes << " bytes, offsets " << so << "/" << dofs;
        for (uint64_t i = at - 64; i < at; ++i) ASSERT_EQ(t[i], 0xee) << "before, at " << i;
        for (uint64_t i = at + bytes; i < at + bytes + 64; ++i) ASSERT_EQ(t[i], 0xee) << "after, at " << i;
      }
    }
  }
  // Many small copies in one batch, shuffled, as a P/D load makes them.
  std::vector<DeviceCopy> batch;
  std::vector<uint64_t> order(512);
  for (uint64_t i = 0; i < order.size(); ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  for (uint64_t i = 0; i < order.size(); ++i) batch.push_back({t + order[i] * 384, s + i * 384 + 3, 384});
  std::memset(t, 0, area);
  ASSERT_TRUE(run(d, 0, batch, CopyMethod::kKernel).ok());
  for (uint64_t i = 0; i < order.size(); ++i) ASSERT_EQ(std::memcmp(t + order[i] * 384, s + i * 384 + 3, 384), 0) << i;
  EXPECT_TRUE(d.free(*src).ok());
  EXPECT_TRUE(d.free(*dst).ok());
}

TEST(GatherTest, CutsCopiesIntoPiecesAndPicksTheWidestSharedWord) {
  std::vector<gather::Piece> pieces;
  gather::cut(1000, 5000, 2 * gather::kPieceBytes + 1, &pieces);
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[2].bytes, 1u);
  EXPECT_EQ(pieces[2].dst, 1000 + 2 * gather::kPieceBytes);
  EXPECT_EQ(pieces[2].src, 5000 + 2 * gather::kPieceBytes);
  EXPECT_EQ(gather::pieces_of(0), 0u);
  EXPECT_EQ(gather::pieces_of(gather::kPieceBytes), 1u);
  EXPECT_EQ(gather::word_bytes(32, 64), 16u);
  EXPECT_EQ(gather::word_bytes(3, 19), 16u) << "the same offset modulo 16";
  EXPECT_EQ(gather::word_bytes(8, 16), 8u);
  EXPECT_EQ(gather::word_bytes(4, 8), 4u);
  EXPECT_EQ(gather::word_bytes(2, 4), 2u);
  EXPECT_EQ(gather::word_bytes(1, 2), 1u);
}

}  // namespace
}  // namespace kvbridge::device
