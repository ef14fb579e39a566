// The shared tier on a Redis Cluster: see cluster_tier.h.
#include "store/cluster_tier.h"

#include <algorithm>
#include <set>
#include <thread>

namespace kvbridge::store_internal {

namespace {

constexpr int kRounds = 4;
// The map is read again when older than this, whatever happened: a node that
// answers at a failed master's address (a restart, another server) would
// otherwise keep its slots, as it never fails.
constexpr std::chrono::milliseconds kMapLifetime{2000};
// A slot map naming more nodes than this is not believed (Redis Cluster
// recommends at most about 1,000 nodes).
constexpr size_t kMaxNodes = 1024;

std::string address(const std::string& host, uint16_t port) { return host + ":" + std::to_string(port); }

// Presents keys `indices` of a caller's sink as keys 0.. of a node's get().
class SubsetSink final : public GetSink {
 public:
  SubsetSink(GetSink& base, std::span<const size_t> indices) : base_(base), indices_(indices) {}
  uint8_t* buffer(size_t i, uint64_t bytes) override { return base_.buffer(indices_[i], bytes); }
  void received(size_t i, uint64_t offset, uint64_t n) override { base_.received(indices_[i], offset, n); }
  void done(size_t i) override { base_.done(indices_[i]); }

 private:
  GetSink& base_;
  std::span<const size_t> indices_;
};

}  // namespace

ClusterTier::ClusterTier(RedisOptions options) : options_(std::move(options)) {}
ClusterTier::~ClusterTier() = default;

RedisTier* ClusterTier::node_locked(const std::string& host, uint16_t port) {
  const std::string a = address(host, port);
  auto it = by_address_.find(a);
  if (it != by_address_.end()) return it->second;
  RedisOptions o = options_;
  o.host = host;
  o.port = port;
  nodes_.push_back(std::make_unique<RedisTier>(std::move(o)));
  by_address_[a] = nodes_.back().get();
  return nodes_.back().get();
}

bool ClusterTier::refresh(bool force, std::chrono::milliseconds older_than) {
  std::lock_guard<std::mutex> one(refresh_mu_);
  std::vector<RedisTier*> ask;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    if (!force && mapped_ && now - refreshed_at_ < older_than) return true;
    refreshed_at_ = now;
    ask.push_back(node_locked(options_.host, options_.port));
    for (const auto& n : nodes_) {
      if (n.get() != ask.front() && !n->down()) ask.push_back(n.get());
    }
  }
  for (RedisTier* n : ask) {
    Result<std::vector<SlotRange>> map = n->cluster_slots();
    if (!map.ok() || map->empty()) continue;
    std::set<std::string> members = {address(options_.host, options_.port)};
    for (const SlotRange& r : *map) members.insert(address(r.host, r.port));
    if (members.size() > kMaxNodes) continue;  // not a map this tier believes
    std::lock_guard<std::mutex> lock(mu_);
    slots_.fill(nullptr);
    for (const SlotRange& r : *map) {
      RedisTier* owner = node_locked(r.host, r.port);
      for (uint32_t s = r.first; s <= r.last; ++s) slots_[s] = owner;
    }
    members_ = std::move(members);
    mapped_ = true;
    ++updates_;
    return true;
  }
  std::lock_guard<std::mutex> lock(mu_);
  ++map_errors_;
  return false;
}

RedisTier* ClusterTier::owner(uint16_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  return slots_[slot];
}

