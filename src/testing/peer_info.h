// testing/peer_info.h: the PeerInfo an engine would hand a transport's
// connect() for a peer process on this host, for tests that drive
// transports without an engine. Header-only, for tests.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <string>
#include <utility>

#include "common/host.h"
#include "transport/transport.h"

namespace kvbridge::testing {

// Peer `name`, process `pid` on this host (its hostname, as the engine's
// metadata carries it: cma and ucx watch the pid only on the same host),
// with `address` and one segment.
inline transport::PeerInfo peer_on_this_host(std::string name, pid_t pid, std::string address,
                                             transport::PeerSegment segment) {
  transport::PeerInfo p;
  p.name = std::move(name);
  p.pid = static_cast<uint64_t>(pid);
  p.hostname = this_hostname();
  p.address = std::move(address);
  p.segments.push_back(std::move(segment));
  return p;
}

}  // namespace kvbridge::testing
