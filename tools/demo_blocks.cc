#include "demo_blocks.h"

#include <regex>
#include <set>
#include <string>

#include "kvbridge/presets.h"

namespace kvbridge::cli::demo {
namespace {

// The preset's error names its own options (--tp 3: ...); the demo's are
// per side (--prefill-tp 3: ...).
Status on_side(const Status& s, const char* side) {
  static const std::regex kOption("--(tp|pp|dcp|dcp-interleave|block-tokens|kernel-block-tokens)\\b(?!-)");
  return Status(s.code(), std::regex_replace(s.message(), kOption, std::string("--") + side + "-$1"))
      .with_context(side);
}

}  // namespace

Result<Layout> layout_of(const DemoArgs& a, const SideArgs& s, uint64_t num_blocks, uint64_t state_blocks) {
  const char* side = &s == &a.prefill ? "prefill" : "decode";
  PresetOptions p;
  p.name = a.preset;
  p.tp_size = s.tp;
  p.dcp_size = s.dcp;
  p.dcp_interleave = s.dcp_interleave;
  p.block_tokens = s.block_tokens;
  p.kernel_block_tokens = s.kernel_block_tokens;
  Result<Order> order = parse_order(s.order);
  if (!order.ok()) return on_side(order.error(), side);
  p.order = *order;
  p.num_blocks = num_blocks;
  p.state_blocks = state_blocks;
  Result<Layout> l = make_preset(p);
  if (!l.ok()) return on_side(l.error(), side);
  return l;
}

std::set<std::string> state_pool_groups(const Layout& l) {
  std::set<std::string> token_tensors, out;
  for (const Group& g : l.groups) {
    if (one_block_per_request(g.kind)) continue;
    for (const Layer& layer : g.layers) {
      for (const Component& c : layer.components) token_tensors.insert(c.tensor);
    }
  }
  for (const Group& g : l.groups) {
    bool own = one_block_per_request(g.kind);
    for (const Layer& layer : g.layers) {
      for (const Component& c : layer.components) own = own && !token_tensors.contains(c.tensor);
    }
    if (own) out.insert(g.name);
  }
  return out;
}

uint64_t blocks_for(const Group& g, uint64_t tokens) {
  if (one_block_per_request(g.kind)) return 1;
  return g.entries_for_tokens(tokens);  // a context shard's share
}

uint64_t blocks_per_request(const Layout& l, uint64_t tokens, bool state_pool) {
  const std::set<std::string> pooled = state_pool_groups(l);
  uint64_t n = 0;
  for (const Group& g : l.groups) n += g.transfer && pooled.contains(g.name) == state_pool ? blocks_for(g, tokens) : 0;
  return n;
}

}  // namespace kvbridge::cli::demo
