// The cma transport: another process on the same host, through Linux's
// cross-memory attach, process_vm_readv(2) / process_vm_writev(2).
//
// Permission: the kernel allows these calls when the caller may ptrace the
// target with PTRACE_MODE_ATTACH_REALCREDS (same uid and a dumpable target, or
// CAP_SYS_PTRACE), further restricted by Yama's kernel.yama.ptrace_scope
// (1: only descendants or a process that named us with PR_SET_PTRACER; 2:
// only CAP_SYS_PTRACE; 3: never), and seccomp filters may refuse the syscall
// outright. So make_cma_transport() probes the syscall on itself (catches
// ENOSYS and seccomp) and reads the Yama policy, and can_reach() makes a real
// one-byte read from the peer, which is the only reliable answer for a pair.
//
// Host and process identity: the address blob carries the pid, the process's
// start time, the boot id (/proc/sys/kernel/random/boot_id) and the pid
// namespace, so a peer on another host, in another pid namespace, or a stale
// pid now used by another process is refused with a clear reason. A Link holds
// a pidfd (pidfd_open(2)); it turns readable when the peer exits, so a run
// never reads or writes a recycled pid.
//
// Threads: a run of at least kParallelBytes is split by bytes over up to
// kMaxThreads threads of its own (capped by the CPUs this process may run on:
// a rank pinned to one core copies on one thread), because one
// thread's process_vm_readv does not saturate memory bandwidth; smaller runs
// use the calling engine thread only. Runs on one Link may overlap.
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "common/host.h"
#include "common/iov.h"
#include "transport/copies.h"
#include "transport/transport.h"

