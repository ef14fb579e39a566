// What is particular to the cma transport: its address blob and the
// identity it carries (host, pid, start time, canary), pid reuse, and
// unmapped peer memory, against a forked child that holds memory with a
// known pattern. What every Link must do (sizes, batches, concurrency,
// cancel, deadlines, a killed peer) is the Link conformance suite's
// (tests/conformance/link/).
#include <signal.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <thread>

#include "testing/link_run.h"
#include "testing/pattern.h"
#include "testing/require.h"
#include "transport/transport.h"

namespace kvbridge::transport {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kChildBytes = uint64_t{32} << 20;

using testing::pattern;

// A child that fills kChildBytes with pattern(), makes its own cma
// transport, reports the buffer's address and the transport's address blob
// (with its own pid, start time and canary) through a pipe, and waits until
// its command pipe closes (or it is killed). Command 'c' overwrites its
// canary, as if another process now had its pid.
struct Child {
  pid_t pid = -1;
  uint64_t base = 0;
  std::string address;

  void start() {
    int up[2], down[2];
    ASSERT_EQ(::pipe(up), 0);
    ASSERT_EQ(::pipe(down), 0);
    pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(up[0]);
      ::close(down[1]);
      auto* mem = static_cast<uint8_t*>(::malloc(kChildBytes));
      for (uint64_t i = 0; i < kChildBytes; ++i) mem[i] = pattern(i);
      auto t = make_cma_transport();
      const std::string a = t.ok() ? (*t)->address() : std::string();
      const uint64_t addr = reinterpret_cast<uint64_t>(mem);
      const uint32_t len = static_cast<uint32_t>(a.size());
      if (::write(up[1], &addr, sizeof addr) != sizeof addr) ::_exit(1);
      if (::write(up[1], &len, sizeof len) != sizeof len) ::_exit(1);
      if (::write(up[1], a.data(), a.size()) != static_cast<ssize_t>(a.size())) ::_exit(1);
      char c;
      while (::read(down[0], &c, 1) > 0) {
        const size_t at = a.find("canary=");
        if (c == 'c' && at != std::string::npos) {
          auto* canary = reinterpret_cast<uint8_t*>(std::strtoull(a.c_str() + at + 7, nullptr, 10));
          for (int i = 0; i < 16; ++i) canary[i] ^= 0x5a;
        }
      }
      ::_exit(0);
    }
    ::close(up[1]);
    ::close(down[0]);
    command_fd = down[1];
    ASSERT_EQ(::read(up[0], &base, sizeof base), static_cast<ssize_t>(sizeof base));
    uint32_t len = 0;
    ASSERT_EQ(::read(up[0], &len, sizeof len), static_cast<ssize_t>(sizeof len));
    address.resize(len);
    for (size_t got = 0; got < len;) {
      const ssize_t n = ::read(up[0], address.data() + got, len - got);
      ASSERT_GT(n, 0);
      got += static_cast<size_t>(n);
    }
    ::close(up[0]);
  }
  void command(char c) { ASSERT_EQ(::write(command_fd, &c, 1), 1); }
  void kill() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      pid = -1;
    }
    if (command_fd >= 0) ::close(command_fd);
    command_fd = -1;
  }
  int command_fd = -1;
};

class CmaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto t = make_cma_transport();
    if (!t.ok()) KVB_SKIP_UNLESS_REQUIRED("cma", "cma cannot run here: " + t.error().to_string());
    transport_ = std::move(*t);
    ASSERT_NO_FATAL_FAILURE(child_.start());
    local_.assign(kChildBytes, 0);
    auto link = transport_->connect(peer());
    // The kernel's ptrace check is per pair of processes (cma.cc).
    if (!link.ok() && link.error().code() == Code::kUnavailable)
      KVB_SKIP_UNLESS_REQUIRED("cma", "cma cannot reach its child here: " + link.error().to_string());
    ASSERT_TRUE(link.ok()) << link.error().to_string();
    link_ = std::move(*link);
  }
  void TearDown() override { child_.kill(); }

  // What the engine would pass: the child's pid and the address blob its
  // own transport made.
  PeerInfo peer() const {
    PeerInfo p;
    p.name = "child";
    p.pid = static_cast<uint64_t>(child_.pid);
    p.address = child_.address;
    p.segments.push_back({1, child_.base, kChildBytes, ""});
    return p;
  }

  Copy copy(uint64_t local_offset, uint64_t remote_offset, uint64_t bytes) {
    return Copy{local_.data() + local_offset, child_.base + remote_offset, bytes, 1};
  }

  Status run(TransferOp op, const std::vector<Copy>& copies, std::chrono::milliseconds timeout = 20s) {
    return testing::run_link(*link_, op, copies, timeout);
  }

  std::unique_ptr<Transport> transport_;
  std::unique_ptr<Link> link_;
  Child child_;
  std::vector<uint8_t> local_;
};

TEST_F(CmaTest, AddressNamesThisHostAndProcess) {
  std::string a = transport_->address();
  EXPECT_NE(a.find("pid=" + std::to_string(::getpid())), std::string::npos) << a;
  EXPECT_NE(a.find("boot="), std::string::npos) << a;
  EXPECT_TRUE(transport_->can_reach(peer()).ok());
}

