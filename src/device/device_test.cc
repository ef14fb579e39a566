// The device seam: the host fake's rules that the layers above rely on
// (what a pointer is, handles that open once and die with their
// allocation, stream order, events across streams and by handle), and the
// real device's answer on a machine without one.
#include "device/device.h"

#include "device/cuda_errors.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

namespace kvbridge::device {
namespace {

using namespace std::chrono_literals;

// Waits for `event` with a deadline; false when it did not complete.
bool await(Device& d, Event event, std::chrono::milliseconds within = 5000ms) {
  const auto end = std::chrono::steady_clock::now() + within;
  while (std::chrono::steady_clock::now() < end) {
    Result<bool> done = d.done(event);
    if (!done.ok() || *done) return done.ok();
    std::this_thread::sleep_for(1ms);
  }
  return false;
}

// What a CUDA error means (cuda_errors.h), by number as the runtime gives
// it: a sticky error says the process's context is unusable and it must
// restart; an invalid handle is "gone" only when opening another process's
// memory or event, and a caller's mistake (another device's stream, a
// destroyed event) otherwise.
TEST(CudaErrorsTest, StickyErrorsSayToRestartAndAnInvalidHandleSaysWhatItMeans) {
  Status s =
      cuda_status(700, "cudaErrorIllegalAddress", "an illegal memory access was encountered", "the gather kernel");
  EXPECT_EQ(s.code(), Code::kUnavailable);
  EXPECT_EQ(s.message(),
            "CUDA: the gather kernel: cudaErrorIllegalAddress: an illegal memory access was encountered (a sticky "
            "error: this process's CUDA context is unusable, every later CUDA call fails the same way; restart the "
            "process)");
  for (int sticky : {700, 702, 710, 714, 715, 716, 717, 718, 719, 721, 810}) EXPECT_TRUE(cuda_sticky(sticky)) << sticky;
  for (int not_sticky : {1, 2, 100, 400, 701, 999}) EXPECT_FALSE(cuda_sticky(not_sticky)) << not_sticky;
  s = cuda_status(400, "cudaErrorInvalidResourceHandle", "invalid resource handle", "cudaEventRecord");
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("of another device, or one already destroyed"), std::string::npos) << s.to_string();
  s = cuda_status(400, "cudaErrorInvalidResourceHandle", "invalid resource handle", "cudaIpcOpenMemHandle", true);
  EXPECT_EQ(s.code(), Code::kNotFound);
  EXPECT_NE(s.message().find("its exporter freed it, or exited"), std::string::npos) << s.to_string();
  EXPECT_EQ(cuda_status(2, "cudaErrorMemoryAllocation", "out of memory", "cudaMalloc").code(),
            Code::kResourceExhausted);
  EXPECT_EQ(cuda_status(100, "cudaErrorNoDevice", "no CUDA-capable device", "cudaGetDeviceCount").code(),
            Code::kUnavailable);
  EXPECT_EQ(cuda_status(101, "cudaErrorInvalidDevice", "invalid device ordinal", "cudaSetDevice").code(),
            Code::kInvalidArgument);
  EXPECT_EQ(cuda_status(999, "cudaErrorUnknown", "unknown error", "x").code(), Code::kIoError);
}

// The content check's hash on the device: what the kernel computes (the
// fake runs the kernel's leaf code on the host) equals libxxhash's tree of
// the same bytes, for ranges of no byte, less than a leaf, and several
// leaves at odd offsets; a range that is not device memory of the device,
// or runs past its allocation, is refused naming it, as CUDA would fault.
TEST(FakeDeviceTest, HashesDeviceMemoryAsTheHostHashesTheSameBytes) {
  Device& d = fake();
  const uint64_t bytes = 3 * (uint64_t{1} << 16) + 4099;
  Result<void*> p = d.allocate(1, bytes);
  ASSERT_TRUE(p.ok()) << p.error().to_string();
  auto* mem = static_cast<uint8_t*>(*p);
  for (uint64_t i = 0; i < bytes; ++i) mem[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
  auto tree = [](const uint8_t* data, uint64_t n) {
    std::vector<uint64_t> leaves;
    for (uint64_t at = 0; at < n; at += uint64_t{1} << 16) {
      leaves.push_back(XXH3_64bits(data + at, std::min<uint64_t>(uint64_t{1} << 16, n - at)));
    }
    return XXH3_64bits(leaves.data(), leaves.size() * sizeof(uint64_t));
  };
  const std::vector<DeviceRange> ranges{{mem, 0}, {mem + 1, 100}, {mem + 3, bytes - 3}, {mem, bytes}};
  std::vector<uint64_t> hashes;
  ASSERT_TRUE(d.content_hashes(1, ranges, &hashes).ok());
  ASSERT_EQ(hashes.size(), ranges.size());
  for (size_t i = 0; i < ranges.size(); ++i) {
    EXPECT_EQ(hashes[i], tree(static_cast<const uint8_t*>(ranges[i].p), ranges[i].bytes)) << "range " << i;
  }
  const uint64_t before = hashes[3];
  mem[bytes - 1] ^= 1;
  ASSERT_TRUE(d.content_hashes(1, std::vector<DeviceRange>{{mem, bytes}}, &hashes).ok());
  EXPECT_NE(hashes[0], before) << "a changed byte changes the hash";
  EXPECT_EQ(hashes[0], tree(mem, bytes));
  std::vector<uint8_t> host(64);
  Status s = d.content_hashes(1, std::vector<DeviceRange>{{mem, 8}, {host.data(), 8}}, &hashes);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("range 1 (8 bytes at 0x"), std::string::npos) << s.to_string();
  EXPECT_EQ(d.content_hashes(0, std::vector<DeviceRange>{{mem, 8}}, &hashes).code(), Code::kInvalidArgument)
      << "memory of device 1 hashed on device 0";
  EXPECT_EQ(d.content_hashes(1, std::vector<DeviceRange>{{mem + 8, bytes}}, &hashes).code(), Code::kInvalidArgument)
      << "past the allocation";
  EXPECT_TRUE(d.free(*p).ok());
}

TEST(FakeDeviceTest, TellsDeviceMemoryFromHostAndManagedMemory) {
  Device& d = fake();
  Result<void*> p = d.allocate(1, 1 << 20);
  ASSERT_TRUE(p.ok()) << p.error().to_string();
  Result<PointerInfo> inside = d.pointer_info(static_cast<uint8_t*>(*p) + 4096);
  ASSERT_TRUE(inside.ok());
  EXPECT_EQ(inside->type, MemoryType::kDevice);
  EXPECT_EQ(inside->device, 1);
  EXPECT_EQ(inside->base, reinterpret_cast<uint64_t>(*p));
  EXPECT_EQ(inside->bytes, uint64_t{1} << 20);
  EXPECT_TRUE(inside->exportable);
  std::vector<uint8_t> host(64);
  Result<PointerInfo> h = d.pointer_info(host.data());
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->type, MemoryType::kHost);
  Result<PointerInfo> past = d.pointer_info(static_cast<uint8_t*>(*p) + (1 << 20));
  ASSERT_TRUE(past.ok());
  EXPECT_NE(past->type == MemoryType::kDevice && past->base == inside->base, true) << "one past the end is not in it";

