// connector/read_grants.h: a pull-mode prefill rank's read grants. Each
// hand-off (ConnectorWorker::hand_off) names a request's blocks; the
// engines that then heartbeat for that request (with a secret, proven) may
// read exactly those blocks' bytes (block_spans(), layout.h) until the
// engine frees them (blocks_released()). A heartbeat that comes before the
// hand-off is kept until it does. Only a registration made with
// RemoteAccess::kGrantedRead is bound by it, and only where the transport
// serves reads itself (tcp); without kGrantedRead the hand-off is checked
// and kept nowhere.
//
// Thread-safety: every method may be called from any thread. Grants are
// made and revoked under the lock that guards the bookkeeping, so that a
// release cannot pass a grant under way (the engine never calls back).
#pragma once

#include <cstdint>
#include <map>
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

  // `regions` are the layout's tensors' registrations, in layout order.
  // `enabled`: they were made with kGrantedRead.
  ReadGrants(Engine& engine, const Layout& layout, std::vector<RegionId> regions, bool enabled)
      : engine_(engine), layout_(layout), regions_(std::move(regions)), enabled_(enabled) {}
  ~ReadGrants();

  // The request's blocks (by group name) are handed off. kInvalidArgument
  // naming an unknown group, kOutOfRange a block past its group,
  // kAlreadyExists for a request handed off and not released.
  Status hand_off(const std::string& request, const std::map<std::string, std::vector<int64_t>>& blocks);
  // `reader` heartbeat for `request`: it may read the request's blocks.
  void heard(const std::string& request, const Reader& reader);
  // The request's blocks are freed: when it returns, no reader is sent a
  // byte of them under its grant.
  void released(const std::string& request);
  // Hand-offs held now (tests).
  size_t held() const;

 private:
  struct HandOff {
    uint64_t seq = 0;  // its key in order_
    std::vector<WriteGrant> ranges;
    std::map<Reader, GrantId> grants;
  };
  struct Early {
    uint64_t seq = 0;
    std::set<Reader> readers;
  };
  // Requires mu_: grants `reader` the hand-off's ranges, once.
  void grant_locked(HandOff& h, const Reader& reader);
  // Requires mu_: ends the hand-off's grants.
  void revoke_locked(HandOff& h);

  Engine& engine_;
  const Layout& layout_;
  const std::vector<RegionId> regions_;
  const bool enabled_;
  mutable std::mutex mu_;
  uint64_t next_seq_ = 0;
  std::map<std::string, HandOff> held_;
  std::map<uint64_t, std::string> held_order_;  // by seq: the oldest first
  std::map<std::string, Early> early_;
  std::map<uint64_t, std::string> early_order_;
};

}  // namespace kvbridge::connector
