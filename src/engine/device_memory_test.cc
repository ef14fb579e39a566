// Device memory in the engine, on the host fake (KVB_DEVICE=fake, set for
// engine_test by CMakeLists.txt): what registers as cuda:N and what is
// refused with which reason, host<->device and device<->device transfers
// in one process (the local transport's batched device path), the
// producer's ready events (no stale byte is read; a cancel while waiting
// for a producer that never finishes lands nothing), and the transports a
// peer gets for each pair of memory kinds. Transfers across processes
// (cuda_ipc) are in tests/conformance (instantiate_device.cc).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "device/device.h"
#include "kvbridge/engine.h"

namespace kvbridge {
namespace {

using namespace std::chrono_literals;

device::Device& fake() { return device::current(); }

// Fake device memory of `bytes` on `device`, filled with `value`, freed at
// the end of the test.
struct DeviceBuffer {
  DeviceBuffer(int device, uint64_t bytes, uint8_t value = 0) : bytes(bytes) {
    Result<void*> p = fake().allocate(device, bytes);
    EXPECT_TRUE(p.ok()) << p.error().to_string();
    data = p.ok() ? static_cast<uint8_t*>(*p) : nullptr;
    if (data != nullptr) std::memset(data, value, bytes);
  }
  ~DeviceBuffer() {
    if (data != nullptr) {
      EXPECT_TRUE(fake().free(data).ok());
    }
  }
  uint8_t* data;
  uint64_t bytes;
};

std::unique_ptr<Engine> make(const std::string& name, const std::string& device_copy = "copy_engine") {
  EngineOptions o;
  o.name = name;
  o.transports = {"local"};
  o.device_copy = device_copy;
  Result<std::unique_ptr<Engine>> e = Engine::create(o);
  EXPECT_TRUE(e.ok()) << e.error().to_string();
  return e.ok() ? std::move(*e) : nullptr;
}

size_t count_of(const uint8_t* p, size_t n, uint8_t value) { return std::count(p, p + n, value); }

class DeviceMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (fake().name() != "fake") GTEST_FAIL() << "engine_test runs with KVB_DEVICE=fake (CMakeLists.txt)";
  }
};

TEST_F(DeviceMemoryTest, RegistersOnlyWhatIsDeviceMemoryOfTheNamedDevice) {
  auto e = make("e");
  DeviceBuffer d0(0, 1 << 16), d1(1, 1 << 16);
  Result<RegionId> ok = e->register_memory(d0.data + 4096, 8192, "cuda:0");
  ASSERT_TRUE(ok.ok()) << ok.error().to_string();
  EXPECT_TRUE(e->register_memory(d1.data, d1.bytes, "cuda:1").ok());

  auto refused = [&](void* p, uint64_t n, const char* memory, Code code, const std::string& says) {
    Result<RegionId> r = e->register_memory(p, n, memory);
    ASSERT_FALSE(r.ok()) << memory << " was accepted";
    EXPECT_EQ(r.error().code(), code) << r.error().to_string();
    EXPECT_NE(r.error().message().find(says), std::string::npos) << r.error().to_string();
  };
  std::vector<uint8_t> host(4096);
  refused(host.data(), host.size(), "cuda:0", Code::kInvalidArgument, "host memory, not cuda:0");
  refused(d0.data, d0.bytes, "cuda:1", Code::kInvalidArgument, "memory of cuda:0, not cuda:1");
  refused(d0.data, d0.bytes, "cuda:5", Code::kInvalidArgument, "no such device");
  refused(d0.data, d0.bytes, "cuda:x", Code::kInvalidArgument, "'cuda:x'");
  // A range that runs past its allocation into memory that is not device
  // memory names the first byte that is not.
  refused(d0.data, d0.bytes + 4096, "cuda:0", Code::kInvalidArgument, "byte 65536");
  Result<void*> managed = fake().allocate(0, 4096, true);
  ASSERT_TRUE(managed.ok());
  refused(*managed, 4096, "cuda:0", Code::kInvalidArgument, "managed (unified) memory");
  EXPECT_TRUE(fake().free(*managed).ok());
  // A device range overlapping a registration of another kind, and device
  // memory registered as host memory.
  refused(d0.data + 4096, 4096, "host", Code::kInvalidArgument, "cuda:0");
  refused(d1.data + 100, 4096, "host", Code::kInvalidArgument, "is device memory of cuda:1");
}

