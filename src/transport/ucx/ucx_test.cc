// The ucx transport at the Transport/Link level: two transports in this
// process (each with its own worker), and a peer in a child process (this
// binary re-executed, so the child starts UCX in a clean process).
//
// ctest runs the binary once per UCX_TLS (tcp, shm); see CMakeLists.txt.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>

#include "transport/transport.h"

namespace kvbridge::transport {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kBytes = uint64_t{32} << 20;
constexpr const char* kPeerEnv = "KVB_UCX_TEST_PEER_FDS";

uint8_t pattern(uint64_t i) { return static_cast<uint8_t>((i * 131 + (i >> 11) * 7 + 5) & 0xff); }

bool write_all(int fd, const void* p, size_t n) {
  auto* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::write(fd, c, n);
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* p, size_t n) {
  auto* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = ::read(fd, c, n);
    if (r <= 0) return false;
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool write_blob(int fd, const std::string& s) {
  uint64_t n = s.size();
  return write_all(fd, &n, sizeof n) && write_all(fd, s.data(), s.size());
}

bool read_blob(int fd, std::string& s) {
  uint64_t n = 0;
  if (!read_all(fd, &n, sizeof n) || n > (1 << 20)) return false;
  s.resize(n);
  return read_all(fd, s.data(), n);
}

// The child: kBytes of pattern, one segment, then "dump" commands
// (offset, bytes) answered with the bytes, until stdin closes.
[[noreturn]] void peer_main(int in, int out) {
  auto t = make_ucx_transport("127.0.0.1");
  if (!t.ok()) ::_exit(3);
  std::vector<uint8_t> mem(kBytes);
  for (uint64_t i = 0; i < kBytes; ++i) mem[i] = pattern(i);
  auto key = (*t)->add_segment(Segment{1, mem.data(), kBytes, "host"});
  if (!key.ok()) ::_exit(4);
  uint64_t base = reinterpret_cast<uint64_t>(mem.data());
  if (!write_blob(out, (*t)->address()) || !write_blob(out, *key) || !write_all(out, &base, sizeof base)) ::_exit(5);
  uint64_t cmd[2];
  while (read_all(in, cmd, sizeof cmd)) {
    if (cmd[0] > kBytes || cmd[1] > kBytes - cmd[0]) ::_exit(6);
    if (!write_all(out, mem.data() + cmd[0], cmd[1])) ::_exit(7);
  }
  ::_exit(0);
}

// Runs before main() in a re-executed child.
[[maybe_unused]] const bool kIsPeer = [] {
  const char* fds = std::getenv(kPeerEnv);
  if (fds == nullptr) return false;
  int in = -1, out = -1;
  if (std::sscanf(fds, "%d,%d", &in, &out) != 2) ::_exit(2);
  peer_main(in, out);
}();

void quiet_ucx() {
  // Tests keep UCX's log to errors (a killed peer is reported once).
  ::setenv("UCX_LOG_LEVEL", "error", 0);
}

// The side that holds memory: a transport in this process or in a child.
struct Side {
  std::string address, key;
  uint64_t base = 0;
  pid_t pid = 0;
  PeerInfo info(const std::string& name) const {
    PeerInfo p;
    p.name = name;
    p.pid = static_cast<uint64_t>(pid);
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    p.hostname = host;
    p.address = address;
    p.segments.push_back({1, base, kBytes, key});
    return p;
  }
};

class UcxTest : public ::testing::Test {
 protected:
  void SetUp() override {
    quiet_ucx();
    auto client = make_ucx_transport("127.0.0.1");
    ASSERT_TRUE(client.ok()) << client.error().to_string();
    client_ = std::move(*client);
    local_.assign(kBytes, 0);
    ASSERT_TRUE(client_->add_segment(Segment{9, local_.data(), kBytes, "host"}).ok());
  }

  void start_in_process() {
    auto server = make_ucx_transport("127.0.0.1");
    ASSERT_TRUE(server.ok()) << server.error().to_string();
    server_ = std::move(*server);
    remote_.resize(kBytes);
    for (uint64_t i = 0; i < kBytes; ++i) remote_[i] = pattern(i);
    auto key = server_->add_segment(Segment{1, remote_.data(), kBytes, "host"});
    ASSERT_TRUE(key.ok()) << key.error().to_string();
    side_ = Side{server_->address(), *key, reinterpret_cast<uint64_t>(remote_.data()), ::getpid()};
    connect("server");
  }

  void start_child() {
    int down[2], up[2];
    ASSERT_EQ(::pipe(down), 0);
    ASSERT_EQ(::pipe(up), 0);
    child_ = ::fork();
    ASSERT_GE(child_, 0);
    if (child_ == 0) {
      ::close(down[1]);
      ::close(up[0]);
      std::string fds = std::to_string(down[0]) + "," + std::to_string(up[1]);
      ::setenv(kPeerEnv, fds.c_str(), 1);
      ::execl("/proc/self/exe", "ucx_test_peer", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::close(down[0]);
    ::close(up[1]);
    to_child_ = down[1];
    from_child_ = up[0];
    ASSERT_TRUE(read_blob(from_child_, side_.address)) << "the child peer did not start";
    ASSERT_TRUE(read_blob(from_child_, side_.key));
    ASSERT_TRUE(read_all(from_child_, &side_.base, sizeof side_.base));
    side_.pid = child_;
    connect("child");
  }

  void connect(const std::string& name) {
    auto link = client_->connect(side_.info(name));
    ASSERT_TRUE(link.ok()) << link.error().to_string();
    link_ = std::move(*link);
  }

  void TearDown() override {
    link_.reset();
    kill_child();
  }

  void kill_child() {
    if (child_ > 0) {
      ::kill(child_, SIGKILL);
      ::waitpid(child_, nullptr, 0);
      child_ = -1;
    }
    if (to_child_ >= 0) ::close(to_child_);
    if (from_child_ >= 0) ::close(from_child_);
    to_child_ = from_child_ = -1;
  }

  // The peer's bytes, read independently of the transport.
  std::vector<uint8_t> peer_bytes(uint64_t offset, uint64_t bytes) {
    if (child_ < 0) return std::vector<uint8_t>(remote_.begin() + offset, remote_.begin() + offset + bytes);
    std::vector<uint8_t> out(bytes);
    uint64_t cmd[2] = {offset, bytes};
    EXPECT_TRUE(write_all(to_child_, cmd, sizeof cmd));
    EXPECT_TRUE(read_all(from_child_, out.data(), bytes));
    return out;
  }

  Copy copy(uint64_t local_offset, uint64_t remote_offset, uint64_t bytes) {
    return Copy{local_.data() + local_offset, side_.base + remote_offset, bytes, 1};
  }

  Status run(TransferOp op, const std::vector<Copy>& copies, std::chrono::milliseconds timeout = 30s) {
    RunControl control;
    control.deadline = Clock::now() + timeout;
    Status s = link_->run(op, copies, control);
    if (s.ok()) {
      uint64_t total = 0;
      for (const Copy& c : copies) total += c.bytes;
      EXPECT_EQ(control.bytes_done.load(), total);
    }
    return s;
  }

  void reads_every_size() {
    for (uint64_t size : {uint64_t{1}, uint64_t{4095}, uint64_t{4096}, uint64_t{4097}, uint64_t{1} << 20}) {
      std::fill(local_.begin(), local_.end(), 0);
      ASSERT_TRUE(run(TransferOp::kRead, {copy(5, 3, size)}).ok()) << size;
      std::vector<uint8_t> want = peer_bytes(3, size);
      ASSERT_TRUE(std::equal(want.begin(), want.end(), local_.begin() + 5)) << size;
      EXPECT_EQ(local_[4], 0);
      EXPECT_EQ(local_[5 + size], 0);
    }
  }

  void writes_every_size() {
    for (uint64_t i = 0; i < kBytes; ++i) local_[i] = static_cast<uint8_t>(~pattern(i));
    for (uint64_t size : {uint64_t{1}, uint64_t{4095}, uint64_t{4096}, uint64_t{4097}, uint64_t{1} << 20}) {
      ASSERT_TRUE(run(TransferOp::kWrite, {copy(11, 9, size)}).ok()) << size;
      // OK means in the peer's memory: check at once.
      std::vector<uint8_t> got = peer_bytes(8, size + 2);
      ASSERT_TRUE(std::equal(local_.begin() + 11, local_.begin() + 11 + size, got.begin() + 1)) << size;
      EXPECT_EQ(got[0], pattern(8));
      EXPECT_EQ(got[size + 1], pattern(9 + size));
    }
  }

  void batch_of_10000() {
    constexpr uint64_t kBlock = 2048, kCount = 10000;
    std::vector<uint64_t> order(kCount);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937(42));
    std::vector<Copy> copies;
    for (uint64_t i = 0; i < kCount; ++i) copies.push_back(copy(i * kBlock, order[i] * kBlock, kBlock));
    auto t0 = Clock::now();
    ASSERT_TRUE(run(TransferOp::kRead, copies).ok());
    auto read_us = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count();
    std::vector<uint8_t> remote = peer_bytes(0, kCount * kBlock);
    for (uint64_t i = 0; i < kCount; ++i) {
      ASSERT_TRUE(std::equal(local_.begin() + i * kBlock, local_.begin() + (i + 1) * kBlock,
                             remote.begin() + order[i] * kBlock))
          << i;
    }
    for (uint64_t i = 0; i < kCount * kBlock; ++i) local_[i] = static_cast<uint8_t>(i * 3);
    t0 = Clock::now();
    ASSERT_TRUE(run(TransferOp::kWrite, copies).ok());
    auto write_us = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count();
    remote = peer_bytes(0, kCount * kBlock);
    for (uint64_t i = 0; i < kCount; ++i) {
      ASSERT_TRUE(std::equal(local_.begin() + i * kBlock, local_.begin() + (i + 1) * kBlock,
                             remote.begin() + order[i] * kBlock))
          << i;
    }
    std::printf("[ info ] 10000 x 2 KiB: read %lld us, write %lld us\n", static_cast<long long>(read_us),
                static_cast<long long>(write_us));
  }

  // Many 1 MiB reads of the same remote range: long enough to stop mid-way.
  std::vector<Copy> long_read(size_t count) {
    std::vector<Copy> copies;
    for (size_t i = 0; i < count; ++i) copies.push_back(copy((i % 16) << 20, (i % 16) << 20, 1 << 20));
    return copies;
  }

  // After run() returned: nothing may land in local memory any more.
  void expect_nothing_lands_after_return() {
    std::fill(local_.begin(), local_.end(), 0);
    std::this_thread::sleep_for(300ms);
    EXPECT_TRUE(std::all_of(local_.begin(), local_.end(), [](uint8_t b) { return b == 0; }))
        << "a byte landed after run() returned";
  }

  std::unique_ptr<Transport> client_, server_;
  std::vector<uint8_t> local_, remote_;
  Side side_;
  std::unique_ptr<Link> link_;
  pid_t child_ = -1;
  int to_child_ = -1, from_child_ = -1;
};

TEST_F(UcxTest, AddressAndKeysAreBoundedBlobs) {
  ASSERT_NO_FATAL_FAILURE(start_in_process());
  EXPECT_GT(client_->address().size(), 0u);
  EXPECT_LE(client_->address().size(), 4096u) << "worker address over 4 KiB";
  EXPECT_LE(side_.key.size(), 4096u);
  std::printf("[ info ] UCX_TLS=%s: worker address %zu bytes, rkey %zu bytes\n",
              std::getenv("UCX_TLS") ? std::getenv("UCX_TLS") : "(default)", client_->address().size(),
              side_.key.size());
  PeerInfo bad = side_.info("bad");
  bad.address.clear();
  EXPECT_EQ(client_->can_reach(bad).code(), Code::kInvalidArgument);
  EXPECT_EQ(client_->add_segment(Segment{3, local_.data(), 16, "cuda:0"}).error().code(), Code::kInvalidArgument);
  EXPECT_EQ(client_->remove_segment(12345).code(), Code::kNotFound);
}

TEST_F(UcxTest, ReadsEverySizeInProcess) {
  ASSERT_NO_FATAL_FAILURE(start_in_process());
  reads_every_size();
}

TEST_F(UcxTest, WritesEverySizeInProcess) {
  ASSERT_NO_FATAL_FAILURE(start_in_process());
  writes_every_size();
}

TEST_F(UcxTest, BatchOf10000ShuffledCopiesInProcess) {
  ASSERT_NO_FATAL_FAILURE(start_in_process());
  batch_of_10000();
}

TEST_F(UcxTest, ReadsEverySizeFromAChild) {
  ASSERT_NO_FATAL_FAILURE(start_child());
  reads_every_size();
}

TEST_F(UcxTest, WritesEverySizeToAChild) {
  ASSERT_NO_FATAL_FAILURE(start_child());
  writes_every_size();
}

TEST_F(UcxTest, BatchOf10000ShuffledCopiesWithAChild) {
  ASSERT_NO_FATAL_FAILURE(start_child());
  batch_of_10000();
}

TEST_F(UcxTest, ThroughputOf1MiBReads) {
  ASSERT_NO_FATAL_FAILURE(start_child());
  std::vector<Copy> copies = long_read(256);
  auto t0 = Clock::now();
  ASSERT_TRUE(run(TransferOp::kRead, copies).ok());
  double s = std::chrono::duration<double>(Clock::now() - t0).count();
  std::printf("[ info ] 256 x 1 MiB reads from a child: %.2f GB/s\n", 256.0 * (1 << 20) / s / 1e9);
}

TEST_F(UcxTest, ConcurrentRunsOnOneLink) {
  ASSERT_NO_FATAL_FAILURE(start_in_process());
  std::vector<std::thread> threads;
  std::vector<Status> results(4);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 5 && results[t].ok(); ++round) {
        uint64_t off = uint64_t(t) * (4 << 20);
        results[t] = run(TransferOp::kRead, {copy(off, off + 17, (3 << 20) + round)});
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) {
    ASSERT_TRUE(results[t].ok()) << results[t].to_string();
    uint64_t off = uint64_t(t) * (4 << 20);
    ASSERT_TRUE(std::equal(local_.begin() + off, local_.begin() + off + (3 << 20), remote_.begin() + off + 17));
  }
}

TEST_F(UcxTest, CancelStopsBeforeRunReturnsAndNothingLandsAfter) {
  ASSERT_NO_FATAL_FAILURE(start_in_process());
  RunControl control;
  control.deadline = Clock::now() + 60s;
  std::vector<Copy> copies = long_read(4096);
  Status result;
  std::thread runner([&] { result = link_->run(TransferOp::kRead, copies, control); });
  while (control.bytes_done.load() == 0) std::this_thread::sleep_for(100us);
  control.cancel.store(true);
  runner.join();
  EXPECT_EQ(result.code(), Code::kCancelled) << result.to_string();
  EXPECT_LT(control.bytes_done.load(), uint64_t{4096} << 20);
  expect_nothing_lands_after_return();
  // The link stays usable.
  reads_every_size();
}

TEST_F(UcxTest, CancelledWriteSendsNothingAfterReturn) {
  ASSERT_NO_FATAL_FAILURE(start_in_process());
  std::fill(local_.begin(), local_.end(), 0x11);
  RunControl control;
  control.deadline = Clock::now() + 60s;
  std::vector<Copy> copies = long_read(4096);
  Status result;
  std::thread runner([&] { result = link_->run(TransferOp::kWrite, copies, control); });
  while (control.bytes_done.load() == 0) std::this_thread::sleep_for(100us);
  control.cancel.store(true);
  runner.join();
  EXPECT_EQ(result.code(), Code::kCancelled) << result.to_string();
  std::vector<uint8_t> before = remote_;
  std::fill(local_.begin(), local_.end(), 0xee);
  std::this_thread::sleep_for(300ms);
  EXPECT_TRUE(before == remote_) << "a byte left after run() returned";
}

TEST_F(UcxTest, DeadlineEndsARunThatCannotFinish) {
  ASSERT_NO_FATAL_FAILURE(start_child());
  RunControl control;
  control.deadline = Clock::now() + 50ms;
  std::vector<Copy> copies = long_read(1 << 14);  // 16 GiB: never within 50 ms
  auto t0 = Clock::now();
  Status s = link_->run(TransferOp::kRead, copies, control);
  auto took = Clock::now() - t0;
  EXPECT_EQ(s.code(), Code::kTimeout) << s.to_string();
  EXPECT_LT(took, 2s);
  expect_nothing_lands_after_return();
  reads_every_size();
}

TEST_F(UcxTest, PeerGoneMidTransferIsAnIoErrorNamingThePeerWithinTheDeadline) {
  ASSERT_NO_FATAL_FAILURE(start_child());
  RunControl control;
  control.deadline = Clock::now() + 20s;
  std::vector<Copy> copies = long_read(1 << 14);
  Status result;
  Clock::time_point ended;
  std::thread runner([&] {
    result = link_->run(TransferOp::kRead, copies, control);
    ended = Clock::now();
  });
  while (control.bytes_done.load() == 0) std::this_thread::sleep_for(100us);
  ::kill(child_, SIGKILL);
  ::waitpid(child_, nullptr, 0);
  child_ = -1;
  auto killed = Clock::now();
  runner.join();
  EXPECT_EQ(result.code(), Code::kIoError) << result.to_string();
  EXPECT_NE(result.message().find("child"), std::string::npos) << result.to_string();
  std::printf("[ info ] peer gone noticed after %lld ms: %s\n",
              static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(ended - killed).count()),
              result.to_string().c_str());
  expect_nothing_lands_after_return();
  // The first error sticks: the next run fails at once.
  RunControl again;
  again.deadline = Clock::now() + 5s;
  Status s = link_->run(TransferOp::kRead, long_read(1), again);
  EXPECT_EQ(s.code(), Code::kIoError) << s.to_string();
}

TEST_F(UcxTest, RefreshUnpacksNewSegmentsAndDropsRemovedOnes) {
  ASSERT_NO_FATAL_FAILURE(start_in_process());
  std::vector<uint8_t> extra(1 << 16);
  for (size_t i = 0; i < extra.size(); ++i) extra[i] = static_cast<uint8_t>(i * 7 + 1);
  auto key = server_->add_segment(Segment{2, extra.data(), extra.size(), "host"});
  ASSERT_TRUE(key.ok()) << key.error().to_string();
  PeerInfo info = side_.info("server");
  info.segments.push_back({2, reinterpret_cast<uint64_t>(extra.data()), extra.size(), *key});
  ASSERT_TRUE(link_->refresh(info).ok());
  Copy c{local_.data(), reinterpret_cast<uint64_t>(extra.data()) + 100, 1000, 2};
  ASSERT_TRUE(run(TransferOp::kRead, {c}).ok());
  EXPECT_TRUE(std::equal(local_.begin(), local_.begin() + 1000, extra.begin() + 100));
  // Dropped: a copy naming it is refused, nothing moves.
  ASSERT_TRUE(link_->refresh(side_.info("server")).ok());
  ASSERT_TRUE(server_->remove_segment(2).ok());
  Status s = run(TransferOp::kRead, {c});
  EXPECT_EQ(s.code(), Code::kNotFound) << s.to_string();
  reads_every_size();
}

}  // namespace
}  // namespace kvbridge::transport
