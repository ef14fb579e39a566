// tools/demo_flood.h: the demo's hostile helpers, each a process of its own:
// a flood of idle connections to one listener, and a pauser that stops and
// resumes a rank (SIGSTOP/SIGCONT) over and over.
//
// Both are forked by the single-threaded driver and stopped with stop().
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kvbridge/status.h"

namespace kvbridge::cli::demo {

struct Helper {
  pid_t pid = -1;
  uint64_t opened = 0;  // a flood: the connections it opened
};

// Opens `n` idle TCP connections to `address` ("host:port") and holds them
// until stopped: it never sends a byte. Returns once they are opened (or the
// process ran out of descriptors or ports; `opened` says how many).
Result<Helper> start_flood(const std::string& address, uint32_t n);

// Stops `victim` for `stopped` out of every `period`, until stopped; then
// leaves it running.
Result<Helper> start_pauser(pid_t victim, std::chrono::milliseconds stopped, std::chrono::milliseconds period);

// Ends a helper (SIGTERM, then reaps it).
void stop(Helper& helper);

// A flood of every listener of some ranks, and what their listener threads
// spent while it lasted.
class Flood {
 public:
  struct Target {
    pid_t pid = -1;
    std::vector<std::string> listeners;  // "host:port"
  };
  // Starts one flood process of `n` connections per listener.
  Status start(const std::vector<Target>& targets, uint32_t n);
  // Stops the floods. `*busiest_pct` is the most CPU (percent of one core)
  // that any listener thread of the targets used while they ran, and
  // `*busiest` names it.
  void stop(double* busiest_pct, std::string* busiest);
  uint64_t connections() const { return connections_; }
  uint32_t listeners() const { return static_cast<uint32_t>(helpers_.size()); }

 private:
  std::vector<Target> targets_;
  std::vector<Helper> helpers_;
  std::vector<std::map<std::string, double>> cpu_before_;
  std::chrono::steady_clock::time_point started_;
  uint64_t connections_ = 0;
};

}  // namespace kvbridge::cli::demo
