// Child processes that die with their parent (see child_process.h).
#include "common/child_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

namespace kvbridge {

Result<std::unique_ptr<ChildProcess>> ChildProcess::spawn(const std::vector<std::string>& argv,
                                                          const SpawnOptions& options) {
  if (argv.empty()) return Status::invalid_argument("spawn: no program");
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  int in[2] = {-1, -1}, out[2] = {-1, -1};
  if ((options.pipe_stdin && ::pipe2(in, O_CLOEXEC) != 0) || (options.pipe_stdout && ::pipe2(out, O_CLOEXEC) != 0)) {
    return Status::io_error("spawn " + argv[0] + ": pipe: " + std::strerror(errno));
  }
  const int devnull = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  const pid_t parent = ::getpid();
  // vfork: the child shares this memory until it execs, and may only make
  // system calls; everything it needs is prepared above.
  const pid_t pid = ::vfork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(126);  // the parent already went
    ::dup2(options.pipe_stdin ? in[0] : devnull, STDIN_FILENO);
    ::dup2(options.pipe_stdout ? out[1] : devnull, STDOUT_FILENO);
    if (!options.inherit_stderr) ::dup2(devnull, STDERR_FILENO);
    ::execvp(args[0], args.data());
    ::_exit(127);
  }
  const int err = errno;
  if (devnull >= 0) ::close(devnull);
  if (in[0] >= 0) ::close(in[0]);
  if (out[1] >= 0) ::close(out[1]);
  if (pid < 0) {
    if (in[1] >= 0) ::close(in[1]);
    if (out[0] >= 0) ::close(out[0]);
    return Status::unavailable("spawn " + argv[0] + ": vfork: " + std::strerror(err));
  }
  std::unique_ptr<ChildProcess> c(new ChildProcess());
  c->pid_ = pid;
  c->stdin_fd_ = in[1];
  c->stdout_fd_ = out[0];
  return c;
}

Result<std::unique_ptr<ChildProcess>> ChildProcess::shell(const std::string& command, const SpawnOptions& options) {
  return spawn({"/bin/sh", "-c", command}, options);
}

ChildProcess::~ChildProcess() {
  stop();
  close_stdin();
  if (stdout_fd_ >= 0) ::close(stdout_fd_);
}

void ChildProcess::close_stdin() {
  if (stdin_fd_ >= 0) ::close(stdin_fd_);
  stdin_fd_ = -1;
}

namespace {

// True when every thread of `pid` is stopped ('T' or 't' in its stat) or
// the process is gone.
bool all_threads_stopped(pid_t pid) {
  std::error_code ec;
  const std::filesystem::path tasks = "/proc/" + std::to_string(pid) + "/task";
  for (const std::filesystem::directory_entry& task : std::filesystem::directory_iterator(tasks, ec)) {
    std::ifstream in(task.path() / "stat");
    std::string stat;
    if (!std::getline(in, stat)) continue;  // the thread just exited
    const std::size_t paren = stat.rfind(')');
    if (paren == std::string::npos || paren + 2 >= stat.size()) continue;
    const char state = stat[paren + 2];
    if (state != 'T' && state != 't' && state != 'Z' && state != 'X') return false;
  }
  return true;
}

}  // namespace

void ChildProcess::signal(int sig) {
  if (reaped_ || pid_ <= 0) return;
  ::kill(pid_, sig);
  if (sig != SIGSTOP) return;
  // kill() only marks the signal pending; a thread running on another core
  // stops at its next return to user space. Wait for every thread, so the
  // caller's next request cannot be served by a thread not yet stopped.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (!all_threads_stopped(pid_) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

bool ChildProcess::wait(std::chrono::milliseconds grace, int* status) {
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (!reaped_) {
    const pid_t r = ::waitpid(pid_, &status_, WNOHANG);
    if (r == pid_ || (r < 0 && errno == ECHILD)) {
      reaped_ = true;
      break;
    }
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (status) *status = status_;
  return true;
}

void ChildProcess::stop(std::chrono::milliseconds grace) {
  if (reaped_ || pid_ <= 0) return;
  ::kill(pid_, SIGCONT);  // a stopped child cannot act on SIGTERM
  ::kill(pid_, SIGTERM);
  if (wait(grace)) return;
  ::kill(pid_, SIGKILL);
  wait(std::chrono::milliseconds(10000));
}

std::string ChildProcess::read_line(std::chrono::milliseconds timeout) {
  std::string line;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (stdout_fd_ >= 0) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) return {};
    pollfd p{stdout_fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    char c = 0;
    const ssize_t n = ::read(stdout_fd_, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0 || c == '\n') return line;  // end of file: whatever came
    line.push_back(c);
  }
  return line;
}

std::string ChildProcess::read_all(std::chrono::milliseconds timeout, size_t max_bytes) {
  std::string out;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  char buf[4096];
  while (stdout_fd_ >= 0 && out.size() < max_bytes) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) break;
    pollfd p{stdout_fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    const ssize_t n = ::read(stdout_fd_, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

}  // namespace kvbridge