  Result<void*> m = d.allocate(0, 4096, true);
  ASSERT_TRUE(m.ok());
  Result<PointerInfo> managed = d.pointer_info(*m);
  ASSERT_TRUE(managed.ok());
  EXPECT_EQ(managed->type, MemoryType::kManaged);
  EXPECT_FALSE(managed->exportable);
  EXPECT_EQ(d.export_memory(*m).error().code(), Code::kUnavailable);
  EXPECT_EQ(d.allocate(7, 4096).error().code(), Code::kInvalidArgument) << "no device 7";
  EXPECT_TRUE(d.free(*p).ok());
  EXPECT_TRUE(d.free(*m).ok());
  EXPECT_EQ(d.free(host.data()).code(), Code::kInvalidArgument);
}

TEST(FakeDeviceTest, AHandleOpensOnceAndNotAfterItsAllocationWasFreed) {
  Device& d = fake();
  Result<void*> p = d.allocate(0, 8192);
  ASSERT_TRUE(p.ok());
  std::memset(*p, 0x5a, 8192);
  Result<std::string> h = d.export_memory(*p);
  ASSERT_TRUE(h.ok()) << h.error().to_string();
  EXPECT_EQ(d.export_memory(static_cast<uint8_t*>(*p) + 1).error().code(), Code::kInvalidArgument)
      << "only an allocation's first byte exports";
  Result<void*> opened = d.open_memory(*h, 0);
  ASSERT_TRUE(opened.ok()) << opened.error().to_string();
  EXPECT_NE(*opened, *p);
  EXPECT_EQ(static_cast<uint8_t*>(*opened)[100], 0x5a);
  static_cast<uint8_t*>(*opened)[200] = 0x11;
  EXPECT_EQ(static_cast<uint8_t*>(*p)[200], 0x11) << "both mappings are the same memory";
  Result<PointerInfo> info = d.pointer_info(*opened);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->type, MemoryType::kDevice) << "an opened allocation is device memory too";
  EXPECT_EQ(d.open_memory(*h, 0).error().code(), Code::kAlreadyExists) << "a handle opens once per device";
  EXPECT_TRUE(d.close_memory(*opened).ok());
  Result<void*> again = d.open_memory(*h, 0);
  ASSERT_TRUE(again.ok()) << "closed, it opens again";
  EXPECT_TRUE(d.close_memory(*again).ok());
  EXPECT_TRUE(d.free(*p).ok());
  Result<void*> gone = d.open_memory(*h, 0);
  EXPECT_EQ(gone.error().code(), Code::kNotFound) << "a freed allocation's handle does not open";

  // A later allocation may reuse the descriptor number: the old handle
  // still does not open it.
  Result<void*> q = d.allocate(0, 8192);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(d.open_memory(*h, 0).error().code(), Code::kNotFound);
  EXPECT_EQ(d.open_memory("garbage", 0).error().code(), Code::kInvalidArgument);
  EXPECT_TRUE(d.free(*q).ok());
}