// By each copy method: the kernel (for device memory on both sides) on
// device 0 reads device 1's memory once the local transport enabled peer
// access (the fake refuses it otherwise, as CUDA faults), and host memory
// goes through the copy engines.
class DeviceCopyMethodTest : public DeviceMemoryTest, public ::testing::WithParamInterface<const char*> {};

TEST_P(DeviceCopyMethodTest, HostAndDeviceMemoryMoveBothWaysInOneProcess) {
  const bool kernel = std::string(GetParam()) == "kernel";
  const size_t kernels_before = device::fake_kernel_copies();
  auto a = make("a", GetParam());
  auto b = make("b", GetParam());
  DeviceBuffer da(0, 1 << 20, 0), db(1, 1 << 20, 0);
  std::vector<uint8_t> host(1 << 20);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<uint8_t>(i * 7 + 3);
  const RegionId rh = *a->register_memory(host.data(), host.size(), "host");
  const RegionId ra = *a->register_memory(da.data, da.bytes, "cuda:0");
  const RegionId rb = *b->register_memory(db.data, db.bytes, "cuda:1");
  const PeerId peer = *a->connect(b->metadata());
  // Host here -> device there (a write), then device there -> device here
  // (a read), in many small items: every byte where it belongs.
  std::vector<TransferItem> items;
  for (uint64_t i = 0; i < 256; ++i) items.push_back({rh, i * 4096, rb, (255 - i) * 4096, 4096});
  Result<TransferId> w = a->submit(peer, TransferOp::kWrite, items);
  ASSERT_TRUE(w.ok()) << w.error().to_string();
  TransferStatus st = a->wait(*w, 10s);
  ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
  for (uint64_t i = 0; i < 256; ++i) {
    ASSERT_EQ(std::memcmp(db.data + (255 - i) * 4096, host.data() + i * 4096, 4096), 0) << "block " << i;
  }
  const TransferItem all{ra, 0, rb, 0, db.bytes};
  Result<TransferId> r = a->submit(peer, TransferOp::kRead, {&all, 1});
  ASSERT_TRUE(r.ok()) << r.error().to_string();
  st = a->wait(*r, 10s);
  ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
  EXPECT_EQ(std::memcmp(da.data, db.data, da.bytes), 0);
  EXPECT_EQ(st.bytes_done, da.bytes);
  EXPECT_EQ(device::fake_kernel_copies() - kernels_before, kernel ? 1u : 0u)
      << "the device-to-device read, and only it, by the kernel when asked";
}

