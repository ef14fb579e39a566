// One rank's lookups and gets, and RankStore's surface: see kvbridge/store.h
// and docs/store.md. Puts are in rank_store_put.cc.
//
// A get computes the presence of every object of the prefix (memory, then
// the disk tier and Redis for what memory lacks), applies the lookup rule,
// pins what the hit needs (fetching from disk, then from Redis what disk did
// not give, into memory: promotion, each object copied into the rank as it
// arrives; objects from Redis are then written to disk), and copies the rest
// object by object
// (Canonical::get: a plan template between the object and the rank's
// layout). An object that vanishes between the
// lookup and the pin lowers the hit and the rule runs again.
#include <algorithm>
#include <functional>
#include <numeric>

#include <xxhash.h>

#include "kvbridge/store.h"
#include "store/object.h"
#include "store/rank_store_impl.h"

namespace kvbridge {

using store_internal::Canonical;
using store_internal::GroupPresence;

namespace {

// GroupPresence::present: where object j is (the nearest tier).
constexpr uint8_t kAbsent = 0, kInMemory = 1, kInRedis = 2, kOnDisk = 3;

// Promotion: objects read from disk or Redis go straight into memory-tier
// buffers (DiskTier::get and RedisTier::get receive each value into the
// buffer named here), are
// checksummed as their bytes arrive (while they are in cache), checked, and
// become visible pinned for the reader. A value of the wrong size is dropped
// unread; a buffer whose value did not arrive whole goes back to the pool.
class Promotion final : public store_internal::GetSink {
 public:
  struct Target {
    ObjectKey key;
    uint64_t bytes;
    const uint8_t** out;  // set to the pinned object's bytes
  };
  // `ready(i, bytes)`, when set, runs after target i is promoted, outside
  // the store lock, while its bytes are still in cache.
  // Objects that fail the check are counted in `*bad` (under the store
  // lock) and listed in bad().
  Promotion(Store::Impl& s, uint64_t H, std::span<const Target> targets, uint64_t* bad,
            std::function<void(size_t, const uint8_t*)> ready)
      : s_(s),
        H_(H),
        bad_(bad),
        targets_(targets),
        ready_(std::move(ready)),
        state_(XXH3_createState()),
        buffers_(targets.size(), nullptr) {}
  ~Promotion() override {
    std::lock_guard<std::mutex> lock(s_.mu);
    for (size_t i = 0; i < buffers_.size(); ++i) s_.memory.release(buffers_[i], targets_[i].bytes);
    XXH3_freeState(state_);
  }

  uint8_t* buffer(size_t i, uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(s_.mu);
    if (bytes != targets_[i].bytes) {
      ++*bad_;
      bad_keys_.push_back(targets_[i].key);
      return nullptr;
    }
    buffers_[i] = s_.allocate_locked(bytes);
    return buffers_[i];
  }
  void received(size_t i, uint64_t offset, uint64_t n) override {
    // The checksum covers the payload; whether there is one, the header says.
    const uint64_t end = offset + n;
    if (end <= store_internal::kHeaderBytes) return;
    if (offset <= store_internal::kHeaderBytes) {
      hashing_ = store_internal::has_checksum(buffers_[i]);
      if (hashing_) XXH3_64bits_reset(state_);
      offset = store_internal::kHeaderBytes;
    }
    if (hashing_) XXH3_64bits_update(state_, buffers_[i] + offset, end - offset);
  }
  void done(size_t i) override {
    const Target& t = targets_[i];
    const uint64_t sum = hashing_ ? XXH3_64bits_digest(state_) : 0;
    const Status ok = store_internal::check_object({buffers_[i], t.bytes}, t.key, t.bytes, H_, &sum);
    {
      std::lock_guard<std::mutex> lock(s_.mu);
      if (!ok.ok()) {
        ++*bad_;
        bad_keys_.push_back(t.key);
        s_.memory.release(buffers_[i], t.bytes);
      } else {
        s_.memory.insert(t.key, buffers_[i], t.bytes, 1);  // pinned for this read
        *t.out = s_.memory.pin(t.key);
        s_.memory.unpin(t.key);
        promoted_.push_back(t.key);
      }
    }
    buffers_[i] = nullptr;
    hashing_ = false;
    if (ok.ok() && ready_) ready_(i, *t.out);
  }
  // Hands over the pins of the promoted objects.
  void finish(std::vector<ObjectKey>* pinned, uint64_t* promoted) {
    pinned->insert(pinned->end(), promoted_.begin(), promoted_.end());
    *promoted += promoted_.size();
    promoted_.clear();
  }
  const std::vector<ObjectKey>& bad() const { return bad_keys_; }

