// One rank's puts, lookups and gets: see kvbridge/store.h and docs/store.md.
//
// A put selects the hash blocks of each stored group (selection.h), reserves
// a staging buffer per object under the store lock, copies its head slice
// into the buffers through a plan from its layout into the canonical write
// view (outside the lock), and publishes each object whose every rank has
// written: into the memory tier, then through to Redis. A get computes the
// presence of every object of the prefix (memory, then Redis for what memory
// lacks), applies the lookup rule, pins what the hit needs (fetching from
// Redis into memory: promotion), and copies through a plan from the canonical
// read view into its layout. An object that vanishes between the lookup and
// the pin lowers the hit and the rule runs again.
#include <algorithm>
#include <cstring>
#include <numeric>

#include "kvbridge/plan.h"
#include "kvbridge/store.h"
#include "store/canonical.h"
#include "store/object.h"
#include "store/selection.h"
#include "store/store_impl.h"

namespace kvbridge {

using store_internal::Canonical;
using store_internal::GroupPresence;

struct RankStore::Impl {
  std::shared_ptr<Store> store;
  Store::Impl* s = nullptr;
  Layout layout;
  Canonical canonical;
  BlockHash seed;
  uint64_t H = 0;
  uint64_t align = 0;
  std::vector<size_t> stored;  // indices of stored groups

