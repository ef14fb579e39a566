// Identity, compatibility hash, and the field-naming compatibility check.
#include <gtest/gtest.h>

#include "kvbridge/layout.h"
#include "layout/test_layouts.h"

namespace kvbridge {
namespace {

using testing::small_gqa;

void expect_incompatible(const Layout& a, const Layout& b, std::initializer_list<std::string> fragments) {
  Status s = check_compatible(a, b);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), Code::kIncompatible);
  for (const std::string& f : fragments) {
    EXPECT_NE(s.message().find(f), std::string::npos) << "message lacks \"" << f << "\": " << s.message();
  }
  EXPECT_NE(compatibility_hash(a), compatibility_hash(b));
}

TEST(IdentityTest, IgnoresTpBlockSizeStridesAndTensors) {
  Layout a = small_gqa(2, 4, 4, 0, 4, 8);
  Layout b = small_gqa(2, 4, 2, 2, 16, 100);  // TP 2 rank 1, 16-token blocks
  b.tp_size = 2;
  b.tp_rank = 1;
  b.tensors[0].memory = "cuda:0";
  ASSERT_TRUE(validate(b).ok()) << validate(b).to_string();
  EXPECT_TRUE(check_compatible(a, b).ok()) << check_compatible(a, b).to_string();
  EXPECT_EQ(compatibility_hash(a), compatibility_hash(b));
  EXPECT_EQ(identity_text(a), identity_text(b));
}

TEST(IdentityTest, GroupOrderDoesNotMatter) {
  Layout a = small_gqa();
  Group g = a.groups[0];
  g.name = "another";
  a.groups.push_back(g);
  Layout b = a;
  std::swap(b.groups[0], b.groups[1]);
  EXPECT_TRUE(check_compatible(a, b).ok());
  EXPECT_EQ(compatibility_hash(a), compatibility_hash(b));
}

TEST(IdentityTest, NamesTheModelWhenItDiffers) {
  Layout b = small_gqa();
  b.model = "other";
  expect_incompatible(small_gqa(), b, {"model differs", "'tiny-gqa' vs 'other'"});
}

TEST(IdentityTest, NamesTheDtypeWhenItDiffers) {
  Layout b = small_gqa();
  b.dtype = "fp8";
  expect_incompatible(small_gqa(), b, {"dtype differs", "'bf16' vs 'fp8'"});
}

TEST(IdentityTest, NamesTheComponentWhoseCellBytesDiffer) {
  Layout b = small_gqa();
  b.groups[0].layers[1].components[1].cell_bytes = 8;
  expect_incompatible(small_gqa(), b, {"group 'full' layer 'layers.1' component 'v'", "cell_bytes differs: 16 vs 8"});
}

TEST(IdentityTest, NamesTotalHeadsWhenTheyDiffer) {
  Layout a = small_gqa(2, 8, 4);
  Layout b = small_gqa(2, 4, 4);
  expect_incompatible(a, b, {"component 'k'", "heads.total differs: 8 vs 4"});
  Layout c = small_gqa();
  c.groups[0].layers[0].components[0].heads.reset();
  expect_incompatible(small_gqa(), c, {"heads.total differs: 4 vs replicated"});
}

TEST(IdentityTest, NamesGroupKindTokensPerStateWindowAndMissingGroups) {
  Layout b = small_gqa();
  b.groups[0].kind = GroupKind::kSlidingWindow;
  b.groups[0].window_tokens = 4;
  expect_incompatible(small_gqa(), b, {"group 'full'", "kind differs: attention vs sliding_window"});
  b = small_gqa();
  b.groups[0].tokens_per_state = 4;
  expect_incompatible(small_gqa(), b, {"tokens_per_state differs: 1 vs 4"});
  b = small_gqa();
  b.groups[0].name = "swa";
  expect_incompatible(small_gqa(), b, {"group 'full' exists on the local side only"});
}

TEST(IdentityTest, NamesLayerAndComponentNamesAndCounts) {
  Layout b = small_gqa(3);
  expect_incompatible(small_gqa(2), b, {"layer count differs: 2 vs 3"});
  b = small_gqa();
  b.groups[0].layers[1].name = "blocks.1";
  expect_incompatible(small_gqa(), b, {"layer 1 name differs: 'layers.1' vs 'blocks.1'"});
  b = small_gqa();
  b.groups[0].layers[0].components[1].name = "value";
  expect_incompatible(small_gqa(), b, {"layer 'layers.0'", "component 1 name differs: 'v' vs 'value'"});
}

TEST(IdentityTest, NamesCannotForgeEachOther) {
  // Length-prefixed names: a name holding the text of the next field must not
  // make two different identities print the same.
  Layout a = small_gqa();
  Layout b = small_gqa();
  a.model = "m dtype 4:bf16";
  b.model = "m";
  b.dtype = "4:bf16 dtype 4:bf16";
  EXPECT_NE(identity_text(a), identity_text(b));
}

TEST(IdentityTest, HashIsStableAcrossRuns) {
  // The hash is a pure function of the identity text: recompute it by hand.
  Layout a = small_gqa();
  std::string t = identity_text(a);
  EXPECT_EQ(t.rfind("kvbridge.identity/1\nmodel 8:tiny-gqa\ndtype 4:bf16\n", 0), 0u) << t;
  EXPECT_EQ(compatibility_hash_hex(a).size(), 16u);
  EXPECT_EQ(compatibility_hash(a), compatibility_hash(small_gqa()));
}

}  // namespace
}  // namespace kvbridge
