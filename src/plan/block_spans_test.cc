// block_spans() (layout.h) over random layouts of every shape the planner's
// property tests make (random_layout.h: any nesting order, padding, kernel
// pages, overlays, PP stages, context shards): the spans of some blocks are
// exactly the bytes of those blocks' cells, no byte of another block of the
// group and no padding; block_places() names the same bytes, repeating
// one tensor's spans in the others.
#include <gtest/gtest.h>

#include "plan/property_support.h"

namespace kvbridge {
namespace {

using namespace ::kvbridge::property;

TEST(BlockSpansTest, TheSpansOfSomeBlocksAreExactlyTheirCellsInRandomLayouts) {
  uint64_t checked = 0, repeated = 0;
  for (uint64_t i : case_indices(std::min<uint64_t>(num_cases(), 300))) {
    gen::Rng rng(gen::case_seed(base_seed() ^ 0xb10c, i));
    const Case c = make_case(base_seed(), i, rng);
    const Layout& l = c.local;
    uint64_t total = 0;
    for (const Tensor& t : l.tensors) total += t.bytes;
    if (total > (uint64_t{64} << 20)) continue;
    for (const Group& g : l.groups) {
      std::vector<int64_t> chosen;
      for (uint64_t b = 0; b < g.num_blocks; ++b) {
        if (gen::chance(rng, 30)) chosen.push_back(static_cast<int64_t>(b));
      }
      if (gen::chance(rng, 20)) chosen.push_back(-1);
      // Each tensor byte: 0 no cell of the group, 1 a chosen block's cell, 2 another block's.
      std::vector<std::vector<uint8_t>> mark(l.tensors.size());
      for (size_t t = 0; t < l.tensors.size(); ++t) mark[t].assign(l.tensors[t].bytes, 0);
      uint64_t chosen_bytes = 0;
      std::vector<bool> is_chosen(g.num_blocks, false);
      for (int64_t b : chosen) {
        if (b >= 0) is_chosen[static_cast<size_t>(b)] = true;
      }
      for (const Layer& layer : g.layers) {
        if (!layer.held) continue;
        for (const Component& comp : layer.components) {
          if (comp.empty()) continue;
          size_t t = 0;
          while (l.tensors[t].name != comp.tensor) ++t;
          for (uint64_t b = 0; b < g.num_blocks; ++b) {
            for (uint64_t h = 0; h < comp.local_heads(); ++h) {
              for (uint64_t p = 0; p < comp.positions_per_block(); ++p) {
                Result<uint64_t> at = cell_offset(comp, {b, h, p});
                ASSERT_TRUE(at.ok()) << at.error().message();
                for (uint64_t k = 0; k < comp.cell_bytes; ++k) mark[t][*at + k] = is_chosen[b] ? 1 : 2;
                if (is_chosen[b]) chosen_bytes += comp.cell_bytes;
              }
            }
          }
        }
      }
      Result<std::vector<TensorSpan>> spans = block_spans(l, g, chosen);
      ASSERT_TRUE(spans.ok()) << spans.error().message();
      uint64_t covered = 0;
      for (size_t k = 0; k < spans->size(); ++k) {
        const TensorSpan& s = (*spans)[k];
        ASSERT_LT(s.tensor, l.tensors.size());
        ASSERT_LE(s.offset + s.bytes, l.tensors[s.tensor].bytes) << c.describe();
        if (k > 0) {
          const TensorSpan& prev = (*spans)[k - 1];
          ASSERT_TRUE(prev.tensor < s.tensor || prev.offset + prev.bytes < s.offset)
              << c.describe() << ": spans " << k - 1 << " and " << k << " touch or are out of order";
        }
        for (uint64_t x = s.offset; x < s.offset + s.bytes; ++x) {
          ASSERT_EQ(mark[s.tensor][x], 1)
              << c.describe() << " group '" << g.name << "': byte " << x << " of tensor '" << l.tensors[s.tensor].name
              << "' is in a span and " << (mark[s.tensor][x] == 2 ? "another block's" : "no block's");
          mark[s.tensor][x] = 3;
        }
        covered += s.bytes;
      }
      for (size_t t = 0; t < mark.size(); ++t) {
        for (uint64_t x = 0; x < mark[t].size(); ++x) {
          ASSERT_NE(mark[t][x], 1) << c.describe() << " group '" << g.name << "': byte " << x << " of tensor '"
                                   << l.tensors[t].name << "' is a chosen block's and in no span";
        }
      }
      EXPECT_LE(covered, chosen_bytes);  // overlays: another group's cells are not counted here
      // block_places(): the same bytes (now marked 3), spans and repeats.
      Result<BlockPlaces> places = block_places(l, g, chosen);
      ASSERT_TRUE(places.ok()) << places.error().message();
      std::vector<std::vector<uint8_t>> seen(l.tensors.size());
      for (size_t t = 0; t < l.tensors.size(); ++t) seen[t].assign(l.tensors[t].bytes, 0);
      auto see = [&](uint32_t tensor, uint64_t offset, uint64_t bytes) {
        ASSERT_LT(tensor, l.tensors.size());
        ASSERT_LE(offset + bytes, l.tensors[tensor].bytes) << c.describe();
        for (uint64_t x = offset; x < offset + bytes; ++x) {
          ASSERT_EQ(mark[tensor][x], 3) << c.describe() << " group '" << g.name << "': block_places names byte " << x
                                        << " of tensor '" << l.tensors[tensor].name << "', no chosen block's";
          seen[tensor][x] = 1;
        }
      };
      for (const TensorSpan& s : places->spans) see(s.tensor, s.offset, s.bytes);
      for (const BlockPlaces::Repeat& r : places->repeats) {
        ASSERT_LE(r.first + r.count, places->spans.size());
        for (uint64_t k = r.first; k < r.first + r.count; ++k) {
          see(r.tensor, places->spans[k].offset + r.shift, places->spans[k].bytes);
        }
      }
      for (size_t t = 0; t < mark.size(); ++t) {
        for (uint64_t x = 0; x < mark[t].size(); ++x) {
          ASSERT_EQ(seen[t][x] == 1, mark[t][x] == 3) << c.describe() << " group '" << g.name << "': byte " << x
                                                      << " of tensor '" << l.tensors[t].name << "' not in block_places";
        }
      }
      repeated += places->repeats.size();
      ++checked;
    }
  }
  EXPECT_GT(checked, 200u);
  EXPECT_GT(repeated, checked) << "the cases' groups have layers of one shape: block_places repeats them";
}

TEST(BlockSpansTest, ABlockPastTheGroupIsRefusedByName) {
  gen::Rng rng(gen::case_seed(base_seed(), 1));
  const Case c = make_case(base_seed(), 1, rng);
  const Group& g = c.local.groups.front();
  const std::vector<int64_t> blocks{0, static_cast<int64_t>(g.num_blocks)};
  Result<std::vector<TensorSpan>> spans = block_spans(c.local, g, blocks);
  ASSERT_EQ(spans.status().code(), Code::kOutOfRange);
  EXPECT_EQ(spans.error().message(), "group '" + g.name + "': block " + std::to_string(g.num_blocks) +
                                         " is not below " + std::to_string(g.num_blocks) + " blocks");
}

}  // namespace
}  // namespace kvbridge
