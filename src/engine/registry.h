// engine/registry.h: this engine's registered memory.
//
// A region is what a caller registered (base, bytes, memory kind) and names
// with a RegionId. Registering the same range again returns the same id and
// counts a reference. Transports never see regions: they see segments, the
// unions of overlapping regions, so that two views of one allocation are
// registered with a transport once. Merging or splitting segments replaces
// them (add the new ones, then remove the old ones), and gives them fresh
// segment ids, so a peer holding stale metadata names a segment that no
// longer exists and gets an error rather than bytes that moved.
//
// A region has an in-use count: transfers hold it from submit until they
// end, and a region in use cannot be deregistered. The count is an atomic
// that a transfer keeps a reference to: it is taken under the registry lock
// (so a region cannot go between its check and its hold) and dropped
// without it, so a transfer can end on any thread, including a transport's
// own, which may not take the registry lock (transport.h).
//
// Thread-safety: none of its own. The engine calls every method with its
// registry lock held, which is also the lock under which transports'
// add_segment/remove_segment run (transport.h). Ownership: the memory stays
// the caller's; the transports are borrowed and outlive the registry.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "engine/metadata.h"
#include "kvbridge/engine.h"
#include "transport/transport.h"

namespace kvbridge::engine_internal {

struct Region {
  RegionId id = 0;
  uint8_t* base = nullptr;
  uint64_t bytes = 0;
  std::string memory;
  uint8_t access = 3;  // RemoteAccess bits
  uint32_t segment = 0;
  uint32_t refs = 0;  // registrations of this exact range
  // Transfers holding it.
  std::shared_ptr<std::atomic<uint32_t>> in_use = std::make_shared<std::atomic<uint32_t>>(0);
};

// A transfer's hold on a region: released by a decrement, on any thread.
using RegionHold = std::shared_ptr<std::atomic<uint32_t>>;

class Registry {
 public:
  explicit Registry(std::vector<transport::Transport*> transports) : transports_(std::move(transports)) {}
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // See Engine::register_memory. A transport's add_segment error is returned
  // with the transport's name, and nothing changes.
  Result<RegionId> add(void* base, uint64_t bytes, std::string_view memory, uint8_t access = 3);
  // See Engine::deregister_memory.
  Status remove(RegionId id);

  // The local address of [offset, offset + bytes) in region `id`. kNotFound
  // for an unknown region, kOutOfRange outside it; `what` prefixes the message
  // ("item 3").
  Result<uint8_t*> resolve(RegionId id, uint64_t offset, uint64_t bytes, std::string_view what) const;

  // In-use counting; requires a known id. acquire() returns the hold;
  // release it with release(hold) (no lock needed) or release(id).
  RegionHold acquire(RegionId id);
  void release(RegionId id);
  static void release(const RegionHold& hold) { hold->fetch_sub(1, std::memory_order_acq_rel); }

  // Appends segments (keys in transports' order) and regions to `m`: those
  // that grant peers some access; the others are this engine's business.
  void describe(EngineMetadata* m) const;

  // Pins host segments for copies to and from devices (device.h
  // register_host): each segment when it is made, after the segments it
  // replaces were unpinned, and unpinned when dropped. A segment CUDA
  // cannot pin (pinned already by its owner, as torch's pin_memory() does)
  // stays registered as it is.
  void set_pin_host(bool pin) { pin_host_ = pin; }

  const Region* find(RegionId id) const;
  size_t num_regions() const { return regions_.size(); }
  size_t num_segments() const { return segments_.size(); }

 private:
  struct SegmentEntry {
    transport::Segment segment;
    std::vector<std::string> keys;  // per transport
    bool pinned = false;            // register_host'ed
  };
  void pin(uint32_t id);
  // Registers a new segment [begin, end) with every transport; on failure
  // unregisters it from those that took it.
  Result<uint32_t> add_segment(uint8_t* begin, uint8_t* end, const std::string& memory, uint8_t access);
  void drop_segment(uint32_t id);

  std::vector<transport::Transport*> transports_;
  std::map<RegionId, Region> regions_;
  std::map<uint32_t, SegmentEntry> segments_;
  RegionId next_region_ = 1;
  uint32_t next_segment_ = 1;
  bool device_seen_ = false;  // a cuda:N range was registered
  bool pin_host_ = false;
};

// Whether `memory` names a kind this build can register ("host"); the reason
// when not.
Status check_memory_kind(std::string_view memory);

// Holds on local regions shared by their owners (a prepared table of
// moves and the transfers that use it), released when the last lets go:
// a transfer takes one reference, not a hold per region.
struct HeldRegions {
  std::vector<RegionHold> holds;
  HeldRegions() = default;
  HeldRegions(const HeldRegions&) = delete;
  HeldRegions& operator=(const HeldRegions&) = delete;
  ~HeldRegions() {
    for (const RegionHold& hold : holds) Registry::release(hold);
  }
};

}  // namespace kvbridge::engine_internal