 private:
  Store::Impl& s_;
  uint64_t H_;
  uint64_t* bad_;
  std::span<const Target> targets_;
  std::function<void(size_t, const uint8_t*)> ready_;
  XXH3_state_t* state_;
  bool hashing_ = false;
  std::vector<uint8_t*> buffers_;  // handed to Redis, not yet done
  std::vector<ObjectKey> promoted_;
  std::vector<ObjectKey> bad_keys_;
};

}  // namespace

Result<std::vector<GroupPresence>> RankStore::Impl::presence(const std::vector<BlockHash>& hashes,
                                                             uint64_t* redis_found) {
  std::vector<GroupPresence> out;
  std::vector<std::pair<size_t, uint64_t>> missing;  // (index in out, j)
  {
    std::lock_guard<std::mutex> lock(s->mu);
    for (size_t gi : stored) {
      GroupPresence gp;
      gp.group = &layout.groups[gi];
      gp.present.assign(hashes.size(), 0);
      for (uint64_t j = 0; j < hashes.size(); ++j) {
        gp.present[j] = s->memory.contains(key(gi, hashes, j)) ? kInMemory : kAbsent;
        if (!gp.present[j]) missing.push_back({out.size(), j});
      }
      out.push_back(std::move(gp));
    }
  }
  if (s->disk && !missing.empty()) {
    std::vector<std::pair<size_t, uint64_t>> still;
    for (const auto& [o, j] : missing) {
      if (s->disk->contains(key(stored[o], hashes, j))) {
        out[o].present[j] = kOnDisk;
      } else {
        still.push_back({o, j});
      }
    }
    missing = std::move(still);
  }
  *redis_found = 0;
  if (s->redis && !missing.empty()) {
    std::vector<std::string> keys;
    keys.reserve(missing.size());
    for (const auto& [o, j] : missing) keys.push_back(s->redis->key_of(key(stored[o], hashes, j)));
    const std::vector<uint8_t> there = s->redis->exists(keys);
    for (size_t m = 0; m < missing.size(); ++m) {
      if (there[m]) {
        out[missing[m].first].present[missing[m].second] = kInRedis;
        ++*redis_found;
      }
    }
  }
  return out;
}

Result<uint64_t> RankStore::Impl::copy_out(size_t gi, const GroupBlocks& list, uint64_t skip, uint64_t hit, uint64_t j,
                                           TensorMemory memory, const uint8_t* object) {
  const Group& g = layout.groups[gi];
  const std::vector<int64_t>& ids = list.local;
  if (g.kind == GroupKind::kState) {
    // The state at `hit` goes into the entry that holds the hit's last token.
    const uint64_t entry = g.entries_for_tokens(hit) - 1;
    if (entry >= ids.size() || ids[entry] < 0) {
      return Status::invalid_argument("store: group '" + g.name + "' lists no block for the state at token " +
                                      std::to_string(hit) + " (entry " + std::to_string(entry) + ")");
    }
    return canonical.get(gi, ids[entry], 0, 0, object, memory, defer());
  }
  // Object j holds tokens [j * H, (j + 1) * H), of which the rank has those
  // before skip.
  const uint64_t first = std::max(j * H, skip), end = (j + 1) * H;
  const BlockSlot slot = g.slot_of_token(first);
  if (slot.entry >= ids.size() || ids[slot.entry] < 0 || static_cast<uint64_t>(ids[slot.entry]) >= g.num_blocks) {
    return Status::invalid_argument("store: get group '" + g.name + "': entry " + std::to_string(slot.entry) +
                                    " of the block list is missing, -1 or past num_blocks");
  }
  return canonical.get(gi, ids[slot.entry], slot.token, slot.token + (end - first), object, memory, defer());
}

Result<GetResult> RankStore::Impl::get(std::span<const uint32_t> tokens, const Request& request, TensorMemory memory,
                                       bool copy, const Readiness& ready) {
  if (request.num_tokens > tokens.size()) {
    return Status::invalid_argument("store: request.num_tokens " + std::to_string(request.num_tokens) +
                                    " exceeds the " + std::to_string(tokens.size()) + " tokens given");
  }
  if (copy) {
    KVB_RETURN_IF_ERROR(check_memory(layout, memory).with_context("store"));
    KVB_RETURN_IF_ERROR(begin(memory, ready));
  }
  const std::vector<BlockHash> hashes = chain_hashes(seed, H, tokens.first(request.num_tokens));
  uint64_t in_redis = 0;
  KVB_ASSIGN_OR_RETURN(std::vector<GroupPresence> pres, presence(hashes, &in_redis));
  GetResult result;
  const uint64_t skip = copy ? request.skip_tokens : 0;
  // Per stored group: the needed blocks and their pinned bytes.
  std::vector<std::vector<uint64_t>> needed(stored.size());
  std::vector<std::vector<const uint8_t*>> data(stored.size());
  std::vector<std::vector<uint8_t>> early(stored.size());  // copied into the rank as it arrived
  std::vector<ObjectKey> pinned;
  std::vector<std::pair<size_t, size_t>> to_disk;  // promoted from Redis: written to disk before unpinning
  // Device memory: the copies deferred so far are made before their
  // objects are unpinned (the first failure is the get's).
  Status flushed;
  auto unpin_all = [&] {
    Status f = flush(true);
    if (flushed.ok()) flushed = f;
    for (const auto& [o, x] : to_disk) {
      s->disk->put(key(stored[o], hashes, needed[o][x]), {data[o][x], canonical.geometry(stored[o]).object_bytes});
    }
    to_disk.clear();
    std::lock_guard<std::mutex> lock(s->mu);
    for (const ObjectKey& k : pinned) s->memory.unpin(k);
    pinned.clear();
  };
  uint64_t hit = 0;
  for (;;) {
    hit = store_internal::hit_tokens(pres, H, align, request.num_tokens);
    result = GetResult{};
    result.hit_tokens = hit;
    bool all = true;
    std::vector<std::pair<size_t, size_t>> fetch;  // (group slot, index in needed)
    {
      std::lock_guard<std::mutex> lock(s->mu);
      for (size_t o = 0; o < stored.size(); ++o) {
        needed[o] = store_internal::needed_blocks(layout.groups[stored[o]], hit, skip, H);
        data[o].assign(needed[o].size(), nullptr);
        early[o].assign(needed[o].size(), 0);
        for (size_t x = 0; x < needed[o].size(); ++x) {
          const ObjectKey k = key(stored[o], hashes, needed[o][x]);
          if (!copy) {
            const uint8_t where = pres[o].present[needed[o][x]];
            (where == kInMemory ? result.memory_objects
             : where == kOnDisk ? result.disk_objects
                                : result.redis_objects) += 1;
            continue;
          }
          if (const uint8_t* d = s->memory.pin(k)) {
            data[o][x] = d;
            pinned.push_back(k);
            ++result.memory_objects;
          } else {
            fetch.push_back({o, x});
          }
        }
      }
    }
    // Copy each promoted object into the rank as it arrives, from cache
    // (one that cannot be copied is left to the copy below, which reports
    // why).
    auto ready = [&](std::span<const std::pair<size_t, size_t>> from, size_t i, const uint8_t* bytes) {
      const auto [o, x] = from[i];
      Result<const GroupBlocks*> list = blocks(request, stored[o]);
      if (!list.ok()) return;
      if (Result<uint64_t> n = copy_out(stored[o], **list, skip, hit, needed[o][x], memory, bytes); n.ok()) {
        early[o][x] = 1;
        result.bytes_copied += *n;
      }
    };
    // Promotes `from` out of one tier (its get(keys, sink)); returns what is
    // still missing.
    auto promote = [&](std::span<const std::pair<size_t, size_t>> from, uint64_t* bad, uint64_t* promoted,
                       const std::function<void(std::span<const ObjectKey>, store_internal::GetSink&)>& tier_get)
        -> std::vector<ObjectKey> {
      std::vector<ObjectKey> keys;
      std::vector<Promotion::Target> targets;
      for (const auto& [o, x] : from) {
        keys.push_back(key(stored[o], hashes, needed[o][x]));
        targets.push_back({keys.back(), canonical.geometry(stored[o]).object_bytes, &data[o][x]});
      }
      std::function<void(size_t, const uint8_t*)> on_ready;
      if (copy) on_ready = [&](size_t i, const uint8_t* bytes) { ready(from, i, bytes); };
      Promotion sink(*s, H, targets, bad, on_ready);
      tier_get(keys, sink);
      sink.finish(&pinned, promoted);
      return sink.bad();
    };
    std::vector<std::pair<size_t, size_t>> from_disk, from_redis;
    for (const auto& [o, x] : fetch) {
      (s->disk && pres[o].present[needed[o][x]] == kOnDisk ? from_disk : from_redis).push_back({o, x});
    }
    if (!from_disk.empty()) {
      uint64_t bad = 0;
      const std::vector<ObjectKey> dropped =
          promote(from_disk, &bad, &result.disk_objects,
                  [&](std::span<const ObjectKey> k, store_internal::GetSink& sink) { s->disk->get(k, sink); });
      for (const ObjectKey& k : dropped) s->disk->drop_bad(k);
      for (const auto& ox : from_disk) {
        if (data[ox.first][ox.second] == nullptr) from_redis.push_back(ox);  // Redis may still have it
      }
    }
    if (!from_redis.empty() && s->redis) {
      const uint64_t before = result.redis_objects;
      promote(from_redis, &s->redis_bad_objects, &result.redis_objects,
              [&](std::span<const ObjectKey> k, store_internal::GetSink& sink) {
                std::vector<std::string> text;
                for (const ObjectKey& one : k) text.push_back(s->redis->key_of(one));
                s->redis->get(text, sink);
              });
      if (s->disk && result.redis_objects > before) {
        for (const auto& [o, x] : from_redis) {
          if (data[o][x] != nullptr) to_disk.push_back({o, x});
        }
      }
    }
    for (const auto& [o, x] : fetch) {
      if (data[o][x] == nullptr) {
        all = false;
        pres[o].present[needed[o][x]] = kAbsent;  // gone: lower the hit and retry
      }
    }
    if (all) break;
    unpin_all();
  }
  if (copy) {  // lookups count nothing: the get that follows does
    std::lock_guard<std::mutex> lock(s->mu);
    s->memory_hits += result.memory_objects;
    s->disk_hits += result.disk_objects;
    s->redis_hits += result.redis_objects;
    s->misses += hashes.size() - hit / H;
  }
  if (!copy || hit <= skip) {
    unpin_all();
    if (!flushed.ok()) return flushed;
    return result;
  }
  Status st;
  for (size_t o = 0; o < stored.size() && st.ok(); ++o) {
    if (needed[o].empty()) continue;
    const size_t gi = stored[o];
    Result<const GroupBlocks*> list = blocks(request, gi);
    if (!list.ok()) {
      st = list.error();
      break;
    }
    for (size_t x = 0; x < needed[o].size() && st.ok(); ++x) {
      if (early[o][x]) continue;  // copied as it arrived from disk or Redis
      Result<uint64_t> n = copy_out(gi, **list, skip, hit, needed[o][x], memory, data[o][x]);
      if (n.ok()) {
        result.bytes_copied += *n;
      } else {
        st = n.error();
      }
    }
  }
  if (!st.ok()) deferred.clear();  // a get that fails copies no more
  unpin_all();
  if (!st.ok()) return st;
  if (!flushed.ok()) return flushed;
  return result;
}

// ---------------------------------------------------------------------------

RankStore::RankStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RankStore::RankStore(RankStore&&) noexcept = default;
RankStore& RankStore::operator=(RankStore&&) noexcept = default;
RankStore::~RankStore() = default;

Result<RankStore> RankStore::create(std::shared_ptr<Store> store, const Layout& layout,
                                    const RankStoreOptions& memory) {
  if (!store) return Status::invalid_argument("store: no store");
  if (memory.memory != "host" && memory.memory.rfind("cuda:", 0) != 0) {
    return Status::invalid_argument("store: unknown memory kind '" + memory.memory + "' (expected 'host' or 'cuda:N')");
  }
  KVB_RETURN_IF_ERROR(validate(layout));
  if (layout.pp_size != 1) {
    return Status::invalid_argument("store: the layout is a rank of pipeline stage " + std::to_string(layout.pp_rank) +
                                    " of " + std::to_string(layout.pp_size) +
                                    "; the prefix store takes ranks that hold every layer (pp_size 1)");
  }
  for (const Group& g : layout.groups) {
    if (g.context.sharded()) {
      return Status::invalid_argument("store: group '" + g.name + "' is context shard " +
                                      std::to_string(g.context.rank) + " of " + std::to_string(g.context.size) +
                                      "; the prefix store takes ranks that hold every token of a block");
    }
  }
  auto impl = std::make_unique<Impl>();
  impl->H = store->options().hash_block_tokens;
  KVB_ASSIGN_OR_RETURN(impl->canonical, Canonical::create(layout, impl->H));
  impl->s = store->impl_.get();
  if (impl->s->options.assembly == Assembly::kShared && layout.tp_size > store_internal::kMaxParts) {
    return Status::invalid_argument("store: assembly in the shared tier takes TP sizes up to " +
                                    std::to_string(store_internal::kMaxParts) + ", not " +
                                    std::to_string(layout.tp_size));
  }
  KVB_ASSIGN_OR_RETURN(impl->device, Impl::make_device(memory));
  impl->store = std::move(store);
  impl->layout = layout;
  impl->seed = chain_seed(layout, impl->H, impl->s->options.extra_keys);
  impl->align = impl->H;
  for (size_t gi = 0; gi < layout.groups.size(); ++gi) {
    if (!impl->canonical.geometry(gi).stored) continue;
    impl->stored.push_back(gi);
    impl->align = std::lcm(impl->align, layout.groups[gi].block_tokens);
  }
  return RankStore(std::move(impl));
}

const Layout& RankStore::layout() const { return impl_->layout; }
uint64_t RankStore::resume_align_tokens() const { return impl_->align; }

std::vector<BlockHash> RankStore::hashes(std::span<const uint32_t> tokens) const {
  return chain_hashes(impl_->seed, impl_->H, tokens);
}

Result<PutResult> RankStore::put(std::span<const uint32_t> tokens, const Request& request, TensorMemory memory,
                                 const Readiness& ready) {
  return impl_->put(tokens, request, memory, ready);
}

Result<LookupResult> RankStore::lookup(std::span<const uint32_t> tokens, uint64_t limit_tokens) {
  Request r;
  r.num_tokens = std::min<uint64_t>(tokens.size(), limit_tokens);
  KVB_ASSIGN_OR_RETURN(GetResult g, impl_->get(tokens, r, {}, false));
  return LookupResult{g.hit_tokens, g.memory_objects, g.disk_objects, g.redis_objects};
}

Result<GetResult> RankStore::get(std::span<const uint32_t> tokens, const Request& request, TensorMemory memory,
                                 const Readiness& ready) {
  return impl_->get(tokens, request, memory, true, ready);
}

}  // namespace kvbridge
