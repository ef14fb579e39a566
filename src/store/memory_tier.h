// The memory tier: visible objects in host memory, bounded by a capacity in
// bytes, evicted least recently used first; an object under a reader's pin is
// never evicted. Buffers of evicted or dropped objects are kept in a pool by
// size and reused: objects of one group all have one size, so in steady state
// a put reuses an evicted object's pages instead of faulting in fresh ones.
// Everything the tier holds (visible objects, buffers handed out for staging,
// pooled buffers) counts toward the capacity.
//
// Not a public header. Thread-safety: none; Store serialises access.
#pragma once

#include <cstdint>
#include <list>
#include <unordered_map>
#include <vector>

#include "kvbridge/store_key.h"

namespace kvbridge::store_internal {

class MemoryTier {
 public:
  explicit MemoryTier(uint64_t capacity_bytes) : capacity_(capacity_bytes) {}
  ~MemoryTier();
  MemoryTier(const MemoryTier&) = delete;
  MemoryTier& operator=(const MemoryTier&) = delete;

  // A buffer of `bytes` (64-byte aligned), from the pool or new, after making
  // room by dropping pooled buffers and evicting unpinned objects. nullptr
  // when everything left is pinned or in use. The caller gives it back with
  // insert() or release().
  uint8_t* allocate(uint64_t bytes);
  // Returns a buffer from allocate() to the pool.
  void release(uint8_t* buffer, uint64_t bytes);

  bool contains(const ObjectKey& key) const { return objects_.count(key) != 0; }
  // Makes `buffer` (from allocate()) the visible object `key`, most recently
  // used, with `pins` pins. When `key` is already visible the buffer goes back
  // to the pool and false is returned (the existing object is pinned instead).
  bool insert(const ObjectKey& key, uint8_t* buffer, uint64_t bytes, uint32_t pins);
  // Pins `key` and returns its bytes, or nullptr when absent. Marks it used.
  const uint8_t* pin(const ObjectKey& key, uint64_t* bytes = nullptr);
  // Drops one pin; at zero the object is evictable again (most recent).
  void unpin(const ObjectKey& key);
  // Evicts every unpinned object; their buffers join the pool when
  // `keep_buffers`, and otherwise the pool is freed too.
  void clear(bool keep_buffers = false);

  uint64_t capacity_bytes() const { return capacity_; }
  uint64_t used_bytes() const { return used_; }
  uint64_t object_count() const { return objects_.size(); }
  uint64_t object_bytes() const { return object_bytes_; }
  uint64_t pooled_bytes() const { return pooled_bytes_; }
  uint64_t pinned_count() const { return pinned_; }
  uint64_t evictions() const { return evictions_; }

 private:
  struct Entry {
    uint8_t* data = nullptr;
    uint64_t bytes = 0;
    uint32_t pins = 0;
    std::list<ObjectKey>::iterator lru;  // valid when pins == 0
  };
  // Evicts the least recently used unpinned object; returns its buffer and
  // size (still counted in used_), or nullptr when none is evictable.
  uint8_t* evict_one(uint64_t* bytes);
  void free_buffer(uint8_t* buffer, uint64_t bytes);

  uint64_t capacity_;
  uint64_t used_ = 0;          // objects + handed out + pooled
  uint64_t object_bytes_ = 0;  // visible objects only
  uint64_t pooled_bytes_ = 0;
  uint64_t pinned_ = 0;
  uint64_t evictions_ = 0;
  std::unordered_map<ObjectKey, Entry, ObjectKeyHasher> objects_;
  std::list<ObjectKey> lru_;  // unpinned objects, most recent first
  std::unordered_map<uint64_t, std::vector<uint8_t*>> pool_;
};

}  // namespace kvbridge::store_internal
