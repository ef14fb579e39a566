// Address arithmetic: cell_offset() against an independent computation for
// each physical order, mixed-radix kernel pages, and out-of-range indices.
#include <gtest/gtest.h>

#include <map>
#include <span>
#include <vector>

#include "kvbridge/layout.h"
#include "layout/test_layouts.h"

namespace kvbridge {
namespace {

struct Dims {
  uint64_t L = 3, B = 5, H = 4, N = 8, C = 32;
};

// One component "k" of layer l whose tensor is laid out in `order`, written as
// the physical nesting of L, B, H, N (C innermost).
Component view(const std::string& order, const Dims& d, uint64_t layer) {
  std::map<char, uint64_t> size{{'L', d.L}, {'B', d.B}, {'H', d.H}, {'N', d.N}};
  std::map<char, uint64_t> stride;
  uint64_t s = d.C;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    stride[*it] = s;
    s *= size[*it];
  }
  Component c;
  c.name = "k";
  c.tensor = "kv";
  c.cell_bytes = d.C;
  c.offset = layer * stride['L'];
  c.heads = HeadMap{static_cast<uint32_t>(d.H), 0, static_cast<uint32_t>(d.H)};
  // Axis order in the list deliberately differs from the physical order.
  c.axes = {{AxisKind::kPosition, d.N, stride['N']},
            {AxisKind::kHead, d.H, stride['H']},
            {AxisKind::kBlock, d.B, stride['B']}};
  return c;
}

class CellOffsetTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CellOffsetTest, MatchesRowMajorIndexForEveryAxisOrder) {
  const std::string order = GetParam();  // e.g. "LBHN": C is innermost
  Dims d;
  for (uint64_t l = 0; l < d.L; ++l) {
    Component c = view(order, d, l);
    for (uint64_t b = 0; b < d.B; ++b)
      for (uint64_t h = 0; h < d.H; ++h)
        for (uint64_t n = 0; n < d.N; ++n) {
          // Independent: row-major linear index over the physical order.
          std::map<char, uint64_t> idx{{'L', l}, {'B', b}, {'H', h}, {'N', n}};
          std::map<char, uint64_t> size{{'L', d.L}, {'B', d.B}, {'H', d.H}, {'N', d.N}};
          uint64_t linear = 0;
          for (char ch : order) linear = linear * size[ch] + idx[ch];
          Result<uint64_t> off = cell_offset(c, {b, h, n});
          ASSERT_TRUE(off.has_value()) << off.error().to_string();
          EXPECT_EQ(*off, linear * d.C) << order << " l=" << l << " b=" << b << " h=" << h << " n=" << n;
        }
  }
}

INSTANTIATE_TEST_SUITE_P(Orders, CellOffsetTest, ::testing::Values("LBHN", "LBNH", "BLHN", "BLNH", "LHBN", "BHLN"));

TEST(CellOffsetTest2, SplitsPositionsOverKernelPagesOutermostFirst) {
  // A logical block of 3 kernel pages of 4 positions; heads sit between the
  // page axis and the position axis ([block][page][head][n][C]), with 8 bytes
  // of padding after each page.
  Component c;
  c.name = "index";
  c.tensor = "t";
  c.cell_bytes = 10;
  c.heads = HeadMap{2, 0, 2};
  const uint64_t page = 2 * 4 * 10 + 8;
  c.axes = {{AxisKind::kBlock, 7, 3 * page},
            {AxisKind::kPosition, 3, page},
            {AxisKind::kHead, 2, 40},
            {AxisKind::kPosition, 4, 10}};
  EXPECT_EQ(c.positions_per_block(), 12u);
  for (uint64_t p = 0; p < 12; ++p) {
    uint64_t expect = 2 * 3 * page + (p / 4) * page + 1 * 40 + (p % 4) * 10;
    EXPECT_EQ(*cell_offset(c, {2, 1, p}), expect) << "position " << p;
  }
  EXPECT_EQ(position_axes(c).offset_of(9), 2 * page + 10);
}

TEST(CellOffsetTest2, KernelBlockJIsPageJNotRowJ) {
  // The seed bug: kernel block j of a logical row was addressed as row j.
  // Here row 1 starts at 36 pages; kernel page 1 of row 0 starts at 1 page.
  Component c;
  c.name = "index";
  c.tensor = "idx";
  c.cell_bytes = 132;
  const uint64_t page = 16 * 132;
  c.axes = {{AxisKind::kBlock, 4, 36 * page}, {AxisKind::kPosition, 36, page}, {AxisKind::kPosition, 16, 132}};
  EXPECT_EQ(*cell_offset(c, {0, 0, 16}), page);
  EXPECT_NE(*cell_offset(c, {0, 0, 16}), *cell_offset(c, {1, 0, 0}));
  EXPECT_EQ(*cell_offset(c, {1, 0, 0}), 36 * page);
}