TEST(FakeDeviceTest, ACopyLandsInStreamOrderAfterASlowProducer) {
  Device& d = fake();
  Result<void*> src = d.allocate(0, 4096);
  Result<void*> dst = d.allocate(0, 4096);
  ASSERT_TRUE(src.ok() && dst.ok());
  std::memset(*src, 1, 4096);
  std::memset(*dst, 0, 4096);
  Result<Stream> s = d.create_stream(0);
  Result<Event> e = d.create_event(0, false);
  ASSERT_TRUE(s.ok() && e.ok());
  ASSERT_TRUE(d.fill_after(*s, *src, 4096, 7, 150ms).ok());
  const DeviceCopy c{*dst, *src, 4096};
  ASSERT_TRUE(d.copy(*s, {&c, 1}, CopyMethod::kCopyEngine).ok());
  ASSERT_TRUE(d.record(*e, *s).ok());
  EXPECT_FALSE(*d.done(*e)) << "the producer is still sleeping";
  EXPECT_EQ(static_cast<uint8_t*>(*dst)[0], 0) << "nothing landed before the stream reached the copy";
  ASSERT_TRUE(await(d, *e));
  EXPECT_EQ(static_cast<uint8_t*>(*dst)[4095], 7) << "the copy ran after the fill";
  d.destroy_event(*e);
  d.destroy_stream(*s);
  EXPECT_TRUE(d.free(*src).ok());
  EXPECT_TRUE(d.free(*dst).ok());
}

