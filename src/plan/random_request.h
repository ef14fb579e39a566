// Test-only: random requests over any pair of layouts (random_layout.h's or
// presets), whose block lists follow DESIGN.md's rules, and an independent
// count of the bytes a request moves. Split from random_layout.h; the same
// determinism rules hold (own integer draws from a std::mt19937_64).
//
// Thread-safety: pure functions of their arguments.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"
#include "plan/random_layout.h"

namespace kvbridge::testing {

// ---------------------------------------------------------------------------
// Requests, for any pair of layouts of one model.

// Positions [first, end) of a token-indexed group that a request moves.
struct PositionRange {
  uint64_t first = 0;
  uint64_t end = 0;
  uint64_t count() const { return end > first ? end - first : 0; }
};

// DESIGN.md, "What a request transfers", written again here independently of
// the planner and of the verifier.
inline PositionRange moving_positions(const Group& g, uint64_t num_tokens, uint64_t skip_tokens) {
  uint64_t first_token = skip_tokens;
  if (g.kind == GroupKind::kSlidingWindow && g.window_tokens && num_tokens > *g.window_tokens) {
    first_token = std::max(first_token, num_tokens - *g.window_tokens);
  }
  if (first_token >= num_tokens) return {0, 0};
  return {first_token / g.tokens_per_state, (num_tokens + g.tokens_per_state - 1) / g.tokens_per_state};
}

// The same range numbered on context shard `shard` of g's sharding (the
// range itself when g is not sharded): the shard's positions of it are its
// positions [count(first), count(end)).
inline PositionRange on_shard(const Group& g, PositionRange r, uint32_t shard) {
  if (!g.context.sharded()) return r;
  return {g.context.count(r.first, shard), g.context.count(r.end, shard)};
}

// Bytes that a request moves into `local`: an oracle for plan.bytes.
inline uint64_t expected_bytes(const Layout& local, const Request& request) {
  uint64_t total = 0;
  for (const Group& g : local.groups) {
    if (!g.transfer) continue;
    uint64_t positions = 0;
    switch (g.kind) {
      case GroupKind::kAttention:
      case GroupKind::kSlidingWindow:
        positions = on_shard(g, moving_positions(g, request.num_tokens, request.skip_tokens), g.context.rank).count();
        break;
      // plan.h is silent on a request whose receiver has every token
      // (skip_tokens == num_tokens); the planner and the verifier both move
      // no state then, and so does this count.
      case GroupKind::kState:
        positions = request.skip_tokens < request.num_tokens ? 1 : 0;
        break;
      case GroupKind::kScratch:
        positions = g.positions_per_block();
        break;
    }
    for (const Layer& l : g.layers) {
      for (const Component& c : l.components) {
        if (!c.empty()) total += positions * c.local_heads() * c.cell_bytes;
      }
    }
  }
  return total;
}

enum class BlockIds : uint8_t { kConsecutive, kShuffled, kRuns };

struct RequestOptions {
  uint64_t num_tokens = 0;
  uint64_t skip_tokens = 0;
  BlockIds local_ids = BlockIds::kConsecutive;
  BlockIds remote_ids = BlockIds::kConsecutive;
  // Chance that a block that moves nothing is listed as -1, per side.
  unsigned local_unused_as_minus_one_percent = 50;
  unsigned remote_unused_as_minus_one_percent = 50;
  uint64_t max_state_blocks = kMaxStateBlocks;
};

// Groups that share a tensor in any of `ranks` (ranks of one instance, with
// the groups of the first), as a class index per group of the first rank.
inline std::vector<size_t> overlay_classes(std::span<const Layout> ranks) {
  const Layout& first = ranks.front();
  std::vector<size_t> parent(first.groups.size());
  std::iota(parent.begin(), parent.end(), 0);
  auto find = [&](size_t x) {
    while (parent[x] != x) x = parent[x] = parent[parent[x]];
    return x;
  };
  for (const Layout& layout : ranks) {
    std::map<std::string, size_t> owner;
    for (const Group& g : layout.groups) {
      const Group* same = first.find_group(g.name);
      if (same == nullptr) continue;
      const size_t gi = static_cast<size_t>(same - first.groups.data());
      for (const Layer& l : g.layers) {
        for (const Component& c : l.components) {
          auto [it, fresh] = owner.emplace(c.tensor, gi);
          if (!fresh) parent[find(gi)] = find(it->second);
        }
      }
    }
  }
  for (size_t gi = 0; gi < parent.size(); ++gi) parent[gi] = find(gi);
  return parent;
}
inline std::vector<size_t> overlay_classes(const Layout& layout) { return overlay_classes(std::span(&layout, 1)); }

namespace detail {

// Draws distinct block ids below num_blocks in the order `mode` asks for.
class IdPool {
 public:
  IdPool(Rng& rng, uint64_t num_blocks, uint64_t need, BlockIds mode) {
    require(need <= num_blocks, "a request needs more blocks than num_blocks");
    switch (mode) {
      case BlockIds::kConsecutive: {
        const uint64_t start = draw(rng, 0, num_blocks - need);
        for (uint64_t i = 0; i < need; ++i) ids_.push_back(static_cast<int64_t>(start + i));
        break;
      }
      case BlockIds::kShuffled: {
        // A partial Fisher-Yates over [0, num_blocks) held sparsely.
        std::map<uint64_t, uint64_t> swapped;
        for (uint64_t i = 0; i < need; ++i) {
          const uint64_t j = draw(rng, i, num_blocks - 1);
          const uint64_t vi = swapped.count(i) ? swapped[i] : i;
          const uint64_t vj = swapped.count(j) ? swapped[j] : j;
          swapped[j] = vi;
          ids_.push_back(static_cast<int64_t>(vj));
        }
        break;
      }
      case BlockIds::kRuns: {
        // Consecutive runs of random length, the runs in random order.
        std::vector<std::pair<uint64_t, uint64_t>> runs;  // [begin, end)
        uint64_t at = draw(rng, 0, num_blocks - need);
        for (uint64_t left = need; left > 0;) {
          const uint64_t len = std::min(left, draw(rng, 1, 6));
          runs.push_back({at, at + len});
          at += len;
          left -= len;
        }
        shuffle(rng, runs);
        for (auto [b, e] : runs) {
          for (uint64_t i = b; i < e; ++i) ids_.push_back(static_cast<int64_t>(i));
        }
        break;
      }
    }
  }
  int64_t next() { return ids_.at(next_++); }

