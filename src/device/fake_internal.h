// device/fake_internal.h: the host fake's parts apart from the Device
// (fake_device.cc): an event's page of counters and its mapping, a stream
// (a thread running its queue in order), and the memfd names and lookup
// that let another process open an allocation or an event by its handle.
// Included by fake_device.cc alone.
//
// Thread-safety: a FakeStream's push() may be called from any thread; an
// EventPage's counters are atomics shared across processes.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/thread_name.h"
#include "kvbridge/status.h"

namespace kvbridge::device {
namespace fake_internal {

struct EventPage {
  std::atomic<uint64_t> recorded{0};
  std::atomic<uint64_t> completed{0};
};

// One mapping of an event's page, unmapped with its last user.
struct PageMapping {
  explicit PageMapping(void* p) : page(static_cast<EventPage*>(p)) {}
  ~PageMapping() { ::munmap(page, 4096); }
  EventPage* page;
};

struct FakeEvent {
  std::shared_ptr<PageMapping> mapping;
  EventPage* page = nullptr;
  int fd = -1;  // the creator's; -1 when opened
  uint64_t serial = 0;
  int device = -1;  // the creator's device; -1 when opened
};

class FakeStream {
 public:
  explicit FakeStream(int device) : device(device), thread_([this] { loop(); }) {}
  const int device;
  ~FakeStream() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void push(std::function<void(const std::atomic<bool>&)> op) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ops_.push_back(std::move(op));
    }
    cv_.notify_all();
  }

 private:
  void loop() {
    set_thread_name("kvb-fake-strm");
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !ops_.empty(); });
      if (ops_.empty()) return;  // stopped and drained
      auto op = std::move(ops_.front());
      ops_.pop_front();
      lock.unlock();
      op(stopping_);
      lock.lock();
      if (stop_) stopping_.store(true);
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void(const std::atomic<bool>&)>> ops_;
  bool stop_ = false;
  std::atomic<bool> stopping_{false};  // a waiting op gives up once the stream is destroyed
  std::thread thread_;
};

inline std::string memfd_name(long pid, const char* what, uint64_t serial) {
  return std::string("kvb-fake-") + what + "-" + std::to_string(pid) + "-" + std::to_string(serial);
}

// Opens /proc/PID/fd/FD when it still is memfd `name`.
inline Result<int> open_peer_memfd(long pid, long fd, const std::string& name) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  char target[512] = {};
  const ssize_t n = ::readlink(path.c_str(), target, sizeof(target) - 1);
  const std::string want = "/memfd:" + name;
  const std::string got(target, n > 0 ? static_cast<size_t>(n) : 0);
  if (n <= 0 || got.compare(0, want.size(), want) != 0 || (got.size() > want.size() && got[want.size()] != ' ')) {
    return Status::not_found("fake device: " + name + " is gone (freed, or its process " + std::to_string(pid) +
                             " exited)");
  }
  const int opened = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (opened < 0) {
    return Status::not_found("fake device: cannot open " + name + ": " + std::strerror(errno));
  }
  return opened;
}

}  // namespace fake_internal
}  // namespace kvbridge::device