TEST(FakeDeviceTest, AStreamWaitsForAnotherStreamsEventOpenedByItsHandle) {
  Device& d = fake();
  Result<void*> src = d.allocate(0, 4096);
  Result<void*> dst = d.allocate(1, 4096);
  ASSERT_TRUE(src.ok() && dst.ok());
  std::memset(*src, 0, 4096);
  std::memset(*dst, 0, 4096);
  Result<Stream> producer = d.create_stream(0);
  Result<Stream> consumer = d.create_stream(1);
  Result<Event> ready = d.create_event(0, true);
  Result<Event> copied = d.create_event(1, false);
  ASSERT_TRUE(producer.ok() && consumer.ok() && ready.ok() && copied.ok());
  Result<bool> never = d.done(*ready);
  ASSERT_FALSE(never.ok()) << "an event never recorded is refused, not called done";
  EXPECT_NE(never.error().message().find("never recorded"), std::string::npos) << never.error().to_string();
  ASSERT_TRUE(d.fill_after(*producer, *src, 4096, 9, 150ms).ok());
  ASSERT_TRUE(d.record(*ready, *producer).ok());
  Result<std::string> handle = d.export_event(*ready);
  ASSERT_TRUE(handle.ok());
  Result<Event> opened = d.open_event(*handle);
  ASSERT_TRUE(opened.ok()) << opened.error().to_string();
  EXPECT_FALSE(*d.done(*opened)) << "the opened event sees the record";
  ASSERT_TRUE(d.wait_event(*consumer, *opened).ok());
  const DeviceCopy c{*dst, *src, 4096};
  ASSERT_TRUE(d.enable_peer_access(1, 0).ok()) << "the kernel on device 1 reads device 0's memory";
  ASSERT_TRUE(d.copy(*consumer, {&c, 1}, CopyMethod::kKernel).ok());
  ASSERT_TRUE(d.record(*copied, *consumer).ok());
  ASSERT_TRUE(await(d, *copied));
  EXPECT_EQ(static_cast<uint8_t*>(*dst)[0], 9) << "the copy waited for the producer's event";
  EXPECT_TRUE(*d.done(*opened));
  d.destroy_event(*opened);
  d.destroy_event(*ready);
  d.destroy_event(*copied);
  d.destroy_stream(*producer);
  d.destroy_stream(*consumer);
  EXPECT_TRUE(d.free(*src).ok());
  EXPECT_TRUE(d.free(*dst).ok());
}

TEST(DeviceTest, ParsesMemoryKindsAndCopyMethodsNamingWhatIsWrong) {
  EXPECT_EQ(*parse_cuda_memory("cuda:0"), 0);
  EXPECT_EQ(*parse_cuda_memory("cuda:12"), 12);
  EXPECT_EQ(*parse_cuda_memory("cuda:99999"), 99999);
  for (const char* bad : {"cuda:", "cuda:x", "cuda:-1", "host", "cuda:999999", "cuda"}) {
    Result<int> r = parse_cuda_memory(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.error().message().find(bad), std::string::npos) << r.error().to_string();
  }
  EXPECT_EQ(*parse_copy_method("kernel"), CopyMethod::kKernel);
  EXPECT_EQ(*parse_copy_method("copy_engine"), CopyMethod::kCopyEngine);
  EXPECT_NE(parse_copy_method("dma").error().message().find("'dma'"), std::string::npos);
}

// The real device, whatever this machine has: a count, or kUnavailable
// saying why (a build without CUDA, no driver, no GPU), never a crash.
TEST(DeviceTest, TheRealDeviceAnswersWithACountOrWhyNot) {
  Result<int> n = cuda_compiled() ? current().count() : Result<int>(Status::unavailable("not built"));
  if (n.ok()) {
    EXPECT_GT(*n, 0);
  } else {
    EXPECT_EQ(n.error().code(), Code::kUnavailable);
    EXPECT_FALSE(n.error().message().empty());
    std::printf("the real device: %s\n", n.error().to_string().c_str());
  }
}

}  // namespace
}  // namespace kvbridge::device
