// testing/ports.h: loopback ports for the servers tests start (redis-server,
// a Redis Cluster, etcd).
//
// Thread-safety: pure functions (the port may be taken by someone else
// between the call and its use: callers retry a server that fails to bind).
#pragma once

#include <cstdint>
#include <string>

namespace kvbridge::testing {

// A TCP port on 127.0.0.1 that nothing listens on now (the kernel's choice).
uint16_t free_loopback_port();
// True when something accepts connections on 127.0.0.1:port.
bool accepts_on_loopback(uint16_t port);

// A socket listening on 127.0.0.1 at an ephemeral port that accepts nobody
// unless asked: connects complete (the kernel's backlog) and nothing ever
// answers, as a silent peer. fd() is non-blocking; closed when destroyed.
class SilentListener {
 public:
  SilentListener();
  ~SilentListener();
  SilentListener(const SilentListener&) = delete;
  SilentListener& operator=(const SilentListener&) = delete;
  bool ok() const { return port_ != 0; }
  int fd() const { return fd_; }
  uint16_t port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  // Whether a connection is waiting (it is accepted and closed).
  bool accepted_any() const;

 private:
  int fd_ = -1;
  uint16_t port_ = 0;
};

}  // namespace kvbridge::testing
