// The preset tests' helpers (presets_test.cc, presets_models_test.cc).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kvbridge/layout.h"
#include "kvbridge/presets.h"

namespace kvbridge::presets_testing {

// A block size other than the default that each preset must take at TP 1..8
// (an input of the tests, chosen from docs/presets.md).
inline uint64_t other_block_tokens(const std::string& name) {
  static const std::map<std::string, uint64_t> blocks = {
      {"llama3-8b", 32},    {"llama3-70b", 32},  {"deepseek-v3", 128}, {"deepseek-v3.2", 128},
      {"glm5-flash", 1152}, {"qwen3-next", 128}, {"gpt-oss", 32},      {"mla-with-draft", 128},
  };
  auto it = blocks.find(name);
  return it == blocks.end() ? 0 : it->second;
}

inline PresetOptions options(const std::string& name, uint32_t tp = 1, uint32_t rank = 0, Order order = Order::kLBHNC,
                             uint64_t block_tokens = 0) {
  PresetOptions o;
  o.name = name;
  o.tp_size = tp;
  o.tp_rank = rank;
  o.order = order;
  o.block_tokens = block_tokens;
  o.num_blocks = 8;  // small, so that tests that walk blocks stay fast
  return o;
}

inline Layout make(const PresetOptions& o) {
  Result<Layout> layout = make_preset(o);
  EXPECT_TRUE(layout.ok()) << o.name << " tp " << o.tp_size << " rank " << o.tp_rank << ": "
                           << layout.status().to_string();
  return layout.ok() ? std::move(layout).value() : Layout{};
}

inline const Layer* find_layer(const Group& group, const std::string& name) {
  for (const Layer& l : group.layers) {
    if (l.name == name) return &l;
  }
  return nullptr;
}

inline const Component* find_component(const Layer& layer, const std::string& name) {
  for (const Component& c : layer.components) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

inline uint64_t offset_of(const Component& c, uint64_t block, uint64_t head, uint64_t position) {
  Result<uint64_t> off = cell_offset(c, CellIndex{block, head, position});
  EXPECT_TRUE(off.ok()) << c.name << ": " << off.status().to_string();
  return off.ok() ? *off : 0;
}

// Byte ranges [begin, end) of every cell of one block of a component.
inline std::vector<std::pair<uint64_t, uint64_t>> block_cells(const Component& c, uint64_t block) {
  std::vector<std::pair<uint64_t, uint64_t>> cells;
  for (uint64_t h = 0; h < c.local_heads(); ++h) {
    for (uint64_t p = 0; p < c.positions_per_block(); ++p) {
      const uint64_t at = offset_of(c, block, h, p);
      cells.emplace_back(at, at + c.cell_bytes);
    }
  }
  std::sort(cells.begin(), cells.end());
  return cells;
}

}  // namespace kvbridge::presets_testing