 private:
  std::vector<int64_t> ids_;
  size_t next_ = 0;
};

// Block ids of every transfer group of one side.
inline std::map<std::string, std::vector<int64_t>> side_lists(Rng& rng, std::span<const Layout> ranks,
                                                              const RequestOptions& o, BlockIds mode,
                                                              unsigned unused_as_minus_one_percent,
                                                              const std::map<std::string, uint64_t>& state_len) {
  const Layout& layout = ranks.front();
  const std::vector<size_t> cls = overlay_classes(ranks);
  // Count the ids each class needs, then draw them from one pool per class.
  std::map<size_t, uint64_t> need, num_blocks;
  auto length = [&](const Group& g) -> uint64_t {
    switch (g.kind) {
      case GroupKind::kState:
        return state_len.at(g.name);
      case GroupKind::kScratch:
        return 1;
      default:
        if (g.context.sharded()) {
          // The ranks share one list: as long as shard 0's, which holds most.
          const uint64_t positions = (o.num_tokens + g.tokens_per_state - 1) / g.tokens_per_state;
          const uint64_t ppb = g.positions_per_block();
          return (g.context.count(positions, 0) + ppb - 1) / ppb;
        }
        return token_list_length(g.block_tokens, o.num_tokens);
    }
  };
  for (size_t gi = 0; gi < layout.groups.size(); ++gi) {
    const Group& g = layout.groups[gi];
    if (!g.transfer) continue;
    need[cls[gi]] += length(g);
    auto [it, fresh] = num_blocks.emplace(cls[gi], g.num_blocks);
    if (!fresh) it->second = std::min(it->second, g.num_blocks);
  }
  std::map<size_t, IdPool> pools;
  for (auto [c, n] : need) pools.emplace(c, IdPool(rng, num_blocks[c], n, mode));
  std::map<std::string, std::vector<int64_t>> out;
  for (size_t gi = 0; gi < layout.groups.size(); ++gi) {
    const Group& g = layout.groups[gi];
    if (!g.transfer) continue;
    IdPool& pool = pools.at(cls[gi]);
    std::vector<int64_t>& ids = out[g.name];
    const uint64_t len = length(g);
    // Positions of any shard of the side (numbered on its shard) that move.
    PositionRange moving = moving_positions(g, o.num_tokens, o.skip_tokens);
    if (g.context.sharded() && moving.count() > 0) {
      PositionRange any{UINT64_MAX, 0};
      for (uint32_t s = 0; s < g.context.size; ++s) {
        const PositionRange r = on_shard(g, moving, s);
        if (r.count() == 0) continue;
        any.first = std::min(any.first, r.first), any.end = std::max(any.end, r.end);
      }
      moving = any.end == 0 ? PositionRange{} : any;
    }
    const uint64_t per_block = g.positions_per_block();
    for (uint64_t j = 0; j < len; ++j) {
      int64_t id = pool.next();
      bool moves = true;
      if (g.kind == GroupKind::kState) moves = j + 1 == len;
      if (token_indexed(g.kind) && g.kind != GroupKind::kScratch) {
        moves = j * per_block < moving.end && (j + 1) * per_block > moving.first;
      }
      if (!moves && chance(rng, unused_as_minus_one_percent)) id = -1;
      ids.push_back(id);
    }
  }
  return out;
}

}  // namespace detail

// A request over `local` and the ranks `remotes` of the other instance
// (block ids and sizes are per instance; the first remote gives the remote
// block sizes). Token-indexed lists are exactly as long as num_tokens needs;
// state lists are 1 to max_state_blocks long, independently on each side;
// scratch lists hold one block. Groups that overlay each other in any rank of
// a side get distinct ids there. Requires: num_blocks large enough.
inline Request make_request(Rng& rng, const Layout& local, std::span<const Layout> remotes, const RequestOptions& o) {
  Request r;
  r.num_tokens = o.num_tokens;
  r.skip_tokens = o.skip_tokens;
  std::map<std::string, uint64_t> local_state, remote_state;
  for (const Group& g : local.groups) {
    if (g.kind == GroupKind::kState) {
      local_state[g.name] = draw(rng, 1, o.max_state_blocks);
      remote_state[g.name] = draw(rng, 1, o.max_state_blocks);
    }
  }
  auto lists_local =
      detail::side_lists(rng, std::span(&local, 1), o, o.local_ids, o.local_unused_as_minus_one_percent, local_state);
  auto lists_remote =
      detail::side_lists(rng, remotes, o, o.remote_ids, o.remote_unused_as_minus_one_percent, remote_state);
  for (auto& [name, ids] : lists_local) {
    GroupBlocks& gb = r.blocks[name];
    gb.local = std::move(ids);
    gb.remote = std::move(lists_remote[name]);
  }
  return r;
}

// The request with other block ids and the same shape (plan.h's
// RequestShape): on each side, the listed ids of each class of overlaid
// groups are mapped one to one, in ascending order, onto distinct ids below
// the class's num_blocks drawn in `mode` order. Lists stay distinct, overlaid
// groups stay apart, -1 entries stay -1. Requires: the request's listed ids
// are below num_blocks.
inline Request with_other_ids(Rng& rng, const Request& r, const Layout& local, std::span<const Layout> remotes,
                              BlockIds mode) {
  Request out = r;
  for (int side = 0; side < 2; ++side) {
    const std::span<const Layout> ranks = side == 0 ? std::span<const Layout>(&local, 1) : remotes;
    const Layout& first = ranks.front();
    const std::vector<size_t> cls = overlay_classes(ranks);
    std::map<size_t, std::vector<std::vector<int64_t>*>> lists;  // per class
    std::map<size_t, uint64_t> num_blocks;
    for (auto& [name, blocks] : out.blocks) {
      const Group* g = first.find_group(name);
      if (g == nullptr) continue;
      const size_t c = cls[static_cast<size_t>(g - first.groups.data())];
      lists[c].push_back(side == 0 ? &blocks.local : &blocks.remote);
      auto [it, fresh] = num_blocks.emplace(c, g->num_blocks);
      if (!fresh) it->second = std::min(it->second, g->num_blocks);
    }
    for (auto& [c, ls] : lists) {
      std::map<int64_t, int64_t> to;
      for (const std::vector<int64_t>* ids : ls) {
        for (int64_t id : *ids) {
          if (id >= 0) to.emplace(id, 0);
        }
      }
      detail::IdPool pool(rng, num_blocks[c], to.size(), mode);
      for (auto& [from, id] : to) id = pool.next();
      for (std::vector<int64_t>* ids : ls) {
        for (int64_t& id : *ids) {
          if (id >= 0) id = to.at(id);
        }
      }
    }
  }
  return out;
}

}  // namespace kvbridge::testing
