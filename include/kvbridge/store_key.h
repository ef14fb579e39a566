// kvbridge/store_key.h: the keys of the prefix store.
//
// A prefix of a prompt is cut into hash blocks of `hash_block_tokens` tokens;
// the key of hash block j is a chained hash: h_j = H(h_{j-1}, tokens of block
// j), with h_{-1} the seed. The seed binds the layout identity (identity_text(),
// which names the model and dtype), the hash block size and optional extra keys
// (a LoRA adapter, a cache salt), so two instances share objects exactly when
// they would compute the same KV. H is XXH3-128 over a fixed little-endian
// byte encoding (docs/formats/store-object.md), with no per-process seed: the
// same tokens give the same keys in any process, on any machine, in any run.
//
// An object is one hash block of one group: ObjectKey = (chained hash, group
// id). The group id is the group's index in name order over *all* groups of
// the layout (the identity's order), so skipping groups that are never stored
// (scratch, not prefix-cacheable) renumbers nothing.
//
// Thread-safety: pure functions and plain values.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/layout.h"
#include "kvbridge/status.h"

namespace kvbridge {

// A 128-bit chained block hash.
struct BlockHash {
  uint64_t lo = 0;
  uint64_t hi = 0;
  bool operator==(const BlockHash&) const = default;
  // 32 lower-case hex digits, `hi` first.
  std::string hex() const;
};

struct ObjectKey {
  BlockHash hash;      // the chained hash of the prefix through this hash block
  uint32_t group = 0;  // group id (index in name order)
  bool operator==(const ObjectKey&) const = default;
  // "<prefix><32 hex>.<group>", the key of the object in a shared tier.
  std::string text(std::string_view prefix) const;
  // "<prefix>{<32 hex>.<group>}", its key in a Redis Cluster: the braces are
  // a hash tag, so the object's staging key (this key and a suffix) lands in
  // the same slot, on the same node.
  std::string cluster_text(std::string_view prefix) const;
};

// The Redis Cluster slot of `key` (0..16383): CRC16 (XMODEM) of the key, or
// of its hash tag (the bytes between the first '{' and the first '}' after
// it, when not empty), modulo 16384, as Redis computes it.
uint16_t redis_key_slot(std::string_view key);

struct ObjectKeyHasher {
  size_t operator()(const ObjectKey& k) const { return static_cast<size_t>(k.hash.lo ^ (k.hash.hi * 31) ^ k.group); }
};

// The seed of the chain: XXH3-128 of "kvbridge.store/1\n", the hash block size,
// identity_text(layout) and each extra key, length-prefixed. Requires a valid
// layout and hash_block_tokens > 0.
BlockHash chain_seed(const Layout& layout, uint64_t hash_block_tokens, std::span<const std::string> extra_keys);

// The chained hashes of the full hash blocks of `tokens` (tokens.size() /
// hash_block_tokens of them; a partial last block has no key). Token ids are
// hashed as 32-bit little-endian unsigned integers.
std::vector<BlockHash> chain_hashes(const BlockHash& seed, uint64_t hash_block_tokens,
                                    std::span<const uint32_t> tokens);

// Group ids: for each group of `layout` (in layout order), its index in name
// order.
std::vector<uint32_t> group_ids(const Layout& layout);

}  // namespace kvbridge
