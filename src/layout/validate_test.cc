// validate(): one test per rejection, each checking that the message names the
// culprit (group, layer, component, field).
#include <gtest/gtest.h>

#include "kvbridge/layout.h"
#include "layout/test_layouts.h"

namespace kvbridge {
namespace {

using testing::small_gqa;

// Expects `l` to be rejected with `code` and a message containing every
// fragment.
void expect_rejected(const Layout& l, Code code, std::initializer_list<std::string> fragments) {
  Status s = validate(l);
  ASSERT_FALSE(s.ok()) << "expected a rejection";
  EXPECT_EQ(s.code(), code) << s.to_string();
  for (const std::string& f : fragments) {
    EXPECT_NE(s.message().find(f), std::string::npos) << "message lacks \"" << f << "\": " << s.message();
  }
}

Component& k0(Layout& l, size_t layer = 0) { return l.groups[0].layers[layer].components[0]; }
Component& v1(Layout& l) { return l.groups[0].layers[1].components[1]; }

TEST(ValidateTest, AcceptsTheSmallLayout) {
  EXPECT_TRUE(validate(small_gqa()).ok()) << validate(small_gqa()).to_string();
}

TEST(ValidateTest, RejectsACellPastTheEndOfItsTensorAndNamesTheComponent) {
  Layout l = small_gqa();
  v1(l).offset += 1;  // v of the last block now ends one byte past the tensor
  expect_rejected(l, Code::kOutOfRange,
                  {"group 'full'", "layer 'layers.1'", "component 'v'", "past the end of tensor 'kv.1'"});
}

TEST(ValidateTest, RejectsAnOffsetPastTheTensor) {
  Layout l = small_gqa();
  k0(l).offset = l.tensors[0].bytes + 1;
  expect_rejected(l, Code::kOutOfRange, {"component 'k'", "offset"});
}

TEST(ValidateTest, RejectsAUncoveredTailView) {
  // A tail view of 64 bytes per block at the start of each row, whose last
  // block would hang past the allocation.
  Layout l = small_gqa();
  Group tail;
  tail.name = "tail";
  tail.kind = GroupKind::kScratch;
  tail.prefix_cacheable = false;
  tail.block_tokens = 1;
  tail.num_blocks = 8;
  Component c;
  c.name = "tail";
  c.tensor = "kv.0";
  c.cell_bytes = 64;
  const uint64_t row = l.tensors[0].bytes / 8;
  c.axes = {{AxisKind::kBlock, 8, row}};
  c.offset = row - 32;
  tail.layers.push_back({"layers.0", {c}});
  l.groups.push_back(tail);
  expect_rejected(l, Code::kOutOfRange, {"group 'tail'", "component 'tail'", "past the end"});
  l.groups.back().layers[0].components[0].offset = 0;
  EXPECT_TRUE(validate(l).ok()) << validate(l).to_string();
}

TEST(ValidateTest, RejectsOverlappingCellsWithinAComponent) {
  Layout l = small_gqa();
  k0(l).axes[2].stride = 8;  // positions 16 bytes wide, 8 apart
  expect_rejected(l, Code::kOutOfRange, {"component 'k'", "overlap"});
}

TEST(ValidateTest, RejectsTwoAxesWithTheSameStride) {
  Layout l = small_gqa();
  k0(l).axes[1].stride = k0(l).axes[2].stride;  // head and position collide
  expect_rejected(l, Code::kOutOfRange, {"component 'k'", "overlap"});
}

TEST(ValidateTest, AcceptsInterleavedButDisjointCells) {
  // Not nested (stride 3 < extent 5 of the stride-2 axis) but disjoint:
  // starts {0,2,4} + {0,3} = {0,2,3,4,5,7}, one byte each.
  Layout l = small_gqa(1, 1, 1, 0, 3, 2);
  Component& c = k0(l);
  l.groups[0].layers[0].components.resize(1);
  c.cell_bytes = 1;
  c.offset = 0;
  c.axes = {{AxisKind::kBlock, 2, 3}, {AxisKind::kHead, 1, 0}, {AxisKind::kPosition, 3, 2}};
  EXPECT_TRUE(validate(l).ok()) << validate(l).to_string();
  c.axes[0].stride = 2;  // now the block axis collides with positions
  expect_rejected(l, Code::kOutOfRange, {"overlap"});
}

TEST(ValidateTest, RejectsAPositionCountThatDisagreesWithBlockTokens) {
  Layout l = small_gqa();
  l.groups[0].block_tokens = 8;  // 8 tokens per block, but 4 positions
  expect_rejected(l, Code::kInvalidArgument, {"component 'k'", "4 positions per block", "8 / 1 = 8"});
}

TEST(ValidateTest, RejectsBlockTokensNotAMultipleOfTokensPerState) {
  Layout l = small_gqa();
  l.groups[0].tokens_per_state = 3;
  expect_rejected(l, Code::kInvalidArgument, {"group 'full'", "tokens_per_state 3"});
}

TEST(ValidateTest, RejectsPositionAxesInAStateGroup) {
  Layout l = small_gqa();
  l.groups[0].kind = GroupKind::kState;
  expect_rejected(l, Code::kInvalidArgument, {"component 'k'", "state"});
}

TEST(ValidateTest, RejectsABlockAxisWhoseSizeIsNotNumBlocks) {
  Layout l = small_gqa();
  k0(l).axes[0].size = 7;
  expect_rejected(l, Code::kInvalidArgument, {"component 'k'", "num_blocks 8"});
}

TEST(ValidateTest, RejectsMissingOrRepeatedBlockAxes) {
  Layout l = small_gqa();
  k0(l).axes.erase(k0(l).axes.begin());
  expect_rejected(l, Code::kInvalidArgument, {"component 'k'", "0 block axes"});
  l = small_gqa();
  k0(l).axes.push_back(k0(l).axes[0]);
  expect_rejected(l, Code::kInvalidArgument, {"2 block axes"});
}

TEST(ValidateTest, RejectsHeadsThatDoNotFit) {
  Layout l = small_gqa(2, 8, 4, 0);
  k0(l).heads->first = 6;  // heads 6..9 of 8
  expect_rejected(l, Code::kInvalidArgument, {"component 'k'", "do not fit in heads.total 8"});
}

TEST(ValidateTest, RejectsAHeadAxisThatDisagreesWithHeadsCount) {
  Layout l = small_gqa();
  k0(l).heads->count = 2;
  expect_rejected(l, Code::kInvalidArgument, {"component 'k'", "heads.count 2"});
}

TEST(ValidateTest, RejectsHeadAxisWithoutHeadsMapAndTheReverse) {
  Layout l = small_gqa();
  k0(l).heads.reset();
  expect_rejected(l, Code::kInvalidArgument, {"component 'k'", "no heads map"});
  l = small_gqa();
  k0(l).axes.erase(k0(l).axes.begin() + 1);
  expect_rejected(l, Code::kInvalidArgument, {"component 'k'", "no head axis"});
}

TEST(ValidateTest, RejectsZeroTotalHeads) {
  Layout l = small_gqa();
  k0(l).heads = HeadMap{0, 0, 0};
  k0(l).axes[1].size = 0;
  expect_rejected(l, Code::kInvalidArgument, {"heads.total 0"});
}

TEST(ValidateTest, RejectsAnUndeclaredTensor) {
  Layout l = small_gqa();
  k0(l).tensor = "kv.9";
  expect_rejected(l, Code::kNotFound, {"component 'k'", "tensor 'kv.9'"});
}

TEST(ValidateTest, RejectsDuplicateNames) {
  Layout l = small_gqa();
  l.tensors[1].name = "kv.0";
  expect_rejected(l, Code::kAlreadyExists, {"tensor 'kv.0'"});
  l = small_gqa();
  l.groups[0].layers[1].name = "layers.0";
  expect_rejected(l, Code::kAlreadyExists, {"layer 'layers.0'"});
  l = small_gqa();
  l.groups[0].layers[0].components[1].name = "k";
  expect_rejected(l, Code::kAlreadyExists, {"component 'k'"});
  l = small_gqa();
  l.groups.push_back(l.groups[0]);
  expect_rejected(l, Code::kAlreadyExists, {"group 'full'"});
}

TEST(ValidateTest, RejectsAbsurdSizesWithoutOverflowing) {
  Layout l = small_gqa();
  k0(l).axes[0].stride = uint64_t{1} << 55;  // block 7 * 2^55 > 2^56 tensor bound
  l.tensors[0].bytes = kMaxTensorBytes;
  expect_rejected(l, Code::kOutOfRange, {"component 'k'", "past the end"});
  l = small_gqa();
  l.tensors[0].bytes = kMaxTensorBytes + 1;
  expect_rejected(l, Code::kResourceExhausted, {"tensor 'kv.0'"});
  l = small_gqa();
  k0(l).axes[1].stride = ~uint64_t{0};
  expect_rejected(l, Code::kResourceExhausted, {"component 'k'", "stride"});
  l = small_gqa();
  l.groups[0].num_blocks = kMaxNumBlocks + 1;
  expect_rejected(l, Code::kInvalidArgument, {"group 'full'", "num_blocks"});
  l = small_gqa();
  k0(l).cell_bytes = kMaxCellBytes + 1;
  expect_rejected(l, Code::kResourceExhausted, {"component 'k'", "cell_bytes"});
}

TEST(ValidateTest, AcceptsAnEmptyComponent) {
  // The rope of a layer without positional encoding: zero bytes, moves nothing.
  Layout l = small_gqa();
  Component rope = k0(l);
  rope.name = "rope";
  rope.cell_bytes = 0;
  rope.offset = l.tensors[0].bytes;  // even at the very end
  l.groups[0].layers[0].components.push_back(rope);
  EXPECT_TRUE(validate(l).ok()) << validate(l).to_string();
  EXPECT_TRUE(l.groups[0].layers[0].components.back().empty());
}

TEST(ValidateTest, RejectsWindowTokensOutsideSlidingWindowGroups) {
  Layout l = small_gqa();
  l.groups[0].window_tokens = 128;
  expect_rejected(l, Code::kInvalidArgument, {"group 'full'", "window_tokens"});
  l.groups[0].kind = GroupKind::kSlidingWindow;
  EXPECT_TRUE(validate(l).ok());
  l.groups[0].window_tokens.reset();
  expect_rejected(l, Code::kInvalidArgument, {"group 'full'", "window_tokens"});
}

TEST(ValidateTest, RejectsABadContextShard) {
  Layout l = small_gqa();
  l.groups[0].context = {2, 1, 4};
  EXPECT_TRUE(validate(l).ok()) << validate(l).to_string();
  l.groups[0].context = {2, 2, 4};
  expect_rejected(l, Code::kInvalidArgument, {"group 'full'", "context.rank 2 must be below context.size 2"});
  l.groups[0].context = {0, 0, 1};
  expect_rejected(l, Code::kInvalidArgument, {"group 'full'", "context.size 0"});
  l.groups[0].context = {2, 0, 0};
  expect_rejected(l, Code::kInvalidArgument, {"group 'full'", "context.interleave 0"});
  l.groups[0].context = {1, 0, 16};
  expect_rejected(l, Code::kInvalidArgument, {"group 'full'", "context.interleave 16 needs context.size above 1"});
  // A state has no positions to deal.
  l.groups[0].context = {2, 0, 1};
  l.groups[0].kind = GroupKind::kScratch;
  l.groups[0].prefix_cacheable = false;
  expect_rejected(l, Code::kInvalidArgument, {"group 'full'", "a scratch group cannot be context-sharded"});
}

TEST(ValidateTest, RejectsAPrefixCacheableScratchGroup) {
  Layout l = small_gqa();
  l.groups[0].kind = GroupKind::kScratch;
  expect_rejected(l, Code::kInvalidArgument, {"group 'full'", "prefix_cacheable"});
  l.groups[0].prefix_cacheable = false;
  EXPECT_TRUE(validate(l).ok());
}

TEST(ValidateTest, RejectsBadTopLevelFields) {
  Layout l = small_gqa();
  l.tp_size = 2;
  l.tp_rank = 2;
  expect_rejected(l, Code::kInvalidArgument, {"tp_rank 2"});
  l = small_gqa();
  l.tp_size = 0;
  expect_rejected(l, Code::kInvalidArgument, {"tp_size 0"});
  l = small_gqa();
  l.model.clear();
  expect_rejected(l, Code::kInvalidArgument, {"model"});
  l = small_gqa();
  l.tensors[0].memory = "gpu0";
  expect_rejected(l, Code::kInvalidArgument, {"tensor 'kv.0'", "memory 'gpu0'"});
  l.tensors[0].memory = "cuda:3";
  EXPECT_TRUE(validate(l).ok());
  l = small_gqa();
  l.groups.clear();
  expect_rejected(l, Code::kInvalidArgument, {"no groups"});
}

TEST(ValidateTest, RejectsNamesThatAreNotUtf8) {
  // Every valid layout must have an exact JSON form, and JSON text is Unicode.
  for (const char* bad : {"bad\xff", "\xc0\xaf", "\xed\xa0\x80", "cut\xe2\x82"}) {
    Layout l = small_gqa();
    l.groups[0].layers[0].components[0].name = bad;
    expect_rejected(l, Code::kInvalidArgument, {"not valid UTF-8"});
  }
  Layout l = small_gqa();
  l.model = "mod\xc3\xa8le-\xe2\x82\xac-\xf0\x9f\x98\x80";  // two-, three- and four-byte forms
  EXPECT_TRUE(validate(l).ok()) << validate(l).to_string();
}

TEST(ValidateTest, AcceptsGroupsThatAliasTheSameBytes) {
  // The hybrid allocator's overlay: a second group over the same tensors.
  Layout l = small_gqa();
  Group other = l.groups[0];
  other.name = "swa";
  other.kind = GroupKind::kSlidingWindow;
  other.window_tokens = 8;
  l.groups.push_back(other);
  EXPECT_TRUE(validate(l).ok()) << validate(l).to_string();
}

}  // namespace
}  // namespace kvbridge
