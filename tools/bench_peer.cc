// The peer process of `kvbridge bench` and the small process helpers the
// baselines use. /proc/self/exe rather than a separate helper binary: the
// bench then needs nothing but the `kvbridge` tool. Children are
// ChildProcesses (common/child_process.h): started with vfork, never fork(2)
// (a fork marks every page of the bench's buffers copy-on-write, and the
// engine's next pass over them would pay a page fault per page that the
// baseline measured after it does not), and they die with the bench.
#include "bench_peer.h"

#include "common/text.h"
#include "device/device.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
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

Result<std::unique_ptr<PeerProcess>> PeerProcess::spawn(const std::string& transport, uint64_t bytes, uint32_t threads,
                                                        uint32_t tcp_streams) {
  std::unique_ptr<PeerProcess> p(new PeerProcess());
  KVB_ASSIGN_OR_RETURN(
      p->child_, ChildProcess::spawn(
                     {"/proc/self/exe", "bench", "peer", "--transport", transport, "--bytes", std::to_string(bytes),
                      "--threads", std::to_string(threads), "--tcp-streams", std::to_string(tcp_streams)},
                     SpawnOptions{.pipe_stdin = true, .pipe_stdout = true}));
  const std::string line = p->child_->read_line(std::chrono::seconds(30));
  std::istringstream words(line);
  std::string word, hex;
  words >> word;
  if (word != "ready") {
    if (line.empty()) return Status::timeout("bench: the " + transport + " peer process said nothing within 30 s");
    return Status::unavailable("bench: the " + transport + " peer process: " + line);
  }
  words >> p->region_ >> word >> p->address_ >> hex;
  p->metadata_ = from_hex(hex).value_or("");
  if (!words || p->metadata_.empty()) return Status::internal("bench: malformed line from the peer process: " + line);
  return p;
}

PeerProcess::~PeerProcess() {
  if (!child_) return;
  child_->close_stdin();  // the peer exits at end of stdin
  if (!child_->wait(std::chrono::milliseconds(5000))) child_->stop();
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
  // Page-aligned and touched, so the parent measures copies, not page
  // faults; device memory of device 0 for cuda_ipc.
  const bool on_device = transport == "cuda_ipc";
  void* buffer = nullptr;
  if (on_device) {
    Result<void*> p = device::current().allocate(0, bytes);
    if (!p.ok()) {
      std::printf("error %s\n", p.error().to_string().c_str());
      return 1;
    }
    buffer = *p;
    std::vector<uint8_t> fill(bytes, 0x5a);
    (void)device::current().copy_sync(buffer, fill.data(), bytes);
  } else if (::posix_memalign(&buffer, 4096, bytes) != 0) {
    std::printf("error cannot allocate %llu bytes\n", static_cast<unsigned long long>(bytes));
    return 1;
  } else {
    std::memset(buffer, 0x5a, bytes);
  }
  Result<RegionId> region = (*engine)->register_memory(buffer, bytes, on_device ? "cuda:0" : "host");
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
  if (on_device) {
    (void)device::current().free(buffer);
  } else {
    std::free(buffer);
  }
  return 0;
}

Result<std::unique_ptr<ShellChild>> ShellChild::start(const std::string& command) {
  std::unique_ptr<ShellChild> c(new ShellChild());
  KVB_ASSIGN_OR_RETURN(c->child_, ChildProcess::shell(command));
  return c;
}

bool ShellChild::wait_exit(std::chrono::milliseconds grace) { return child_->wait(grace); }

ShellChild::~ShellChild() = default;

ShellOutput run_shell(const std::string& command) {
  ShellOutput r;
  Result<std::unique_ptr<ChildProcess>> c = ChildProcess::shell(command, SpawnOptions{.pipe_stdout = true});
  if (!c.ok()) return r;
  r.out = (*c)->read_all(std::chrono::minutes(10));
  int status = 0;
  r.ok = (*c)->wait(std::chrono::minutes(1), &status) && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  return r;
}

bool have_program(const std::string& program) { return run_shell("command -v " + program + " >/dev/null").ok; }

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