TEST(CellOffsetTest2, RejectsIndicesPastTheirAxis) {
  Layout l = testing::small_gqa();
  const Component& k = l.groups[0].layers[0].components[0];
  Result<uint64_t> r = cell_offset(k, {8, 0, 0});
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), Code::kOutOfRange);
  EXPECT_NE(r.error().message().find("block index 8"), std::string::npos) << r.error().message();
  EXPECT_FALSE(cell_offset(k, {0, 4, 0}));
  r = cell_offset(k, {0, 0, 4});
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("position"), std::string::npos);
}

TEST(CellOffsetTest2, ReplicatedComponentHasOnlyHeadZero) {
  Layout l = testing::small_gqa();
  Component c = l.groups[0].layers[0].components[0];
  c.heads.reset();
  c.axes.erase(c.axes.begin() + 1);
  EXPECT_TRUE(cell_offset(c, {1, 0, 1}).has_value());
  EXPECT_FALSE(cell_offset(c, {1, 1, 1}).has_value());
}

TEST(LayoutModelTest, EmptyComponentsAreRecognised) {
  Layout l = testing::small_gqa();
  Component c = l.groups[0].layers[0].components[0];
  EXPECT_FALSE(c.empty());
  c.cell_bytes = 0;
  EXPECT_TRUE(c.empty());
  c.cell_bytes = 16;
  c.heads->count = 0;
  c.axes[1].size = 0;
  EXPECT_TRUE(c.empty());
}

TEST(LayoutModelTest, KindNamesRoundTrip) {
  for (GroupKind k : {GroupKind::kAttention, GroupKind::kSlidingWindow, GroupKind::kState, GroupKind::kScratch}) {
    EXPECT_EQ(parse_group_kind(group_kind_name(k)), k);
  }
  EXPECT_FALSE(parse_group_kind("mamba").has_value());
  for (AxisKind k : {AxisKind::kBlock, AxisKind::kHead, AxisKind::kPosition}) {
    EXPECT_EQ(parse_axis_kind(axis_kind_name(k)), k);
  }
  EXPECT_FALSE(parse_axis_kind("layer").has_value());
}

TEST(LayoutModelTest, TokenTLivesInEntryTOverBlockTokens) {
  Group g;
  g.kind = GroupKind::kAttention;
  g.block_tokens = 16;
  EXPECT_EQ(g.slot_of_token(0), (BlockSlot{0, 0}));
  EXPECT_EQ(g.slot_of_token(15), (BlockSlot{0, 15}));
  EXPECT_EQ(g.slot_of_token(16), (BlockSlot{1, 0}));
  EXPECT_EQ(g.slot_of_token(37), (BlockSlot{2, 5}));
  EXPECT_EQ(g.entries_for_tokens(0), 0u);
  EXPECT_EQ(g.entries_for_tokens(1), 1u);
  EXPECT_EQ(g.entries_for_tokens(16), 1u);
  EXPECT_EQ(g.entries_for_tokens(17), 2u);
  // A state group's final state for 144 tokens of 64-token blocks: entry 2.
  g.kind = GroupKind::kState;
  g.block_tokens = 64;
  EXPECT_EQ(g.entries_for_tokens(144) - 1, 2u);
  EXPECT_EQ(g.entries_for_tokens(128) - 1, 1u);
}

// Every position is on exactly one shard, numbered densely there: the
// shards' numbers of [0, n) are [0, count(n, s)) each, and global_of()
// undoes local_of().
TEST(LayoutModelTest, ContextShardsDealEveryPositionOnceAndNumberThemDensely) {
  for (uint32_t size : {1u, 2u, 3u, 4u}) {
    for (uint64_t interleave : {1u, 2u, 5u, 16u}) {
      for (uint64_t n : {0u, 1u, 7u, 64u, 101u}) {
        std::vector<uint64_t> next(size, 0);
        for (uint64_t p = 0; p < n; ++p) {
          ContextShard any{size, 0, interleave};
          const uint32_t s = any.shard_of(p);
          ASSERT_LT(s, size);
          ContextShard own{size, s, interleave};
          EXPECT_TRUE(own.holds(p));
          EXPECT_EQ(own.local_of(p), next[s]) << "size " << size << " interleave " << interleave << " p " << p;
          EXPECT_EQ(own.global_of(next[s]), p);
          ++next[s];
        }
        for (uint32_t s = 0; s < size; ++s) EXPECT_EQ(ContextShard({size, 0, interleave}).count(n, s), next[s]);
      }
    }
  }
}

