// The GPU tests (ctest label "gpu"): the device seam, the engine's device
// paths and cuda_ipc on the process's real device. Without a device each
// test skips, printing why (a build without CUDA, no driver, no GPU); with
// KVB_DEVICE=fake they run on the host fake, which is how they are
// rehearsed on a machine without a GPU (gpu_test_fake in ctest).
//
// Device memory is read and written only through Device::copy_sync, so the
// same checks hold on both. The cuda_ipc cases start this binary again as
// the peer (`gpu_test --peer`), since a CUDA process cannot fork.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/child_process.h"
#include "conformance/pattern.h"
#include "device/device.h"
#include "kvbridge/engine.h"
#include "transport/copies.h"

namespace kvbridge {
namespace {

using namespace std::chrono_literals;
using conformance::fill_pattern;
using conformance::find_mismatch;
using conformance::from_hex;
using conformance::to_hex;

std::string self_path;  // this binary, for the peer

device::Device& dev() { return device::current(); }

// Skips the test, saying why, when the process has no device; fails it
// instead with KVB_GPU_REQUIRED=1 (the device check: a skip there would
// pass without testing anything).
bool gpu_required() {
  const char* v = std::getenv("KVB_GPU_REQUIRED");
  return v != nullptr && std::string(v) == "1";
}
#define REQUIRE_DEVICE()                                                                                      \
  do {                                                                                                        \
    Result<int> n_ = dev().count();                                                                           \
    if (!n_.ok() && gpu_required()) FAIL() << "KVB_GPU_REQUIRED=1 and no device: " << n_.error().to_string(); \
    if (!n_.ok()) GTEST_SKIP() << "no device for the GPU tests: " << n_.error().to_string();                  \
  } while (0)

struct DeviceBuffer {
  DeviceBuffer(int device, uint64_t n) : bytes(n) {
    Result<void*> r = dev().allocate(device, n);
    EXPECT_TRUE(r.ok()) << r.error().to_string();
    p = r.ok() ? static_cast<uint8_t*>(*r) : nullptr;
  }
  ~DeviceBuffer() {
    if (p != nullptr) {
      EXPECT_TRUE(dev().free(p).ok());
    }
  }
  std::vector<uint8_t> read() const {
    std::vector<uint8_t> h(bytes);
    EXPECT_TRUE(dev().copy_sync(h.data(), p, bytes).ok());
    return h;
  }
  void write(const std::vector<uint8_t>& h) { EXPECT_TRUE(dev().copy_sync(p, h.data(), bytes).ok()); }
  uint8_t* p;
  uint64_t bytes;
};

std::vector<uint8_t> pattern(uint64_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  fill_pattern(v.data(), n, seed, 0);
  return v;
}

std::unique_ptr<Engine> engine(const std::string& name, std::vector<std::string> transports,
                               const std::string& method = "copy_engine") {
  EngineOptions o;
  o.name = name;
  o.transports = std::move(transports);
  o.device_copy = method;
  Result<std::unique_ptr<Engine>> e = Engine::create(o);
  EXPECT_TRUE(e.ok()) << e.error().to_string();
  return e.ok() ? std::move(*e) : nullptr;
}

TEST(GpuTest, PointersAreToldApartAndAllocationsExport) {
  REQUIRE_DEVICE();
  DeviceBuffer d(0, 3 << 20);
  Result<device::PointerInfo> info = dev().pointer_info(d.p + 12345);
  ASSERT_TRUE(info.ok()) << info.error().to_string();
  EXPECT_EQ(info->type, device::MemoryType::kDevice);
  EXPECT_EQ(info->device, 0);
  EXPECT_LE(info->base, reinterpret_cast<uint64_t>(d.p));
  EXPECT_GE(info->base + info->bytes, reinterpret_cast<uint64_t>(d.p) + d.bytes);
  EXPECT_TRUE(info->exportable) << info->why_not;
  std::vector<uint8_t> host(64);
  EXPECT_EQ(dev().pointer_info(host.data())->type, device::MemoryType::kHost);
  Result<void*> managed = dev().allocate(0, 4096, true);
  ASSERT_TRUE(managed.ok());
  EXPECT_EQ(dev().pointer_info(*managed)->type, device::MemoryType::kManaged);
  EXPECT_TRUE(dev().free(*managed).ok());
  EXPECT_TRUE(dev().export_memory(reinterpret_cast<void*>(info->base)).ok());
}

// In one process (the local transport): 10,000 shuffled 2 KiB blocks
// device -> device with each copy method, then host <-> device.
TEST(GpuTest, ManyBlocksMoveExactlyWithBothCopyMethods) {
  REQUIRE_DEVICE();
  const int devices = *dev().count();
  constexpr uint64_t kBlock = 2048, kBlocks = 10000, kBytes = kBlock * kBlocks;
  for (const char* method : {"copy_engine", "kernel"}) {
    auto a = engine("a", {"local"}, method);
    auto b = engine("b", {"local"}, method);
    DeviceBuffer src(devices > 1 ? 1 : 0, kBytes), dst(0, kBytes);
    src.write(pattern(kBytes, 3));
    dst.write(std::vector<uint8_t>(kBytes, 0));
    const RegionId rs = *b->register_memory(src.p, kBytes, devices > 1 ? "cuda:1" : "cuda:0");
    const RegionId rd = *a->register_memory(dst.p, kBytes, "cuda:0");
    const PeerId peer = *a->connect(b->metadata());
    std::vector<uint64_t> order(kBlocks);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937(7));
    std::vector<TransferItem> items;
    for (uint64_t i = 0; i < kBlocks; ++i) items.push_back({rd, i * kBlock, rs, order[i] * kBlock, kBlock});
    Result<TransferId> t = a->submit(peer, TransferOp::kRead, items);
    ASSERT_TRUE(t.ok()) << t.error().to_string();
    TransferStatus st = a->wait(*t, 30s);
    ASSERT_EQ(st.state, TransferState::kDone) << method << ": " << st.error.to_string();
    const std::vector<uint8_t> got = dst.read();
    for (uint64_t i = 0; i < kBlocks; ++i) {
      ASSERT_EQ(find_mismatch(got.data() + i * kBlock, kBlock, 3, order[i] * kBlock), -1) << method << ": block " << i;
    }
    // Host -> device and back.
    std::vector<uint8_t> host = pattern(kBytes, 5);
    const RegionId rh = *a->register_memory(host.data(), kBytes, "host");
    const TransferItem all{rh, 0, rs, 0, kBytes};
    t = a->submit(peer, TransferOp::kWrite, {&all, 1});
    ASSERT_EQ(a->wait(*t, 30s).state, TransferState::kDone);
    EXPECT_EQ(find_mismatch(src.read().data(), kBytes, 5, 0), -1) << method << ": host -> device";
    std::fill(host.begin(), host.end(), uint8_t{0});
    t = a->submit(peer, TransferOp::kRead, {&all, 1});
    ASSERT_EQ(a->wait(*t, 30s).state, TransferState::kDone);
    EXPECT_EQ(find_mismatch(host.data(), kBytes, 5, 0), -1) << method << ": device -> host";
  }
}

// The content hash kernel: device memory hashed on the device equals the
// host's hash of the same bytes (ranges of no byte, less than a leaf, many
// leaves, odd offsets); a content-checked transfer of device memory ends
// done and counts its bytes.
TEST(GpuTest, TheContentHashKernelHashesAsTheHostDoes) {
  REQUIRE_DEVICE();
  constexpr uint64_t kBytes = (uint64_t{5} << 20) + 12345;
  DeviceBuffer d(0, kBytes);
  const std::vector<uint8_t> host = pattern(kBytes, 9);
  d.write(host);
  const std::vector<std::pair<uint64_t, uint64_t>> spans{{0, 0}, {1, 100}, {7, 65536}, {3, kBytes - 3}, {0, kBytes}};
  std::vector<device::DeviceRange> ranges;
  for (auto [at, n] : spans) ranges.push_back({d.p + at, n});
  std::vector<uint64_t> hashes;
  ASSERT_TRUE(dev().content_hashes(0, ranges, &hashes).ok());
  ASSERT_EQ(hashes.size(), spans.size());
  for (size_t i = 0; i < spans.size(); ++i) {
    EXPECT_EQ(hashes[i], transport::content_hash(host.data() + spans[i].first, spans[i].second)) << "range " << i;
  }
  auto a = engine("a", {"local"});
  auto b = engine("b", {"local"});
  DeviceBuffer dst(0, kBytes);
  const RegionId rs = *b->register_memory(d.p, kBytes, "cuda:0");
  const RegionId rd = *a->register_memory(dst.p, kBytes, "cuda:0");
  const PeerId peer = *a->connect(b->metadata());
  const TransferItem all{rd, 0, rs, 0, kBytes};
  SubmitOptions o;
  o.verify_content = true;
  Result<TransferId> t = a->submit(peer, TransferOp::kRead, {&all, 1}, o);
  ASSERT_TRUE(t.ok()) << t.error().to_string();
  TransferStatus st = a->wait(*t, 30s);
  ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
  EXPECT_EQ(a->metrics().bytes_content_checked, kBytes);
  EXPECT_EQ(find_mismatch(dst.read().data(), kBytes, 9, 0), -1);
}

// A slow producer kernel: the transfer, submitted at once with the
// producer's event, never copies a stale byte; a cancel while it waits
// returns at once and lands nothing.
TEST(GpuTest, TransfersWaitForTheProducersEventAndCancelWhileWaiting) {
  REQUIRE_DEVICE();
  auto a = engine("a", {"local"});
  auto b = engine("b", {"local"});
  constexpr uint64_t kBytes = 8 << 20;
  DeviceBuffer src(0, kBytes), dst(0, kBytes);
  src.write(std::vector<uint8_t>(kBytes, 0x11));
  dst.write(std::vector<uint8_t>(kBytes, 0));
  const RegionId rs = *b->register_memory(src.p, kBytes, "cuda:0");
  const RegionId rd = *a->register_memory(dst.p, kBytes, "cuda:0");
  const PeerId peer = *a->connect(b->metadata());
  Result<device::Stream> producer = dev().create_stream(0);
  Result<device::Event> ready = dev().create_event(0, true);
  ASSERT_TRUE(producer.ok() && ready.ok());
  ASSERT_TRUE(dev().fill_after(*producer, src.p, kBytes, 0x77, 300ms).ok());
  ASSERT_TRUE(dev().record(*ready, *producer).ok());
  SubmitOptions o;
  o.ready_event = reinterpret_cast<uintptr_t>(*ready);
  const TransferItem all{rd, 0, rs, 0, kBytes};
  Result<TransferId> t = a->submit(peer, TransferOp::kRead, {&all, 1}, std::move(o));
  ASSERT_TRUE(t.ok()) << t.error().to_string();
  ASSERT_EQ(a->wait(*t, 10s).state, TransferState::kDone);
  const std::vector<uint8_t> got = dst.read();
  EXPECT_EQ(static_cast<uint64_t>(std::count(got.begin(), got.end(), 0x77)), kBytes) << "a stale byte arrived";

  dst.write(std::vector<uint8_t>(kBytes, 0));
  ASSERT_TRUE(dev().fill_after(*producer, src.p, kBytes, 0x99, 1000ms).ok());
  ASSERT_TRUE(dev().record(*ready, *producer).ok());
  SubmitOptions w;
  w.ready_event = reinterpret_cast<uintptr_t>(*ready);
  t = a->submit(peer, TransferOp::kRead, {&all, 1}, std::move(w));
  ASSERT_TRUE(t.ok());
  std::this_thread::sleep_for(50ms);
  const auto before = std::chrono::steady_clock::now();
  ASSERT_TRUE(a->cancel(*t).ok());
  EXPECT_LT(std::chrono::steady_clock::now() - before, 300ms);
  EXPECT_EQ(a->status(*t).state, TransferState::kCancelled);
  std::this_thread::sleep_for(1200ms);
  const std::vector<uint8_t> after = dst.read();
  EXPECT_EQ(static_cast<uint64_t>(std::count(after.begin(), after.end(), 0)), kBytes) << "a byte landed after cancel";
  dev().destroy_event(*ready);
  dev().destroy_stream(*producer);
}

// The peer process: an engine with one device buffer of pattern 9,
// registered as cuda:0; prints "ready REGION METADATA_HEX", then answers
// "check SEED" (ok / bad at N) until "exit".
int peer_main(uint64_t bytes, bool unexportable) {
  Result<int> n = dev().count();
  if (!n.ok()) {
    std::cout << "error " << n.error().to_string() << std::endl;
    return 1;
  }
  EngineOptions o;
  o.name = "gpu-peer";
  Result<std::unique_ptr<Engine>> e = Engine::create(o);
  if (!e.ok()) {
    std::cout << "error " << e.error().to_string() << std::endl;
    return 1;
  }
  Result<void*> p = unexportable ? dev().allocate_unexportable(0, bytes) : dev().allocate(0, bytes);
  if (!p.ok()) {
    std::cout << "error " << p.error().to_string() << std::endl;
    return 1;
  }
  std::vector<uint8_t> host = pattern(bytes, 9);
  (void)dev().copy_sync(*p, host.data(), bytes);
  Result<RegionId> r = (*e)->register_memory(*p, bytes, "cuda:0");
  if (!r.ok()) {
    std::cout << "error " << r.error().to_string() << std::endl;
    return 1;
  }
  std::cout << "ready " << *r << " " << to_hex((*e)->metadata()) << std::endl;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    uint32_t seed = 0;
    in >> cmd >> seed;
    if (cmd == "exit") break;
    if (cmd == "check") {
      (void)dev().copy_sync(host.data(), *p, bytes);
      const int64_t bad = find_mismatch(host.data(), bytes, seed, 0);
      std::cout << (bad < 0 ? std::string("ok") : "bad at " + std::to_string(bad)) << std::endl;
    }
  }
  e->reset();
  (void)dev().free(*p);
  return 0;
}