void ClusterTier::run(size_t n, const std::function<uint16_t(size_t)>& slot_of, const NodeOp& op) {
  if (n == 0) return;
  {
    bool mapped;
    {
      std::lock_guard<std::mutex> lock(mu_);
      mapped = mapped_;
    }
    if (!mapped && !refresh(true)) return;  // no node answered: every key a miss
  }
  refresh(false, kMapLifetime);
  std::vector<size_t> pending(n);
  for (size_t i = 0; i < n; ++i) pending[i] = i;
  std::string last_refusal;  // the latest CLUSTERDOWN/TRYAGAIN reply
  std::string stranger;      // the latest redirect to a node the map does not name
  // The operation as a whole ends within about two nodes' timeouts, however
  // many nodes the map names and however many of them are silent: keys of
  // nodes not tried by then are misses (or are not written).
  const std::chrono::milliseconds budget = 2 * (options_.connect_timeout + options_.command_timeout);
  const auto deadline = std::chrono::steady_clock::now() + budget;
  bool late = false;
  for (int round = 0; round < kRounds && !pending.empty() && !late; ++round) {
    // Split by owner, in key order within each node.
    std::map<RedisTier*, std::vector<size_t>> by_node;
    for (size_t i : pending) {
      if (RedisTier* t = owner(slot_of(i))) by_node[t].push_back(i);
    }
    std::vector<size_t> again;
    bool moved = false, wait = false, node_down = false;
    std::map<RedisTier*, std::vector<size_t>> ask;
    auto follow = [&](std::span<const size_t> indices, const std::vector<Redirect>& redirects) {
      for (const Redirect& r : redirects) {
        const size_t i = indices[r.index];
        if (r.kind == Redirect::kRetry) {
          last_refusal = r.reply;
          wait = true;
          again.push_back(i);
          continue;
        }
        std::lock_guard<std::mutex> lock(mu_);
        if (!members_.contains(address(r.host, r.port))) {
          // Only to nodes of the cluster (its map, read from the seed): a
          // node cannot send keys to any host:port. The map is read again
          // (the node may be new); until it names the target the key waits.
          stranger = address(r.host, r.port);
          moved = true;
          again.push_back(i);
          continue;
        }
        ++redirects_;
        RedisTier* target = node_locked(r.host, r.port);
        if (r.kind == Redirect::kMoved) {
          slots_[r.slot] = target;  // the rest of the map is read again below
          moved = true;
          again.push_back(i);
        } else {
          ask[target].push_back(i);
        }
      }
    };
    for (auto& [node, indices] : by_node) {
      if (std::chrono::steady_clock::now() >= deadline) {
        late = true;
        again.insert(again.end(), indices.begin(), indices.end());
        continue;
      }
      std::vector<Redirect> redirects;
      op(*node, indices, &redirects, false);
      follow(indices, redirects);
      if (node->down()) node_down = true;
    }
    for (auto& [node, indices] : ask) {
      if (std::chrono::steady_clock::now() >= deadline) {
        late = true;
        again.insert(again.end(), indices.begin(), indices.end());
        continue;
      }
      std::vector<Redirect> redirects;
      op(*node, indices, &redirects, true);
      for (const Redirect& r : redirects) again.push_back(indices[r.index]);  // moved on again: next round
      wait = wait || !redirects.empty();
    }
    if (moved) {
      refresh(true);
    } else if (node_down) {
      // Keys of a master that is down are misses unless the map (after a
      // failover) names another node for them.
      if (refresh(false, options_.retry_interval / 4)) {
        for (auto& [node, indices] : by_node) {
          if (!node->down()) continue;
          for (size_t i : indices) {
            if (owner(slot_of(i)) != node) again.push_back(i);
          }
        }
      }
    }
    if (wait && !again.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(10 << round));
    std::sort(again.begin(), again.end());
    again.erase(std::unique(again.begin(), again.end()), again.end());
    pending = std::move(again);
  }
  if (!pending.empty()) {
    // Keys still refused or redirected: not read or not written, an error
    // the caller's stats show (a miss or an unwritten part otherwise says
    // nothing of why).
    std::lock_guard<std::mutex> lock(mu_);
    unanswered_ += pending.size();
    std::string why = last_refusal.empty() ? std::string("MOVED or ASK") : last_refusal;
    if (!stranger.empty()) why = "a redirect to " + stranger + ", which the cluster's slot map does not name";
    unanswered_error_ = "redis cluster: " + std::to_string(pending.size()) + " of " + std::to_string(n) +
                        " keys unanswered " +
                        (late ? "when the operation's " + std::to_string(budget.count()) + " ms deadline passed"
                              : "after " + std::to_string(kRounds) + " rounds") +
                        "; last reply: " + why;
  }
}

size_t ClusterTier::put(std::span<const std::string> keys, std::span<const std::span<const uint8_t>> values) {
  size_t written = 0;
  std::vector<std::string> k;
  std::vector<std::span<const uint8_t>> v;
  run(
      keys.size(), [&](size_t i) { return redis_key_slot(keys[i]); },
      [&](RedisTier& node, std::span<const size_t> indices, std::vector<Redirect>* redirects, bool asking) {
        k.clear();
        v.clear();
        for (size_t i : indices) {
          k.push_back(keys[i]);
          v.push_back(values[i]);
        }
        written += node.put(k, v, redirects, asking);
      });
  return written;
}

