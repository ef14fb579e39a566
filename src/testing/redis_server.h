// testing/redis_server.h: a redis-server of its own on a free loopback port,
// for the store's tests and `kvbridge store bench`: started as a
// ChildProcess (it dies with this process), stopped when destroyed.
//
// Thread-safety: one owner.
#pragma once

#include <cstdint>
#include <memory>

#include "common/child_process.h"
#include "kvbridge/status.h"

namespace kvbridge::testing {

class RedisServer {
 public:
  // Starts redis-server (no persistence) and waits until it accepts
  // connections. kUnavailable saying how to install it when it cannot.
  static Result<std::unique_ptr<RedisServer>> start();

  uint16_t port() const { return port_; }
  // SIGSTOP / SIGCONT / SIGKILL ... while it runs.
  void signal(int signal) { child_->signal(signal); }
  // Kills it at once (connections reset, the port closed).
  void stop() { child_->stop(std::chrono::milliseconds(0)); }

 private:
  RedisServer() = default;
  std::unique_ptr<ChildProcess> child_;
  uint16_t port_ = 0;
};

}  // namespace kvbridge::testing