TEST_F(CmaTest, CannotReachAnotherHostAndSaysWhy) {
  PeerInfo p = peer();
  std::string a = p.address;
  size_t boot = a.find("boot=") + 5;
  a[boot] = a[boot] == '0' ? '1' : '0';
  p.address = a;
  Status s = transport_->can_reach(p);
  EXPECT_EQ(s.code(), Code::kUnavailable);
  EXPECT_NE(s.message().find("another host"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("'child'"), std::string::npos) << s.message();
}

TEST_F(CmaTest, CannotReachAProcessThatDoesNotExist) {
  PeerInfo p = peer();
  p.pid = 0;
  EXPECT_EQ(transport_->can_reach(p).code(), Code::kUnavailable);
  Child gone;
  gone.start();
  p = peer();
  p.pid = static_cast<uint64_t>(gone.pid);
  p.address.clear();
  gone.kill();
  Status s = transport_->can_reach(p);
  EXPECT_EQ(s.code(), Code::kUnavailable) << s.to_string();
  EXPECT_NE(s.message().find(std::to_string(p.pid)), std::string::npos) << s.message();
}

// Every message of a link names the peer; cma's names its pid too, the
// identity that the canary and the pidfd guard.
TEST_F(CmaTest, AReadFromAPeerThatExitedIsAnIoErrorNamingItsPid) {
  ASSERT_TRUE(run(TransferOp::kRead, {copy(0, 0, 4096)}).ok());
  const pid_t pid = child_.pid;
  child_.kill();
  Status s = run(TransferOp::kRead, {copy(0, 0, 4096)});
  EXPECT_EQ(s.code(), Code::kIoError) << s.to_string();
  EXPECT_NE(s.message().find("'child' (pid " + std::to_string(pid) + ")"), std::string::npos) << s.message();
  EXPECT_EQ(run(TransferOp::kWrite, {copy(0, 0, 4096)}).code(), Code::kIoError);
}

// The liveness canary (cma.cc): a read's last syscall also reads the 16
// random bytes the peer advertised; if they differ, the pid names another
// process and the read fails rather than report its bytes as the peer's.
TEST_F(CmaTest, AReadFailsWhenThePidNoLongerHoldsThePeersCanary) {
  EXPECT_NE(child_.address.find("canary="), std::string::npos) << child_.address;
  ASSERT_TRUE(run(TransferOp::kRead, {copy(0, 0, 4096)}).ok());
  std::vector<Copy> many;
  for (uint64_t i = 0; i < 3000; ++i) many.push_back(copy(i * 8192, i * 4096, 4096));  // > IOV_MAX: several syscalls
  ASSERT_TRUE(run(TransferOp::kRead, many).ok());
  child_.command('c');
  Status s;
  for (int i = 0; i < 200 && s.ok(); ++i) {  // the command takes effect when the child reads it
    s = run(TransferOp::kRead, {copy(0, 0, 4096)});
    if (s.ok()) std::this_thread::sleep_for(5ms);
  }
  EXPECT_EQ(s.code(), Code::kIoError) << s.to_string();
  EXPECT_NE(s.message().find("no longer holds the peer's canary"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("pid " + std::to_string(child_.pid)), std::string::npos) << s.message();
  EXPECT_EQ(run(TransferOp::kRead, many).code(), Code::kIoError);
  // Writes are checked against the pidfd; the process is alive, so they go.
  EXPECT_TRUE(run(TransferOp::kWrite, {copy(0, 0, 4096)}).ok());
}

TEST_F(CmaTest, ConnectRefusesAPeerWithoutItsCanaryOrWithAMalformedOne) {
  // This process's blob with the child's pid: the child's memory holds a
  // different canary (forked children re-randomise theirs).
  PeerInfo p = peer();
  std::string mine = transport_->address();
  p.address.clear();
  for (size_t pos = 0; pos < mine.size();) {
    size_t end = mine.find(' ', pos);
    if (end == std::string::npos) end = mine.size();
    std::string token = mine.substr(pos, end - pos);
    if (token.rfind("pid=", 0) == 0) token = "pid=" + std::to_string(child_.pid);
    if (token.rfind("start=", 0) != 0) p.address += token + " ";
    pos = end + 1;
  }
  Status s = transport_->can_reach(p);
  EXPECT_EQ(s.code(), Code::kUnavailable) << s.to_string();
  EXPECT_NE(s.message().find("does not hold the canary it advertised"), std::string::npos) << s.message();
  for (const char* bad :
       {"canary=12:zz", "canary=0:00112233445566778899aabbccddeeff", "canary=1234", "canary=99:00112233"}) {
    p = peer();
    p.address = p.address.substr(0, p.address.find("canary=")) + bad;
    s = transport_->can_reach(p);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << bad << ": " << s.to_string();
    EXPECT_NE(s.message().find("malformed canary"), std::string::npos) << s.message();
  }
}

TEST_F(CmaTest, UnmappedPeerMemoryIsAnIoError) {
  Copy bad{local_.data(), 0x1000, 16, 1};
  Status s = run(TransferOp::kRead, {bad});
  EXPECT_EQ(s.code(), Code::kIoError) << s.to_string();
}

}  // namespace
}  // namespace kvbridge::transport
