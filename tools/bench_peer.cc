// The peer process of `kvbridge bench` and the small process helpers the
// baselines use. /proc/self/exe rather than a separate helper binary: the
// bench then needs nothing but the `kvbridge` tool. Children are started
// with posix_spawn(3), never fork(2): a fork marks every page of the bench's
// buffers copy-on-write, and the engine's next pass over them would pay a
// page fault per page that the baseline measured after it does not.
#include "bench_peer.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <spawn.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <sstream>
#include <thread>

namespace kvbridge::cli::bench {
namespace {

// Reads one line from `fd` within `timeout`; empty on end of file or timeout.
std::string read_line(int fd, std::chrono::milliseconds timeout) {
  std::string line;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return {};
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    char c = 0;
    const ssize_t n = ::read(fd, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return line;  // end of file: whatever came (an error line without newline)
    if (c == '\n') return line;
    line.push_back(c);
  }
}

// Waits up to `grace` for `pid`; true when it was reaped.
bool reap(pid_t pid, std::chrono::milliseconds grace) {
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (true) {
    int status = 0;
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid || (r < 0 && errno == ECHILD)) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void stop_child(pid_t pid, std::chrono::milliseconds grace) {
  if (pid <= 0) return;
  if (reap(pid, grace)) return;
  ::kill(pid, SIGTERM);
  if (reap(pid, std::chrono::milliseconds(2000))) return;
  ::kill(pid, SIGKILL);
  reap(pid, std::chrono::milliseconds(5000));
}

}  // namespace

std::string to_hex(std::string_view bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

std::string from_hex(std::string_view hex) {
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    const int hi = nibble(hex[i]), lo = nibble(hex[i + 1]);
    if (hi < 0 || lo < 0) return {};
    out.push_back(static_cast<char>(hi << 4 | lo));
  }
  return out;
}

Result<std::unique_ptr<PeerProcess>> PeerProcess::spawn(const std::string& transport, uint64_t bytes,
                                                        uint32_t threads, uint32_t tcp_streams) {
  int in[2], out[2];
  if (::pipe2(in, O_CLOEXEC) != 0) return Status::io_error(std::string("bench: pipe: ") + std::strerror(errno));
  if (::pipe2(out, O_CLOEXEC) != 0) {
    ::close(in[0]);
    ::close(in[1]);
    return Status::io_error(std::string("bench: pipe: ") + std::strerror(errno));
  }
  const std::string bytes_text = std::to_string(bytes), threads_text = std::to_string(threads),
                    streams_text = std::to_string(tcp_streams);
  std::vector<const char*> argv = {"kvbridge",      "bench",         "peer",         "--transport",
                                   transport.c_str(), "--bytes",     bytes_text.c_str(), "--threads",
                                   threads_text.c_str(), "--tcp-streams", streams_text.c_str(), nullptr};
  posix_spawn_file_actions_t actions;
  ::posix_spawn_file_actions_init(&actions);
  ::posix_spawn_file_actions_adddup2(&actions, in[0], STDIN_FILENO);
  ::posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  pid_t pid = -1;
  const int err = ::posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, const_cast<char* const*>(argv.data()), environ);
  ::posix_spawn_file_actions_destroy(&actions);
  ::close(in[0]);
  ::close(out[1]);
  if (err != 0) {
    ::close(in[1]);
    ::close(out[0]);
    return Status::io_error(std::string("bench: cannot start /proc/self/exe: ") + std::strerror(err));
  }
  std::unique_ptr<PeerProcess> p(new PeerProcess());
  p->pid_ = pid;
  p->to_child_ = in[1];
  p->from_child_ = out[0];
  const std::string line = read_line(p->from_child_, std::chrono::seconds(30));
  std::istringstream words(line);
  std::string word, hex;
  words >> word;
  if (word != "ready") {
    if (line.empty()) return Status::timeout("bench: the " + transport + " peer process said nothing within 30 s");
    return Status::unavailable("bench: the " + transport + " peer process: " + line);
  }
  words >> p->region_ >> word >> p->address_ >> hex;
  p->metadata_ = from_hex(hex);
  if (!words || p->metadata_.empty()) return Status::internal("bench: malformed line from the peer process: " + line);
  return p;
}

PeerProcess::~PeerProcess() {
  if (to_child_ >= 0) ::close(to_child_);  // the peer exits at end of stdin
  stop_child(pid_, std::chrono::milliseconds(5000));
  if (from_child_ >= 0) ::close(from_child_);
}

int run_bench_peer(const std::string& transport, uint64_t bytes, uint32_t threads, uint32_t tcp_streams) {
  EngineOptions options;
  options.name = "bench-peer";
  options.transports = {transport};
  options.threads = threads;
  options.tcp_streams = tcp_streams;
  Result<std::unique_ptr<Engine>> engine = Engine::create(options);
  if (!engine.ok()) {
    std::printf("error %s\n", engine.error().to_string().c_str());
    return 1;
  }
  // Page-aligned and touched, so the parent measures copies, not page faults.
  void* buffer = nullptr;
  if (::posix_memalign(&buffer, 4096, bytes) != 0) {
    std::printf("error cannot allocate %llu bytes\n", static_cast<unsigned long long>(bytes));
    return 1;
  }
  std::memset(buffer, 0x5a, bytes);
  Result<RegionId> region = (*engine)->register_memory(buffer, bytes);
  if (!region.ok()) {
    std::printf("error %s\n", region.error().to_string().c_str());
    return 1;
  }
  std::printf("ready %u %d %llu %s\n", *region, static_cast<int>(::getpid()),
              static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(buffer)),
              to_hex((*engine)->metadata()).c_str());
  std::fflush(stdout);
  std::string ignored;
  while (std::getline(std::cin, ignored)) {
  }
  engine->reset();  // before the buffer goes: no transfer may use it after
  std::free(buffer);
  return 0;
}

Result<std::unique_ptr<ShellChild>> ShellChild::start(const std::string& command) {
  posix_spawn_file_actions_t actions;
  ::posix_spawn_file_actions_init(&actions);
  for (int fd : {STDIN_FILENO, STDOUT_FILENO, STDERR_FILENO}) {
    ::posix_spawn_file_actions_addopen(&actions, fd, "/dev/null", O_RDWR, 0);
  }
  const char* argv[] = {"sh", "-c", command.c_str(), nullptr};
  pid_t pid = -1;
  const int err = ::posix_spawn(&pid, "/bin/sh", &actions, nullptr, const_cast<char* const*>(argv), environ);
  ::posix_spawn_file_actions_destroy(&actions);
  if (err != 0) return Status::io_error(std::string("bench: cannot start /bin/sh: ") + std::strerror(err));
  std::unique_ptr<ShellChild> c(new ShellChild());
  c->pid_ = pid;
  return c;
}

bool ShellChild::wait_exit(std::chrono::milliseconds grace) {
  if (!reaped_) reaped_ = reap(pid_, grace);
  return reaped_;
}

ShellChild::~ShellChild() {
  if (!reaped_) stop_child(pid_, std::chrono::milliseconds(0));
}

ShellOutput run_shell(const std::string& command) {
  ShellOutput r;
  FILE* f = ::popen((command + " 2>/dev/null").c_str(), "r");
  if (!f) return r;
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) r.out.append(buf, n);
  const int status = ::pclose(f);
  r.ok = status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  return r;
}

bool have_program(const std::string& program) {
  return run_shell("command -v " + program + " >/dev/null").ok;
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  ::close(fd);
  return port;
}

}  // namespace kvbridge::cli::bench
