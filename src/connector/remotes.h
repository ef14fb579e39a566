// connector/remotes.h: the remote instances one worker knows: each rank's
// side channel address, what its handshake told (fetched once per instance,
// on first use), and the engine connection to it (made once, on first use).
//
// A decode worker reads from prefill instances; a streaming prefill worker
// announces layers to decode instances: both find their peers here.
//
// Instances change: add() with other addresses replaces what was fetched (a
// restart or a move), remove() forgets an instance, and fetch() handshakes
// again when a rank of the snapshot is gone (its engine connection closed:
// the process exited) or when a caller found the snapshot stale
// (invalidate()). A snapshot is immutable, so loads under way keep theirs.
//
// Methods take a remote *key*: an instance's name for the addresses add()
// gave it, or what route() returns for other addresses a load names (a
// hand-off from before or after a restart), kept beside the instance's own
// so that neither disturbs the other.
//
// Thread-safety: every method from any thread. fetch() and peer() dial
// without holding the lock that the other methods take, so one slow remote
// holds up only the callers that need it. A Fetched is immutable once made.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "connector/side_channel.h"
#include "kvbridge/engine.h"
#include "kvbridge/layout.h"

namespace kvbridge::connector {

// What the handshakes told about a remote instance's ranks, in tp_rank order.
struct Fetched {
  std::vector<RankInfo> infos;
  std::vector<Layout> layouts;
  // Each rank's engine as its notifications name it: (name, instance).
  std::vector<std::pair<std::string, uint64_t>> engines;
  // The ranks a load into this rank reads (source_ranks(local, layouts)),
  // found once per snapshot; or why there are none.
  std::vector<uint32_t> sources;
  Status sources_error;
  // Each rank's incarnation (ConnectorWorker::incarnation()): its engine's
  // instance id, 16 hex digits.
  std::string incarnation(size_t rank) const;
};

class Remotes {
 public:
  // `local`, `identity` and `hash` are this rank's: every remote rank must be
  // compatible with it. The engine must outlive this.
  Remotes(Engine& engine, const Layout& local, SideChannelOptions options, std::string identity, uint64_t hash);

  // The side channels of `instance`'s ranks, in tp_rank order; other
  // addresses than known replace them (the snapshot is dropped). Returns
  // whether anything changed. kInvalidArgument for an address that is not
  // host:port.
  Result<bool> add(const std::string& instance, std::vector<std::string> addresses);
  // Forgets `instance` (and every key route() made for it). kNotFound when
  // unknown.
  Status remove(const std::string& instance);
  // The key for `instance` at `addresses`: the instance's own when they are
  // empty or its addresses, else one kept for them (made now if new; the
  // least recently routed of more than kMaxAlternates goes). kNotFound for
  // an instance never added; kInvalidArgument for an address that is not
  // host:port.
  static constexpr size_t kMaxAlternates = 8;
  Result<std::string> route(const std::string& instance, const std::vector<std::string>& addresses);
  // The instance a key is of.
  static std::string instance_of(const std::string& key);
  // How the instance of `key` answers at its other keys, for errors:
  // "now incarnation(s) a, b at h:1, h:2"; empty when it is not known there.
  std::string elsewhere(const std::string& key) const;
  // Handshakes with every rank of `instance` the first time, and again once
  // a rank of the snapshot is gone or invalidate() dropped it; otherwise
  // returns the same snapshot. kNotFound for an instance never added; the
  // handshake's errors, naming the rank; kIncompatible for a rank whose
  // layout is not compatible, not the rank it was listed as, or that says
  // it belongs to another instance.
  Result<std::shared_ptr<const Fetched>> fetch(const std::string& instance);
  // Drops `snapshot` if it is still `instance`'s, so the next fetch()
  // handshakes again.
  void invalidate(const std::string& instance, const Fetched* snapshot);
  // The snapshot, if fetched; null otherwise.
  std::shared_ptr<const Fetched> fetched(const std::string& instance) const;
  // True when `instance` was added.
  bool known(const std::string& instance) const;
  // The instances added and not fetched yet.
  std::vector<std::string> unfetched() const;
  // The fetched instance and rank whose engine is `engine` (name, instance).
  std::optional<std::pair<std::string, size_t>> locate(const std::pair<std::string, uint64_t>& engine) const;
  // True when `engine` (name, instance) is a rank of a fetched instance and
  // of none that this rank reads from (its sources, Fetched::sources): a
  // rank that announces a layer to this one need not. False when unknown.
  bool reads_nothing_from(const std::pair<std::string, uint64_t>& engine) const;
  // True when `instance` is fetched and connected to every rank's engine,
  // each still there: nothing of a load from it waits on the network.
  bool connected(const std::string& instance) const;
  // The engine connection to rank `rank` of a fetched `instance`, made on
  // first use (Engine::connect's errors).
  Result<PeerId> peer(const std::string& instance, size_t rank);

  uint64_t handshakes() const;  // ranks fetched

 private:
  struct Instance {
    std::vector<std::string> addresses;
    std::shared_ptr<const Fetched> fetched;
    std::vector<std::optional<PeerId>> peers;
    // A value of generations_, new when the addresses change or the snapshot
    // is dropped: never reused, so a handshake that began before a removal
    // and an add again cannot store what it found under the new entry.
    uint64_t generation = 0;
    uint64_t routed = 0;                                                 // an alternate key: when route() last chose it
    std::shared_ptr<std::mutex> round = std::make_shared<std::mutex>();  // one handshake round at a time
  };
  // One round of fetch(); sets `replaced` when the instance was replaced
  // meanwhile (what it found is not the instance's now).
  Result<std::shared_ptr<const Fetched>> fetch_once(const std::string& instance, bool* replaced);
  // Requires mu_: whether a rank of `i`'s snapshot is gone.
  bool stale_locked(const Instance& i) const;
  Engine& engine_;
  const Layout& local_;
  const SideChannelOptions options_;
  const std::string identity_;
  const uint64_t hash_;
  mutable std::mutex mu_;
  std::map<std::string, Instance> instances_;  // by key
  uint64_t handshakes_ = 0;
  uint64_t routes_ = 0;
  uint64_t generations_ = 0;
};

}  // namespace kvbridge::connector
