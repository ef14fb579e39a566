// Test-only helpers for the store tests: rank memory for a preset layout,
// requests with consecutive block ids, tokens, and content checks that skip
// the groups the store never keeps.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include <gtest/gtest.h>

#include "kvbridge/content.h"
#include "kvbridge/presets.h"
#include "kvbridge/store.h"
#include "store/canonical.h"

namespace kvbridge::testing {

struct RankMemory {
  Layout layout;
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<std::span<uint8_t>> spans;
  explicit RankMemory(Layout l) : layout(std::move(l)) {
    for (const Tensor& t : layout.tensors) bytes.emplace_back(t.bytes, uint8_t{0});
    for (auto& b : bytes) spans.emplace_back(b);
  }
  TensorMemory memory() { return TensorMemory(spans); }
};

inline Layout preset(const std::string& name, uint32_t tp, uint32_t rank, uint64_t block_tokens, uint64_t num_blocks,
                     Order order = Order::kLBHNC) {
  PresetOptions o;
  o.name = name;
  o.tp_size = tp;
  o.tp_rank = rank;
  o.block_tokens = block_tokens;
  o.num_blocks = num_blocks;
  o.order = order;
  Result<Layout> l = make_preset(o);
  EXPECT_TRUE(l.ok()) << l.status().to_string();
  return l.ok() ? *l : Layout{};
}

// Every group's list covers num_tokens (one block for scratch) with
// consecutive ids from `first` + (group index) * `stride`; a stride keeps
// groups that overlay one tensor (gpt-oss, glm5-flash) off each other's blocks.
inline Request make_request(const Layout& l, uint64_t num_tokens, int64_t first = 0, int64_t stride = 0) {
  Request r;
  r.num_tokens = num_tokens;
  for (size_t gi = 0; gi < l.groups.size(); ++gi) {
    const Group& g = l.groups[gi];
    if (!g.transfer) continue;
    const int64_t base = first + static_cast<int64_t>(gi) * stride;
    GroupBlocks& b = r.blocks[g.name];
    const uint64_t n = g.kind == GroupKind::kScratch ? 1 : (num_tokens + g.block_tokens - 1) / g.block_tokens;
    for (uint64_t i = 0; i < n; ++i) b.local.push_back(base + static_cast<int64_t>(i));
    b.remote = b.local;
  }
  return r;
}

// The layout with only the groups the store keeps transferable: what a get
// writes, for check_request.
inline Layout stored_view(Layout l) {
  for (Group& g : l.groups) g.transfer = store_internal::is_stored(g);
  return l;
}

inline std::vector<uint32_t> tokens(uint64_t seed, uint64_t n) {
  std::mt19937_64 rng(seed);
  std::vector<uint32_t> t(n);
  for (auto& x : t) x = static_cast<uint32_t>(rng() % 150000);
  return t;
}

}  // namespace kvbridge::testing
