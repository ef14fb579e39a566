// Group selection and the lookup rule, on groups alone.
#include "store/selection.h"

#include <gtest/gtest.h>

namespace kvbridge::store_internal {
namespace {

Group group(GroupKind kind, uint64_t block_tokens, std::optional<uint64_t> window = std::nullopt) {
  Group g;
  g.name = "g";
  g.kind = kind;
  g.block_tokens = block_tokens;
  g.window_tokens = window;
  return g;
}

std::vector<uint64_t> blocks(const Result<std::vector<Selected>>& r) {
  std::vector<uint64_t> out;
  for (const Selected& s : *r) out.push_back(s.block);
  return out;
}

TEST(SelectionTest, AttentionStoresFullHashBlocksAfterTheSkip) {
  const Group g = group(GroupKind::kAttention, 32);
  const std::vector<int64_t> ids = {5, 6, 7, 8};
  EXPECT_EQ(blocks(select_blocks(g, ids, 120, 0, 16)), (std::vector<uint64_t>{0, 1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(blocks(select_blocks(g, ids, 120, 40, 16)), (std::vector<uint64_t>{2, 3, 4, 5, 6}));
  const std::vector<int64_t> holes = {5, -1, 7, 8};
  EXPECT_EQ(blocks(select_blocks(g, holes, 128, 0, 16)), (std::vector<uint64_t>{0, 1, 4, 5, 6, 7}));
  EXPECT_FALSE(select_blocks(g, std::vector<int64_t>{1, 2}, 128, 0, 16).ok());
}

TEST(SelectionTest, ScratchAndNonCacheableGroupsAreNeverStored) {
  Group s = group(GroupKind::kScratch, 4);
  EXPECT_TRUE(select_blocks(s, std::vector<int64_t>{3}, 64, 0, 4)->empty());
  Group a = group(GroupKind::kAttention, 16);
  a.prefix_cacheable = false;
  EXPECT_TRUE(select_blocks(a, std::vector<int64_t>{1, 2, 3, 4}, 64, 0, 16)->empty());
}

TEST(SelectionTest, SlidingWindowStoresOnlyTheWindow) {
  const Group g = group(GroupKind::kSlidingWindow, 16, 64);
  std::vector<int64_t> ids(21);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i);
  // 320 tokens: the window is [256, 320), blocks 16..19.
  EXPECT_EQ(blocks(select_blocks(g, ids, 320, 0, 16)), (std::vector<uint64_t>{16, 17, 18, 19}));
  // 330 tokens: still the window of the last full block.
  EXPECT_EQ(blocks(select_blocks(g, ids, 330, 0, 16)).size(), 4u);
  // A window of 72 tokens meets five blocks.
  EXPECT_EQ(blocks(select_blocks(group(GroupKind::kSlidingWindow, 16, 72), ids, 320, 0, 16)).front(), 15u);
}

TEST(SelectionTest, StatesAreStoredAtHashBlockBoundariesTheListKeeps) {
  const Group g = group(GroupKind::kState, 64);
  // Entries hold the states at 64, 128 and (the last) 144.
  auto r = select_blocks(g, std::vector<int64_t>{4, 5, 6}, 144, 0, 16);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r->size(), 3u);
  EXPECT_EQ((*r)[0].block, 3u);
  EXPECT_EQ((*r)[0].state_block_id, 4);
  EXPECT_EQ((*r)[1].block, 7u);
  EXPECT_EQ((*r)[2].block, 8u);
  EXPECT_EQ((*r)[2].state_block_id, 6);
  // 136 is no hash-block boundary; a -1 entry keeps no state.
  EXPECT_EQ(blocks(select_blocks(g, std::vector<int64_t>{-1, 5, 6}, 136, 0, 16)), (std::vector<uint64_t>{7}));
}

TEST(SelectionTest, HitNeedsEveryGroup) {
  const Group att = group(GroupKind::kAttention, 64);
  const Group st = group(GroupKind::kState, 64);
  const Group win = group(GroupKind::kSlidingWindow, 64, 32);
  GroupPresence a{&att, std::vector<uint8_t>(8, 1)};
  GroupPresence s{&st, std::vector<uint8_t>(8, 0)};
  GroupPresence w{&win, std::vector<uint8_t>(8, 0)};
  std::vector<GroupPresence> groups = {a, s};
  EXPECT_EQ(hit_tokens(groups, 16, 64, 128), 0u);  // attention present, state absent
  groups[1].present[3] = 1;                        // the state at 64
  EXPECT_EQ(hit_tokens(groups, 16, 64, 128), 64u);
  groups[1].present[7] = 1;  // the state at 128
  EXPECT_EQ(hit_tokens(groups, 16, 64, 128), 128u);
  groups[0].present[5] = 0;  // an attention hole caps the hit
  EXPECT_EQ(hit_tokens(groups, 16, 64, 128), 64u);
  std::vector<GroupPresence> sw = {a, w};
  EXPECT_EQ(hit_tokens(sw, 16, 16, 128), 0u);
  sw[1].present[6] = sw[1].present[7] = 1;  // the window [96, 128)
  EXPECT_EQ(hit_tokens(sw, 16, 16, 128), 128u);
  EXPECT_EQ(hit_tokens(sw, 16, 16, 112), 0u);  // [80, 112) is not there
}

TEST(SelectionTest, NeededBlocksFollowTheKind) {
  EXPECT_EQ(needed_blocks(group(GroupKind::kAttention, 16), 64, 20, 16), (std::vector<uint64_t>{1, 2, 3}));
  EXPECT_EQ(needed_blocks(group(GroupKind::kSlidingWindow, 16, 40), 64, 0, 16), (std::vector<uint64_t>{1, 2, 3}));
  EXPECT_EQ(needed_blocks(group(GroupKind::kState, 64), 128, 0, 16), (std::vector<uint64_t>{7}));
  EXPECT_TRUE(needed_blocks(group(GroupKind::kState, 64), 128, 128, 16).empty());
}

}  // namespace
}  // namespace kvbridge::store_internal
