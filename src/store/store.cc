// The shared part of the prefix store: see kvbridge/store.h.
#include "kvbridge/store.h"

#include <cstdlib>

#include "store/cluster_tier.h"
#include "store/redis_tier.h"
#include "store/store_impl.h"

namespace kvbridge {

uint8_t* Store::Impl::allocate_locked(uint64_t bytes) {
  for (;;) {
    if (uint8_t* b = memory.allocate(bytes)) return b;
    auto oldest = staging.end();
    for (auto it = staging.begin(); it != staging.end(); ++it) {
      if (it->second.writers == 0 && (oldest == staging.end() || it->second.seq < oldest->second.seq)) oldest = it;
    }
    if (oldest == staging.end()) return nullptr;
    memory.release(oldest->second.data, oldest->second.bytes);
    staging.erase(oldest);
  }
}

Store::Store(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Store::~Store() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  for (auto& [key, s] : impl_->staging) impl_->memory.release(s.data, s.bytes);
  impl_->staging.clear();
}

Result<std::shared_ptr<Store>> Store::create(StoreOptions options) {
  if (options.hash_block_tokens == 0) return Status::invalid_argument("store: hash_block_tokens must be positive");
  if (options.memory_bytes == 0) return Status::invalid_argument("store: memory_bytes must be positive");
  if (options.redis && options.redis->host.empty()) return Status::invalid_argument("store: redis host is empty");
  std::unique_ptr<store_internal::DiskTier> disk;
  if (options.disk) {
    KVB_ASSIGN_OR_RETURN(disk, store_internal::DiskTier::open(*options.disk));
  }
  auto impl = std::make_unique<Impl>(std::move(options));
  impl->disk = std::move(disk);
  if (impl->options.redis) {
    if (impl->options.redis->cluster) {
      impl->redis = std::make_unique<store_internal::ClusterTier>(*impl->options.redis);
    } else {
      impl->redis = std::make_unique<store_internal::RedisTier>(*impl->options.redis);
    }
    // Asked once now, so that a tier that cannot be reached (a typo in its
    // address, a server not started) says why in stats() from the start,
    // not at the first lookup. Its failure is not the store's: the memory
    // and disk tiers work, and the shared tier is tried again later.
    const std::string ping = "PING";
    (void)impl->redis->command(std::span<const std::string>(&ping, 1));
  }
  return std::shared_ptr<Store>(new Store(std::move(impl)));
}

const StoreOptions& Store::options() const { return impl_->options; }

StoreStats Store::stats() const {
  StoreStats s;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    const auto& m = impl_->memory;
    s.memory_objects = m.object_count();
    s.memory_bytes = m.object_bytes();
    s.capacity_bytes = m.capacity_bytes();
    s.pooled_bytes = m.pooled_bytes();
    s.staging_objects = impl_->staging.size();
    s.pinned_objects = m.pinned_count();
    s.evictions = m.evictions();
    s.rejected = impl_->rejected;
    s.published = impl_->published;
    s.memory_hits = impl_->memory_hits;
    s.disk_hits = impl_->disk_hits;
    s.redis_hits = impl_->redis_hits;
    s.misses = impl_->misses;
    s.redis_bad_objects = impl_->redis_bad_objects;
  }
  if (impl_->disk) {
    const store_internal::DiskCounters c = impl_->disk->counters();
    s.disk_configured = true;
    s.disk_objects = c.objects;
    s.disk_bytes = c.bytes;
    s.disk_capacity_bytes = c.capacity;
    s.disk_writes = c.writes;
    s.disk_evictions = c.evictions;
    s.disk_errors = c.errors;
    s.disk_bad_objects = c.bad;
  }
  if (impl_->redis) {
    const store_internal::RedisCounters c = impl_->redis->counters();
    s.redis_configured = true;
    s.redis_up = c.up;
    s.redis_writes = c.writes;
    s.redis_parts = c.parts;
    s.redis_errors = c.errors;
    s.redis_skipped = c.skipped;
    s.redis_redirects = c.redirects;
    s.redis_slot_map_updates = c.slot_map_updates;
    s.redis_nodes = c.nodes;
    s.redis_last_error = c.last_error;
  }
  return s;
}

Result<Store::RedisInfo> Store::redis_info() {
  if (!impl_->redis) return Status::not_found("store: no shared tier is configured");
  KVB_ASSIGN_OR_RETURN(store_internal::TierSize t, impl_->redis->size());
  RedisInfo info;
  info.keys = t.keys;
  info.used_memory_bytes = t.used_memory_bytes;
  return info;
}

void Store::clear_memory(bool keep_buffers) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->memory.clear(keep_buffers);
}

}  // namespace kvbridge
