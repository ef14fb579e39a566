// Regressions for the failures in the seed pull requests (shared/seeds/):
// kernel block j addressed as row j of a compressed indexer; two views with
// the same base address and different lengths; a tail view not covered by its
// allocation.
#include <gtest/gtest.h>

#include "kvbridge/plan.h"
#include "kvbridge/presets.h"
#include "kvbridge/verify.h"

namespace kvbridge {
namespace {

// A compressed indexer like GLM's kpool: 16-token logical blocks,
// tokens_per_state 4 (4 states per block) in kernel pages of 2 states (r = 2),
// 132-byte cells, one row per logical block; plus a 64-byte tail view at the
// start of each row (another group, same tensor, same base address).
Layout indexer(uint64_t row_padding = 0) {
  Layout l;
  l.model = "kpool";
  l.dtype = "fp8";
  const uint64_t page = 2 * 132, row = 2 * page + row_padding, blocks = 6;
  l.tensors = {{"idx", blocks * row, "host"}};
  Group g;
  g.name = "indexer";
  g.block_tokens = 16;
  g.tokens_per_state = 4;
  g.num_blocks = blocks;
  g.layers = {{"layers.0",
               {{"index",
                 "idx",
                 0,
                 132,
                 std::nullopt,
                 {{AxisKind::kBlock, blocks, row}, {AxisKind::kPosition, 2, page}, {AxisKind::kPosition, 2, 132}}}}}};
  Group tail;
  tail.name = "tail";
  tail.kind = GroupKind::kScratch;
  tail.prefix_cacheable = false;
  tail.block_tokens = 1;
  tail.num_blocks = blocks;
  tail.layers = {{"layers.0", {{"tail", "idx", 0, 64, std::nullopt, {{AxisKind::kBlock, blocks, row}}}}}};
  l.groups = {g, tail};
  EXPECT_TRUE(validate(l).ok()) << validate(l).to_string();
  return l;
}

TEST(SeedRegressionTest, KernelBlockJIsPageJOfItsLogicalRowNotRowJ) {
  // Remote rows are padded, local rows are not, so kernel page 1 of logical
  // block b is at b*row + page on each side; the naive expansion (kernel id
  // b*r + j addressed as row b*r + j) reads the wrong bytes.
  Layout local = indexer(0), remote = indexer(40);
  Request r;
  r.num_tokens = 32;  // 8 states = 2 logical blocks = 4 kernel pages
  r.blocks["indexer"] = {{0, 1}, {0, 1}};
  r.blocks["tail"] = {{5}, {5}};
  Result<Plan> p = plan(local, std::vector<Layout>{remote}, r);
  ASSERT_TRUE(p.has_value()) << p.error().to_string();
  ASSERT_TRUE(verify(*p, local, std::vector<Layout>{remote}, r).has_value());

  // The buggy scheme, written out: kernel block id k = b*2 + j addressed as
  // row k with one kernel page's length.
  Plan buggy;
  buggy.sources = p->sources;
  const uint64_t lrow = 2 * 264, rrow = 2 * 264 + 40;
  const int64_t lb[] = {0, 1}, rb[] = {0, 1};
  for (int i = 0; i < 2; ++i) {
    for (uint64_t j = 0; j < 2; ++j) {
      const uint64_t lk = lb[i] * 2 + j, rk = rb[i] * 2 + j;
      buggy.descriptors.push_back({0, 0, 0, 0, lk * lrow, rk * rrow, 264});
    }
  }
  buggy.descriptors.push_back({0, 0, 0, 0, 5 * lrow, 5 * rrow, 64});
  Result<VerifyReport> v = verify(buggy, local, std::vector<Layout>{remote}, r, false);
  ASSERT_FALSE(v.has_value());
  EXPECT_NE(v.error().message().find("component 'index'"), std::string::npos) << v.error().message();
}

TEST(SeedRegressionTest, ViewsWithTheSameBaseAddressKeepTheirOwnLengths) {
  // The tail (64 B) and the indexer rows (528 B) start at the same address of
  // one tensor. Keyed by address alone they would fold into one region and
  // one of them would be truncated; here each descriptor has its view's length.
  Layout l = indexer(0);
  Request r;
  r.num_tokens = 16;
  r.blocks["indexer"] = {{2}, {3}};
  r.blocks["tail"] = {{0}, {0}};
  Result<Plan> p = plan(l, std::vector<Layout>{l}, r);
  ASSERT_TRUE(p.has_value()) << p.error().to_string();
  ASSERT_TRUE(verify(*p, l, std::vector<Layout>{l}, r).has_value());
  ASSERT_EQ(p->descriptors.size(), 2u);
  EXPECT_EQ(p->descriptors[0].bytes, 64u);       // tail of block 0
  EXPECT_EQ(p->descriptors[1].bytes, 2u * 264);  // indexer row 2, whole
}

TEST(SeedRegressionTest, GlmTailOutsideItsAllocationIsRejectedNamingTheTail) {
  PresetOptions o;
  o.name = "glm5-flash";
  o.tp_size = 4;
  o.tp_rank = 1;
  Result<Layout> l = make_preset(o);
  ASSERT_TRUE(l.has_value()) << l.error().to_string();
  Layout broken = *l;
  bool moved = false;
  for (Group& g : broken.groups) {
    for (Layer& layer : g.layers) {
      for (Component& c : layer.components) {
        if (c.name == "tail" && !moved) {
          c.offset = broken.find_tensor(c.tensor)->bytes - 1024;  // half the tail hangs off the end
          moved = true;
        }
      }
    }
  }
  ASSERT_TRUE(moved);
  Status s = validate(broken);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("component 'tail'"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("past the end of tensor"), std::string::npos) << s.message();
}

TEST(SeedRegressionTest, GlmRequestWithIndexerTailAndStateVerifiesAcrossTp) {
  // The full GLM-5-Flash shape: P TP 2 (2304/64) -> D TP 4 (2304/128 kernel
  // pages), MLA + indexer + tail + overlaid state, each rank verified.
  std::vector<Layout> remotes;
  for (uint32_t r = 0; r < 2; ++r) {
    PresetOptions o{.name = "glm5-flash", .tp_size = 2, .tp_rank = r, .num_blocks = 24};
    Result<Layout> l = make_preset(o);
    ASSERT_TRUE(l.has_value()) << l.error().to_string();
    remotes.push_back(*l);
  }
  for (uint32_t r = 0; r < 4; ++r) {
    PresetOptions o{.name = "glm5-flash", .tp_size = 4, .tp_rank = r, .kernel_block_tokens = 128, .num_blocks = 24};
    Result<Layout> local = make_preset(o);
    ASSERT_TRUE(local.has_value()) << local.error().to_string();
    Request q;
    q.num_tokens = 5000;  // 3 logical blocks, the last partial
    q.skip_tokens = 0;
    int64_t state_block = 10;  // each overlaid state group owns its blocks
    for (const Group& g : local->groups) {
      if (g.kind == GroupKind::kScratch) {
        q.blocks[g.name] = {{9}, {12}};
      } else if (g.kind == GroupKind::kState) {
        q.blocks[g.name] = {{7, state_block}, {state_block + 1}};
        state_block += 2;
      } else {
        q.blocks[g.name] = {{1, 2, 3}, {4, 5, 6}};
      }
    }
    Result<Plan> p = plan(*local, remotes, q);
    ASSERT_TRUE(p.has_value()) << p.error().to_string();
    Result<VerifyReport> v = verify(*p, *local, remotes, q);
    ASSERT_TRUE(v.has_value()) << "rank " << r << ": " << v.error().to_string();
    EXPECT_GT(v->bytes_checked, 0u);
  }
}

}  // namespace
}  // namespace kvbridge
