// A demo rank's load results, as they come: see demo_results.h.
#include "demo_results.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>

#include "common/text.h"

namespace kvbridge::cli::demo {

ResultWaiter::~ResultWaiter() {
  if (thread_.joinable()) {
    stop_ = true;
    thread_.join();
  }
  for (int fd : fds_) {
    if (fd >= 0) ::close(fd);
  }
}

Status ResultWaiter::start(ConnectorWorker* worker) {
  if (::pipe2(fds_, O_CLOEXEC | O_NONBLOCK) != 0) return Status::io_error("demo rank: pipe2: " + errno_text(errno));
  worker_ = worker;
  thread_ = std::thread([this] { run(); });
  return Status();
}

std::vector<std::pair<LoadResult, int64_t>> ResultWaiter::take() {
  char buf[64];
  while (::read(fds_[0], buf, sizeof buf) > 0) {
  }
  std::vector<std::pair<LoadResult, int64_t>> out;
  std::lock_guard<std::mutex> lock(mu_);
  out.swap(results_);
  return out;
}

void ResultWaiter::run() {
  while (!stop_) {
    worker_->wait_results(std::chrono::milliseconds(20));
    std::vector<LoadResult> got = worker_->take_results();
    if (got.empty()) continue;
    const int64_t now =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count();
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (LoadResult& r : got) results_.emplace_back(std::move(r), now);
    }
    const char x = 1;
    (void)!::write(fds_[1], &x, 1);  // a full pipe already wakes the loop
  }
}

}  // namespace kvbridge::cli::demo
