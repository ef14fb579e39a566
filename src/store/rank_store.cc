// One rank's lookups and gets, and RankStore's surface: see kvbridge/store.h
// and docs/store.md. Puts are in rank_store_put.cc.
//
// A get computes the presence of every object of the prefix (memory, then
// Redis for what memory lacks), applies the lookup rule, pins what the hit
// needs (fetching from Redis into memory: promotion, each object copied into
// the rank as it arrives), and copies the rest through a plan from the
// canonical read view into its layout. An object that vanishes between the
// lookup and the pin lowers the hit and the rule runs again.
#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>

#include <xxhash.h>

#include "kvbridge/plan.h"
#include "kvbridge/store.h"
#include "store/object.h"
#include "store/rank_store_impl.h"

namespace kvbridge {

using store_internal::Canonical;
using store_internal::canonical_ids;
using store_internal::GroupPresence;
using store_internal::truncated;

namespace {

// Promotion: objects read from Redis go straight into memory-tier buffers
// (RedisTier::get receives each value into the buffer named here), are
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
  Promotion(Store::Impl& s, uint64_t H, std::span<const Target> targets,
            std::function<void(size_t, const uint8_t*)> ready)
      : s_(s), H_(H), targets_(targets), ready_(std::move(ready)), state_(XXH3_createState()),
        buffers_(targets.size(), nullptr) {}
  ~Promotion() override {
    std::lock_guard<std::mutex> lock(s_.mu);
    for (size_t i = 0; i < buffers_.size(); ++i) s_.memory.release(buffers_[i], targets_[i].bytes);
    XXH3_freeState(state_);
  }

  uint8_t* buffer(size_t i, uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(s_.mu);
    if (bytes != targets_[i].bytes) {
      ++s_.redis_bad_objects;
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
        ++s_.redis_bad_objects;
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

 private:
  Store::Impl& s_;
  uint64_t H_;
  std::span<const Target> targets_;
  std::function<void(size_t, const uint8_t*)> ready_;
  XXH3_state_t* state_;
  bool hashing_ = false;
  std::vector<uint8_t*> buffers_;  // handed to Redis, not yet done
  std::vector<ObjectKey> promoted_;
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
        gp.present[j] = s->memory.contains(key(gi, hashes, j)) ? 1 : 0;
        if (!gp.present[j]) missing.push_back({out.size(), j});
      }
      out.push_back(std::move(gp));
    }
  }
  *redis_found = 0;
  if (s->redis && !missing.empty()) {
    std::vector<std::string> keys;
    keys.reserve(missing.size());
    for (const auto& [o, j] : missing) keys.push_back(key(stored[o], hashes, j).text(s->redis->options().key_prefix));
    const std::vector<uint8_t> there = s->redis->exists(keys);
    for (size_t m = 0; m < missing.size(); ++m) {
      if (there[m]) {
        out[missing[m].first].present[missing[m].second] = 2;  // 2: in Redis
        ++*redis_found;
      }
    }
  }
  return out;
}

int64_t RankStore::Impl::copy_out_fast(size_t gi, const Request& request, uint64_t skip, uint64_t j,
                                       TensorMemory memory, const uint8_t* object) {
  const Group& g = layout.groups[gi];
  if (g.kind == GroupKind::kState || skip % H != 0) return -1;
  auto it = request.blocks.find(g.name);
  if (it == request.blocks.end()) return -1;
  const std::vector<int64_t>& ids = it->second.local;
  const uint64_t entry = j * H / g.block_tokens;
  if (entry >= ids.size() || ids[entry] < 0 || static_cast<uint64_t>(ids[entry]) >= g.num_blocks) return -1;
  const store_internal::ObjectPlan* op = canonical.object_plan(gi, false, (j * H % g.block_tokens) / H);
  if (op == nullptr) return -1;
  return static_cast<int64_t>(store_internal::get_object(*op, memory, static_cast<uint64_t>(ids[entry]), object));
}

