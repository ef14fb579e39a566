// Hand-written plans with known descriptor counts. Each test writes down the
// arithmetic; every plan is also checked by the verifier.
#include <gtest/gtest.h>

#include <algorithm>

#include "kvbridge/plan.h"
#include "kvbridge/verify.h"
#include "layout/test_layouts.h"

namespace kvbridge {
namespace {

using testing::small_gqa;

// small_gqa: 2 layers, one tensor per layer laid out [block][head][pos][k|v],
// 16-byte k and v cells (a 32-byte fused cell), 4 heads, 4 positions per block.

Request req(uint64_t tokens, std::vector<int64_t> local, std::vector<int64_t> remote, uint64_t skip = 0,
            const std::string& group = "full") {
  Request r;
  r.num_tokens = tokens;
  r.skip_tokens = skip;
  r.blocks[group] = {std::move(local), std::move(remote)};
  return r;
}

// TP `tp` rank `rank` of a 4-head small_gqa.
Layout rank_of(uint32_t tp, uint32_t rank, uint64_t positions = 4, uint64_t num_blocks = 8) {
  Layout l = small_gqa(2, 4, 4 / tp, rank * (4 / tp), positions, num_blocks);
  l.tp_size = tp;
  l.tp_rank = rank;
  return l;
}

Plan checked_plan(const Layout& local, const std::vector<Layout>& remotes, const Request& r) {
  Result<Plan> p = plan(local, remotes, r);
  EXPECT_TRUE(p.has_value()) << p.error().to_string();
  if (!p) return {};
  Result<VerifyReport> v = verify(*p, local, remotes, r);
  EXPECT_TRUE(v.has_value()) << v.error().to_string();
  if (v) {
    EXPECT_EQ(v->bytes_checked, p->bytes);
  }
  return *p;
}

TEST(PlannerTest, ConsecutiveBlocksOnBothSidesGiveOneDescriptorPerLayer) {
  // 12 tokens = 3 blocks; K|V packed and all heads: a block is one 512-byte
  // page, and blocks 0..2 <- 4..6 are contiguous on both sides: 1 per layer.
  Layout l = rank_of(1, 0);
  Plan p = checked_plan(l, {l}, req(12, {0, 1, 2}, {4, 5, 6}));
  EXPECT_EQ(p.descriptors.size(), 2u);
  EXPECT_EQ(p.bytes, 2u * 12 * 4 * 32);
  EXPECT_EQ(p.descriptors[0].bytes, 3u * 512);
  EXPECT_EQ(p.descriptors[0].remote_offset, 4u * 512);
}

TEST(PlannerTest, MergesOnlyBlocksConsecutiveOnBothSides) {
  // Remote 6,4,5: pairs (0,6) alone, (1,4)(2,5) merge: 2 per layer.
  Layout l = rank_of(1, 0);
  Plan p = checked_plan(l, {l}, req(12, {0, 1, 2}, {6, 4, 5}));
  EXPECT_EQ(p.descriptors.size(), 4u);
}

TEST(PlannerTest, ShuffledLocalIdsStillMergeWhatIsContiguous) {
  // Local 2,0,1 <- remote 7,5,6: sorted by local id, (0,5)(1,6)(2,7) are one
  // run on both sides: 1 per layer.
  Layout l = rank_of(1, 0);
  Plan p = checked_plan(l, {l}, req(12, {2, 0, 1}, {7, 5, 6}));
  EXPECT_EQ(p.descriptors.size(), 2u);
}

TEST(PlannerTest, TpOneToTpFourGivesEachRankItsQuarterOfTheHeads) {
  // Local rank r holds head r: its block page is 4 pos x 32 B = 128 B; the
  // remote holds that head's 128 B inside a 512 B page, so consecutive blocks
  // are contiguous locally but not remotely: 2 layers x 3 blocks = 6.
  Layout remote = rank_of(1, 0);
  for (uint32_t r = 0; r < 4; ++r) {
    Layout local = rank_of(4, r);
    Plan p = checked_plan(local, {remote}, req(12, {0, 1, 2}, {4, 5, 6}));
    EXPECT_EQ(p.descriptors.size(), 6u) << "rank " << r;
    EXPECT_EQ(p.bytes, 2u * 12 * 32) << "rank " << r;
    for (const Descriptor& d : p.descriptors) EXPECT_EQ(d.remote_offset % 512, r * 128u);
  }
}

TEST(PlannerTest, TpFourToTpOneReadsEachHeadFromItsRank) {
  // Remote rank r holds head r in 128 B pages, contiguous over consecutive
  // blocks; locally head r of one block is 128 B within a 512 B page: one
  // descriptor per (layer, head, block) = 2 x 4 x 3 = 24, 6 per source.
  std::vector<Layout> remotes;
  for (uint32_t r = 0; r < 4; ++r) remotes.push_back(rank_of(4, 3 - r));  // any order
  Plan p = checked_plan(rank_of(1, 0), remotes, req(12, {0, 1, 2}, {4, 5, 6}));
  EXPECT_EQ(p.descriptors.size(), 24u);
  ASSERT_EQ(p.sources.size(), 4u);
  for (const SourceTotals& s : p.sources) {
    EXPECT_EQ(s.descriptors, 6u);
    EXPECT_EQ(s.bytes, 2u * 12 * 32);
  }
  EXPECT_EQ(p.sources[0].tp_rank, 3u);
}

TEST(PlannerTest, DifferentBlockSizesMatchByPositionNotBlockIndex) {
  // Local 4 positions per block, remote 8. Pages are [head][pos], so a local
  // block's head slice (4 pos, 128 B) is contiguous on both sides but the next
  // head is not: 16 tokens = 4 local blocks x 4 heads x 2 layers = 32 pieces.
  // One pair per layer still merges: local block 1 head 3 ends where local
  // block 2 head 0 begins, and remotely block 2 head 3 (positions 4..7) ends
  // where block 3 head 0 (positions 8..11) begins. 32 - 2 = 30.
  Layout local = rank_of(1, 0, 4);
  Layout remote = rank_of(1, 0, 8);
  Plan p = checked_plan(local, {remote}, req(16, {0, 1, 2, 3}, {2, 3}));
  EXPECT_EQ(p.descriptors.size(), 30u);
  EXPECT_EQ(p.bytes, 2u * 16 * 4 * 32);
}

TEST(PlannerTest, SkipTokensMovesOnlyTheRestIncludingAPartialFirstBlock) {
  // 12 tokens, 5 cached: positions 5..11. Block 1 moves positions 1..3 of each
  // head (4 pieces of 96 B); the last (head 3) ends where block 2 begins, and
  // block 2 is contiguous: 4 descriptors per layer, 7 x 4 x 32 B each layer.
  Layout l = rank_of(1, 0);
  Plan p = checked_plan(l, {l}, req(12, {-1, 1, 2}, {-1, 5, 6}, 5));
  EXPECT_EQ(p.descriptors.size(), 8u);
  EXPECT_EQ(p.bytes, 2u * 7 * 4 * 32);
}

TEST(PlannerTest, SlidingWindowMovesOnlyTheWindow) {
  // Window 4 of 12 tokens: only the third block moves, 1 page per layer.
  Layout l = rank_of(1, 0);
  l.groups[0].kind = GroupKind::kSlidingWindow;
  l.groups[0].window_tokens = 4;
  Plan p = checked_plan(l, {l}, req(12, {-1, -1, 2}, {-1, -1, 7}));
  EXPECT_EQ(p.descriptors.size(), 2u);
  EXPECT_EQ(p.bytes, 2u * 512);
  EXPECT_EQ(p.descriptors[0].remote_offset, 7u * 512);
}

Layout state_layout(uint32_t tp, uint32_t rank) {
  // One state group: per layer a [block][head] array of 64-byte states in one
  // tensor, 8 heads.
  Layout l;
  l.model = "tiny-ssm";
  l.dtype = "fp32";
  l.tp_size = tp;
  l.tp_rank = rank;
  const uint32_t heads = 8 / tp;
  Group g;
  g.name = "ssm";
  g.kind = GroupKind::kState;
  g.block_tokens = 16;
  g.num_blocks = 10;
  for (int i = 0; i < 2; ++i) {
    std::string t = "state." + std::to_string(i);
    l.tensors.push_back({t, 10 * heads * 64, "host"});
    Component c{"ssm",
                t,
                0,
                64,
                HeadMap{8, rank * heads, heads},
                {{AxisKind::kBlock, 10, heads * 64}, {AxisKind::kHead, heads, 64}}};
    g.layers.push_back({"layers." + std::to_string(i), {c}});
  }
  l.groups.push_back(g);
  return l;
}

TEST(PlannerTest, StateGroupMovesOnlyTheFinalState) {
  // Lists differ in length; only the last blocks (3 and 9) move: one state of
  // 8 heads x 64 B per layer, contiguous on both sides.
  Layout l = state_layout(1, 0);
  Request r;
  r.num_tokens = 40;
  r.blocks["ssm"] = {{1, 2, 3}, {9}};
  Plan p = checked_plan(l, {l}, r);
  EXPECT_EQ(p.descriptors.size(), 2u);
  EXPECT_EQ(p.bytes, 2u * 8 * 64);
  EXPECT_EQ(p.descriptors[0].local_offset, 3u * 512);
  EXPECT_EQ(p.descriptors[0].remote_offset, 9u * 512);
}

TEST(PlannerTest, ShardedStateFromTpTwoToTpOne) {
  // Each remote rank holds 4 heads (256 B); locally they are the two halves of
  // the state: 2 layers x 2 ranks = 4.
  std::vector<Layout> remotes{state_layout(2, 0), state_layout(2, 1)};
  Request r;
  r.num_tokens = 40;
  r.blocks["ssm"] = {{5}, {2, 3}};
  Plan p = checked_plan(state_layout(1, 0), remotes, r);
  EXPECT_EQ(p.descriptors.size(), 4u);
  EXPECT_EQ(p.sources[0].bytes, 2u * 256);
  EXPECT_EQ(p.sources[1].bytes, 2u * 256);
}

TEST(PlannerTest, ScratchMovesItsSingleBlock) {
  Layout l = rank_of(1, 0);
  l.groups[0].kind = GroupKind::kScratch;
  l.groups[0].prefix_cacheable = false;
  Plan p = checked_plan(l, {l}, req(100, {3}, {5}));
  EXPECT_EQ(p.descriptors.size(), 2u);
  EXPECT_EQ(p.bytes, 2u * 512);
}

TEST(PlannerTest, EmptyComponentMovesNothingAndNeverMakesAZeroLengthDescriptor) {
  Layout l = rank_of(1, 0);
  for (Layer& layer : l.groups[0].layers) {
    Component rope = layer.components[0];
    rope.name = "rope";
    rope.cell_bytes = 0;
    layer.components.push_back(rope);
  }
  Plan p = checked_plan(l, {l}, req(12, {0, 1, 2}, {4, 5, 6}));
  EXPECT_EQ(p.descriptors.size(), 2u);
  for (const Descriptor& d : p.descriptors) EXPECT_GT(d.bytes, 0u);
}

Layout replicated(uint32_t tp, uint32_t rank) {
  Layout l = small_gqa(2, 4, 4, 0);
  l.model = "tiny-mla";
  l.tp_size = tp;
  l.tp_rank = rank;
  for (Layer& layer : l.groups[0].layers) {
    for (Component& c : layer.components) {
      c.heads.reset();
      c.axes.erase(c.axes.begin() + 1);  // drop the head axis; heads collapse into 1 (4x padding is fine)
    }
  }
  return l;
}

TEST(PlannerTest, ReplicatedComponentsSpreadLocalRanksOverRemoteRanks) {
  std::vector<Layout> remotes{replicated(2, 1), replicated(2, 0)};
  for (uint32_t r = 0; r < 4; ++r) {
    Layout local = replicated(4, r);
    Plan p = checked_plan(local, remotes, req(12, {0, 1, 2}, {4, 5, 6}));
    ASSERT_FALSE(p.descriptors.empty());
    for (const Descriptor& d : p.descriptors) EXPECT_EQ(remotes[d.source].tp_rank, r % 2) << "local rank " << r;
  }
}

TEST(PlannerTest, BlockMajorRowsBecomeOneDescriptorPerRunOfBlocks) {
  // One tensor whose row holds both layers' pages: [block][layer][head][pos][k|v].
  Layout l = small_gqa();
  const uint64_t page = 4 * 4 * 32, row = 2 * page;
  l.tensors = {{"kv", 8 * row, "host"}};
  for (size_t i = 0; i < 2; ++i) {
    for (Component& c : l.groups[0].layers[i].components) {
      c.tensor = "kv";
      c.offset = i * page + (c.name == "v" ? 16 : 0);
      c.axes[0].stride = row;
    }
  }
  ASSERT_TRUE(validate(l).ok()) << validate(l).to_string();
  // Blocks 1,2,3 <- 4,5,6 and 6 <- 0: two runs, one descriptor each.
  Plan p = checked_plan(l, {l}, req(16, {1, 2, 3, 6}, {4, 5, 6, 0}));
  EXPECT_EQ(p.descriptors.size(), 2u);
  EXPECT_EQ(p.descriptors[0].bytes, 3u * row);
  // Against a layer-major remote nothing merges: locally a layer's pages of
  // consecutive blocks are a row apart, remotely the layers are in different
  // tensors: 4 blocks x 2 layers = 8.
  Plan q = checked_plan(l, {rank_of(1, 0)}, req(16, {1, 2, 3, 6}, {4, 5, 6, 0}));
  EXPECT_EQ(q.descriptors.size(), 8u);
}

TEST(PlannerTest, IsDeterministicAndIndependentOfRemoteOrder) {
  std::vector<Layout> a{rank_of(2, 0), rank_of(2, 1)};
  std::vector<Layout> b{rank_of(2, 1), rank_of(2, 0)};
  Request r = req(12, {0, 1, 2}, {4, 5, 6});
  Result<Plan> p1 = plan(rank_of(1, 0), a, r), p2 = plan(rank_of(1, 0), a, r), p3 = plan(rank_of(1, 0), b, r);
  ASSERT_TRUE(p1 && p2 && p3);
  EXPECT_EQ(p1->descriptors, p2->descriptors);
  ASSERT_EQ(p1->descriptors.size(), p3->descriptors.size());
  for (size_t i = 0; i < p1->descriptors.size(); ++i) {
    Descriptor x = p1->descriptors[i], y = p3->descriptors[i];
    EXPECT_EQ(a[x.source].tp_rank, b[y.source].tp_rank);
    x.source = y.source = 0;
    EXPECT_EQ(x, y);
  }
}

void expect_error(const Result<Plan>& p, Code code, const std::string& fragment) {
  ASSERT_FALSE(p.has_value()) << "expected an error containing " << fragment;
  EXPECT_EQ(p.error().code(), code) << p.error().to_string();
  EXPECT_NE(p.error().message().find(fragment), std::string::npos) << p.error().message();
}

TEST(PlannerErrorTest, RejectsABlockListTooShortForItsTokens) {
  Layout l = rank_of(1, 0);
  expect_error(plan(l, std::vector<Layout>{l}, req(13, {0, 1, 2}, {4, 5, 6, 7})), Code::kInvalidArgument,
               "group 'full' local block list has 3 entries but the request's positions need 4");
}

TEST(PlannerErrorTest, RejectsABlockIdBeyondNumBlocks) {
  Layout l = rank_of(1, 0);
  expect_error(plan(l, std::vector<Layout>{l}, req(12, {0, 1, 2}, {4, 5, 8})), Code::kOutOfRange,
               "group 'full' remote[2] = 8 is beyond num_blocks 8");
}

TEST(PlannerErrorTest, RejectsMinusOneWhereABlockMoves) {
  Layout l = rank_of(1, 0);
  expect_error(plan(l, std::vector<Layout>{l}, req(12, {0, -1, 2}, {4, 5, 6})), Code::kInvalidArgument,
               "local[1] is -1");
}

TEST(PlannerErrorTest, RejectsAnIdentityMismatchNamingTheField) {
  Layout l = rank_of(1, 0);
  Layout r = l;
  r.groups[0].layers[1].components[0].cell_bytes = 8;
  r.groups[0].layers[1].components[1].offset = 8;
  ASSERT_TRUE(validate(r).ok()) << validate(r).to_string();
  expect_error(plan(l, std::vector<Layout>{r}, req(12, {0, 1, 2}, {4, 5, 6})), Code::kIncompatible,
               "remote rank 0: group 'full' layer 'layers.1' component 'k': cell_bytes differs: 16 vs 8");
}

TEST(PlannerErrorTest, RejectsRemotesThatDoNotCoverTheHeads) {
  expect_error(plan(rank_of(1, 0), std::vector<Layout>{rank_of(2, 0)}, req(12, {0, 1, 2}, {4, 5, 6})),
               Code::kIncompatible, "no given remote rank holds global head 2");
}

TEST(PlannerErrorTest, RejectsDuplicateOrMixedRemoteRanks) {
  expect_error(plan(rank_of(1, 0), std::vector<Layout>{rank_of(2, 0), rank_of(2, 0)}, req(12, {0, 1, 2}, {4, 5, 6})),
               Code::kInvalidArgument, "remote rank 0 is given twice");
  expect_error(plan(rank_of(1, 0), std::vector<Layout>{rank_of(2, 0), rank_of(4, 1)}, req(12, {0, 1, 2}, {4, 5, 6})),
               Code::kIncompatible, "tp_size");
}

TEST(PlannerErrorTest, RejectsUnknownAndMissingGroups) {
  Layout l = rank_of(1, 0);
  expect_error(plan(l, std::vector<Layout>{l}, req(12, {0, 1, 2}, {4, 5, 6}, 0, "swa")), Code::kInvalidArgument,
               "request names group 'swa'");
  Request r = req(12, {0, 1, 2}, {4, 5, 6});
  r.blocks["full"].local.clear();
  r.blocks.clear();
  expect_error(plan(l, std::vector<Layout>{l}, r), Code::kInvalidArgument,
               "request has no block lists for group 'full'");
}

TEST(PlannerErrorTest, RejectsAScratchListThatIsNotOneBlock) {
  Layout l = rank_of(1, 0);
  l.groups[0].kind = GroupKind::kScratch;
  l.groups[0].prefix_cacheable = false;
  expect_error(plan(l, std::vector<Layout>{l}, req(4, {1, 2}, {3})), Code::kInvalidArgument,
               "group 'full' is a scratch group: it needs exactly one block per side");
}

TEST(PlannerErrorTest, RejectsOneBlockIdGivenToTwoAliasingGroups) {
  // Overlay: "swa" aliases "full"'s bytes; giving both block 1 would write
  // the same local bytes twice.
  Layout l = rank_of(1, 0);
  Group swa = l.groups[0];
  swa.name = "swa";
  swa.kind = GroupKind::kSlidingWindow;
  swa.window_tokens = 8;
  l.groups.push_back(swa);
  Request r = req(4, {1}, {1});
  r.blocks["swa"] = {{1}, {2}};
  expect_error(plan(l, std::vector<Layout>{l}, r), Code::kInvalidArgument, "would be written twice");
  r.blocks["swa"] = {{2}, {2}};
  EXPECT_TRUE(plan(l, std::vector<Layout>{l}, r).has_value());
}

TEST(PlannerErrorTest, RejectsABlockListedTwiceInOneList) {
  Layout l = rank_of(1, 0);
  expect_error(plan(l, std::vector<Layout>{l}, req(12, {3, 1, 3}, {4, 5, 6})), Code::kInvalidArgument,
               "group 'full' local block 3 is listed twice (entries 0 and 2)");
  expect_error(plan(l, std::vector<Layout>{l}, req(12, {0, 1, 2}, {6, 5, 6})), Code::kInvalidArgument,
               "remote block 6 is listed twice");
}

TEST(PlannerTest, NaiveCountIsOnePerLayerComponentBlockAndSource) {
  // 2 layers x 2 components x 3 blocks x 1 source = 12 against the plan's 2.
  Layout l = rank_of(1, 0);
  Request r = req(12, {0, 1, 2}, {4, 5, 6});
  EXPECT_EQ(naive_descriptor_count(l, std::vector<Layout>{l}, r), 12u);
}

}  // namespace
}  // namespace kvbridge
