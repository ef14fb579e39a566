// Test-only: random but valid layouts of one model, and random requests over
// any pair of layouts, for the planner's property tests, the preset matrix and
// the benchmarks.
//
// A ModelRecipe is a model's identity (groups, kinds, tokens_per_state,
// windows, layers, components with cell bytes and total heads). An
// InstanceShape is how one engine instance lays that model out in memory: TP
// size, block sizes, kernel ratios, a physical nesting order per tensor family
// (block, head, kernel page, position, component and layer dims in any
// permutation), padding, one tensor per layer or one for all layers, K/V
// packed into one cell or split, and groups that overlay one another's bytes.
// The recipes, the shapes and the seeded draws that make them are in
// random_shape.h (included here). make_rank_layout() turns (recipe, shape,
// rank) into a Layout and asserts that it validates. Requests over such
// layouts (or presets) are made by random_request.h.
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
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"
#include "plan/random_shape.h"

namespace kvbridge::testing {

namespace detail {

struct FamilyGeometry {
  // Per dim: size and, for dims outside the component level, the stride.
  uint64_t size[kNumDims] = {};
  std::vector<std::vector<uint64_t>> member_stride;  // [member][dim index in dims]
  std::vector<uint64_t> member_offset;               // at the component level
  std::vector<uint64_t> stride;                      // [dim index in dims], outer dims only
  uint64_t under_outer = 0;                          // bytes of one step of dims[0]
  uint64_t extent = 0;                               // bytes of the whole family (from base_offset)
};

inline size_t dim_index(Dim d) { return static_cast<size_t>(d); }

inline FamilyGeometry family_geometry(const ModelRecipe& recipe, const InstanceShape& s, const FamilyShape& f,
                                      uint32_t rank, std::optional<uint64_t> outer_stride) {
  const GroupRecipe& g = recipe.groups[f.group];
  const GroupShape& gs = s.groups[f.group];
  FamilyGeometry geo;
  const uint64_t positions = recipe_positions_per_block(g, gs.block_tokens);
  geo.size[dim_index(Dim::kBlock)] = s.num_blocks;
  geo.size[dim_index(Dim::kHead)] =
      f.sharded ? shard_heads(g.components[f.components[0]].total_heads, s.tp_size, rank).count : 1;
  geo.size[dim_index(Dim::kKernel)] = gs.kernel_ratio;
  geo.size[dim_index(Dim::kPosition)] = positions / gs.kernel_ratio / gs.inner_split;
  geo.size[dim_index(Dim::kInner)] = gs.inner_split;
  geo.size[dim_index(Dim::kComponent)] = f.components.size();
  geo.size[dim_index(Dim::kLayer)] = g.layers.size();
  const size_t comp_at = std::find(f.dims.begin(), f.dims.end(), Dim::kComponent) - f.dims.begin();
  geo.member_stride.assign(f.components.size(), std::vector<uint64_t>(f.dims.size(), 0));
  uint64_t level = 0;
  for (size_t m = 0; m < f.components.size(); ++m) {
    uint64_t e = g.components[f.components[m]].cell_bytes;
    for (size_t i = f.dims.size(); i-- > comp_at + 1;) {
      const uint64_t stride = e + f.pad[dim_index(f.dims[i])];
      geo.member_stride[m][i] = stride;
      e = stride * geo.size[dim_index(f.dims[i])];
    }
    geo.member_offset.push_back(level);
    level += e + f.member_pad;
  }
  geo.stride.assign(f.dims.size(), 0);
  uint64_t e = level;
  for (size_t i = comp_at; i-- > 0;) {
    uint64_t stride = e + f.pad[dim_index(f.dims[i])];
    if (i == 0) {
      geo.under_outer = stride;
      if (outer_stride) stride = *outer_stride;
    }
    geo.stride[i] = stride;
    e = stride * geo.size[dim_index(f.dims[i])];
  }
  if (comp_at == 0) geo.under_outer = level;
  geo.extent = e;
  return geo;
}

inline std::string family_tensor(size_t family, const FamilyShape& f, size_t layer) {
  const std::string base = f.alias >= 0 ? "overlay" + std::to_string(f.alias) : "t" + std::to_string(family);
  return f.one_tensor ? base : base + "." + std::to_string(layer);
}

}  // namespace detail

// The layout of rank `rank` of an instance of `recipe` shaped `s`. Asserts
// (aborts with the message) that it passes validate().
inline Layout make_rank_layout(const ModelRecipe& recipe, const InstanceShape& s, uint32_t rank) {
  using detail::dim_index;
  Layout out;
  out.model = recipe.model;
  out.dtype = recipe.dtype;
  out.tp_size = s.tp_size;
  out.tp_rank = rank;
  for (size_t gi = 0; gi < recipe.groups.size(); ++gi) {
    const GroupRecipe& g = recipe.groups[gi];
    Group group;
    group.name = g.name;
    group.kind = g.kind;
    group.block_tokens = s.groups[gi].block_tokens;
    group.tokens_per_state = g.tokens_per_state;
    group.window_tokens = g.window_tokens;
    group.prefix_cacheable = g.kind != GroupKind::kScratch;
    group.transfer = g.transfer;
    group.num_blocks = s.num_blocks;
    for (const std::string& name : g.layers) group.layers.push_back(Layer{name, {}});
    out.groups.push_back(std::move(group));
  }

  // Overlays share the outer (block) stride: the larger of the two.
  std::vector<std::optional<uint64_t>> outer(s.families.size());
  for (const Overlay& o : s.overlays) {
    const uint64_t a = detail::family_geometry(recipe, s, s.families[o.first], rank, std::nullopt).under_outer;
    const uint64_t b = detail::family_geometry(recipe, s, s.families[o.second], rank, std::nullopt).under_outer;
    outer[o.first] = outer[o.second] = std::max(a, b) + o.pad;
  }

  std::map<std::string, uint64_t> tensor_bytes;
  for (size_t fi = 0; fi < s.families.size(); ++fi) {
    const FamilyShape& f = s.families[fi];
    const GroupRecipe& g = recipe.groups[f.group];
    const detail::FamilyGeometry geo = detail::family_geometry(recipe, s, f, rank, outer[fi]);
    const size_t comp_at = std::find(f.dims.begin(), f.dims.end(), Dim::kComponent) - f.dims.begin();
    const size_t layer_at = std::find(f.dims.begin(), f.dims.end(), Dim::kLayer) - f.dims.begin();
    for (size_t l = 0; l < g.layers.size(); ++l) {
      const std::string tensor = detail::family_tensor(fi, f, l);
      uint64_t& bytes = tensor_bytes[tensor];
      bytes = std::max(bytes, f.base_offset + geo.extent + f.tail_slack);
      for (size_t m = 0; m < f.components.size(); ++m) {
        const ComponentRecipe& cr = g.components[f.components[m]];
        Component c;
        c.name = cr.name;
        c.tensor = tensor;
        c.cell_bytes = cr.cell_bytes;
        c.offset = f.base_offset + geo.member_offset[m];
        if (f.one_tensor) {
          const uint64_t layer_stride = layer_at < comp_at ? geo.stride[layer_at] : geo.member_stride[m][layer_at];
          c.offset += l * layer_stride;
        }
        if (f.sharded) c.heads = shard_heads(cr.total_heads, s.tp_size, rank);
        std::vector<std::pair<Dim, Axis>> position_digits;  // in physical order
        for (size_t i = 0; i < f.dims.size(); ++i) {
          const Dim d = f.dims[i];
          if (d == Dim::kComponent || d == Dim::kLayer) continue;
          const uint64_t stride = i < comp_at ? geo.stride[i] : geo.member_stride[m][i];
          const uint64_t size = geo.size[dim_index(d)];
          AxisKind kind = d == Dim::kBlock ? AxisKind::kBlock : d == Dim::kHead ? AxisKind::kHead : AxisKind::kPosition;
          c.axes.push_back(Axis{kind, size, stride});
          if (kind == AxisKind::kPosition) position_digits.push_back({d, c.axes.back()});
        }
        // Position axes must read outermost digit first (kernel page,
        // position, inner split), whatever their physical nesting: put them
        // in digit order into the slots the position axes hold.
        std::stable_sort(position_digits.begin(), position_digits.end(),
                         [](const auto& a, const auto& b) { return a.first < b.first; });
        for (size_t i = 0, k = 0; i < c.axes.size(); ++i) {
          if (c.axes[i].kind == AxisKind::kPosition) c.axes[i] = position_digits[k++].second;
        }
        Rng axes_rng(f.axes_seed + 1000 * l + m);
        if (f.junk_unit_strides) {
          // An axis of size 1 is only ever indexed 0: its stride must not matter.
          for (Axis& a : c.axes) {
            if (a.size == 1 && chance(axes_rng, 50)) {
              a.stride = pick(axes_rng, std::vector<uint64_t>{0, 3, uint64_t{1} << 20, uint64_t{1} << 40});
            }
          }
        }
        if (f.shuffle_axes) {
          std::vector<Axis> others, positions;
          for (const Axis& a : c.axes) (a.kind == AxisKind::kPosition ? positions : others).push_back(a);
          shuffle(axes_rng, others);
          // Interleave the position axes back at random places, in order.
          std::vector<Axis> axes = others;
          size_t lo = 0;
          for (const Axis& p : positions) {
            const size_t at = draw(axes_rng, lo, axes.size());
            axes.insert(axes.begin() + at, p);
            lo = at + 1;
          }
          c.axes = std::move(axes);
        }
        out.groups[f.group].layers[l].components.push_back(std::move(c));
      }
    }
  }
  // Components in recipe order within each layer.
  for (size_t gi = 0; gi < recipe.groups.size(); ++gi) {
    const GroupRecipe& g = recipe.groups[gi];
    for (Layer& layer : out.groups[gi].layers) {
      std::vector<Component> ordered;
      for (const ComponentRecipe& cr : g.components) {
        for (Component& c : layer.components) {
          if (c.name == cr.name) ordered.push_back(std::move(c));
        }
      }
      layer.components = std::move(ordered);
    }
  }
  for (const auto& [name, bytes] : tensor_bytes) out.tensors.push_back(Tensor{name, bytes, "host"});
  Rng order_rng(s.tensor_order_seed);
  shuffle(order_rng, out.tensors);

  const Status valid = validate(out);
  if (!valid.ok()) {
    std::fprintf(stderr, "random_layout: generated an invalid layout: %s\n%s\n", valid.to_string().c_str(),
                 to_json(out).c_str());
    std::abort();
  }
  return out;
}

// `layout` as context shard `shard` of `size` (chunks of `interleave`
// positions) of every attention and sliding-window group, and as rank
// tp_rank * size + shard of an instance of tp_size * size ranks (each rank
// of the unsharded instance becomes `size` ranks, one per shard, as vLLM's
// decode context parallelism carves shards out of TP ranks).
inline Layout as_context_shard(Layout layout, uint32_t size, uint32_t shard, uint64_t interleave) {
  layout.tp_rank = layout.tp_rank * size + shard;
  layout.tp_size *= size;
  for (Group& g : layout.groups) {
    if (g.kind == GroupKind::kAttention || g.kind == GroupKind::kSlidingWindow) g.context = {size, shard, interleave};
  }
  return layout;
}

// Every rank of `ranks` as `size` context shards (as_context_shard()).
inline std::vector<Layout> context_sharded(std::span<const Layout> ranks, uint32_t size, uint64_t interleave) {
  std::vector<Layout> out;
  for (const Layout& r : ranks) {
    for (uint32_t s = 0; s < size; ++s) out.push_back(as_context_shard(r, size, s, interleave));
  }
  return out;
}

// Every rank of an instance, in rank order.
inline std::vector<Layout> make_instance(const ModelRecipe& recipe, const InstanceShape& s) {
  std::vector<Layout> ranks;
  for (uint32_t r = 0; r < s.tp_size; ++r) ranks.push_back(make_rank_layout(recipe, s, r));
  return ranks;
}

}  // namespace kvbridge::testing