Result<GetResult> RankStore::Impl::get(std::span<const uint32_t> tokens, const Request& request, TensorMemory memory,
                                       bool copy) {
  if (request.num_tokens > tokens.size()) {
    return Status::invalid_argument("store: request.num_tokens " + std::to_string(request.num_tokens) +
                                    " exceeds the " + std::to_string(tokens.size()) + " tokens given");
  }
  if (copy) KVB_RETURN_IF_ERROR(check_memory(layout, memory).with_context("store"));
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
  auto unpin_all = [&] {
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
            (pres[o].present[needed[o][x]] == 1 ? result.memory_objects : result.redis_objects) += 1;
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
    if (!fetch.empty() && s->redis) {
      std::vector<std::string> keys;
      for (const auto& [o, x] : fetch) keys.push_back(key(stored[o], hashes, needed[o][x]).text(s->redis->options().key_prefix));
      std::vector<Promotion::Target> targets;
      for (const auto& [o, x] : fetch) {
        targets.push_back({key(stored[o], hashes, needed[o][x]), canonical.geometry(stored[o]).object_bytes,
                           &data[o][x]});
      }
      // Copy each promoted object into the rank as it arrives, from cache,
      // on the fast path (the rest is copied below).
      auto ready = [&](size_t i, const uint8_t* bytes) {
        const auto [o, x] = fetch[i];
        if (const int64_t n = copy_out_fast(stored[o], request, skip, needed[o][x], memory, bytes); n >= 0) {
          early[o][x] = 1;
          result.bytes_copied += static_cast<uint64_t>(n);
        }
      };
      Promotion sink(*s, H, targets, copy ? std::function<void(size_t, const uint8_t*)>(ready) : nullptr);
      s->redis->get(keys, sink);
      sink.finish(&pinned, &result.redis_objects);
    }
    for (const auto& [o, x] : fetch) {
      if (data[o][x] == nullptr) {
        all = false;
        pres[o].present[needed[o][x]] = 0;  // gone: lower the hit and retry
      }
    }
    if (all) break;
    unpin_all();
  }
  if (copy) {  // lookups count nothing: the get that follows does
    std::lock_guard<std::mutex> lock(s->mu);
    s->memory_hits += result.memory_objects;
    s->redis_hits += result.redis_objects;
    s->misses += hashes.size() - hit / H;
  }
  if (!copy || hit <= skip) {
    unpin_all();
    return result;
  }
  Status st;
  for (size_t o = 0; o < stored.size() && st.ok(); ++o) {
    if (needed[o].empty()) continue;
    const size_t gi = stored[o];
    const Group& g = layout.groups[gi];
    Result<const GroupBlocks*> list = blocks(request, gi);
    if (!list.ok()) {
      st = list.error();
      break;
    }
    if (g.kind != GroupKind::kState && skip % H == 0) {
      // The fast path: cached per-object plans (canonical.h).
      const std::vector<int64_t>& ids = (*list)->local;
      size_t x = 0;
      for (; x < needed[o].size(); ++x) {
        if (early[o][x]) continue;  // copied as it arrived from Redis
        const int64_t n = copy_out_fast(gi, request, skip, needed[o][x], memory, data[o][x]);
        if (n >= 0) {
          result.bytes_copied += static_cast<uint64_t>(n);
          continue;
        }
        const uint64_t entry = needed[o][x] * H / g.block_tokens;
        if (entry >= ids.size() || ids[entry] < 0 || static_cast<uint64_t>(ids[entry]) >= g.num_blocks) {
          st = Status::invalid_argument("store: get group '" + g.name + "': entry " + std::to_string(entry) +
                                        " of the block list is missing, -1 or past num_blocks");
        }
        break;  // an error, or no cached plan applies
      }
      if (!st.ok()) break;
      if (x == needed[o].size()) continue;
      // Not affine: plan below (rewrites the same bytes).
    }
    Request sub;
    GroupBlocks& gb = sub.blocks[g.name];
    sub.num_tokens = hit;
    const uint64_t a = needed[o].front(), k = needed[o].size();
    if (g.kind == GroupKind::kState) {
      const uint64_t entry = (hit + g.block_tokens - 1) / g.block_tokens - 1;
      if (entry >= (*list)->local.size() || (*list)->local[entry] < 0) {
        st = Status::invalid_argument("store: group '" + g.name + "' lists no block for the state at token " +
                                      std::to_string(hit) + " (entry " + std::to_string(entry) + ")");
        break;
      }
      gb.local = {(*list)->local[entry]};
      gb.remote = {0};
    } else {
      sub.skip_tokens = skip;
      gb.local = truncated((*list)->local, hit, g.block_tokens);
      gb.remote = canonical_ids(a, k);
    }
    const Layout& src = canonical.read_view(gi, k);
    Result<Plan> p = plan(canonical.rank_view(gi), std::span<const Layout>(&src, 1), sub);
    if (!p.ok()) {
      st = p.error().with_context("store: get group '" + g.name + "'");
      break;
    }
    result.bytes_copied += store_internal::copy_from_objects(*p, memory, data[o], canonical.geometry(gi).object_bytes);
  }
  unpin_all();
  if (!st.ok()) return st;
  return result;
}

// ---------------------------------------------------------------------------

RankStore::RankStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RankStore::RankStore(RankStore&&) noexcept = default;
RankStore& RankStore::operator=(RankStore&&) noexcept = default;
RankStore::~RankStore() = default;

Result<RankStore> RankStore::create(std::shared_ptr<Store> store, const Layout& layout) {
  if (!store) return Status::invalid_argument("store: no store");
  KVB_RETURN_IF_ERROR(validate(layout));
  auto impl = std::make_unique<Impl>();
  impl->H = store->options().hash_block_tokens;
  KVB_ASSIGN_OR_RETURN(impl->canonical, Canonical::create(layout, impl->H));
  impl->s = store->impl_.get();
  if (impl->s->options.assembly == Assembly::kShared && layout.tp_size > store_internal::kMaxParts) {
    return Status::invalid_argument("store: assembly in the shared tier takes TP sizes up to " +
                                    std::to_string(store_internal::kMaxParts) + ", not " +
                                    std::to_string(layout.tp_size));
  }
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

Result<PutResult> RankStore::put(std::span<const uint32_t> tokens, const Request& request, TensorMemory memory) {
  return impl_->put(tokens, request, memory);
}

Result<LookupResult> RankStore::lookup(std::span<const uint32_t> tokens, uint64_t limit_tokens) {
  Request r;
  r.num_tokens = std::min<uint64_t>(tokens.size(), limit_tokens);
  KVB_ASSIGN_OR_RETURN(GetResult g, impl_->get(tokens, r, {}, false));
  return LookupResult{g.hit_tokens, g.memory_objects, g.redis_objects};
}

Result<GetResult> RankStore::get(std::span<const uint32_t> tokens, const Request& request, TensorMemory memory) {
  return impl_->get(tokens, request, memory, true);
}

}  // namespace kvbridge
