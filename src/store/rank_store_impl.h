// RankStore's state, shared by rank_store.cc (create, lookup, get) and
// rank_store_put.cc (put). Not a public header.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvbridge/store.h"
#include "store/canonical.h"
#include "store/redis_tier.h"
#include "store/selection.h"
#include "store/store_impl.h"

namespace kvbridge {

struct RankStore::Impl {
  std::shared_ptr<Store> store;
  Store::Impl* s = nullptr;
  Layout layout;
  store_internal::Canonical canonical;
  BlockHash seed;
  uint64_t H = 0;
  uint64_t align = 0;
  std::vector<size_t> stored;  // indices of stored groups

  // Rank memory on a device (RankStoreOptions): the staging its copies go
  // through (rank_store_device.cc); null for host memory. The copies of a
  // put or get are collected in `deferred` (Canonical's defer) and made by
  // flush(), before the objects they read are unpinned or published.
  struct Device;
  std::shared_ptr<Device> device;
  std::vector<ByteCopy> deferred;
  std::vector<ByteCopy>* defer() { return device ? &deferred : nullptr; }
  static Result<std::shared_ptr<Device>> make_device(const RankStoreOptions& memory);
  // Starts a put or get that copies: `memory` is of the rank's kind, and
  // `ready` is taken (device memory) or refused (host memory).
  Status begin(TensorMemory memory, const Readiness& ready);
  // Makes the deferred copies (into the device for a get), the first of a
  // call after its ready event completed; clears them whatever the outcome.
  Status flush(bool to_device);

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
  // One object a put writes (its part of): hash block j, the state's block
  // id for a state group, and where its bytes go.
  struct Item {
    uint64_t j;
    int64_t state_id;
    ObjectKey key;
    uint8_t* data;
  };
  bool shared_assembly() const {
    return s->options.assembly == Assembly::kShared && s->redis != nullptr && layout.tp_size > 1;
  }
  Result<PutResult> put(std::span<const uint32_t> tokens, const Request& request, TensorMemory memory,
                        const Readiness& ready);
  // Copies the rank's part of each item from `memory` into item.data.
  Status copy_in(size_t gi, const GroupBlocks& list, std::span<const Item> items, ConstTensorMemory memory,
                 uint64_t* copied);
  Status put_in_process(size_t gi, const GroupBlocks& list, ConstTensorMemory memory,
                        const std::vector<BlockHash>& hashes, std::span<const store_internal::Selected> selected,
                        PutResult* result);
  Status put_parts(size_t gi, const GroupBlocks& list, ConstTensorMemory memory, const std::vector<BlockHash>& hashes,
                   std::span<const store_internal::Selected> selected, PutResult* result);
  Result<std::vector<store_internal::GroupPresence>> presence(const std::vector<BlockHash>& hashes,
                                                              uint64_t* redis_found);
  Result<GetResult> get(std::span<const uint32_t> tokens, const Request& request, TensorMemory memory, bool copy,
                        const Readiness& ready = Readiness());
  // Copies what the rank lacks of object j of group gi (hash block j, or the
  // state at `hit`) into the rank block its list names. Returns the bytes
  // copied; kInvalidArgument when the list names no block for it.
  Result<uint64_t> copy_out(size_t gi, const GroupBlocks& list, uint64_t skip, uint64_t hit, uint64_t j,
                            TensorMemory memory, const uint8_t* object);
};

}  // namespace kvbridge
