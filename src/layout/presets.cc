// Preset layouts of public model architectures. The figures and the public
// architectures they are modelled on are in docs/presets.md; this file turns
// them into geometry.
//
// Every preset is described in two steps. First, each group lists its layers,
// and each layer lists its *pages*: the bytes of one block of that layer in
// one tensor slot (a slot of a tensor family such as "kv" or "idx"), with the
// components packed inside the page. Second, assemble() sizes every slot (the
// largest page placed in it, so overlays always fit), turns the slots into
// tensors according to the order (one tensor per slot for LB*, one block-major
// tensor per family for BLHNC) and writes each component's axes. Overlays
// (gpt-oss's SWA and full layers, GLM's KDA state over MLA pages and its
// indexer tail inside indexer pages) are simply several pages in one slot,
// which is how vLLM's hybrid allocator shares one KVCacheTensor between groups
// (vllm-connectors.md §1.4, §1.7).
//
// The first step, the presets themselves and their table, is in
// presets_table.cc; this file resolves the options against a preset's
// defaults, assembles the layout and serves the public functions of
// kvbridge/presets.h.

#include "kvbridge/presets.h"

#include <algorithm>
#include <cctype>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <utility>

#include "common/checked.h"
#include "layout/presets_internal.h"

namespace kvbridge {
namespace {

using preset_internal::bad;
using preset_internal::find_preset;
using preset_internal::GroupSpec;
using preset_internal::LayerSpec;
using preset_internal::Options;
using preset_internal::Page;
using preset_internal::Part;
using preset_internal::Placed;
using preset_internal::PresetDef;
using preset_internal::presets;
using std::to_string;

Result<Options> resolve(const PresetOptions& in, const PresetDef& def) {
  Options o;
  o.model = std::string(def.name);
  o.tp = in.tp_size;
  o.rank = in.tp_rank;
  o.order = in.order;
  o.spec_tokens = in.spec_tokens;
  if (o.tp == 0 || o.tp > kMaxTpSize) {
    return bad("--tp " + to_string(o.tp) + ": the TP size must be between 1 and " + to_string(kMaxTpSize));
  }
  if (o.rank >= o.tp) {
    return bad("--rank " + to_string(o.rank) + ": the rank must be below the TP size (--tp " + to_string(o.tp) + ")");
  }
  if (in.dcp_size == 0 || in.dcp_size > kMaxContextShards || o.tp % in.dcp_size != 0) {
    return bad("--dcp " + to_string(in.dcp_size) + ": the decode context-parallel size must divide the TP size (--tp " +
               to_string(o.tp) + ")");
  }
  if (in.dcp_interleave == 0 || in.dcp_interleave > kMaxBlockTokens) {
    return bad("--dcp-interleave " + to_string(in.dcp_interleave) + ": must be between 1 and " +
               to_string(kMaxBlockTokens) + " tokens");
  }
  // Heads are sharded over the TP ranks of one context shard.
  o.tp /= in.dcp_size;
  o.rank /= in.dcp_size;
  o.block_tokens = in.block_tokens != 0 ? in.block_tokens : def.block_tokens;
  if (o.block_tokens > kMaxBlockTokens) {
    return bad("--block-tokens " + to_string(o.block_tokens) + ": more than the limit of " +
               to_string(kMaxBlockTokens) + " tokens");
  }
  // Without an explicit kernel block, use the largest divisor of the block
  // that the preset's kernel block allows, as vLLM's select_common_block_size
  // does (vllm-connectors.md §1.6).
  o.kernel_tokens = in.kernel_block_tokens != 0 ? in.kernel_block_tokens : std::gcd(o.block_tokens, def.kernel_tokens);
  if (o.kernel_tokens > o.block_tokens || o.block_tokens % o.kernel_tokens != 0) {
    return bad("--kernel-block-tokens " + to_string(o.kernel_tokens) + ": the block of " + to_string(o.block_tokens) +
               " tokens (--block-tokens) must be a multiple of the kernel block");
  }
  o.num_blocks = in.num_blocks != 0 ? in.num_blocks : def.num_blocks;
  if (o.num_blocks > kMaxNumBlocks) {
    return bad("--num-blocks " + to_string(o.num_blocks) + ": more than the limit of " + to_string(kMaxNumBlocks));
  }
  o.state_blocks = in.state_blocks != 0 ? in.state_blocks : o.num_blocks;
  if (o.state_blocks > kMaxNumBlocks) {
    return bad("--state-blocks " + to_string(o.state_blocks) + ": more than the limit of " + to_string(kMaxNumBlocks));
  }
  return o;
}

// Where one slot lives.
struct Where {
  std::string tensor;
  uint64_t offset = 0;
  uint64_t block_stride = 0;
  uint64_t num_blocks = 0;
};

std::vector<Component> components_of(const Page& page, const Where& w, Order order) {
  const uint64_t h = page.local_heads();
  const uint64_t c = page.content_bytes();
  std::vector<Component> out;
  uint64_t at = 0;  // offset of the part within the cell group (token) or page (state)
  for (const Part& part : page.parts) {
    Component comp;
    comp.name = part.name;
    comp.tensor = w.tensor;
    comp.offset = w.offset + at;
    comp.cell_bytes = part.cell_bytes;
    comp.heads = page.heads;
    comp.axes.push_back({AxisKind::kBlock, w.num_blocks, w.block_stride});
    if (page.positions == 0) {
      if (page.heads) comp.axes.push_back({AxisKind::kHead, h, part.cell_bytes});
      at += h * part.cell_bytes;
    } else {
      const uint64_t n = page.kernel_positions;
      const uint64_t r = page.positions / n;
      if (r > 1) comp.axes.push_back({AxisKind::kPosition, r, h * n * c});
      if (order == Order::kLBNHC) {
        comp.axes.push_back({AxisKind::kPosition, n, h * c});
        if (page.heads) comp.axes.push_back({AxisKind::kHead, h, c});
      } else {
        if (page.heads) comp.axes.push_back({AxisKind::kHead, h, n * c});
        comp.axes.push_back({AxisKind::kPosition, n, c});
      }
      at += part.cell_bytes;
    }
    out.push_back(std::move(comp));
  }
  return out;
}

Status tensor_bytes(uint64_t row, uint64_t blocks, const char* option, const std::string& name, uint64_t* out) {
  if (!checked_mul(row, blocks, out) || *out > kMaxTensorBytes) {
    return bad(std::string(option) + " " + to_string(blocks) + ": tensor '" + name + "' of " + to_string(row) +
               " B per block would exceed the limit of " + to_string(kMaxTensorBytes) + " B");
  }
  return Status();
}

Result<Layout> assemble(const Options& o, const std::vector<GroupSpec>& groups) {
  // Slot sizes per family, families in order of first use. A family only
  // state and scratch groups use is a pool of state_blocks slots; one an
  // attention or sliding-window group uses (alone or overlaid) has
  // num_blocks.
  std::vector<std::string> families;
  std::map<std::string, std::vector<uint64_t>> slots;
  std::set<std::string> token_families;
  for (const GroupSpec& g : groups) {
    for (const LayerSpec& l : g.layers) {
      for (const Placed& p : l.pages) {
        if (!slots.contains(p.family)) families.push_back(p.family);
        std::vector<uint64_t>& s = slots[p.family];
        if (s.size() <= p.slot) s.resize(p.slot + 1, 0);
        s[p.slot] = std::max(s[p.slot], p.page.bytes());
      }
    }
  }
  // The families of attention and sliding-window groups, and every family
  // of a group that shares one of them (a state overlaying their pages
  // keeps their blocks).
  for (bool grew = true; grew;) {
    grew = false;
    for (const GroupSpec& g : groups) {
      bool token = !one_block_per_request(g.group.kind);
      for (const LayerSpec& l : g.layers) {
        for (const Placed& p : l.pages) token = token || token_families.contains(p.family);
      }
      if (!token) continue;
      for (const LayerSpec& l : g.layers) {
        for (const Placed& p : l.pages) grew = token_families.insert(p.family).second || grew;
      }
    }
  }

  Layout layout;
  layout.model = o.model;
  layout.dtype = "bf16";
  layout.tp_size = o.tp;
  layout.tp_rank = o.rank;
  std::map<std::pair<std::string, uint32_t>, Where> where;
  for (const std::string& f : families) {
    const std::vector<uint64_t>& pages = slots[f];
    const bool state_pool = !token_families.contains(f);
    const uint64_t blocks = state_pool ? o.state_blocks : o.num_blocks;
    const char* option = state_pool && o.state_blocks != o.num_blocks ? "--state-blocks" : "--num-blocks";
    if (o.order == Order::kBLHNC) {
      const uint64_t row = std::accumulate(pages.begin(), pages.end(), uint64_t{0});
      Tensor t{f, 0, "host"};
      KVB_RETURN_IF_ERROR(tensor_bytes(row, blocks, option, f, &t.bytes));
      uint64_t at = 0;
      for (uint32_t s = 0; s < pages.size(); ++s) {
        where[{f, s}] = Where{f, at, row, blocks};
        at += pages[s];
      }
      layout.tensors.push_back(std::move(t));
    } else {
      for (uint32_t s = 0; s < pages.size(); ++s) {
        if (pages[s] == 0) continue;  // a slot of layers another PP stage holds
        Tensor t{f + "." + to_string(s), 0, "host"};
        KVB_RETURN_IF_ERROR(tensor_bytes(pages[s], blocks, option, t.name, &t.bytes));
        where[{f, s}] = Where{t.name, 0, pages[s], blocks};
        layout.tensors.push_back(std::move(t));
      }
    }
  }

  for (const GroupSpec& g : groups) {
    Group group = g.group;
    for (const LayerSpec& l : g.layers) {
      Layer layer{l.name, {}};
      for (const Placed& p : l.pages) {
        const Where& w = where.at({p.family, p.slot});
        group.num_blocks = w.num_blocks;  // a group's families are all pools or all not
        for (Component& c : components_of(p.page, w, o.order)) {
          layer.components.push_back(std::move(c));
        }
      }
      group.layers.push_back(std::move(layer));
    }
    layout.groups.push_back(std::move(group));
  }
  return layout;
}

// The rank of PP stage options.pp_rank: the whole model's layout `full`
// with the layers of the other stages marked not held, and the tensors of a
// layout assembled from the stage's own layers (so a stage allocates only
// what it holds; block-major rows hold only its layers).
Result<Layout> pp_stage(const Options& o, const PresetOptions& options, std::vector<GroupSpec> groups, Layout full) {
  const std::vector<std::string> order = layer_order(full);
  if (options.pp_size == 0 || options.pp_size > std::min<size_t>(order.size(), kMaxPpSize)) {
    return bad("--pp " + to_string(options.pp_size) + ": " + o.model + " has " + to_string(order.size()) +
               " layers; the PP size must be between 1 and that");
  }
  if (options.pp_rank >= options.pp_size) {
    return bad("--pp-rank " + to_string(options.pp_rank) + ": the stage must be below the PP size (--pp " +
               to_string(options.pp_size) + ")");
  }
  const std::set<std::string, std::less<>> held = pp_stage_layers(order, options.pp_size, options.pp_rank);
  for (GroupSpec& g : groups) {
    std::erase_if(g.layers, [&](const LayerSpec& l) { return held.count(l.name) == 0; });
  }
  KVB_ASSIGN_OR_RETURN(Layout own, assemble(o, groups));
  Layout out = as_pp_stage(std::move(full), options.pp_size, options.pp_rank, held);
  out.tensors = std::move(own.tensors);
  for (size_t gi = 0; gi < out.groups.size(); ++gi) {
    size_t next = 0;  // the stage's layers come in the same order
    for (Layer& l : out.groups[gi].layers) {
      if (l.held) l = std::move(own.groups[gi].layers[next++]);
    }
  }
  return out;
}

}  // namespace

std::string_view order_name(Order order) {
  switch (order) {
    case Order::kLBHNC:
      return "LBHNC";
    case Order::kLBNHC:
      return "LBNHC";
    case Order::kBLHNC:
      return "BLHNC";
  }
  return "unknown";
}

Result<Order> parse_order(std::string_view name) {
  std::string upper(name);
  for (char& ch : upper) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  for (Order order : all_orders()) {
    if (order_name(order) == upper) return order;
  }
  return bad("unknown order '" + std::string(name) + "' (expected LBHNC, LBNHC or BLHNC)");
}

std::vector<Order> all_orders() { return {Order::kLBHNC, Order::kLBNHC, Order::kBLHNC}; }

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const PresetDef& d : presets()) names.emplace_back(d.name);
  return names;
}

