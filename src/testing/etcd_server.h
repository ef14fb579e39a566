// testing/etcd_server.h: an etcd of its own on free loopback ports, for the
// discovery tests and `kvbridge discovery`'s test: a one-member cluster
// started as a ChildProcess (it dies with this process) with a temporary
// data dir, removed when the EtcdServer is destroyed.
//
// Thread-safety: one owner.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "common/child_process.h"
#include "kvbridge/status.h"

namespace kvbridge::testing {

class EtcdServer {
 public:
  // Starts etcd and waits until GET /health says it is healthy (a leader is
  // elected). kUnavailable saying how to install it when it cannot.
  static Result<std::unique_ptr<EtcdServer>> start();
  ~EtcdServer();

  // "http://127.0.0.1:<port>".
  std::string endpoint() const;
  uint16_t port() const { return client_port_; }
  // SIGSTOP / SIGCONT / SIGKILL ... while it runs.
  void signal(int signal);
  // Stops it (SIGTERM, then SIGKILL after `grace`); the data dir stays.
  void stop(std::chrono::milliseconds grace = std::chrono::milliseconds(2000));
  // Kills it at once (SIGKILL); the data dir stays.
  void kill() { stop(std::chrono::milliseconds(0)); }
  // Starts it again on the same ports and data dir, and waits until healthy.
  Status restart();

 private:
  EtcdServer() = default;
  Status launch();
  std::unique_ptr<ChildProcess> child_;
  std::string data_dir_;
  uint16_t client_port_ = 0, peer_port_ = 0;
};

}  // namespace kvbridge::testing
