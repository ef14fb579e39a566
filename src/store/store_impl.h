// Store's state, shared by store.cc (the shared part) and rank_store.cc (the
// per-rank puts and gets). Not a public header.
//
// Locking: `mu` guards the memory tier, staging and the counters. Bytes are
// copied outside the lock: a reader holds pins, a writer owns its staging
// buffer's parts (ranks write disjoint bytes) and the buffer cannot go while
// `writers` > 0. The disk and Redis tiers have their own locks and are never
// called with `mu` held, so a slow disk or Redis never blocks memory hits.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "kvbridge/store.h"
#include "store/disk_tier.h"
#include "store/memory_tier.h"
#include "store/shared_tier.h"

namespace kvbridge {

struct StagingKey {
  ObjectKey key;
  uint32_t tp_size = 1;
  bool operator==(const StagingKey&) const = default;
};

struct StagingKeyHasher {
  size_t operator()(const StagingKey& k) const { return ObjectKeyHasher()(k.key) * 131 + k.tp_size; }
};

// An object being written by the ranks of one instance (one TP size).
struct Staging {
  uint8_t* data = nullptr;
  uint64_t bytes = 0;
  std::vector<uint8_t> done;  // per tp_rank
  uint32_t done_count = 0;
  uint32_t writers = 0;  // ranks copying into it now
  uint64_t seq = 0;      // creation order, oldest dropped first
};

struct Store::Impl {
  explicit Impl(StoreOptions o) : options(std::move(o)), memory(options.memory_bytes) {}

  // A buffer from the memory tier; when it is full of pinned objects, drops
  // the oldest staging entries that no rank is writing. Requires `mu`.
  uint8_t* allocate_locked(uint64_t bytes);

  StoreOptions options;
  mutable std::mutex mu;
  store_internal::MemoryTier memory;
  std::unique_ptr<store_internal::DiskTier> disk;     // opened by Store::create
  std::unique_ptr<store_internal::SharedTier> redis;  // made by Store::create
  std::unordered_map<StagingKey, Staging, StagingKeyHasher> staging;
  uint64_t next_seq = 0;
  uint64_t rejected = 0, published = 0, memory_hits = 0, disk_hits = 0, redis_hits = 0, misses = 0,
           redis_bad_objects = 0;
};

}  // namespace kvbridge
