// tools/demo_results.h: a demo rank's load results, as they come.
//
// Waits for a worker's load results on its own thread and wakes the rank's
// loop through a pipe, so that a load's "loaded" time is when its result
// came, not the loop's next poll (up to 2 ms later).
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "kvbridge/connector.h"
#include "kvbridge/status.h"

namespace kvbridge::cli::demo {

class ResultWaiter {
 public:
  ResultWaiter() = default;
  ResultWaiter(const ResultWaiter&) = delete;
  ResultWaiter& operator=(const ResultWaiter&) = delete;
  ~ResultWaiter();  // joins the thread (started or not), closes the pipe

  // Starts waiting on `worker` (which outlives this object).
  Status start(ConnectorWorker* worker);
  // Readable when results came: poll() it in the rank's loop.
  int fd() const { return fds_[0]; }

  // The results that came since the last call, each with the time it came
  // (ns of CLOCK_MONOTONIC).
  std::vector<std::pair<LoadResult, int64_t>> take();

 private:
  void run();

  int fds_[2] = {-1, -1};
  ConnectorWorker* worker_ = nullptr;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::mutex mu_;
  std::vector<std::pair<LoadResult, int64_t>> results_;
};

}  // namespace kvbridge::cli::demo
