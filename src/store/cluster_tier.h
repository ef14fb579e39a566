// The shared tier on a Redis Cluster: each key goes to the master that serves
// its hash slot (redis_key_slot(), store_key.h), through one RedisTier per
// master (its own connection, pipelining and failure policy, redis_tier.h).
//
// Keys: ObjectKey::cluster_text(), whose hash tag puts an object and its
// staging key (the object key and a suffix) in one slot, so the part
// transactions and the script that renames a completed staging key into the
// object key run on one node, as Redis Cluster requires.
//
// The slot map: CLUSTER SLOTS from the seed (RedisOptions host:port) or,
// when it is unreachable, from any master known from an earlier map. It is
// read on first use; again at once when a reply says MOVED (the slot's new
// owner is also taken from the reply, so the retried keys go straight
// there); when a master is down (it failed an operation), at most once per
// `retry_interval / 4`, so that after a failover the promoted replica is
// found without waiting for a MOVED; and by the first operation after it is
// 2 s old, so that a node answering at a failed master's address (restarted
// empty, or another server) does not keep that master's slots.
//
// Redirects: an operation splits its keys by node, runs each node's share
// (node by node, each pipelined), and retries the keys answered with MOVED
// on the new owner, those answered with ASK (a slot being migrated) on the
// target with ASKING first, and those answered CLUSTERDOWN or TRYAGAIN after
// a short pause, up to 4 rounds; a key still unanswered then is a miss (or is
// not written), counted as an error with the last refusal as the reason.
// A redirect is followed only to a node the slot map names (read from the
// seed): one to any other host:port makes the map be read again, and is
// not followed until the map names it. An operation ends within twice a
// node's connect and command timeouts whatever the map: keys of the nodes
// not tried by then are misses.
// A map that names more than 1,024 nodes is not believed.
// Keys of a master that is down are misses until the map names another node
// for their slot. So a failover costs the misses of the failover window and
// never a hang: each node's operations keep their timeouts and the retry
// interval of redis_tier.h.
//
// Not a public header. Thread-safety: thread-safe. The map has its own lock;
// node I/O runs outside it, each node serialising its own operations.
#pragma once

#include <array>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "store/redis_tier.h"
#include "store/shared_tier.h"

namespace kvbridge::store_internal {

class ClusterTier final : public SharedTier {
 public:
  explicit ClusterTier(RedisOptions options);
  ~ClusterTier() override;

  const RedisOptions& options() const override { return options_; }
  std::string key_of(const ObjectKey& key) const override { return key.cluster_text(options_.key_prefix); }
  size_t put(std::span<const std::string> keys, std::span<const std::span<const uint8_t>> values) override;
  std::vector<PartOutcome> put_parts(std::span<const PartWrite> parts) override;
  std::vector<uint8_t> exists(std::span<const std::string> keys) override;
  bool get(std::span<const std::string> keys, GetSink& sink) override;
  Result<std::string> command(std::span<const std::string> args) override;
  Result<TierSize> size() override;
  RedisCounters counters() const override;

 private:
  // One node's share of an operation: the indices (into the caller's keys)
  // it gets, run with `asking`; redirects come back with subset indices.
  using NodeOp = std::function<void(RedisTier& node, std::span<const size_t> indices, std::vector<Redirect>* redirects,
                                    bool asking)>;
  // Runs `op` over keys [0, n) with `slot_of(i)`, following redirects.
  void run(size_t n, const std::function<uint16_t(size_t)>& slot_of, const NodeOp& op);
  // The node at host:port (made on first use; nodes live as long as the
  // tier). Requires mu_.
  RedisTier* node_locked(const std::string& host, uint16_t port);
  // Reads the slot map. With `force`, now; otherwise only when the last read
  // is older than `older_than`. False when no node answered.
  bool refresh(bool force, std::chrono::milliseconds older_than = std::chrono::milliseconds(0));
  // The master of `slot`, or nullptr when the map has none.
  RedisTier* owner(uint16_t slot);

  const RedisOptions options_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<RedisTier>> nodes_;
  std::map<std::string, RedisTier*> by_address_;
  std::set<std::string> members_;  // the seed and the nodes the last map named: where redirects may go
  std::array<RedisTier*, 16384> slots_{};
  bool mapped_ = false;
  std::chrono::steady_clock::time_point refreshed_at_{};
  uint64_t redirects_ = 0, updates_ = 0, map_errors_ = 0;
  uint64_t unanswered_ = 0;       // keys given up on after kRounds (counted as errors)
  std::string unanswered_error_;  // why, for RedisCounters::last_error
  std::mutex refresh_mu_;         // one refresh at a time (taken before mu_)
};

}  // namespace kvbridge::store_internal
