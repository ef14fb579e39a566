// tests/conformance/harness.h: the peers the conformance suite talks to.
//
// A Peer is another engine with one registered buffer of `bytes` bytes,
// filled with pattern `seed` (pattern.h) at start. It runs either in this
// process (InProcessPeer: for local, and for any transport when a child is
// not needed) or in a child process running peer_main (ChildPeer: for
// transports that cross processes, and for "peer gone" by SIGKILL). The
// suite drives both through this one interface, so a case is written once.
//
// Every call that waits has a deadline and fails with a message saying what
// it waited for.
//
// Thread-safety: a Peer is used from the test thread only.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "kvbridge/engine.h"

namespace kvbridge::conformance {

struct PeerOptions {
  std::string name = "peer";
  std::string transport = "local";  // the only transport the peer offers
  uint64_t bytes = uint64_t{8} << 20;
  uint32_t seed = 7;
  // The buffer's memory kind: "host", or "cuda:0" (device memory of the
  // host fake, KVB_DEVICE=fake: host-visible, so check and fill read it).
  std::string memory = "host";
};

class Peer {
 public:
  virtual ~Peer() = default;
  virtual const std::string& name() const = 0;
  virtual std::string metadata() = 0;
  virtual RegionId region() const = 0;
  // Whether the peer's bytes [offset, offset + len) equal pattern `seed`
  // bytes [from, from + len).
  virtual ::testing::AssertionResult check(uint64_t offset, uint64_t len, uint32_t seed, uint64_t from) = 0;
  // Sets the peer's bytes [offset, offset + len) to pattern `seed` bytes
  // [offset, offset + len).
  virtual Status fill(uint64_t offset, uint64_t len, uint32_t seed) = 0;
  // Notifications the peer received since the last call, in arrival order.
  virtual std::vector<Notification> take_notifications() = 0;
  // Deregisters its buffer, frees it, and registers a new one of the same
  // size and memory kind (device memory may get the same address) filled
  // with pattern `seed`; region() is then the new region. The peer's
  // metadata changes: connect() again to see it.
  virtual Status reregister(uint32_t seed) = 0;
  // The peer vanishes abruptly (a child is SIGKILLed; an in-process peer's
  // engine is destroyed, its buffer kept so no late copy touches freed memory).
  virtual void kill() = 0;
};

Result<std::unique_ptr<Peer>> make_in_process_peer(const PeerOptions& options);
// Starts `peer_main` (the path compiled in as KVB_PEER_MAIN) with the options.
Result<std::unique_ptr<Peer>> make_child_peer(const PeerOptions& options);

// Polls `peer` until it has received `count` notifications or `timeout`
// passes; returns what arrived.
std::vector<Notification> await_notifications(Peer& peer, size_t count, std::chrono::milliseconds timeout);

}  // namespace kvbridge::conformance