// Another process's device memory through cuda_ipc, with each copy
// method: a read of all of it, then a write back, checked by the peer.
TEST(GpuTest, CudaIpcReadsAndWritesAnotherProcesssDeviceMemory) {
  REQUIRE_DEVICE();
  constexpr uint64_t kBytes = 32 << 20;
  for (const char* method : {"copy_engine", "kernel"}) {
    SpawnOptions so;
    so.pipe_stdin = true;
    so.pipe_stdout = true;
    so.inherit_stderr = true;
    Result<std::unique_ptr<ChildProcess>> child =
        ChildProcess::spawn({self_path, "--peer", std::to_string(kBytes)}, so);
    ASSERT_TRUE(child.ok()) << child.error().to_string();
    std::istringstream ready((*child)->read_line(60s));
    std::string word, hex;
    RegionId remote = 0;
    ready >> word >> remote >> hex;
    ASSERT_EQ(word, "ready") << "the peer did not start";
    auto a = engine("a", {"cuda_ipc", "cma"}, method);
    DeviceBuffer local(0, kBytes);
    local.write(std::vector<uint8_t>(kBytes, 0));
    const RegionId rl = *a->register_memory(local.p, kBytes, "cuda:0");
    Result<PeerId> peer = a->connect(from_hex(hex));
    ASSERT_TRUE(peer.ok()) << peer.error().to_string();
    const TransferItem all{rl, 0, remote, 0, kBytes};
    Result<TransferId> t = a->submit(*peer, TransferOp::kRead, {&all, 1});
    ASSERT_TRUE(t.ok()) << t.error().to_string();
    TransferStatus st = a->wait(*t, 30s);
    ASSERT_EQ(st.state, TransferState::kDone) << method << ": " << st.error.to_string();
    EXPECT_EQ(find_mismatch(local.read().data(), kBytes, 9, 0), -1) << method << ": read";
    local.write(pattern(kBytes, 4));
    t = a->submit(*peer, TransferOp::kWrite, {&all, 1});
    ASSERT_EQ(a->wait(*t, 30s).state, TransferState::kDone);
    const std::string check = "check 4\n";
    ASSERT_EQ(::write((*child)->stdin_fd(), check.data(), check.size()), static_cast<ssize_t>(check.size()));
    EXPECT_EQ((*child)->read_line(30s), "ok") << method << ": write";
    const std::string bye = "exit\n";
    (void)::write((*child)->stdin_fd(), bye.data(), bye.size());
    (*child)->wait(10s);
  }
}

