// tools/bench_peer.h: the second process of `kvbridge bench`, and child
// processes in general (iperf3, ucx_perftest).
//
// For cma, tcp and ucx the peer engine must live in another process. The
// bench forks and execs its own binary (/proc/self/exe) as the hidden
// subcommand `kvbridge bench peer --transport T --bytes N`, which creates an
// engine offering only T, registers and touches one buffer of N bytes, and
// prints one line on stdout (a pipe to the parent):
//
//   ready REGION PID BUFFER_ADDRESS METADATA_HEX
//
// then waits until its stdin (another pipe) reaches end of file and exits 0.
// The parent connects its engine to METADATA; PID and BUFFER_ADDRESS are for
// the raw process_vm_readv/writev baseline against the same process.
//
// Ownership: a PeerProcess owns its child (a ChildProcess: it dies with the
// bench); the destructor closes the child's stdin, waits up to 5 s, then
// stops it.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "common/child_process.h"
#include "kvbridge/engine.h"
#include "kvbridge/status.h"

namespace kvbridge::cli::bench {

class PeerProcess {
 public:
  // Starts `kvbridge bench peer`; kUnavailable with the child's own message
  // when its engine cannot offer `transport`, kTimeout when it says nothing
  // within 30 s.
  static Result<std::unique_ptr<PeerProcess>> spawn(const std::string& transport, uint64_t bytes, uint32_t threads,
                                                    uint32_t tcp_streams);
  ~PeerProcess();

  pid_t pid() const { return child_->pid(); }
  RegionId region() const { return region_; }
  uint64_t buffer_address() const { return address_; }
  const std::string& metadata() const { return metadata_; }

 private:
  PeerProcess() = default;
  std::unique_ptr<ChildProcess> child_;
  RegionId region_ = 0;
  uint64_t address_ = 0;
  std::string metadata_;
};

// The body of `kvbridge bench peer`; returns the exit code.
int run_bench_peer(const std::string& transport, uint64_t bytes, uint32_t threads, uint32_t tcp_streams);

// A child running `sh -c command` (start it with exec) with stdout and stderr discarded
// (a server: iperf3 -s, ucx_perftest). The destructor stops it (SIGTERM,
// then SIGKILL) and reaps it; it dies with the bench too.
class ShellChild {
 public:
  static Result<std::unique_ptr<ShellChild>> start(const std::string& command);
  // Waits up to `grace` for the child to exit by itself; true when it did.
  bool wait_exit(std::chrono::milliseconds grace);
  ~ShellChild();

 private:
  ShellChild() = default;
  std::unique_ptr<ChildProcess> child_;
};

// Runs `sh -c command` (a ChildProcess; start the command with exec),
// returns its stdout (stderr discarded) and whether it exited 0. Callers
// bound it with `timeout(1)` in the command.
struct ShellOutput {
  std::string out;
  bool ok = false;
};
ShellOutput run_shell(const std::string& command);

// True when `program` is found on PATH.
bool have_program(const std::string& program);

// A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0).
int free_port();

}  // namespace kvbridge::cli::bench
