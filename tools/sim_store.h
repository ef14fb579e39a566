// tools/sim_store.h: the request stream of `kvbridge sim`, and the prefix
// store on a Redis Cluster that it meets (sim.h says what is modelled).
//
// The workload: Poisson arrivals, log-normal prompt lengths, and a share of
// requests that reuse a prefix of a recent request; each request carries
// the real chained block hashes of its tokens (store_key.h), so that a
// shared prefix gives shared keys exactly as the store computes them. The
// store: objects keyed by (chained hash, group), placed on masters by Redis
// Cluster key slot (sim_slot.h), each master an LRU of a fixed memory.
//
// Thread-safety: pure functions (their randomness comes from the seed).
#pragma once

#include <cstdint>
#include <vector>

#include "kvbridge/layout.h"
#include "kvbridge/store_key.h"
#include "sim.h"

namespace kvbridge::cli {

struct SimWorkload {
  std::vector<double> arrival_s;
  std::vector<uint64_t> tokens;
  std::vector<uint64_t> shared_blocks;         // hash blocks shared with the parent
  std::vector<std::vector<BlockHash>> hashes;  // chained hashes of the full hash blocks
  uint64_t max_tokens = 0;
};

// A seed of its own for each use of the options' seed (splitmix64).
uint64_t sim_seed(uint64_t seed, uint64_t salt);

// The groups a store keeps: prefix-cacheable and not scratch (docs/store.md).
bool stored_group(const Group& g);

// The hash block: the gcd of the stored groups' block sizes on both sides.
uint64_t store_hash_block_tokens(const Layout& a, const Layout& b);

// Per group of `l`, the bytes of one hash block's object in the canonical
// order: cells x global heads x positions (headers not counted): an estimate.
std::vector<uint64_t> store_object_bytes(const Layout& l, uint64_t hb);

// `o.requests` requests, lengths cut at `max_tokens`, hashed for `layout`'s
// identity with hash blocks of `hb` tokens.
SimWorkload make_workload(const SimOptions& o, const Layout& layout, uint64_t hb, uint64_t max_tokens);

// Each of `o.store_nodes`: the requests in arrival order look up their
// prefix (one GET per object, until the first block some group misses) and
// put the rest (one SET per object). Requires duration_s > 0.
std::vector<SimStoreRow> simulate_store(const SimOptions& o, const SimWorkload& w, const Layout& layout, uint64_t hb,
                                        double duration_s);

}  // namespace kvbridge::cli
