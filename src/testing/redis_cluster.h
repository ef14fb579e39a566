// testing/redis_cluster.h: a Redis Cluster of its own on loopback, for the
// store's tests and `kvbridge store bench`: `masters` redis-server children
// with `replicas` replicas each, on free ports (and their cluster-bus ports,
// port + 10000), their files in a temporary directory removed afterwards,
// formed with `redis-cli --cluster create` and ready (every node says
// cluster_state:ok and agrees on the slot map) when start() returns. Every
// server dies with this process (ChildProcess).
//
// Thread-safety: one owner.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/child_process.h"
#include "kvbridge/status.h"

namespace kvbridge::testing {

class RedisCluster {
 public:
  // kUnavailable saying what is missing (redis-server, redis-cli) or what
  // failed, with the last lines redis-cli printed.
  static Result<std::unique_ptr<RedisCluster>> start(int masters, int replicas, int node_timeout_ms = 1000);
  ~RedisCluster();

  // Every node's port, in start order.
  const std::vector<uint16_t>& ports() const { return ports_; }
  // The ports of the nodes that are masters now (CLUSTER NODES).
  std::vector<uint16_t> master_ports() const;
  // The port of the master serving `slot` now.
  uint16_t master_of(uint16_t slot) const;
  // Runs `redis-cli -p port ARGS` and returns its output (trimmed).
  std::string cli(uint16_t port, const std::string& args) const;
  // Waits until every replica holds as many keys as its master (so a
  // failover loses nothing written before); false at the deadline.
  bool wait_replicated(int timeout_ms) const;
  // Kills the node at `port` at once (SIGKILL).
  void kill(uint16_t port);
  // Waits until every live node says cluster_state:ok and `slot` is served
  // by a master other than `not_port`; false at the deadline.
  bool wait_failover(uint16_t slot, uint16_t not_port, int timeout_ms) const;
  // Moves `slot` to the master at `to` with keys (CLUSTER SETSLOT
  // IMPORTING/MIGRATING, MIGRATE in batches, SETSLOT NODE on every master).
  // `between(k)` runs after each batch of k keys moved (so a test can read
  // while the slot is half way). An error names the step.
  Status migrate_slot(uint16_t slot, uint16_t to, const std::function<void(int)>& between = nullptr) const;

 private:
  RedisCluster() = default;
  std::string dir_;
  std::vector<uint16_t> ports_;
  std::vector<std::unique_ptr<ChildProcess>> servers_;
};

}  // namespace kvbridge::testing
