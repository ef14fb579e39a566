// Small hand-built layouts shared by the layout tests. Test-only.
#pragma once

#include "kvbridge/layout.h"

namespace kvbridge::testing {

// One attention group "full" of `layers` layers with components k and v, each
// of `heads` local heads out of `total_heads`, starting at `first_head`, 16-byte
// cells, `positions` tokens per block and `num_blocks` blocks, in one tensor per
// layer laid out as [block][head][position][k|v] (LBHNC, K/V packed).
inline Layout small_gqa(uint32_t layers = 2, uint32_t total_heads = 4, uint32_t heads = 4, uint32_t first_head = 0,
                        uint64_t positions = 4, uint64_t num_blocks = 8) {
  Layout l;
  l.model = "tiny-gqa";
  l.dtype = "bf16";
  const uint64_t cell = 16;
  const uint64_t pos_stride = 2 * cell;
  const uint64_t head_stride = positions * pos_stride;
  const uint64_t block_stride = heads * head_stride;
  Group g;
  g.name = "full";
  g.kind = GroupKind::kAttention;
  g.block_tokens = positions;
  g.num_blocks = num_blocks;
  for (uint32_t i = 0; i < layers; ++i) {
    std::string t = "kv." + std::to_string(i);
    l.tensors.push_back({t, block_stride * num_blocks, "host"});
    Layer layer{"layers." + std::to_string(i), {}};
    for (int kv = 0; kv < 2; ++kv) {
      Component c;
      c.name = kv == 0 ? "k" : "v";
      c.tensor = t;
      c.offset = kv * cell;
      c.cell_bytes = cell;
      c.heads = HeadMap{total_heads, first_head, heads};
      c.axes = {{AxisKind::kBlock, num_blocks, block_stride},
                {AxisKind::kHead, heads, head_stride},
                {AxisKind::kPosition, positions, pos_stride}};
      layer.components.push_back(c);
    }
    g.layers.push_back(layer);
  }
  l.groups.push_back(g);
  return l;
}

}  // namespace kvbridge::testing
