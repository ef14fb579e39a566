// LRU memory tier with pins and a buffer pool: see memory_tier.h.
#include "store/memory_tier.h"

#include <cstdlib>

namespace kvbridge::store_internal {
namespace {

uint64_t rounded(uint64_t bytes) { return (bytes + 63) / 64 * 64; }

}  // namespace

MemoryTier::~MemoryTier() {
  for (auto& [key, e] : objects_) std::free(e.data);
  for (auto& [size, bufs] : pool_) {
    for (uint8_t* b : bufs) std::free(b);
  }
}

void MemoryTier::free_buffer(uint8_t* buffer, uint64_t bytes) {
  std::free(buffer);
  used_ -= bytes;
}

uint8_t* MemoryTier::evict_one(uint64_t* bytes) {
  if (lru_.empty()) return nullptr;
  const ObjectKey key = lru_.back();
  lru_.pop_back();
  auto it = objects_.find(key);
  uint8_t* data = it->second.data;
  *bytes = it->second.bytes;
  object_bytes_ -= it->second.bytes;
  objects_.erase(it);
  ++evictions_;
  return data;
}

uint8_t* MemoryTier::allocate(uint64_t bytes) {
  auto p = pool_.find(bytes);
  if (p != pool_.end() && !p->second.empty()) {
    uint8_t* b = p->second.back();
    p->second.pop_back();
    pooled_bytes_ -= bytes;
    return b;
  }
  while (used_ + bytes > capacity_) {
    // Pooled buffers of other sizes go first: they hold no data.
    bool dropped = false;
    for (auto& [size, bufs] : pool_) {
      if (bufs.empty()) continue;
      free_buffer(bufs.back(), size);
      pooled_bytes_ -= size;
      bufs.pop_back();
      dropped = true;
      break;
    }
    if (dropped) continue;
    uint64_t evicted_bytes = 0;
    uint8_t* evicted = evict_one(&evicted_bytes);
    if (evicted == nullptr) return nullptr;
    if (evicted_bytes == bytes) return evicted;  // reuse its pages as they are
    free_buffer(evicted, evicted_bytes);
  }
  void* b = std::aligned_alloc(64, rounded(bytes));
  if (b == nullptr) return nullptr;
  used_ += bytes;
  return static_cast<uint8_t*>(b);
}

void MemoryTier::release(uint8_t* buffer, uint64_t bytes) {
  if (buffer == nullptr) return;
  pool_[bytes].push_back(buffer);
  pooled_bytes_ += bytes;
}

bool MemoryTier::insert(const ObjectKey& key, uint8_t* buffer, uint64_t bytes, uint32_t pins) {
  auto it = objects_.find(key);
  if (it != objects_.end()) {
    release(buffer, bytes);
    for (uint32_t i = 0; i < pins; ++i) pin(key);
    return false;
  }
  Entry e;
  e.data = buffer;
  e.bytes = bytes;
  e.pins = pins;
  if (pins == 0) {
    lru_.push_front(key);
    e.lru = lru_.begin();
  } else {
    ++pinned_;
  }
  objects_.emplace(key, e);
  object_bytes_ += bytes;
  return true;
}

const uint8_t* MemoryTier::pin(const ObjectKey& key, uint64_t* bytes) {
  auto it = objects_.find(key);
  if (it == objects_.end()) return nullptr;
  Entry& e = it->second;
  if (e.pins++ == 0) {
    lru_.erase(e.lru);
    ++pinned_;
  }
  if (bytes) *bytes = e.bytes;
  return e.data;
}

void MemoryTier::unpin(const ObjectKey& key) {
  auto it = objects_.find(key);
  if (it == objects_.end() || it->second.pins == 0) return;
  Entry& e = it->second;
  if (--e.pins == 0) {
    lru_.push_front(key);
    e.lru = lru_.begin();
    --pinned_;
  }
}

void MemoryTier::clear(bool keep_buffers) {
  while (!lru_.empty()) {
    uint64_t b = 0;
    uint8_t* d = evict_one(&b);
    --evictions_;  // a clear is not an eviction under pressure
    if (keep_buffers) {
      release(d, b);
    } else {
      free_buffer(d, b);
    }
  }
  if (keep_buffers) return;
  for (auto& [size, bufs] : pool_) {
    for (uint8_t* b : bufs) free_buffer(b, size);
    pooled_bytes_ -= size * bufs.size();
    bufs.clear();
  }
}

}  // namespace kvbridge::store_internal
