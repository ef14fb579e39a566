// One rank's puts: see kvbridge/store.h, docs/store.md and rank_store.cc.
//
// A put selects the hash blocks of each stored group (selection.h) and copies
// the rank's part of each into an object-sized buffer (Canonical::put: a plan
// template from its layout into the canonical write view). In process
// (Assembly::kInProcess) the buffers are staging buffers that every rank of
// the instance fills; the put that completes one publishes it into the memory
// tier and then through to Redis. With Assembly::kShared the buffers are
// scratch, and the rank writes its part into Redis, where the last part
// publishes the object.
#include <algorithm>
#include <string>

#include "store/object.h"
#include "store/rank_store_impl.h"

namespace kvbridge {

Status RankStore::Impl::copy_in(size_t gi, const GroupBlocks& list, std::span<const Item> items,
                                ConstTensorMemory memory, uint64_t* copied) {
  const Group& g = layout.groups[gi];
  for (const Item& it : items) {
    // Hash block j is tokens [j * H, (j + 1) * H), whose entry selection
    // found listed; a state item names its block.
    const BlockSlot slot = g.slot_of_token(it.j * H);
    Result<uint64_t> n = g.kind == GroupKind::kState ? canonical.put(gi, it.state_id, 0, 0, memory, it.data, defer())
                                                     : canonical.put(gi, list.local[slot.entry], slot.token,
                                                                     slot.token + H, memory, it.data, defer());
    if (!n.ok()) {
      deferred.clear();
      return n.error();
    }
    *copied += *n;
  }
  return flush(false);  // device memory: the parts are in the buffers once this returns
}

Result<PutResult> RankStore::Impl::put(std::span<const uint32_t> tokens, const Request& request, TensorMemory memory,
                                       const Readiness& ready) {
  if (request.num_tokens > tokens.size()) {
    return Status::invalid_argument("store: request.num_tokens " + std::to_string(request.num_tokens) +
                                    " exceeds the " + std::to_string(tokens.size()) + " tokens given");
  }
  KVB_RETURN_IF_ERROR(check_memory(layout, memory).with_context("store"));
  KVB_RETURN_IF_ERROR(begin(memory, ready));
  const std::vector<std::span<const uint8_t>> rank(memory.begin(), memory.end());
  const std::vector<BlockHash> hashes = chain_hashes(seed, H, tokens.first(request.num_tokens));
  PutResult result;
  for (size_t gi : stored) {
    KVB_ASSIGN_OR_RETURN(const GroupBlocks* list, blocks(request, gi));
    KVB_ASSIGN_OR_RETURN(auto selected, store_internal::select_blocks(layout.groups[gi], list->local,
                                                                      request.num_tokens, request.skip_tokens, H));
    if (shared_assembly()) {
      KVB_RETURN_IF_ERROR(put_parts(gi, *list, rank, hashes, selected, &result));
    } else {
      KVB_RETURN_IF_ERROR(put_in_process(gi, *list, rank, hashes, selected, &result));
    }
  }
  return result;
}

Status RankStore::Impl::put_in_process(size_t gi, const GroupBlocks& list, ConstTensorMemory memory,
                                       const std::vector<BlockHash>& hashes,
                                       std::span<const store_internal::Selected> selected, PutResult* result) {
  const auto& geo = canonical.geometry(gi);
  const uint32_t tp = layout.tp_size, rank = layout.tp_rank;
  // Objects that leave memory (to disk or Redis) carry a checksum.
  const bool checksum = s->redis != nullptr || s->disk != nullptr;
  std::vector<Item> items;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    for (const auto& sel : selected) {
      const StagingKey sk{key(gi, hashes, sel.block), tp};
      if (s->memory.contains(sk.key)) {
        ++result->objects_present;
        continue;
      }
      auto it = s->staging.find(sk);
      if (it == s->staging.end()) {
        uint8_t* buf = s->allocate_locked(geo.object_bytes);
        if (buf == nullptr) {
          ++result->objects_rejected;
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
        ++result->objects_present;  // this rank's part is in already
        continue;
      }
      ++it->second.writers;
      items.push_back({sel.block, sel.state_block_id, sk.key, it->second.data});
    }
  }
  const Status copy_status = copy_in(gi, list, items, memory, &result->bytes_copied);
  // Mark the parts done; publish complete objects.
  std::vector<Staging> complete;
  std::vector<ObjectKey> complete_keys;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    for (const Item& it : items) {
      auto st = s->staging.find({it.key, tp});
      if (st == s->staging.end()) continue;
      --st->second.writers;
      if (copy_status.ok() && !st->second.done[rank]) {
        st->second.done[rank] = 1;
        ++st->second.done_count;
        ++result->parts_written;
      }
      if (st->second.done_count == tp && st->second.writers == 0) {
        complete.push_back(st->second);
        complete_keys.push_back(it.key);
        s->staging.erase(st);
      } else if (st->second.done_count == 0 && st->second.writers == 0) {
        // The copy failed and no rank wrote a part: nothing to keep.
        s->memory.release(st->second.data, st->second.bytes);
        s->staging.erase(st);
      }
    }
  }
  for (size_t c = 0; c < complete.size(); ++c) {
    store_internal::write_header(complete[c].data, complete_keys[c], complete[c].bytes, H, checksum);
  }
  std::vector<ObjectKey> published;  // pinned until written through
  {
    std::lock_guard<std::mutex> lock(s->mu);
    for (size_t c = 0; c < complete.size(); ++c) {
      const uint32_t pins = checksum ? 1 : 0;
      if (s->memory.insert(complete_keys[c], complete[c].data, complete[c].bytes, pins)) {
        ++result->objects_published;
        ++s->published;
      }
      if (checksum) published.push_back(complete_keys[c]);
    }
  }
  // Write through to disk and Redis, outside the store lock; the objects are
  // pinned.
  if (!published.empty()) {
    std::vector<std::span<const uint8_t>> values;
    {
      std::lock_guard<std::mutex> lock(s->mu);
      for (const ObjectKey& k : published) {
        uint64_t n = 0;
        const uint8_t* d = s->memory.pin(k, &n);
        s->memory.unpin(k);  // still pinned by the publish pin
        values.emplace_back(d, n);
      }
    }
    if (s->disk) {
      for (size_t i = 0; i < published.size(); ++i) s->disk->put(published[i], values[i]);
    }
    if (s->redis) {
      std::vector<std::string> keys;
      for (const ObjectKey& k : published) keys.push_back(s->redis->key_of(k));
      s->redis->put(keys, values);
    }
    std::lock_guard<std::mutex> lock(s->mu);
    for (const ObjectKey& k : published) s->memory.unpin(k);
  }
  return copy_status;
}

