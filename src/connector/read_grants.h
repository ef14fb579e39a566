// connector/read_grants.h: a pull-mode prefill rank's read grants. Each
// hand-off (ConnectorWorker::hand_off) names a request's blocks; the
// engines that then heartbeat for that request (with a secret, proven) may
// read exactly those blocks' bytes (block_places(), layout.h) until the
// engine frees them (blocks_released()). A heartbeat that comes before the
// hand-off is kept until it does. Only a registration made with
// RemoteAccess::kGrantedRead is bound by it, and only where the transport
// serves reads itself (tcp); without kGrantedRead a hand-off is checked and
// kept nowhere.
//
// The costly part, a hand-off's places (a request of 8,192 blocks of an
// 80-layer model is its blocks' spans in one tensor, repeated in the 159
// others: block_places()) and the engine's grant, runs on the
// worker's pump (grant_waiting()), never on the caller of hand_off() or
// released(), which only record: released() waits only for a grant of
// that same request under way, so that when it returns no reader is sent a
// byte of the request's blocks under its grant.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "kvbridge/engine.h"
#include "kvbridge/layout.h"
#include "kvbridge/status.h"

namespace kvbridge::connector {

class ReadGrants {
 public:
  // At most this many hand-offs held, and requests heard of before their
  // hand-off kept; the oldest go first past the bound.
  static constexpr size_t kMaxHeld = 65536;
  static constexpr size_t kMaxEarly = 4096;
  // Reader engines granted per hand-off (a decode instance's ranks).
  static constexpr size_t kMaxReaders = 1024;

  using Reader = std::pair<std::string, uint64_t>;  // engine name and instance
  using Blocks = std::map<std::string, std::vector<int64_t>>;

  // `regions` are the layout's tensors' registrations, in layout order.
  // `enabled`: they were made with kGrantedRead.
  ReadGrants(Engine& engine, const Layout& layout, std::vector<RegionId> regions, bool enabled)
      : engine_(engine), layout_(layout), regions_(std::move(regions)), enabled_(enabled) {}
  ~ReadGrants();

  // The request's blocks (by group name) are handed off. True when readers
  // heard before it now wait for grant_waiting(). kInvalidArgument naming
  // an unknown group, kOutOfRange a block past its group, kAlreadyExists for
  // a request handed off and not released.
  Result<bool> hand_off(const std::string& request, Blocks blocks);
  // `reader` heartbeat for `request`: it may read the request's blocks (once
  // grant_waiting() ran).
  void heard(const std::string& request, const Reader& reader);
  // Grants every reader heard for a hand-off that has not got its grant.
  // Runs on one thread (the worker's pump).
  void grant_waiting();
  // The request's blocks are freed: when it returns, no reader is sent a
  // byte of them under its grant.
  void released(const std::string& request);
  // Hand-offs held now (tests).
  size_t held() const;

 private:
  // A hand-off's places as the engine grants them: ranges and repeats.
  struct Places {
    std::vector<WriteGrant> ranges;
    std::vector<GrantRepeat> repeats;
  };
  struct HandOff {
    uint64_t seq = 0;  // its key in held_order_
    std::shared_ptr<const Blocks> blocks;
    std::shared_ptr<const Places> places;  // made by the first grant
    std::map<Reader, GrantId> grants;
    std::set<Reader> waiting;  // heard, not granted yet
    bool granting = false;     // grant_waiting() works on it outside the lock
  };
  struct Early {
    uint64_t seq = 0;
    std::set<Reader> readers;
  };
  // The engine places of `blocks` (block_places(), group by group).
  Result<Places> places_of(const Blocks& blocks) const;
  // Requires mu_: ends the hand-off's grants.
  void revoke_locked(HandOff& h);

  Engine& engine_;
  const Layout& layout_;
  const std::vector<RegionId> regions_;
  const bool enabled_;
  mutable std::mutex mu_;
  std::condition_variable granted_;  // a hand-off's `granting` ended
  uint64_t next_seq_ = 0;
  std::map<std::string, HandOff> held_;
  std::map<uint64_t, std::string> held_order_;  // by seq: the oldest first
  std::set<std::string> pending_;               // hand-offs with waiting readers
  std::map<std::string, Early> early_;
  std::map<uint64_t, std::string> early_order_;
};

}  // namespace kvbridge::connector