// A batch given as runs over device memory: the moved runs (layers 1..3
// of each side's allocation) are expanded into one batch on the device,
// every byte where its items would put it.
TEST_P(DeviceCopyMethodTest, MovedRunsOfDeviceMemoryLandWhereTheirItemsWould) {
  auto a = make("a", GetParam());
  auto b = make("b", GetParam());
  constexpr uint64_t kLayer = 256 << 10, kBlocks = 64, kBlock = kLayer / kBlocks;
  DeviceBuffer da(0, 4 * kLayer, 0), db(1, 4 * kLayer, 0);
  std::vector<uint8_t> pattern(db.bytes);
  for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<uint8_t>(i * 13 + i / 4096);
  std::memcpy(db.data, pattern.data(), pattern.size());
  std::vector<RegionId> ra, rb;
  for (uint64_t l = 0; l < 4; ++l) {
    ra.push_back(*a->register_memory(da.data + l * kLayer, kLayer, "cuda:0"));
    rb.push_back(*b->register_memory(db.data + l * kLayer, kLayer, "cuda:1"));
  }
  const PeerId peer = *a->connect(b->metadata());
  std::vector<TransferItem> items;
  for (uint64_t i = 0; i < kBlocks; ++i)
    items.push_back({ra[0], i * kBlock, rb[0], (kBlocks - 1 - i) * kBlock, kBlock});
  std::vector<ItemRun> runs = {{0, kBlocks}};
  for (uint64_t l = 1; l < 4; ++l) runs.push_back({0, kBlocks, true, ra[l], 0, rb[l], 0});
  Result<TransferId> r = a->submit(peer, TransferOp::kRead, items, runs, SubmitOptions{});
  ASSERT_TRUE(r.ok()) << r.error().to_string();
  const TransferStatus st = a->wait(*r, 10s);
  ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
  EXPECT_EQ(st.bytes_done, da.bytes);
  for (uint64_t l = 0; l < 4; ++l) {
    for (uint64_t i = 0; i < kBlocks; ++i) {
      ASSERT_EQ(std::memcmp(da.data + l * kLayer + i * kBlock, pattern.data() + l * kLayer + (kBlocks - 1 - i) * kBlock,
                            kBlock),
                0)
          << "layer " << l << " block " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(CopyMethods, DeviceCopyMethodTest, ::testing::Values("copy_engine", "kernel"));

// "auto" gives a transfer of many small copies to the kernel and one of a
// few large ones to the copy engines, at the crossover configured.
TEST_F(DeviceMemoryTest, AutoChoosesTheKernelForManySmallCopiesAndTheCopyEnginesOtherwise) {
  EngineOptions o;
  o.transports = {"local"};
  o.device_copy = "auto";
  o.device_copy_kernel_below = 4096;
  o.device_copy_kernel_min = 16;
  o.name = "a";
  auto a = Engine::create(o);
  o.name = "b";
  auto b = Engine::create(o);
  ASSERT_TRUE(a.ok() && b.ok());
  DeviceBuffer da(0, 1 << 20, 0), db(1, 1 << 20, 0x6b);
  const RegionId ra = *(*a)->register_memory(da.data, da.bytes, "cuda:0");
  const RegionId rb = *(*b)->register_memory(db.data, db.bytes, "cuda:1");
  const PeerId peer = *(*a)->connect((*b)->metadata());
  auto read = [&](const std::vector<TransferItem>& items) {
    Result<TransferId> t = (*a)->submit(peer, TransferOp::kRead, items);
    ASSERT_TRUE(t.ok()) << t.error().to_string();
    ASSERT_EQ((*a)->wait(*t, 10s).state, TransferState::kDone);
  };
  size_t before = device::fake_kernel_copies();
  std::vector<TransferItem> small;
  for (uint64_t i = 0; i < 64; ++i) small.push_back({ra, i * 8192, rb, (63 - i) * 8192, 2048});
  read(small);
  EXPECT_EQ(device::fake_kernel_copies() - before, 1u) << "64 copies of 2 KiB: the kernel";
  EXPECT_EQ(count_of(da.data, 2048, 0x6b), 2048u);
  before = device::fake_kernel_copies();
  read({{ra, 0, rb, 0, da.bytes}});
  EXPECT_EQ(device::fake_kernel_copies(), before) << "one copy of 1 MiB: the copy engines";
  std::vector<TransferItem> few(small.begin(), small.begin() + 8);
  read(few);
  EXPECT_EQ(device::fake_kernel_copies(), before) << "8 small copies, fewer than the minimum: the copy engines";
  EXPECT_EQ(count_of(da.data, da.bytes, 0x6b), da.bytes);
}

// Engine a reads device memory `src` (device `from`, registered by engine
// b) into `dst` (device 0), and a producer writes `src` on its own stream,
// recording `ready` after it.
struct Producer {
  Producer(int from, uint64_t bytes) : src(from, bytes, 0x11), dst(0, bytes, 0) {
    rs = *b->register_memory(src.data, src.bytes, "cuda:" + std::to_string(from));
    rd = *a->register_memory(dst.data, dst.bytes, "cuda:0");
    peer = *a->connect(b->metadata());
    stream = *fake().create_stream(from);
    ready = *fake().create_event(from, true);
  }
  ~Producer() {
    fake().destroy_event(ready);
    fake().destroy_stream(stream);
  }
  // The producer sets `src` to `value` after `delay`, then records `ready`.
  void write_later(uint8_t value, std::chrono::milliseconds delay) {
    ASSERT_TRUE(fake().fill_after(stream, src.data, src.bytes, value, delay).ok());
    ASSERT_TRUE(fake().record(ready, stream).ok());
  }
  Result<TransferId> read_all(SubmitOptions o) {
    const TransferItem all{rd, 0, rs, 0, src.bytes};
    return a->submit(peer, TransferOp::kRead, {&all, 1}, std::move(o));
  }
  DeviceBuffer src, dst;  // before the engines: outlive them
  std::unique_ptr<Engine> a = make("a"), b = make("b");
  RegionId rs = 0, rd = 0;
  PeerId peer = 0;
  device::Stream stream = nullptr;
  device::Event ready = nullptr;
};

// The producer fills the KV slowly on its stream and records an event; the
// transfer is submitted at once with that event: every byte that arrives is
// the filled one, never the stale one.
TEST_F(DeviceMemoryTest, ATransferReadsNothingBeforeTheProducersEvent) {
  Producer p(1, 1 << 20);
  for (bool by_handle : {false, true}) {
    const uint8_t value = by_handle ? 0x33 : 0x22;
    p.write_later(value, 200ms);
    SubmitOptions o;
    if (by_handle) {
      o.ready_event_handles.push_back(*fake().export_event(p.ready));
    } else {
      o.ready_event = reinterpret_cast<uintptr_t>(p.ready);
    }
    Result<TransferId> id = p.read_all(std::move(o));
    ASSERT_TRUE(id.ok()) << id.error().to_string();
    TransferStatus st = p.a->wait(*id, 10s);
    ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
    EXPECT_EQ(count_of(p.dst.data, p.dst.bytes, value), p.dst.bytes)
        << (by_handle ? "by handle" : "by event") << ": a stale byte arrived";
  }
}

// A producer that does not finish before the transfer is cancelled: cancel
// returns at once (nothing was queued behind the event), and no byte lands
// afterwards, even when the producer finishes later.
TEST_F(DeviceMemoryTest, ACancelWhileWaitingForTheProducerLandsNothing) {
  Producer p(0, 1 << 16);
  auto& a = p.a;
  auto& dst = p.dst;
  p.write_later(0x44, 600ms);
  SubmitOptions o;
  o.ready_event = reinterpret_cast<uintptr_t>(p.ready);
  Result<TransferId> id = p.read_all(std::move(o));
  ASSERT_TRUE(id.ok()) << id.error().to_string();
  std::this_thread::sleep_for(50ms);
  const auto before = std::chrono::steady_clock::now();
  ASSERT_TRUE(a->cancel(*id).ok());
  EXPECT_LT(std::chrono::steady_clock::now() - before, 300ms) << "cancel waited for the producer";
  EXPECT_EQ(a->status(*id).state, TransferState::kCancelled);
  std::this_thread::sleep_for(800ms);  // the producer has finished by now
  EXPECT_EQ(count_of(dst.data, dst.bytes, 0), dst.bytes) << "a byte landed after cancel() returned";
  // Past its deadline, the same: a timeout, nothing lands.
  p.write_later(0x55, 600ms);
  SubmitOptions late;
  late.ready_event = reinterpret_cast<uintptr_t>(p.ready);
  late.timeout = 100ms;
  Result<TransferId> timed = p.read_all(std::move(late));
  ASSERT_TRUE(timed.ok());
  TransferStatus st = a->wait(*timed, 5s);
  EXPECT_EQ(st.state, TransferState::kFailed);
  EXPECT_EQ(st.error.code(), Code::kTimeout) << st.error.to_string();
  std::this_thread::sleep_for(800ms);
  EXPECT_EQ(count_of(dst.data, dst.bytes, 0), dst.bytes) << "a byte landed after the deadline";
}

// Host memory of an engine that moves device memory is pinned once per
// segment at registration (a range that joins a segment re-pins the joined
// span, after the old one is unpinned) and unpinned at deregistration or
// with the engine; an engine without a device transport pins nothing.
TEST_F(DeviceMemoryTest, HostMemoryIsPinnedWhileRegisteredWithAnEngineThatMovesDeviceMemory) {
  std::vector<uint8_t> host(1 << 20);
  const size_t before = device::fake_pinned_count();
  {
    auto a = make("a");
    const RegionId r1 = *a->register_memory(host.data(), 4096, "host");
    EXPECT_EQ(device::fake_pinned_count(), before + 1);
    const RegionId r2 = *a->register_memory(host.data() + 2048, 8192, "host");
    EXPECT_EQ(device::fake_pinned_count(), before + 1) << "the joined segment, pinned once";
    const RegionId r3 = *a->register_memory(host.data() + 65536, 4096, "host");
    EXPECT_EQ(device::fake_pinned_count(), before + 2);
    ASSERT_TRUE(a->deregister_memory(r2).ok());
    EXPECT_EQ(device::fake_pinned_count(), before + 2) << "r1 and r3, each its own segment again";
    ASSERT_TRUE(a->deregister_memory(r1).ok());
    EXPECT_EQ(device::fake_pinned_count(), before + 1);
    (void)r3;  // unpinned with the engine
  }
  EXPECT_EQ(device::fake_pinned_count(), before) << "the engine's end unpins what it pinned";
  EngineOptions o;
  o.name = "host-only";
  o.transports = {"cma"};
  auto c = Engine::create(o);
  ASSERT_TRUE(c.ok()) << c.error().to_string();
  ASSERT_TRUE((*c)->register_memory(host.data(), 4096, "host").ok());
  EXPECT_EQ(device::fake_pinned_count(), before) << "no transport of this engine moves device memory";
}

// A producer's event that was never recorded is refused by name: CUDA
// would call it complete, and the read would take the stale bytes.
TEST_F(DeviceMemoryTest, AReadyEventNeverRecordedIsRefusedNotTakenAsDone) {
  Producer p(1, 4096);
  SubmitOptions o;
  o.ready_event_handles = {*fake().export_event(p.ready)};
  Result<TransferId> id = p.read_all(o);
  ASSERT_TRUE(id.ok()) << id.error().to_string();
  const TransferStatus st = p.a->wait(*id, 10s);
  EXPECT_EQ(st.state, TransferState::kFailed);
  EXPECT_NE(st.error.message().find("never recorded"), std::string::npos) << st.error.to_string();
  EXPECT_EQ(count_of(p.dst.data, p.dst.bytes, 0x11), 0u) << "the stale bytes were read";
}

TEST_F(DeviceMemoryTest, ReadyEventsOnAHostOnlyTransferAreRefused) {
  auto a = make("a");
  auto b = make("b");
  std::vector<uint8_t> x(4096), y(4096);
  const RegionId rx = *a->register_memory(x.data(), x.size());
  const RegionId ry = *b->register_memory(y.data(), y.size());
  const PeerId peer = *a->connect(b->metadata());
  SubmitOptions o;
  o.ready_event_handles = {"some handle"};
  const TransferItem item{rx, 0, ry, 0, 4096};
  Result<TransferId> id = a->submit(peer, TransferOp::kRead, {&item, 1}, std::move(o));
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.error().code(), Code::kInvalidArgument);
  EXPECT_NE(id.error().message().find("host memory only"), std::string::npos) << id.error().to_string();
}

// cma moves host memory only: a peer reached by cma alone cannot move
// device memory, and the error names the pair of kinds and the transports.
TEST_F(DeviceMemoryTest, NoTransportForAPairOfMemoryKindsIsAClearError) {
  EngineOptions o;
  o.name = "a";
  o.transports = {"cma"};
  Result<std::unique_ptr<Engine>> a = Engine::create(o);
  o.name = "b";
  Result<std::unique_ptr<Engine>> b = Engine::create(o);
  if (!a.ok() || !b.ok()) GTEST_SKIP() << "cma cannot run here: " << (a.ok() ? b : a).error().to_string();
  DeviceBuffer d(0, 4096);
  std::vector<uint8_t> y(4096);
  Result<RegionId> rd = (*a)->register_memory(d.data, d.bytes, "cuda:0");
  ASSERT_TRUE(rd.ok()) << "cma does not serve device memory, but registration still succeeds: "
                       << rd.error().to_string();
  const RegionId ry = *(*b)->register_memory(y.data(), y.size());
  const PeerId peer = *(*a)->connect((*b)->metadata());
  const TransferItem item{*rd, 0, ry, 0, 4096};
  Result<TransferId> id = (*a)->submit(peer, TransferOp::kRead, {&item, 1});
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.error().code(), Code::kUnavailable);
  EXPECT_NE(id.error().message().find("moves device memory here to host memory there"), std::string::npos)
      << id.error().to_string();
  EXPECT_NE(id.error().message().find("cma"), std::string::npos) << id.error().to_string();
}

// Engines with tcp only (as across hosts): device memory on both sides, and
// device memory here with host memory there, moves staged through pinned
// host memory, every byte checked.
TEST_F(DeviceMemoryTest, TcpMovesDeviceMemoryBetweenEnginesStaged) {
  // The memory first: it outlives the engines, whose threads last touched it.
  constexpr uint64_t kBytes = uint64_t{3} << 20;
  DeviceBuffer here(0, kBytes, 0), there(1, kBytes, 0);
  std::vector<uint8_t> host(kBytes);
  EngineOptions o;
  o.name = "a";
  o.transports = {"tcp"};
  o.staging_chunk_bytes = uint64_t{1} << 20;
  Result<std::unique_ptr<Engine>> a = Engine::create(o);
  o.name = "b";
  Result<std::unique_ptr<Engine>> b = Engine::create(o);
  ASSERT_TRUE(a.ok() && b.ok());
  for (uint64_t i = 0; i < kBytes; ++i) there.data[i] = host[i] = static_cast<uint8_t>(i * 7 + 1);
  const RegionId rh = *(*a)->register_memory(here.data, kBytes, "cuda:0");
  const RegionId rt = *(*b)->register_memory(there.data, kBytes, "cuda:1");
  const RegionId ry = *(*b)->register_memory(host.data(), kBytes);
  const PeerId peer = *(*a)->connect((*b)->metadata());
  for (const RegionId remote : {rt, ry}) {
    std::fill(here.data, here.data + kBytes, 0);
    // Two items, swapped halves.
    const TransferItem items[] = {{rh, 0, remote, kBytes / 2, kBytes / 2}, {rh, kBytes / 2, remote, 0, kBytes / 2}};
    Result<TransferId> id = (*a)->submit(peer, TransferOp::kRead, items);
    ASSERT_TRUE(id.ok()) << id.error().to_string();
    const TransferStatus st = (*a)->wait(*id, std::chrono::seconds(20));
    ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
    EXPECT_TRUE(std::equal(here.data, here.data + kBytes / 2, host.data() + kBytes / 2));
    EXPECT_TRUE(std::equal(here.data + kBytes / 2, here.data + kBytes, host.data()));
  }
}

}  // namespace
}  // namespace kvbridge