// Assembly in Redis (docs/formats/store-object.md): the rank copies its part
// into object-sized scratch buffers (from the memory tier's pool, returned
// right after), then writes its byte ranges and its part bit; Redis publishes
// the object when the last part lands. Nothing enters the memory tier: it
// holds whole objects only, and a get promotes the whole object from Redis.
Status RankStore::Impl::put_parts(size_t gi, const GroupBlocks& list, ConstTensorMemory memory,
                                  const std::vector<BlockHash>& hashes,
                                  std::span<const store_internal::Selected> selected, PutResult* result) {
  const auto& geo = canonical.geometry(gi);
  const std::string suffix = ".tp" + std::to_string(layout.tp_size);
  // Objects visible anywhere are skipped: memory first, then one pipelined
  // EXISTS for the rest.
  std::vector<store_internal::Selected> todo;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    for (const auto& sel : selected) {
      if (s->memory.contains(key(gi, hashes, sel.block))) {
        ++result->objects_present;
      } else {
        todo.push_back(sel);
      }
    }
  }
  std::vector<std::string> keys;
  for (const auto& sel : todo) keys.push_back(s->redis->key_of(key(gi, hashes, sel.block)));
  const std::vector<uint8_t> there = s->redis->exists(keys);
  // In batches, so scratch memory stays at a batch of objects.
  const size_t batch = 2 * std::max<uint32_t>(1, s->redis->options().pipeline_depth);
  for (size_t b = 0; b < todo.size(); b += batch) {
    std::vector<Item> items;
    std::vector<size_t> index;  // into todo/keys
    {
      std::lock_guard<std::mutex> lock(s->mu);
      for (size_t i = b; i < std::min(todo.size(), b + batch); ++i) {
        if (there[i]) {
          ++result->objects_present;
          continue;
        }
        uint8_t* buf = s->allocate_locked(geo.object_bytes);
        if (buf == nullptr) {
          ++result->objects_rejected;
          ++s->rejected;
          continue;
        }
        items.push_back({todo[i].block, todo[i].state_block_id, key(gi, hashes, todo[i].block), buf});
        index.push_back(i);
      }
    }
    Status st = copy_in(gi, list, items, memory, &result->bytes_copied);
    if (st.ok()) {
      std::vector<store_internal::PartWrite> parts(items.size());
      for (size_t x = 0; x < items.size(); ++x) {
        store_internal::write_part_header(items[x].data, items[x].key, geo.object_bytes, H);
        store_internal::PartWrite& p = parts[x];
        p.object_key = std::move(keys[index[x]]);
        p.staging_key = p.object_key + suffix;
        p.object = items[x].data;
        p.ranges = geo.part;
        p.header_bytes = store_internal::kPartBitmapByte;
        p.part_bit = store_internal::kPartBitmapByte * 8 + layout.tp_rank;
        p.bitmap_byte_begin = store_internal::kPartBitmapByte;
        p.bitmap_byte_end = store_internal::kHeaderBytes - 1;
        p.parts = layout.tp_size;
      }
      for (store_internal::PartOutcome o : s->redis->put_parts(parts)) {
        switch (o) {
          case store_internal::PartOutcome::kFailed:
            break;
          case store_internal::PartOutcome::kWritten:
            ++result->parts_written;
            break;
          case store_internal::PartOutcome::kPublished:
            ++result->parts_written;
            ++result->objects_published;
            break;
          case store_internal::PartOutcome::kPresent:
            ++result->objects_present;
            break;
        }
      }
    }
    std::lock_guard<std::mutex> lock(s->mu);
    for (const Item& it : items) s->memory.release(it.data, geo.object_bytes);
    KVB_RETURN_IF_ERROR(st);
  }
  return Status();
}

}  // namespace kvbridge
