// Test-only: the inputs of random_layout.h, drawn at random: a ModelRecipe (a
// model's identity: groups, kinds, tokens_per_state, windows, layers,
// components with cell bytes and total heads) and an InstanceShape (how one
// engine instance lays that model out in memory: TP size, block sizes, kernel
// ratios, a physical nesting order per tensor family, padding, one tensor per
// layer or one for all layers, K/V packed into one cell or split, and groups
// that overlay one another's bytes), with the seeded draws (draw(), chance(),
// pick(), shuffle(), case_seed()) that every generator of random_layout.h and
// random_request.h uses. random_layout.h includes this header and turns a
// recipe and a shape into the layouts of an instance's ranks.
//
// Everything is a function of a std::mt19937_64 and uses its own integer
// draws (not <random>'s distributions, whose results differ between standard
// libraries), so a seed reproduces a case on any machine.
//
// Header-only so that tests/ and bench/ can use it without a library of their
// own. Thread-safety: pure functions of their arguments.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "kvbridge/layout.h"

namespace kvbridge::testing {

using Rng = std::mt19937_64;

// Aborts with `message` when `condition` fails, in every build type (assert
// vanishes under NDEBUG, and a generator bug must not pass silently).
inline void require(bool condition, const char* message) {
  if (!condition) {
    std::fprintf(stderr, "random_layout: %s\n", message);
    std::abort();
  }
}

// A uniform integer in [lo, hi] (the modulo bias is irrelevant here).
inline uint64_t draw(Rng& rng, uint64_t lo, uint64_t hi) { return lo + rng() % (hi - lo + 1); }
// True with probability percent / 100.
inline bool chance(Rng& rng, unsigned percent) { return rng() % 100 < percent; }
template <typename T>
T pick(Rng& rng, const std::vector<T>& values) {
  return values[draw(rng, 0, values.size() - 1)];
}
template <typename T>
void shuffle(Rng& rng, std::vector<T>& values) {
  for (size_t i = values.size(); i > 1; --i) std::swap(values[i - 1], values[draw(rng, 0, i - 1)]);
}
// A well-mixed seed for case `index` of a run seeded with `seed` (splitmix64).
inline uint64_t case_seed(uint64_t seed, uint64_t index) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ULL * (index + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// ---------------------------------------------------------------------------
// The model identity.

struct ComponentRecipe {
  std::string name;
  uint64_t cell_bytes = 0;
  uint32_t total_heads = 0;  // 0: replicated
};

struct GroupRecipe {
  std::string name;
  GroupKind kind = GroupKind::kAttention;
  uint64_t tokens_per_state = 1;
  std::optional<uint64_t> window_tokens;  // sliding_window only
  uint64_t scratch_block_tokens = 0;      // scratch only: equal on every instance
  bool transfer = true;
  std::vector<std::string> layers;
  std::vector<ComponentRecipe> components;  // every layer of the group has these
};

struct ModelRecipe {
  std::string model = "random-model";
  std::string dtype = "bf16";
  std::vector<GroupRecipe> groups;
};

// Head map of rank `rank` of `tp` for `total` heads: T <= H splits evenly, T >
// H gives each rank one head, held by T/H consecutive ranks. Requires that
// one of the two divides the other.
inline HeadMap shard_heads(uint32_t total, uint32_t tp, uint32_t rank) {
  require(tp <= total ? total % tp == 0 : tp % total == 0, "the TP size does not fit the heads");
  if (tp <= total) return HeadMap{total, rank * (total / tp), total / tp};
  return HeadMap{total, rank / (tp / total), 1};
}

// TP sizes up to `max_tp` that every sharded component of `recipe` can take.
inline std::vector<uint32_t> valid_tp_sizes(const ModelRecipe& recipe, uint32_t max_tp = 8) {
  std::vector<uint32_t> out;
  for (uint32_t tp = 1; tp <= max_tp; ++tp) {
    bool ok = true;
    for (const GroupRecipe& g : recipe.groups) {
      for (const ComponentRecipe& c : g.components) {
        if (c.total_heads == 0) continue;
        const uint32_t h = c.total_heads;
        if (tp <= h ? h % tp != 0 : tp % h != 0) ok = false;
      }
    }
    if (ok) out.push_back(tp);
  }
  return out;
}

inline ModelRecipe random_recipe(Rng& rng) {
  ModelRecipe m;
  m.model = "random-" + std::to_string(draw(rng, 0, 3));
  m.dtype = pick(rng, std::vector<std::string>{"bf16", "fp8"});
  const uint64_t num_groups = pick(rng, std::vector<uint64_t>{1, 1, 2, 2, 3, 4});
  // Mostly a power-of-two head family so that several TP sizes fit; sometimes
  // a 3 that pins TP to few sizes.
  const unsigned family = static_cast<unsigned>(draw(rng, 0, 99));
  const std::vector<uint32_t> head_totals = family < 15   ? std::vector<uint32_t>{1, 3}
                                            : family < 22 ? std::vector<uint32_t>{2, 16}
                                                          : std::vector<uint32_t>{1, 2, 4, 8};
  static const std::vector<std::string> kNames = {"k", "v", "latent", "rope", "index", "tail", "conv", "ssm"};
  uint32_t layer_counter = 0;
  for (uint64_t gi = 0; gi < num_groups; ++gi) {
    GroupRecipe g;
    g.name = "g" + std::to_string(gi);
    g.kind = gi == 0 && chance(rng, 70)
                 ? GroupKind::kAttention
                 : pick(rng, std::vector<GroupKind>{GroupKind::kAttention, GroupKind::kSlidingWindow, GroupKind::kState,
                                                    GroupKind::kScratch});
    switch (g.kind) {
      case GroupKind::kAttention:
        g.tokens_per_state = pick(rng, std::vector<uint64_t>{1, 1, 1, 2, 4});
        break;
      case GroupKind::kSlidingWindow:
        g.tokens_per_state = pick(rng, std::vector<uint64_t>{1, 1, 2});
        g.window_tokens = pick(rng, std::vector<uint64_t>{1, 3, 8, 16, 37, 64, 128});
        break;
      case GroupKind::kState:
        g.tokens_per_state = 1;
        break;
      case GroupKind::kScratch:
        g.tokens_per_state = pick(rng, std::vector<uint64_t>{1, 1, 2});
        g.scratch_block_tokens = g.tokens_per_state * pick(rng, std::vector<uint64_t>{1, 2, 4, 8});
        break;
    }
    g.transfer = gi == 0 || chance(rng, 90);
    const uint64_t num_layers = draw(rng, 1, 4);
    for (uint64_t l = 0; l < num_layers; ++l) g.layers.push_back("layers." + std::to_string(layer_counter++));
    std::vector<std::string> names = kNames;
    shuffle(rng, names);
    const uint64_t num_components = pick(rng, std::vector<uint64_t>{1, 2, 2, 3});
    bool has_empty = false;
    for (uint64_t c = 0; c < num_components; ++c) {
      ComponentRecipe cr;
      cr.name = names[c];
      cr.cell_bytes = pick(rng, std::vector<uint64_t>{1, 2, 4, 8, 8, 12, 16, 16, 132});
      if (num_components > 1 && !has_empty && chance(rng, 8)) {
        cr.cell_bytes = 0;
        has_empty = true;
      }
      cr.total_heads = chance(rng, 25) ? 0 : pick(rng, head_totals);
      g.components.push_back(cr);
    }
    m.groups.push_back(std::move(g));
  }
  return m;
}

// ---------------------------------------------------------------------------
// The physical layout of one instance.

// Dims of a tensor family, nested outermost first; the cell is innermost.
// kKernel, kPosition and kInner are the digits of the position within a block
// (outermost first: kernel page, position, a further split of it).
// kComponent is the level at which the family's components sit side by side
// (innermost: packed into one cell; outer: K/V split at that level). kLayer
// exists only when the family's layers share one tensor.
enum class Dim : uint8_t { kBlock, kHead, kKernel, kPosition, kInner, kComponent, kLayer };
inline constexpr size_t kNumDims = 7;

// One tensor family: some components of one group, the same in every layer.
struct FamilyShape {
  size_t group = 0;
  std::vector<size_t> components;  // indices into the group recipe's components
  bool sharded = false;            // the components' heads (all sharded alike, or all replicated)
  std::vector<Dim> dims;           // outermost first
  uint64_t pad[kNumDims] = {};     // added to the stride of each dim
  uint64_t member_pad = 0;         // after each component at the component level
  bool one_tensor = false;         // all layers in one tensor (kLayer in dims)
  uint64_t base_offset = 0;        // of the family in its tensor(s)
  uint64_t tail_slack = 0;         // bytes after the last cell
  int alias = -1;                  // index of the overlay this family is part of
  bool shuffle_axes = false;       // write the axes in a random order
  bool junk_unit_strides = false;  // give axes of size 1 arbitrary strides (never used)
  uint64_t axes_seed = 0;
};

struct GroupShape {
  uint64_t block_tokens = 0;
  uint64_t kernel_ratio = 1;        // kernel pages per block: two position axes when > 1
  uint64_t inner_split = 1;         // a third position axis (the innermost digit) when > 1
  bool omit_unit_position = false;  // one position per block written with no position axis
};

// Two families of different groups that overlay one tensor (the hybrid
// allocator): both have the block dim outermost and share the block stride.
struct Overlay {
  size_t first = 0, second = 0;  // family indices
  uint64_t pad = 0;
};

struct InstanceShape {
  uint32_t tp_size = 1;
  uint64_t num_blocks = 1;
  std::vector<GroupShape> groups;  // parallel to the recipe's groups
  std::vector<FamilyShape> families;
  std::vector<Overlay> overlays;
  uint64_t tensor_order_seed = 0;
};

// Positions per block of `g` with block size `block_tokens`.
inline uint64_t recipe_positions_per_block(const GroupRecipe& g, uint64_t block_tokens) {
  return g.kind == GroupKind::kState ? 1 : block_tokens / g.tokens_per_state;
}

// Blocks a request of `num_tokens` lists for a token-indexed group.
inline uint64_t token_list_length(uint64_t block_tokens, uint64_t num_tokens) {
  return (num_tokens + block_tokens - 1) / block_tokens;
}

inline constexpr uint64_t kMaxStateBlocks = 4;

// A random shape for `recipe` with TP `tp_size`, where num_blocks is large
// enough for requests of up to `max_tokens` tokens made by make_request().
// With `same_blocks`, the block sizes and num_blocks are those of that shape
// (another rank of the same instance laid out differently); the rest is drawn.
inline InstanceShape random_instance(Rng& rng, const ModelRecipe& recipe, uint32_t tp_size, uint64_t max_tokens,
                                     const InstanceShape* same_blocks = nullptr) {
  InstanceShape s;
  s.tp_size = tp_size;
  s.tensor_order_seed = rng();
  const uint64_t base_positions = pick(rng, std::vector<uint64_t>{1, 2, 4, 4, 8, 8, 16, 6});
  for (const GroupRecipe& g : recipe.groups) {
    GroupShape gs;
    if (same_blocks != nullptr) {
      gs.block_tokens = same_blocks->groups[s.groups.size()].block_tokens;
    } else if (g.kind == GroupKind::kScratch) {
      gs.block_tokens = g.scratch_block_tokens;
    } else if (g.kind == GroupKind::kState) {
      gs.block_tokens = pick(rng, std::vector<uint64_t>{1, 4, 16, 64});
    } else {
      const uint64_t positions = chance(rng, 70) ? base_positions : pick(rng, std::vector<uint64_t>{1, 2, 3, 4, 8, 12});
      gs.block_tokens = positions * g.tokens_per_state;
    }
    const uint64_t positions = recipe_positions_per_block(g, gs.block_tokens);
    if (token_indexed(g.kind)) {
      std::vector<uint64_t> ratios;
      for (uint64_t r : {1, 2, 3, 4}) {
        if (positions % r == 0) ratios.push_back(r);
      }
      gs.kernel_ratio = chance(rng, 50) ? 1 : pick(rng, ratios);
      std::vector<uint64_t> splits;
      for (uint64_t d : {2, 3, 4}) {
        if ((positions / gs.kernel_ratio) % d == 0) splits.push_back(d);
      }
      if (!splits.empty() && chance(rng, 20)) gs.inner_split = pick(rng, splits);
      gs.omit_unit_position = positions == 1 && chance(rng, 50);
    }
    s.groups.push_back(gs);
  }

  // Block ids: make_request() draws every group of an overlay class from one
  // pool, so the class's blocks must fit.
  uint64_t need = 0;
  for (size_t gi = 0; gi < recipe.groups.size(); ++gi) {
    const GroupRecipe& g = recipe.groups[gi];
    if (g.kind == GroupKind::kState)
      need += kMaxStateBlocks;
    else if (g.kind == GroupKind::kScratch)
      need += 1;
    else
      need += token_list_length(s.groups[gi].block_tokens, max_tokens);
  }
  s.num_blocks = same_blocks != nullptr ? same_blocks->num_blocks : need + draw(rng, 0, 8);

  // Families: split each group's components into packs of one head kind.
  for (size_t gi = 0; gi < recipe.groups.size(); ++gi) {
    const GroupRecipe& g = recipe.groups[gi];
    const GroupShape& gs = s.groups[gi];
    std::map<uint32_t, std::vector<size_t>> by_heads;  // total heads (0: replicated) -> components
    for (size_t c = 0; c < g.components.size(); ++c) by_heads[g.components[c].total_heads].push_back(c);
    // Components of different totals may share a family only when each rank
    // holds the same count of each; keep it simple and split by total.
    for (auto& [total, comps] : by_heads) {
      std::vector<std::vector<size_t>> packs;
      if (comps.size() > 1 && chance(rng, 35)) {
        for (size_t c : comps) packs.push_back({c});  // K/V split into families of their own
      } else {
        packs.push_back(comps);
      }
      for (std::vector<size_t>& pack : packs) {
        FamilyShape f;
        f.group = gi;
        f.components = pack;
        f.sharded = total != 0;
        f.one_tensor = chance(rng, 40);
        f.dims = {Dim::kBlock, Dim::kComponent};
        if (f.sharded) f.dims.push_back(Dim::kHead);
        if (token_indexed(g.kind)) {
          if (gs.kernel_ratio > 1) f.dims.push_back(Dim::kKernel);
          if (!gs.omit_unit_position) f.dims.push_back(Dim::kPosition);
          if (gs.inner_split > 1) f.dims.push_back(Dim::kInner);
        }
        if (f.one_tensor) f.dims.push_back(Dim::kLayer);
        if (chance(rng, 60)) {
          // A usual order: block outermost (or layer, then block), components
          // packed in the cell, heads before positions or after.
          std::vector<Dim> usual;
          if (f.one_tensor && chance(rng, 50)) usual.push_back(Dim::kLayer);
          usual.push_back(Dim::kBlock);
          if (f.one_tensor && usual.size() == 1) usual.push_back(Dim::kLayer);
          const bool heads_first = chance(rng, 60);
          if (f.sharded && heads_first) usual.push_back(Dim::kHead);
          if (gs.kernel_ratio > 1) usual.push_back(Dim::kKernel);
          if (token_indexed(g.kind) && !gs.omit_unit_position) usual.push_back(Dim::kPosition);
          if (gs.inner_split > 1) usual.push_back(Dim::kInner);
          if (f.sharded && !heads_first) usual.push_back(Dim::kHead);
          if (chance(rng, 70))
            usual.push_back(Dim::kComponent);
          else
            usual.insert(usual.begin() + draw(rng, 0, usual.size()), Dim::kComponent);
          f.dims = usual;
        } else {
          shuffle(rng, f.dims);
        }
        for (uint64_t& p : f.pad) p = chance(rng, 25) ? pick(rng, std::vector<uint64_t>{1, 4, 16, 64}) : 0;
        f.member_pad = chance(rng, 15) ? pick(rng, std::vector<uint64_t>{1, 8}) : 0;
        f.base_offset = chance(rng, 25) ? pick(rng, std::vector<uint64_t>{8, 64, 4096}) : 0;
        f.tail_slack = chance(rng, 25) ? pick(rng, std::vector<uint64_t>{1, 100}) : 0;
        f.shuffle_axes = chance(rng, 30);
        f.junk_unit_strides = chance(rng, 20);
        f.axes_seed = rng();
        s.families.push_back(std::move(f));
      }
    }
  }

  // An overlay between two families of different groups, sometimes.
  if (recipe.groups.size() > 1 && chance(rng, 40)) {
    const size_t a = draw(rng, 0, s.families.size() - 1);
    const size_t b = draw(rng, 0, s.families.size() - 1);
    if (s.families[a].group != s.families[b].group) {
      for (size_t f : {a, b}) {
        FamilyShape& fs = s.families[f];
        // Block outermost; the rest keeps its order.
        fs.dims.erase(std::find(fs.dims.begin(), fs.dims.end(), Dim::kBlock));
        fs.dims.insert(fs.dims.begin(), Dim::kBlock);
        fs.alias = static_cast<int>(s.overlays.size());
      }
      // Both one tensor, or both one tensor per layer, so the tensors pair up.
      const bool one = s.families[a].one_tensor;
      FamilyShape& other = s.families[b];
      if (other.one_tensor != one) {
        other.one_tensor = one;
        if (one)
          other.dims.push_back(Dim::kLayer);
        else
          other.dims.erase(std::find(other.dims.begin(), other.dims.end(), Dim::kLayer));
      }
      s.families[b].base_offset = s.families[a].base_offset;
      s.overlays.push_back({a, b, chance(rng, 30) ? uint64_t{32} : uint64_t{0}});
    }
  }
  return s;
}

}  // namespace kvbridge::testing
