// testing/ports.h: loopback ports for the servers tests start (redis-server,
// a Redis Cluster, etcd).
//
// Thread-safety: pure functions (the port may be taken by someone else
// between the call and its use: callers retry a server that fails to bind).
#pragma once

#include <cstdint>

namespace kvbridge::testing {

// A TCP port on 127.0.0.1 that nothing listens on now (the kernel's choice).
uint16_t free_loopback_port();
// True when something accepts connections on 127.0.0.1:port.
bool accepts_on_loopback(uint16_t port);

}  // namespace kvbridge::testing