// vLLM's decode-context-parallel slot of token t (virtual block of
// block_size * dcp tokens; offset within the rank's block) is the group's.
TEST(LayoutModelTest, AContextShardedTokenLivesWhereVllmsDcpSlotMappingPutsIt) {
  Group g;
  g.kind = GroupKind::kAttention;
  g.block_tokens = 16;
  for (uint32_t dcp : {2u, 4u}) {
    for (uint64_t interleave : {1u, 4u, 16u}) {
      g.context = {dcp, 0, interleave};
      for (uint64_t t = 0; t < 300; ++t) {
        const uint64_t vbs = g.block_tokens * dcp, vo = t % vbs;
        const uint64_t entry = t / vbs;
        const uint64_t offset = vo / (dcp * interleave) * interleave + vo % interleave;
        EXPECT_EQ(g.context.shard_of(t), vo / interleave % dcp);
        EXPECT_EQ(g.slot_of_token(t), (BlockSlot{entry, offset})) << "dcp " << dcp << " I " << interleave << " t " << t;
      }
      for (uint64_t n : {0u, 1u, 31u, 32u, 33u, 300u}) {
        EXPECT_EQ(g.entries_for_tokens(n), (n + g.block_tokens * dcp - 1) / (g.block_tokens * dcp));
      }
    }
  }
}

TEST(LayoutModelTest, GroupsSharingATensorAreAnOverlay) {
  Layout l = testing::small_gqa();
  EXPECT_FALSE(has_overlay(l));
  Group second = l.groups[0];
  second.name = "swa";
  l.groups.push_back(second);  // the same tensors as "full"
  EXPECT_TRUE(has_overlay(l));
  for (Layer& layer : l.groups[1].layers) {
    for (Component& c : layer.components) c.tensor += ".swa";
  }
  EXPECT_FALSE(has_overlay(l));
}

TEST(LayoutModelTest, KeepLayersEmptiesEveryOtherLayersCellsAndStaysValid) {
  const Layout l = testing::small_gqa();
  ASSERT_GE(l.groups[0].layers.size(), 2u);
  const std::string first = l.groups[0].layers[0].name;
  const Layout kept = keep_layers(l, {first});
  EXPECT_TRUE(validate(kept).ok()) << validate(kept).to_string();
  for (size_t i = 0; i < kept.groups[0].layers.size(); ++i) {
    for (size_t c = 0; c < kept.groups[0].layers[i].components.size(); ++c) {
      const Component& got = kept.groups[0].layers[i].components[c];
      const Component& was = l.groups[0].layers[i].components[c];
      EXPECT_EQ(got.cell_bytes, i == 0 ? was.cell_bytes : 0u) << kept.groups[0].layers[i].name;
      EXPECT_EQ(got.offset, was.offset);  // same addresses for what is kept
    }
  }
  EXPECT_EQ(kept.tensors, l.tensors);
  EXPECT_TRUE(keep_layers(l, {}).groups[0].layers[0].components[0].empty());
}

TEST(LayoutModelTest, MemoryMustMatchTheTensorsOneSpanEach) {
  Layout l = testing::small_gqa(2);
  std::vector<std::vector<uint8_t>> bytes;
  for (const Tensor& t : l.tensors) bytes.emplace_back(t.bytes);
  std::vector<std::span<uint8_t>> spans(bytes.begin(), bytes.end());
  EXPECT_TRUE(check_memory(l, spans).ok());
  Status few = check_memory(l, TensorMemory(spans).first(1));
  EXPECT_EQ(few.code(), Code::kInvalidArgument);
  EXPECT_EQ(few.message(), "memory for 1 tensors given, the layout has 2");
  spans[1] = spans[1].first(100);
  Status small = check_memory(l, spans);
  EXPECT_EQ(small.code(), Code::kInvalidArgument);
  EXPECT_EQ(small.message(),
            "memory for tensor 'kv.1' is 100 bytes, the layout says " + std::to_string(l.tensors[1].bytes));
}

}  // namespace
}  // namespace kvbridge
