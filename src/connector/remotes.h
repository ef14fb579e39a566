// connector/remotes.h: the remote instances one worker knows: each rank's
// side channel address, what its handshake told (fetched once per instance,
// on first use), and the engine connection to it (made once, on first use).
//
// A decode worker reads from prefill instances; a streaming prefill worker
// announces layers to decode instances: both find their peers here.
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
};

class Remotes {
 public:
  // `local`, `identity` and `hash` are this rank's: every remote rank must be
  // compatible with it. The engine must outlive this.
  Remotes(Engine& engine, const Layout& local, SideChannelOptions options, std::string identity, uint64_t hash);

  // The side channels of `instance`'s ranks, in tp_rank order. kAlreadyExists
  // when it was fetched already with other addresses.
  Status add(const std::string& instance, std::vector<std::string> addresses);
  // Handshakes with every rank of `instance` the first time (a later call
  // returns the same snapshot). kNotFound for an instance never added; the
  // handshake's errors, naming the rank; kIncompatible for a rank whose
  // layout is not compatible or not the rank it was listed as.
  Result<std::shared_ptr<const Fetched>> fetch(const std::string& instance);
  // The snapshot, if fetched; null otherwise.
  std::shared_ptr<const Fetched> fetched(const std::string& instance) const;
  // True when `instance` was added.
  bool known(const std::string& instance) const;
  // The instances added and not fetched yet.
  std::vector<std::string> unfetched() const;
  // The fetched instance and rank whose engine is `engine` (name, instance).
  std::optional<std::pair<std::string, size_t>> locate(const std::pair<std::string, uint64_t>& engine) const;
  // True when `instance` is fetched and connected to every rank's engine:
  // nothing of a load from it waits on the network.
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
  };
  Engine& engine_;
  const Layout& local_;
  const SideChannelOptions options_;
  const std::string identity_;
  const uint64_t hash_;
  mutable std::mutex mu_;
  std::mutex fetch_mu_;  // one handshake round at a time
  std::map<std::string, Instance> instances_;
  uint64_t handshakes_ = 0;
};

}  // namespace kvbridge::connector