std::string preset_summary(std::string_view name) {
  const PresetDef* def = find_preset(name);
  return def ? std::string(def->summary) : std::string();
}

Result<Layout> make_preset(const PresetOptions& options) {
  const PresetDef* def = find_preset(options.name);
  if (def == nullptr) {
    std::string known;
    for (const PresetDef& d : presets()) known += (known.empty() ? "" : ", ") + std::string(d.name);
    return Status::not_found("unknown preset '" + options.name + "'; known presets: " + known);
  }
  KVB_ASSIGN_OR_RETURN(Options o, resolve(options, *def));
  KVB_ASSIGN_OR_RETURN(std::vector<GroupSpec> groups, def->build(o));
  KVB_ASSIGN_OR_RETURN(Layout layout, assemble(o, groups));
  if (options.pp_size != 1 || options.pp_rank != 0) {
    KVB_ASSIGN_OR_RETURN(layout, pp_stage(o, options, std::move(groups), std::move(layout)));
  }
  if (options.dcp_size > 1) {
    layout.tp_size = options.tp_size;
    layout.tp_rank = options.tp_rank;
    for (Group& g : layout.groups) {
      if (g.kind != GroupKind::kAttention && g.kind != GroupKind::kSlidingWindow) continue;
      if (options.dcp_interleave % g.tokens_per_state != 0) {
        return bad("--dcp-interleave " + to_string(options.dcp_interleave) + ": group '" + g.name + "' keeps one " +
                   "position per " + to_string(g.tokens_per_state) + " tokens; the interleave must be a multiple");
      }
      g.context = {options.dcp_size, options.tp_rank % options.dcp_size, options.dcp_interleave / g.tokens_per_state};
    }
  }
  // The contract is that a preset always validates; a failure here is a bug
  // in this file, reported as such rather than handed out.
  Status valid = validate(layout);
  if (!valid.ok()) {
    return Status::internal("preset '" + o.model + "' built an invalid layout: " + valid.to_string());
  }
  return layout;
}

}  // namespace kvbridge