// Device memory over tcp on loopback, staged through pinned host memory on
// each side that has it: a device read from the peer's host memory and from
// its device memory, and a device write into its host memory, in chunks of
// 1 MiB, many descriptors each, every byte checked.
TEST(GpuTest, TcpStagesDeviceMemoryThroughPinnedHostMemory) {
  REQUIRE_DEVICE();
  EngineOptions o;
  o.transports = {"tcp"};
  o.staging_chunk_bytes = uint64_t{1} << 20;
  o.name = "staged-a";
  Result<std::unique_ptr<Engine>> a = Engine::create(o);
  o.name = "staged-b";
  Result<std::unique_ptr<Engine>> b = Engine::create(o);
  ASSERT_TRUE(a.ok() && b.ok()) << (a.ok() ? b : a).error().to_string();
  constexpr uint64_t kBytes = uint64_t{24} << 20, kPiece = 24 << 10;
  DeviceBuffer here(0, kBytes), there(0, kBytes);
  std::vector<uint8_t> host = pattern(kBytes, 5);
  there.write(pattern(kBytes, 6));
  const RegionId rh = *(*a)->register_memory(here.p, kBytes, "cuda:0");
  const RegionId rt = *(*b)->register_memory(there.p, kBytes, "cuda:0");
  const RegionId ry = *(*b)->register_memory(host.data(), kBytes);
  const PeerId peer = *(*a)->connect((*b)->metadata());
  // Piece i of here <- piece (n - 1 - i) of the peer's.
  auto items_of = [&](RegionId remote) {
    std::vector<TransferItem> items;
    const uint64_t n = kBytes / kPiece;
    for (uint64_t i = 0; i < n; ++i) items.push_back({rh, i * kPiece, remote, (n - 1 - i) * kPiece, kPiece});
    return items;
  };
  auto reversed = [&](const std::vector<uint8_t>& v) {
    std::vector<uint8_t> r(v.size());
    const uint64_t n = kBytes / kPiece;
    for (uint64_t i = 0; i < n; ++i)
      std::copy_n(v.begin() + static_cast<ptrdiff_t>((n - 1 - i) * kPiece), kPiece,
                  r.begin() + static_cast<ptrdiff_t>(i * kPiece));
    return r;
  };
  for (const RegionId remote : {ry, rt}) {
    here.write(std::vector<uint8_t>(kBytes, 0));
    const std::vector<TransferItem> items = items_of(remote);
    Result<TransferId> t = (*a)->submit(peer, TransferOp::kRead, items);
    ASSERT_TRUE(t.ok()) << t.error().to_string();
    const TransferStatus st = (*a)->wait(*t, 30s);
    ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
    EXPECT_TRUE(here.read() == reversed(remote == ry ? host : there.read()))
        << "staged read from the peer's " << (remote == ry ? "host" : "device") << " memory";
  }
  // And back: a device write into the peer's host memory.
  std::fill(host.begin(), host.end(), 0);
  const std::vector<uint8_t> mine = here.read();
  Result<TransferId> t = (*a)->submit(peer, TransferOp::kWrite, items_of(ry));
  ASSERT_TRUE(t.ok()) << t.error().to_string();
  const TransferStatus st = (*a)->wait(*t, 30s);
  ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
  EXPECT_TRUE(reversed(host) == mine) << "staged write into the peer's host memory";
}

