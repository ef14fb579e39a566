// The workload of `kvbridge sim` and the prefix store it meets (sim_store.h).

#include "sim_store.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <unordered_map>

#include "kvbridge/store_key.h"
#include "sim_slot.h"

namespace kvbridge::cli {
namespace {

// How far back a reusing request's parent is, on average (requests).
constexpr double kReuseDistance = 256;

// Masters as LRU lists over dense key ids (intrusive, in arrays: the
// workload's keys are numbered once and every cluster size reuses them).
struct Lru {
  static constexpr uint32_t kNone = UINT32_MAX;
  uint64_t capacity = 0, bytes = 0, ops = 0, evictions = 0;
  uint32_t head = kNone, tail = kNone;  // most recent at head
};

struct LruKeys {
  std::vector<uint32_t> prev, next;
  std::vector<uint8_t> held;
  explicit LruKeys(size_t n) : prev(n, Lru::kNone), next(n, Lru::kNone), held(n, 0) {}

  void unlink(Lru& l, uint32_t k) {
    (prev[k] == Lru::kNone ? l.head : next[prev[k]]) = next[k];
    (next[k] == Lru::kNone ? l.tail : prev[next[k]]) = prev[k];
  }
  void push_front(Lru& l, uint32_t k) {
    prev[k] = Lru::kNone;
    next[k] = l.head;
    (l.head == Lru::kNone ? l.tail : prev[l.head]) = k;
    l.head = k;
  }
  bool touch(Lru& l, uint32_t k) {
    if (!held[k]) return false;
    unlink(l, k);
    push_front(l, k);
    return true;
  }
  void insert(Lru& l, uint32_t k, const std::vector<uint64_t>& size) {
    if (touch(l, k) || size[k] > l.capacity) return;
    while (l.bytes + size[k] > l.capacity && l.tail != Lru::kNone) {
      const uint32_t victim = l.tail;
      unlink(l, victim);
      held[victim] = 0;
      l.bytes -= size[victim];
      ++l.evictions;
    }
    push_front(l, k);
    held[k] = 1;
    l.bytes += size[k];
  }
};

}  // namespace

uint64_t sim_seed(uint64_t seed, uint64_t salt) {
  // splitmix64: decorrelates the streams of one seed.
  uint64_t z = seed + 0x9e3779b97f4a7c15ULL * (salt + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// The groups a store keeps: prefix-cacheable and not scratch (docs/store.md).
bool stored_group(const Group& g) { return g.prefix_cacheable && g.kind != GroupKind::kScratch; }

uint64_t store_hash_block_tokens(const Layout& a, const Layout& b) {
  uint64_t hb = 0;
  for (const Layout* l : {&a, &b}) {
    for (const Group& g : l->groups) {
      if (stored_group(g)) hb = std::gcd(hb, g.block_tokens);
    }
  }
  return hb == 0 ? 16 : hb;
}

// One hash block's objects (every stored group), in the canonical order's
// bytes: cells x global heads x positions; headers not counted.
std::vector<uint64_t> store_object_bytes(const Layout& l, uint64_t hb) {
  std::vector<uint64_t> out;
  for (const Group& g : l.groups) {
    uint64_t bytes = 0;
    const uint64_t positions = g.kind == GroupKind::kState ? 1 : std::max<uint64_t>(1, hb / g.tokens_per_state);
    for (const Layer& layer : g.layers) {
      for (const Component& c : layer.components) bytes += c.cell_bytes * (c.heads ? c.heads->total : 1) * positions;
    }
    out.push_back(bytes);
  }
  return out;
}

SimWorkload make_workload(const SimOptions& o, const Layout& layout, uint64_t hb, uint64_t max_tokens) {
  SimWorkload w;
  std::mt19937_64 rng(sim_seed(o.seed, 1));
  std::exponential_distribution<double> gap(o.rate);
  // Log-normal lengths with the asked mean: mu = ln(mean) - sigma^2 / 2.
  const double sigma = 0.8;
  std::lognormal_distribution<double> length(std::log(static_cast<double>(o.prompt_tokens)) - sigma * sigma / 2, sigma);
  std::uniform_real_distribution<double> unit(0, 1);
  std::uniform_int_distribution<uint32_t> token(0, 151935);
  const BlockHash seed = chain_seed(layout, hb, {});
  w.max_tokens = max_tokens;
  double t = 0;
  std::vector<uint32_t> fresh;
  for (uint64_t i = 0; i < o.requests; ++i) {
    t += gap(rng);
    const uint64_t n = std::clamp<uint64_t>(static_cast<uint64_t>(length(rng)), 1, max_tokens);
    const uint64_t blocks = n / hb;
    std::vector<BlockHash> h;
    uint64_t shared = 0;
    if (i > 0 && unit(rng) < o.reuse) {
      // A prefix of a recent request (a conversation's next turn, a system
      // prompt in use: a geometric distance back, mean kReuseDistance
      // requests): between half and all of the shorter of the two.
      const uint64_t back = std::geometric_distribution<uint64_t>(1.0 / kReuseDistance)(rng);
      const uint64_t parent = i - 1 - std::min(back, i - 1);
      const uint64_t common = std::min(n, w.tokens[parent]);
      shared =
          std::min<uint64_t>(static_cast<uint64_t>(common * (0.5 + 0.5 * unit(rng))) / hb, w.hashes[parent].size());
      h.assign(w.hashes[parent].begin(), w.hashes[parent].begin() + static_cast<ptrdiff_t>(shared));
    }
    // The chain continues from the last shared hash over fresh tokens.
    fresh.resize((blocks - std::min(blocks, shared)) * hb);
    for (uint32_t& tok : fresh) tok = token(rng);
    const std::vector<BlockHash> rest = chain_hashes(h.empty() ? seed : h.back(), hb, fresh);
    h.insert(h.end(), rest.begin(), rest.end());
    w.arrival_s.push_back(t);
    w.tokens.push_back(n);
    w.shared_blocks.push_back(shared);
    w.hashes.push_back(std::move(h));
  }
  return w;
}

std::vector<SimStoreRow> simulate_store(const SimOptions& o, const SimWorkload& w, const Layout& layout, uint64_t hb,
                                        double duration_s) {
  const std::vector<uint32_t> gids = group_ids(layout);
  const std::vector<uint64_t> sizes = store_object_bytes(layout, hb);
  std::vector<size_t> groups;  // indices of the stored groups
  uint64_t block_bytes = 0;
  for (size_t g = 0; g < layout.groups.size(); ++g) {
    if (stored_group(layout.groups[g])) {
      groups.push_back(g);
      block_bytes += sizes[g];
    }
  }
  // Every object of the workload, numbered; its slot from the key text as a
  // Redis Cluster tier names objects: "kvb1:{<hash>.<group>}", the braces a
  // hash tag, so that an object's staging key (the key and a suffix) shares
  // its slot.
  std::unordered_map<ObjectKey, uint32_t, ObjectKeyHasher> id_of;
  std::vector<uint16_t> slot;
  std::vector<uint64_t> size;
  std::vector<std::vector<uint32_t>> keys(w.hashes.size());  // per request: block-major, stored groups inside
  for (size_t i = 0; i < w.hashes.size(); ++i) {
    for (const BlockHash& h : w.hashes[i]) {
      for (size_t g : groups) {
        const ObjectKey k{h, gids[g]};
        auto [it, fresh] = id_of.try_emplace(k, static_cast<uint32_t>(slot.size()));
        if (fresh) {
          slot.push_back(redis_key_slot(k.cluster_text("kvb1:")));
          size.push_back(sizes[g]);
        }
        keys[i].push_back(it->second);
      }
    }
  }
  uint64_t total_tokens = 0;
  for (uint64_t n : w.tokens) total_tokens += n;
  const size_t per_block = groups.size();
  std::vector<SimStoreRow> rows;
  for (uint32_t nodes : o.store_nodes) {
    std::vector<uint32_t> master(slot.size());
    for (size_t k = 0; k < slot.size(); ++k) master[k] = slot_master(slot[k], nodes);
    std::vector<Lru> node(nodes);
    const auto capacity = static_cast<uint64_t>(o.store_node_gib * double(uint64_t{1} << 30));
    for (Lru& n : node) n.capacity = capacity;
    LruKeys lru(slot.size());
    uint64_t hit_tokens = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      const std::vector<uint32_t>& ks = keys[i];
      const size_t blocks = per_block == 0 ? 0 : ks.size() / per_block;
      // Lookup: one GET per object, block by block, until the first block
      // some group misses.
      size_t hit = 0;
      for (; hit < blocks; ++hit) {
        bool all = true;
        for (size_t j = hit * per_block; j < (hit + 1) * per_block; ++j) {
          Lru& n = node[master[ks[j]]];
          ++n.ops;
          if (!lru.touch(n, ks[j])) all = false;
        }
        if (!all) break;
      }
      hit_tokens += hit * hb;
      // Put: one SET per object of the blocks the prefill computed.
      for (size_t j = hit * per_block; j < ks.size(); ++j) {
        Lru& n = node[master[ks[j]]];
        ++n.ops;
        lru.insert(n, ks[j], size);
      }
    }
    SimStoreRow row;
    row.nodes = nodes;
    row.capacity_objects = block_bytes == 0 ? 0 : capacity / block_bytes;
    uint64_t ops_max = 0, ops_sum = 0;
    for (const Lru& n : node) {
      ops_max = std::max(ops_max, n.ops);
      ops_sum += n.ops;
      row.evictions += n.evictions;
    }
    // Distinct keys per master: where the slots put the workload's keys.
    std::vector<uint64_t> placed(nodes, 0);
    for (uint32_t m : master) ++placed[m];
    row.keys_max = *std::max_element(placed.begin(), placed.end());
    row.keys_min = *std::min_element(placed.begin(), placed.end());
    row.ops_per_s_max = ops_max / duration_s;
    row.ops_per_s_mean = ops_sum / double(nodes) / duration_s;
    row.hit_rate = total_tokens == 0 ? 0 : double(hit_tokens) / double(total_tokens);
    rows.push_back(row);
  }
  return rows;
}

}  // namespace kvbridge::cli
