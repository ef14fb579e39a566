// The demo's flood and pauser processes (see demo_flood.h).
#include "demo_flood.h"

#include "net/address.h"
#include "proc_info.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>
#include <vector>

namespace kvbridge::cli::demo {
namespace {

volatile sig_atomic_t g_stop = 0;
void on_term(int) { g_stop = 1; }

// The child's side of a fork: dies with the driver, ends on SIGTERM.
void become_helper() {
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  struct sigaction sa {};
  sa.sa_handler = on_term;
  ::sigaction(SIGTERM, &sa, nullptr);
}

}  // namespace

Result<Helper> start_flood(const std::string& address, uint32_t n) {
  KVB_ASSIGN_OR_RETURN(const net::HostPort to, net::parse_host_port(address, "flood address"));
  const std::string host = to.host, port = std::to_string(to.port);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0) {
    return Status::invalid_argument("flood: cannot resolve '" + address + "'");
  }
  int report[2];
  if (::pipe2(report, O_CLOEXEC) != 0) return Status::io_error("flood: pipe failed");
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return Status::io_error("flood: fork failed");
  if (pid == 0) {
    become_helper();
    ::close(report[0]);
    rlimit r{};
    ::getrlimit(RLIMIT_NOFILE, &r);
    r.rlim_cur = r.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &r);
    std::vector<int> fds;
    fds.reserve(n);
    for (uint32_t i = 0; i < n && !g_stop; ++i) {
      const int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (fd < 0) break;
      if (::connect(fd, res->ai_addr, res->ai_addrlen) != 0 && errno != EINPROGRESS) {
        ::close(fd);
        break;
      }
      fds.push_back(fd);
    }
    const uint64_t opened = fds.size();
    [[maybe_unused]] ssize_t w = ::write(report[1], &opened, sizeof opened);
    ::close(report[1]);
    while (!g_stop) ::pause();
    ::_exit(0);
  }
  ::freeaddrinfo(res);
  ::close(report[1]);
  Helper h;
  h.pid = pid;
  if (::read(report[0], &h.opened, sizeof h.opened) != static_cast<ssize_t>(sizeof h.opened)) h.opened = 0;
  ::close(report[0]);
  return h;
}

Result<Helper> start_pauser(pid_t victim, std::chrono::milliseconds stopped, std::chrono::milliseconds period) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return Status::io_error("pauser: fork failed");
  if (pid == 0) {
    become_helper();
    while (!g_stop) {
      ::kill(victim, SIGSTOP);
      std::this_thread::sleep_for(stopped);
      ::kill(victim, SIGCONT);
      if (!g_stop) std::this_thread::sleep_for(period - stopped);
    }
    ::kill(victim, SIGCONT);
    ::_exit(0);
  }
  return Helper{pid, 0};
}

void stop(Helper& helper) {
  if (helper.pid <= 0) return;
  ::kill(helper.pid, SIGTERM);
  ::waitpid(helper.pid, nullptr, 0);
  helper.pid = -1;
}

Status Flood::start(const std::vector<Target>& targets, uint32_t n) {
  targets_ = targets;
  for (const Target& t : targets_) {
    for (const std::string& address : t.listeners) {
      KVB_ASSIGN_OR_RETURN(Helper h, start_flood(address, n));
      connections_ += h.opened;
      helpers_.push_back(h);
    }
  }
  // The listeners' answer to the flood (accepting, closing the oldest) is
  // part of what is measured.
  started_ = std::chrono::steady_clock::now();
  for (const Target& t : targets_) cpu_before_.push_back(thread_cpu_seconds(t.pid, "kvb-"));
  return Status();
}

void Flood::stop(double* busiest_pct, std::string* busiest) {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  *busiest_pct = 0;
  for (size_t i = 0; i < targets_.size(); ++i) {
    for (const auto& [thread, cpu] : thread_cpu_seconds(targets_[i].pid, "kvb-")) {
      if (thread.find("listen") == std::string::npos) continue;
      auto was = cpu_before_[i].find(thread);
      const double pct = 100.0 * (cpu - (was == cpu_before_[i].end() ? 0.0 : was->second)) / std::max(seconds, 1e-3);
      if (pct >= *busiest_pct) {
        *busiest_pct = pct;
        *busiest = thread + " of pid " + std::to_string(targets_[i].pid);
      }
    }
  }
  for (Helper& h : helpers_) demo::stop(h);
  helpers_.clear();
}

}  // namespace kvbridge::cli::demo