std::vector<PartOutcome> ClusterTier::put_parts(std::span<const PartWrite> parts) {
  std::vector<PartOutcome> out(parts.size(), PartOutcome::kFailed);
  std::vector<PartWrite> sub;
  run(
      parts.size(), [&](size_t i) { return redis_key_slot(parts[i].staging_key); },
      [&](RedisTier& node, std::span<const size_t> indices, std::vector<Redirect>* redirects, bool asking) {
        sub.clear();
        for (size_t i : indices) sub.push_back(parts[i]);
        const std::vector<PartOutcome> got = node.put_parts(sub, redirects, asking);
        for (size_t x = 0; x < indices.size(); ++x) out[indices[x]] = got[x];
      });
  return out;
}

std::vector<uint8_t> ClusterTier::exists(std::span<const std::string> keys) {
  std::vector<uint8_t> out(keys.size(), 0);
  std::vector<std::string> k;
  run(
      keys.size(), [&](size_t i) { return redis_key_slot(keys[i]); },
      [&](RedisTier& node, std::span<const size_t> indices, std::vector<Redirect>* redirects, bool asking) {
        k.clear();
        for (size_t i : indices) k.push_back(keys[i]);
        const std::vector<uint8_t> got = node.exists(k, redirects, asking);
        for (size_t x = 0; x < indices.size(); ++x) out[indices[x]] = got[x];
      });
  return out;
}

bool ClusterTier::get(std::span<const std::string> keys, GetSink& sink) {
  bool ok = true;
  std::vector<std::string> k;
  run(
      keys.size(), [&](size_t i) { return redis_key_slot(keys[i]); },
      [&](RedisTier& node, std::span<const size_t> indices, std::vector<Redirect>* redirects, bool asking) {
        k.clear();
        for (size_t i : indices) k.push_back(keys[i]);
        SubsetSink subset(sink, indices);
        ok = node.get(k, subset, redirects, asking) && ok;
      });
  return ok;
}

Result<std::string> ClusterTier::command(std::span<const std::string> args) {
  const uint16_t slot = args.size() > 1 ? redis_key_slot(args[1]) : 0;
  for (int round = 0; round < kRounds; ++round) {
    RedisTier* node = owner(slot);
    if (node == nullptr) {
      if (!refresh(true) || (node = owner(slot)) == nullptr) {
        return Status::unavailable("redis cluster at " + address(options_.host, options_.port) +
                                   ": no node serves slot " + std::to_string(slot));
      }
    }
    Result<std::string> r = node->command(args);
    Redirect rd;
    const std::string prefix = "redis: ";
    if (r.ok() || r.error().message().rfind(prefix, 0) != 0 ||
        !parse_redirect(std::string_view(r.error().message()).substr(prefix.size()), &rd) ||
        rd.kind != Redirect::kMoved) {
      return r;
    }
    refresh(true);
  }
  return Status::unavailable("redis cluster: slot " + std::to_string(slot) + " keeps moving");
}

Result<TierSize> ClusterTier::size() {
  if (!refresh(true)) {
    return Status::unavailable("redis cluster at " + address(options_.host, options_.port) + " is unreachable");
  }
  std::vector<RedisTier*> masters;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (RedisTier* t : slots_) {
      if (t != nullptr && std::find(masters.begin(), masters.end(), t) == masters.end()) masters.push_back(t);
    }
  }
  TierSize total;
  for (RedisTier* m : masters) {
    KVB_ASSIGN_OR_RETURN(TierSize t, m->size());
    total.keys += t.keys;
    total.used_memory_bytes += t.used_memory_bytes;
  }
  return total;
}

RedisCounters ClusterTier::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  RedisCounters c;
  std::vector<RedisTier*> masters;
  for (RedisTier* t : slots_) {
    if (t != nullptr && std::find(masters.begin(), masters.end(), t) == masters.end()) masters.push_back(t);
  }
  c.up = mapped_;
  for (const auto& n : nodes_) {
    const RedisCounters x = n->counters();
    c.writes += x.writes;
    c.parts += x.parts;
    c.errors += x.errors;
    c.skipped += x.skipped;
    const bool master_down = std::find(masters.begin(), masters.end(), n.get()) != masters.end() && n->down();
    if (master_down) c.up = false;
    // A master that is down explains more than a node that failed once.
    if (!x.last_error.empty() && (c.last_error.empty() || master_down)) c.last_error = x.last_error;
  }
  c.errors += map_errors_ + unanswered_;
  // Keys refused says more than a map that could not be read (a cluster
  // serving no slots answers an empty one).
  if (c.last_error.empty()) c.last_error = unanswered_error_;
  if (c.last_error.empty() && map_errors_ != 0) c.last_error = "no node answered CLUSTER SLOTS";
  c.redirects = redirects_;
  c.slot_map_updates = updates_;
  c.nodes = static_cast<uint32_t>(masters.size());
  return c;
}

}  // namespace kvbridge::store_internal