// Memory from cuMemCreate (PyTorch's expandable segments) has no legacy
// IPC handle: a peer registers it, and a reader's transfer of it over
// cuda_ipc is refused naming why and what to set, never a crash or a
// wrong byte.
TEST(GpuTest, MemoryFromCuMemCreateIsRefusedByName) {
  REQUIRE_DEVICE();
  constexpr uint64_t kBytes = 4 << 20;
  SpawnOptions so;
  so.pipe_stdin = so.pipe_stdout = so.inherit_stderr = true;
  Result<std::unique_ptr<ChildProcess>> child =
      ChildProcess::spawn({self_path, "--peer", std::to_string(kBytes), "unexportable"}, so);
  ASSERT_TRUE(child.ok()) << child.error().to_string();
  std::istringstream ready((*child)->read_line(60s));
  std::string word, hex;
  RegionId remote = 0;
  ready >> word >> remote >> hex;
  ASSERT_EQ(word, "ready");
  auto a = engine("a", {"cuda_ipc"});
  DeviceBuffer local(0, kBytes);
  Result<RegionId> rl = a->register_memory(local.p, kBytes, "cuda:0");
  ASSERT_TRUE(rl.ok()) << rl.error().to_string();
  Result<PeerId> peer = a->connect(from_hex(hex));
  ASSERT_TRUE(peer.ok()) << peer.error().to_string();
  const TransferItem all{*rl, 0, remote, 0, kBytes};
  Result<TransferId> t = a->submit(*peer, TransferOp::kRead, {&all, 1});
  const std::string why = t.ok() ? a->wait(*t, 30s).error.to_string() : t.error().to_string();
  EXPECT_NE(why.find("cuMemCreate"), std::string::npos) << why;
  EXPECT_NE(why.find("expandable_segments:False"), std::string::npos) << why;
  const std::string bye = "exit\n";
  (void)::write((*child)->stdin_fd(), bye.data(), bye.size());
  (*child)->wait(10s);
}

}  // namespace
}  // namespace kvbridge

int main(int argc, char** argv) {
  kvbridge::self_path = argv[0];
  if (argc >= 3 && std::string(argv[1]) == "--peer") {
    return kvbridge::peer_main(std::stoull(argv[2]), argc == 4 && std::string(argv[3]) == "unexportable");
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