namespace kvbridge::transport {
namespace {

constexpr uint64_t kParallelBytes = uint64_t{8} << 20;
constexpr unsigned kMaxThreads = 4;
// At most this many bytes per syscall, so that cancel and the deadline are
// seen within a few milliseconds.
constexpr uint64_t kSyscallBytes = uint64_t{64} << 20;

std::string pid_namespace(pid_t pid) {
  char buf[128] = {};
  std::string path = "/proc/" + std::to_string(pid) + "/ns/pid";
  ssize_t n = ::readlink(path.c_str(), buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

// Field 22 of /proc/<pid>/stat: start time in clock ticks since boot; with
// the pid it names one process for the life of the boot.
std::string start_time(pid_t pid) {
  std::string stat = read_first_line("/proc/" + std::to_string(pid) + "/stat");
  size_t close = stat.rfind(')');
  if (close == std::string::npos) return {};
  std::istringstream rest(stat.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && (rest >> field); ++i) {
    if (i == 22) return field;
  }
  return {};
}

// The Yama policy, or -1 when Yama is not present.
int ptrace_scope() {
  std::string v = read_first_line("/proc/sys/kernel/yama/ptrace_scope");
  if (v.empty()) return -1;
  return std::atoi(v.c_str());
}

bool has_cap_sys_ptrace() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("CapEff:", 0) == 0) {
      uint64_t caps = std::strtoull(line.c_str() + 7, nullptr, 16);
      return (caps >> 19) & 1;  // CAP_SYS_PTRACE
    }
  }
  return false;
}

std::string policy_text() {
  int scope = ptrace_scope();
  std::string s = scope < 0 ? "no Yama ptrace policy" : "kernel.yama.ptrace_scope=" + std::to_string(scope);
  s += has_cap_sys_ptrace() ? ", CAP_SYS_PTRACE held" : ", no CAP_SYS_PTRACE";
  return s;
}

constexpr size_t kCanaryBytes = 16;
using CanaryValue = std::array<uint8_t, kCanaryBytes>;

// Where a peer's canary lives and what it holds.
struct CanaryRef {
  uint64_t address = 0;
  CanaryValue value{};
};

void randomize(CanaryValue* c) {
  size_t got = 0;
  while (got < c->size()) {
    ssize_t n = ::getrandom(c->data() + got, c->size() - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
}

// This process's canary: on a page of its own (never freed, so a peer can
// read it for the life of the process), re-randomised in forked children,
// whose copy of the page would otherwise claim to be this process.
CanaryValue* process_canary() {
  static CanaryValue* canary = [] {
    void* page = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    auto* c = page == MAP_FAILED ? new CanaryValue() : static_cast<CanaryValue*>(page);
    randomize(c);
    ::pthread_atfork(nullptr, nullptr, [] { randomize(process_canary()); });
    return c;
  }();
  return canary;
}

std::string format_canary() {
  static const char* digits = "0123456789abcdef";
  const CanaryValue& c = *process_canary();
  std::string out = std::to_string(reinterpret_cast<uint64_t>(&c)) + ":";
  for (uint8_t b : c) {
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

// "ADDR:HEX" (decimal address, 32 hex digits); nullopt when malformed.
std::optional<CanaryRef> parse_canary(std::string_view text) {
  const size_t colon = text.find(':');
  if (colon == std::string_view::npos || text.size() - colon - 1 != 2 * kCanaryBytes) return std::nullopt;
  CanaryRef ref;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + colon, ref.address);
  if (ec != std::errc() || end != text.data() + colon || ref.address == 0) return std::nullopt;
  auto nibble = [](char ch) -> int {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < kCanaryBytes; ++i) {
    const int hi = nibble(text[colon + 1 + 2 * i]), lo = nibble(text[colon + 2 + 2 * i]);
    if (hi < 0 || lo < 0) return std::nullopt;
    ref.value[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return ref;
}

struct Identity {
  std::string pid, start, boot, pidns, host, canary;
};

std::string format_identity(const Identity& id) {
  std::string out =
      "pid=" + id.pid + " start=" + id.start + " boot=" + id.boot + " pidns=" + id.pidns + " host=" + id.host;
  if (!id.canary.empty()) out += " canary=" + id.canary;
  return out;
}

Identity parse_identity(std::string_view blob) {
  Identity id;
  std::istringstream in{std::string(blob.substr(0, 1024))};
  std::string token;
  while (in >> token) {
    size_t eq = token.find('=');
    if (eq == std::string::npos) continue;
    std::string key = token.substr(0, eq), value = token.substr(eq + 1);
    if (key == "pid")
      id.pid = value;
    else if (key == "start")
      id.start = value;
    else if (key == "boot")
      id.boot = value;
    else if (key == "pidns")
      id.pidns = value;
    else if (key == "host")
      id.host = value;
    else if (key == "canary")
      id.canary = value;
  }
  return id;
}

std::string peer_text(const std::string& name, uint64_t pid) {
  return "cma peer '" + name + "' (pid " + std::to_string(pid) + ")";
}

class CmaLink final : public Link {
 public:
  CmaLink(pid_t pid, int pidfd, std::string name, std::optional<CanaryRef> canary)
      : pid_(pid), pidfd_(pidfd), who_(peer_text(name, pid)), canary_(canary) {}
  ~CmaLink() override {
    if (pidfd_ >= 0) ::close(pidfd_);
  }

  // The peer's identity is checked where it proves most. A read: its last
  // syscall also reads the peer's canary (see the top of this file), or,
  // for a peer that advertises none, the pidfd is polled after the last
  // syscall (not readable then: the peer lived through every syscall, so
  // its pid named it throughout). A write: the pidfd before the first
  // syscall (bytes cannot be recalled; a pid is reused only after its
  // process exited and was reaped, and a peer that exits mid-run fails the
  // syscall with ESRCH).
  Status run(TransferOp op, std::span<const Copy> copies, RunControl& control) override {
    if (op == TransferOp::kWrite) KVB_RETURN_IF_ERROR(check_alive());
    Status s = run_checked(op, copies, control);
    if (s.ok() && op == TransferOp::kRead && !canary_) KVB_RETURN_IF_ERROR(check_alive());
    return s;
  }

  Status refresh(const PeerInfo&) override { return Status(); }
  bool runs_inline() const override { return true; }

 private:
  Status run_checked(TransferOp op, std::span<const Copy> copies, RunControl& control) {
    uint64_t total = 0;
    for (const Copy& c : copies) total += c.bytes;
    if (total == 0) return Status();
    unsigned threads = 1;
    if (total >= kParallelBytes) {
      threads = std::min(usable_cpus(), kMaxThreads);
      threads = static_cast<unsigned>(std::min<uint64_t>(threads, total / (kParallelBytes / 2)));
    }
    if (threads <= 1) return run_share(op, copies, control, nullptr);
    // Shares of about equal bytes; copies are cut at share boundaries.
    return run_shares(split_by_bytes(copies, threads),
                      [&](size_t, std::span<const Copy> share, const std::atomic<bool>& abort) {
                        return run_share(op, share, control, &abort);
                      });
  }

  Status check_alive() const {
    if (pidfd_ < 0) return Status();
    pollfd p{pidfd_, POLLIN, 0};
    if (::poll(&p, 1, 0) > 0) return Status::io_error(who_ + " is gone: its process exited");
    return Status();
  }

  Status run_share(TransferOp op, std::span<const Copy> copies, RunControl& control,
                   const std::atomic<bool>* abort) const {
    IovCursor local, remote;
    for (const Copy& c : copies) {
      local.push(c.local, c.bytes);
      remote.push(reinterpret_cast<void*>(c.remote), c.bytes);
    }
    uint64_t remaining = 0;
    for (const Copy& c : copies) remaining += c.bytes;
    iovec lw[IOV_MAX], rw[IOV_MAX];  // 32 KiB of stack, no allocation per run
    const bool read = op == TransferOp::kRead;
    const char* verb = read ? "process_vm_readv" : "process_vm_writev";
    bool verified = false;  // a read's canary matched
    // Cancel and the deadline are checked before every syscall but the
    // first: the engine checked both just before starting the run.
    for (bool first = true; !local.done(); first = false) {
      if (control.cancel.load(std::memory_order_relaxed)) return Status::cancelled(who_ + ": cancelled");
      if (abort && abort->load(std::memory_order_relaxed)) return Status::cancelled(who_ + ": aborted");
      if (!first && Clock::now() >= control.deadline)
        return Status::timeout(who_ + ": deadline passed with " + std::to_string(control.bytes_done.load()) +
                               " bytes done");
      // One entry of each window is kept for the canary.
      uint64_t lb = 0, rb = 0;
      size_t ln = local.window(kSyscallBytes, IOV_MAX - 1, lw, &lb);
      size_t rn = remote.window(kSyscallBytes, IOV_MAX - 1, rw, &rb);
      const uint64_t data = std::min(lb, rb);
      // The last syscall of a read (it covers what remains) reads the canary too.
      const bool with_canary = read && canary_ && lb == remaining && rb == remaining;
      CanaryValue seen{};
      if (with_canary) {
        lw[ln++] = iovec{seen.data(), kCanaryBytes};
        rw[rn++] = iovec{reinterpret_cast<void*>(canary_->address), kCanaryBytes};
      }
      ssize_t n = read ? ::process_vm_readv(pid_, lw, ln, rw, rn, 0) : ::process_vm_writev(pid_, lw, ln, rw, rn, 0);
      if (with_canary && n >= 0 && static_cast<uint64_t>(n) >= data) {
        // Every data byte was read; the canary decides whether they count.
        if (static_cast<uint64_t>(n) != data + kCanaryBytes || seen != canary_->value) {
          KVB_RETURN_IF_ERROR(check_alive());
          return Status::io_error(who_ + ": pid " + std::to_string(pid_) +
                                  " no longer holds the peer's canary: it names another process (the peer "
                                  "exited and its pid was reused); the read fails, its bytes are not the peer's");
        }
        verified = true;
        n = static_cast<ssize_t>(data);
      }
      if (n < 0) {
        int err = errno;
        if (err == EINTR || err == ENOMEM || err == EAGAIN) continue;
        if (err == ESRCH) return Status::io_error(who_ + " is gone (" + verb + ": ESRCH)");
        if (err == EPERM) return Status::unavailable(who_ + ": " + verb + " not permitted (" + policy_text() + ")");
        KVB_RETURN_IF_ERROR(check_alive());
        return Status::io_error(who_ + ": " + verb + ": " + std::strerror(err));
      }
      if (n == 0) {
        // The kernel stops at the first remote range it cannot access.
        KVB_RETURN_IF_ERROR(check_alive());
        return Status::io_error(who_ + ": " + verb + " made no progress: remote memory at " +
                                std::to_string(reinterpret_cast<uint64_t>(rw[0].iov_base)) + " is not mapped");
      }
      local.advance(static_cast<uint64_t>(n));
      remote.advance(static_cast<uint64_t>(n));
      remaining -= static_cast<uint64_t>(n);
      control.bytes_done.fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
    }
    // Not reached: the syscall that read the last bytes covered what remained.
    if (read && canary_ && !verified) return Status::internal(who_ + ": a read ended without its canary check");
    return Status();
  }

  pid_t pid_;
  int pidfd_;
  std::string who_;
  std::optional<CanaryRef> canary_;  // none: the peer advertised none (older kvbridge)
};

class CmaTransport final : public Transport {
 public:
  explicit CmaTransport(Identity self) : self_(std::move(self)) {}

  std::string_view name() const override { return "cma"; }
  std::string address() const override { return format_identity(self_); }

  Status can_reach(const PeerInfo& peer) const override {
    std::string who = peer_text(peer.name, peer.pid);
    if (peer.pid == 0 || peer.pid > static_cast<uint64_t>(INT_MAX))
      return Status::unavailable(who + ": no valid pid advertised");
    Identity other = parse_identity(peer.address);
    if (!other.boot.empty()) {
      if (other.boot != self_.boot)
        return Status::unavailable(who + " is on another host (host '" + other.host + "' boot id " + other.boot +
                                   ", here '" + self_.host + "' boot id " + self_.boot + ")");
      if (!other.pidns.empty() && other.pidns != self_.pidns)
        return Status::unavailable(who + " is in another pid namespace (" + other.pidns + " vs " + self_.pidns + ")");
    } else if (!peer.hostname.empty() && peer.hostname != self_.host) {
      return Status::unavailable(who + " is on another host ('" + peer.hostname + "', here '" + self_.host + "')");
    }
    if (!other.pid.empty() && other.pid != std::to_string(peer.pid))
      return Status::unavailable(who + ": advertised pid " + other.pid + " differs from the peer's pid");
    pid_t pid = static_cast<pid_t>(peer.pid);
    if (!other.start.empty() && start_time(pid) != other.start)
      return Status::unavailable(who + " is gone (pid reused or process exited)");
    if (!other.canary.empty()) {
      std::optional<CanaryRef> canary = parse_canary(other.canary);
      if (!canary) {
        return Status::invalid_argument(who + " advertises a malformed canary '" + other.canary.substr(0, 80) +
                                        "' (expected ADDRESS:32 hex digits)");
      }
      CanaryValue seen{};
      iovec l{seen.data(), kCanaryBytes}, r{reinterpret_cast<void*>(canary->address), kCanaryBytes};
      const ssize_t n = ::process_vm_readv(pid, &l, 1, &r, 1, 0);
      if (n == static_cast<ssize_t>(kCanaryBytes) && seen != canary->value)
        return Status::unavailable(who + " does not hold the canary it advertised: pid " + std::to_string(pid) +
                                   " names another process");
      // Other failures (EPERM, ESRCH, EFAULT) are explained by the probe below.
    }
    // A real one-byte read: the only reliable answer to "may we".
    for (const PeerSegment& seg : peer.segments) {
      if (seg.bytes == 0) continue;
      uint8_t byte = 0;
      iovec l{&byte, 1}, r{reinterpret_cast<void*>(seg.base), 1};
      if (::process_vm_readv(pid, &l, 1, &r, 1, 0) == 1) return Status();
      int err = errno;
      if (err == EPERM)
        return Status::unavailable(who + ": the kernel refuses process_vm_readv (EPERM; " + policy_text() +
                                   "): the peer must run as the same user and be dumpable, or this process "
                                   "needs CAP_SYS_PTRACE, or the peer must call prctl(PR_SET_PTRACER)");
      if (err == ESRCH) return Status::unavailable(who + " does not exist (ESRCH)");
      if (err != EFAULT) return Status::unavailable(who + ": probe failed: " + std::strerror(err));
      // EFAULT: permitted, but that segment is not mapped; try the next one.
    }
    if (::kill(pid, 0) != 0 && errno == ESRCH) return Status::unavailable(who + " does not exist");
    return Status();
  }

  Result<std::string> add_segment(const Segment& segment) override {
    if (segment.memory != "host")
      return Status::invalid_argument("cma: segment " + std::to_string(segment.id) + " is '" + segment.memory +
                                      "' memory; cma moves host memory only");
    return std::string();
  }
  Status remove_segment(uint32_t) override { return Status(); }

  Result<std::unique_ptr<Link>> connect(const PeerInfo& peer) override {
    KVB_RETURN_IF_ERROR(can_reach(peer));
    pid_t pid = static_cast<pid_t>(peer.pid);
    int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
    if (pidfd < 0 && errno == ESRCH) return Status::unavailable(peer_text(peer.name, peer.pid) + " does not exist");
    // Without pidfd_open (ENOSYS before Linux 5.3) the start time check above
    // is the only guard against a recycled pid.
    std::optional<CanaryRef> canary;
    const Identity other = parse_identity(peer.address);
    if (!other.canary.empty()) canary = parse_canary(other.canary);  // well formed: can_reach checked
    return std::unique_ptr<Link>(std::make_unique<CmaLink>(pid, pidfd, peer.name, canary));
  }

 private:
  Identity self_;
};

}  // namespace

Result<std::unique_ptr<Transport>> make_cma_transport() {
  int scope = ptrace_scope();
  if (scope == 3)
    return Status::unavailable("cma: kernel.yama.ptrace_scope=3 forbids process_vm_readv between processes");
  if (scope == 2 && !has_cap_sys_ptrace())
    return Status::unavailable(
        "cma: kernel.yama.ptrace_scope=2 allows process_vm_readv only with CAP_SYS_PTRACE, which this process lacks");
  // The syscall itself, on ourselves: ENOSYS (kernel without
  // CONFIG_CROSS_MEMORY_ATTACH) or EPERM (a seccomp filter, as in some
  // container runtimes) mean it cannot work at all.
  static const uint64_t probe_value = 0x6b76627269646765;
  uint64_t got = 0;
  iovec l{&got, sizeof got}, r{const_cast<uint64_t*>(&probe_value), sizeof probe_value};
  ssize_t n = ::process_vm_readv(::getpid(), &l, 1, &r, 1, 0);
  if (n != static_cast<ssize_t>(sizeof got) || got != probe_value) {
    int err = errno;
    if (n < 0 && err == ENOSYS)
      return Status::unavailable("cma: this kernel has no process_vm_readv (CONFIG_CROSS_MEMORY_ATTACH is off)");
    if (n < 0 && err == EPERM)
      return Status::unavailable("cma: process_vm_readv is refused even on this process (EPERM: a seccomp filter?)");
    return Status::unavailable(std::string("cma: process_vm_readv probe failed: ") +
                               (n < 0 ? std::strerror(err) : "short read"));
  }
  Identity self;
  self.pid = std::to_string(::getpid());
  self.start = start_time(::getpid());
  self.boot = boot_id();
  self.pidns = pid_namespace(::getpid());
  self.host = this_hostname();
  self.canary = format_canary();
  for (char& c : self.host) {
    if (c == ' ' || c == '=') c = '_';
  }
  for (char& c : self.pidns) {
    if (c == ' ') c = '_';
  }
  return std::unique_ptr<Transport>(std::make_unique<CmaTransport>(std::move(self)));
}

}  // namespace kvbridge::transport
