#include "demo_blocks.h"

#include <algorithm>
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

Result<PoolSizes> size_pools(const DemoArgs& a) {
  PoolSizes out;
  KVB_ASSIGN_OR_RETURN(const Layout p1, layout_of(a, a.prefill, 1));
  KVB_ASSIGN_OR_RETURN(const Layout d1, layout_of(a, a.decode, 1));
  uint64_t max_block = 1;
  for (const Layout* l : {&p1, &d1}) {
    for (const Group& g : l->groups) {
      if (g.kind == GroupKind::kAttention || g.kind == GroupKind::kSlidingWindow) {
        max_block = std::max(max_block, g.block_tokens);
      }
    }
  }
  out.max_tokens = a.max_tokens ? a.max_tokens : std::min<uint64_t>(4096, std::max<uint64_t>(1024, 4 * max_block));
  if (a.min_tokens == 0 || a.min_tokens > out.max_tokens) {
    return Status::invalid_argument("--min-tokens " + std::to_string(a.min_tokens) + " must be from 1 to the " +
                                    std::to_string(out.max_tokens) + " tokens of the longest request");
  }
  auto need = [&](bool state_pool) {
    return std::max(blocks_per_request(p1, out.max_tokens, state_pool),
                    blocks_per_request(d1, out.max_tokens, state_pool));
  };
  const uint64_t need_blocks = need(false), need_state = need(true);
  out.num_blocks = a.num_blocks ? a.num_blocks : need_blocks + 2;
  if (out.num_blocks < need_blocks) {
    return Status::invalid_argument("--num-blocks " + std::to_string(out.num_blocks) + " is fewer than the " +
                                    std::to_string(need_blocks) + " blocks a request of " +
                                    std::to_string(out.max_tokens) + " tokens needs");
  }
  // State and scratch groups with tensors of their own take a slot per
  // request (qwen3-next's 2 MB of state per layer and block would otherwise
  // be sized by the longest request's blocks).
  out.state_blocks = need_state ? need_state + 2 : 0;
  KVB_ASSIGN_OR_RETURN(out.prefill, layout_of(a, a.prefill, out.num_blocks, out.state_blocks));
  KVB_ASSIGN_OR_RETURN(out.decode, layout_of(a, a.decode, out.num_blocks, out.state_blocks));
  return out;
}

}  // namespace kvbridge::cli::demo
