// common/child_process.h: a process this one starts and that cannot outlive
// it: bench peers and baselines, redis-server, redis-benchmark, test peers.
//
// The child is started with vfork(2) and execvp(3) (no copy-on-write of the
// parent's memory, which matters to a benchmark whose buffers are large),
// gets SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG,
// prctl(2); timeout(1) passes it on to its command), and is stopped
// (SIGTERM, then SIGKILL) and reaped when the ChildProcess is destroyed.
// Its stdin and stdout are pipes or /dev/null; stderr is /dev/null unless
// inherited.
//
// Thread-safety: one owner. Ownership: the ChildProcess owns the child and
// both pipe ends on this side.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "kvbridge/status.h"

namespace kvbridge {

struct SpawnOptions {
  bool pipe_stdin = false;
  bool pipe_stdout = false;
  bool inherit_stderr = false;
};

class ChildProcess {
 public:
  // Starts argv[0] (looked up in PATH without a '/') with `argv`.
  // kUnavailable naming the program when it cannot be started; a program
  // that is not installed exits 127 at once.
  static Result<std::unique_ptr<ChildProcess>> spawn(const std::vector<std::string>& argv,
                                                     const SpawnOptions& options = {});
  // `sh -c COMMAND`: a command line with redirections. Start it with `exec`
  // ("exec timeout 60 iperf3 -s", "VAR=x exec prog") so the shell becomes the
  // program and the program is the child that dies with this process.
  static Result<std::unique_ptr<ChildProcess>> shell(const std::string& command, const SpawnOptions& options = {});
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  int stdin_fd() const { return stdin_fd_; }
  void close_stdin();

  // Sends `signal` while it runs. SIGSTOP returns once every thread of the
  // child is stopped (within 2 s), not when the signal is merely pending.
  void signal(int signal);
  // Waits up to `grace` for it to exit; true when it did (and was reaped),
  // with its wait status in *status when given.
  bool wait(std::chrono::milliseconds grace, int* status = nullptr);
  // Stops it: SIGTERM, then SIGKILL after `grace`; reaps it.
  void stop(std::chrono::milliseconds grace = std::chrono::milliseconds(2000));
  // One line of its stdout within `timeout` (empty at end of file or timeout).
  std::string read_line(std::chrono::milliseconds timeout);
  // Its stdout to the end (at most `max_bytes`), within `timeout`.
  std::string read_all(std::chrono::milliseconds timeout, size_t max_bytes = size_t{1} << 20);

 private:
  ChildProcess() = default;
  pid_t pid_ = -1;
  bool reaped_ = false;
  int status_ = 0;
  int stdin_fd_ = -1, stdout_fd_ = -1;
};

}  // namespace kvbridge