  ObjectKey key(size_t gi, const std::vector<BlockHash>& hashes, uint64_t j) const {
    return {hashes[j], canonical.geometry(gi).id};
  }
  Result<const GroupBlocks*> blocks(const Request& r, size_t gi) const {
    auto it = r.blocks.find(layout.groups[gi].name);
    if (it == r.blocks.end()) {
      return Status::invalid_argument("store: request has no block list for group '" + layout.groups[gi].name + "'");
    }
    return &it->second;
  }
  Result<PutResult> put(std::span<const uint32_t> tokens, const Request& request, TensorMemory memory);
  Result<std::vector<GroupPresence>> presence(const std::vector<BlockHash>& hashes, uint64_t* redis_found);
  Result<GetResult> get(std::span<const uint32_t> tokens, const Request& request, TensorMemory memory, bool copy);
};

namespace {

// The rank block list covering tokens [0, end): its first ceil(end / bt) ids.
std::vector<int64_t> truncated(const std::vector<int64_t>& ids, uint64_t end, uint64_t bt) {
  const uint64_t n = std::min<uint64_t>(ids.size(), (end + bt - 1) / bt);
  return std::vector<int64_t>(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(n));
}

// Canonical ids for objects [a, a + k): -1 before, then 0..k-1.
std::vector<int64_t> canonical_ids(uint64_t a, uint64_t k) {
  std::vector<int64_t> ids(a + k, -1);
  std::iota(ids.begin() + static_cast<std::ptrdiff_t>(a), ids.end(), int64_t{0});
  return ids;
}

}  // namespace

Result<PutResult> RankStore::Impl::put(std::span<const uint32_t> tokens, const Request& request,
                                       TensorMemory memory) {
  if (request.num_tokens > tokens.size()) {
    return Status::invalid_argument("store: request.num_tokens " + std::to_string(request.num_tokens) +
                                    " exceeds the " + std::to_string(tokens.size()) + " tokens given");
  }
  KVB_RETURN_IF_ERROR(store_internal::check_memory(layout, memory));
  const std::vector<BlockHash> hashes = chain_hashes(seed, H, tokens.first(request.num_tokens));
  const uint32_t tp = layout.tp_size, rank = layout.tp_rank;
  const bool checksum = s->redis != nullptr;
  PutResult result;
  std::vector<std::pair<ObjectKey, uint64_t>> published;  // pinned until written through

  for (size_t gi : stored) {
    const Group& g = layout.groups[gi];
    const auto& geo = canonical.geometry(gi);
    KVB_ASSIGN_OR_RETURN(const GroupBlocks* list, blocks(request, gi));
    KVB_ASSIGN_OR_RETURN(auto selected, store_internal::select_blocks(g, list->local, request.num_tokens,
                                                                      request.skip_tokens, H));
    struct Item {
      uint64_t j;
      int64_t state_id;
      StagingKey key;
      uint8_t* data;
    };
    std::vector<Item> items;
    {
      std::lock_guard<std::mutex> lock(s->mu);
      for (const auto& sel : selected) {
        const StagingKey sk{key(gi, hashes, sel.block), tp};
        if (s->memory.contains(sk.key)) {
          ++result.objects_present;
          continue;
        }
        auto it = s->staging.find(sk);
        if (it == s->staging.end()) {
          uint8_t* buf = s->allocate_locked(geo.object_bytes);
          if (buf == nullptr) {
            ++result.objects_rejected;
            ++s->rejected;
            continue;
          }
          Staging st;
          st.data = buf;
          st.bytes = geo.object_bytes;
          st.done.assign(tp, 0);
          st.seq = s->next_seq++;
          it = s->staging.emplace(sk, std::move(st)).first;
        } else if (it->second.done[rank]) {
          ++result.objects_present;  // this rank's part is in already
          continue;
        }
        ++it->second.writers;
        items.push_back({sel.block, sel.state_block_id, sk, it->second.data});
      }
    }
    // Copy, one plan per run of consecutive objects (per object for state and
    // sliding-window groups: the plan cuts a window to the run's last tokens,
    // and a state plan moves one state).
    const bool per_object = g.kind != GroupKind::kAttention;
    Status copy_status;
    // The fast path: one cached plan per object position (canonical.h).
    size_t done = 0;
    for (; done < items.size(); ++done) {
      const Item& it = items[done];
      const uint64_t phase = g.kind == GroupKind::kState ? 0 : (it.j * H % g.block_tokens) / H;
      const store_internal::ObjectPlan* op = canonical.object_plan(gi, true, phase);
      if (op == nullptr) break;
      const int64_t b = g.kind == GroupKind::kState ? it.state_id : list->local[it.j * H / g.block_tokens];
      if (b < 0 || static_cast<uint64_t>(b) >= g.num_blocks) {
        copy_status = Status::out_of_range("store: put group '" + g.name + "': block id " + std::to_string(b) +
                                           " is not below num_blocks " + std::to_string(g.num_blocks));
        break;
      }
      result.bytes_copied += store_internal::put_object(*op, memory, static_cast<uint64_t>(b), it.data, geo.skip);
    }
    for (size_t i = done; i < items.size() && copy_status.ok();) {
      size_t e = i + 1;
      while (!per_object && e < items.size() && items[e].j == items[e - 1].j + 1) ++e;
      const uint64_t a = items[i].j, k = e - i;
      Request sub;
      GroupBlocks& gb = sub.blocks[g.name];
      if (g.kind == GroupKind::kState) {
        sub.num_tokens = (a + 1) * H;
        gb.local = {0};
        gb.remote = {items[i].state_id};
      } else {
        sub.num_tokens = (a + k) * H;
        sub.skip_tokens = a * H;
        gb.local = canonical_ids(a, k);
        gb.remote = truncated(list->local, sub.num_tokens, g.block_tokens);
      }
      const Layout& view = canonical.rank_view(gi);
      Result<Plan> p = plan(canonical.write_view(gi, k), std::span<const Layout>(&view, 1), sub);
      if (!p.ok()) {
        copy_status = p.error().with_context("store: put group '" + g.name + "'");
        break;
      }
      std::vector<uint8_t*> bufs;
      for (size_t x = i; x < e; ++x) bufs.push_back(items[x].data);
      result.bytes_copied += store_internal::copy_into_objects(*p, memory, bufs, geo.object_bytes, geo.skip);
      i = e;
    }
    // Mark the parts done; publish complete objects.
    std::vector<Staging> complete;
    std::vector<StagingKey> complete_keys;
    {
      std::lock_guard<std::mutex> lock(s->mu);
      for (const Item& it : items) {
        auto st = s->staging.find(it.key);
        if (st == s->staging.end()) continue;
        --st->second.writers;
        if (copy_status.ok() && !st->second.done[rank]) {
          st->second.done[rank] = 1;
          ++st->second.done_count;
          ++result.parts_written;
        }
        if (st->second.done_count == tp && st->second.writers == 0) {
          complete.push_back(st->second);
          complete_keys.push_back(it.key);
          s->staging.erase(st);
        }
      }
    }
    for (size_t c = 0; c < complete.size(); ++c) {
      store_internal::write_header(complete[c].data, complete_keys[c].key, complete[c].bytes, H, checksum);
    }
    {
      std::lock_guard<std::mutex> lock(s->mu);
      for (size_t c = 0; c < complete.size(); ++c) {
        const uint32_t pins = checksum ? 1 : 0;
        if (s->memory.insert(complete_keys[c].key, complete[c].data, complete[c].bytes, pins)) {
          ++result.objects_published;
          ++s->published;
        }
        if (checksum) published.push_back({complete_keys[c].key, complete[c].bytes});
      }
    }
    KVB_RETURN_IF_ERROR(copy_status);
  }
  // Write through to Redis, outside the store lock; the objects are pinned.
  if (s->redis && !published.empty()) {
    std::vector<std::string> keys;
    std::vector<std::span<const uint8_t>> values;
    {
      std::lock_guard<std::mutex> lock(s->mu);
      for (const auto& [k, bytes] : published) {
        uint64_t n = 0;
        const uint8_t* d = s->memory.pin(k, &n);
        s->memory.unpin(k);  // still pinned by the publish pin
        keys.push_back(k.text(s->redis->options().key_prefix));
        values.emplace_back(d, n);
      }
    }
    s->redis->put(keys, values);
    std::lock_guard<std::mutex> lock(s->mu);
    for (const auto& [k, bytes] : published) s->memory.unpin(k);
  }
  return result;
}

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

Result<GetResult> RankStore::Impl::get(std::span<const uint32_t> tokens, const Request& request, TensorMemory memory,
                                       bool copy) {
  if (request.num_tokens > tokens.size()) {
    return Status::invalid_argument("store: request.num_tokens " + std::to_string(request.num_tokens) +
                                    " exceeds the " + std::to_string(tokens.size()) + " tokens given");
  }
  if (copy) KVB_RETURN_IF_ERROR(store_internal::check_memory(layout, memory));
  const std::vector<BlockHash> hashes = chain_hashes(seed, H, tokens.first(request.num_tokens));
  uint64_t in_redis = 0;
  KVB_ASSIGN_OR_RETURN(std::vector<GroupPresence> pres, presence(hashes, &in_redis));
  GetResult result;
  const uint64_t skip = copy ? request.skip_tokens : 0;
  // Per stored group: the needed blocks and their pinned bytes.
  std::vector<std::vector<uint64_t>> needed(stored.size());
  std::vector<std::vector<const uint8_t*>> data(stored.size());
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
      s->redis->get(keys, [&](size_t i, std::span<const uint8_t> bytes) {
        const auto [o, x] = fetch[i];
        const size_t gi = stored[o];
        const ObjectKey k = key(gi, hashes, needed[o][x]);
        const uint64_t n = canonical.geometry(gi).object_bytes;
        std::lock_guard<std::mutex> lock(s->mu);
        if (!store_internal::check_object(bytes, k, n, H).ok()) {
          ++s->redis_bad_objects;
          return;
        }
        uint8_t* buf = s->allocate_locked(n);
        if (buf == nullptr) return;
        std::memcpy(buf, bytes.data(), n);
        s->memory.insert(k, buf, n, 1);  // promotion, pinned for this read
        data[o][x] = s->memory.pin(k);
        s->memory.unpin(k);
        pinned.push_back(k);
        ++result.redis_objects;
      });
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
        const uint64_t j = needed[o][x];
        const uint64_t entry = j * H / g.block_tokens;
        const store_internal::ObjectPlan* op = canonical.object_plan(gi, false, (j * H % g.block_tokens) / H);
        if (op == nullptr) break;
        if (entry >= ids.size() || ids[entry] < 0 || static_cast<uint64_t>(ids[entry]) >= g.num_blocks) {
          st = Status::invalid_argument("store: get group '" + g.name + "': entry " + std::to_string(entry) +
                                        " of the block list is missing, -1 or past num_blocks");
          break;
        }
        result.bytes_copied += store_internal::get_object(*op, memory, static_cast<uint64_t>(ids[entry]), data[o][x]);
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
