// Identity, compatibility hash, and the field-naming compatibility check.
#include <gtest/gtest.h>

#include "kvbridge/layout.h"
#include "kvbridge/presets.h"
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

// compare_identity_text() on the texts of two layouts says what
// check_compatible() says about the layouts.
void expect_same_verdict(const Layout& a, const Layout& b) {
  Status layouts = check_compatible(a, b);
  Status texts = compare_identity_text(identity_text(a), identity_text(b));
  EXPECT_EQ(texts.code(), layouts.code()) << texts.to_string() << " / " << layouts.to_string();
  EXPECT_EQ(texts.message(), layouts.message());
}

TEST(CompareIdentityTextTest, AgreesWithCheckCompatibleOnEachField) {
  const Layout base = small_gqa();
  std::vector<Layout> others;
  others.push_back(small_gqa(2, 4, 2, 2, 16, 100));  // compatible
  others.push_back(base);
  others.back().model = "other";
  others.push_back(base);
  others.back().dtype = "fp8";
  others.push_back(base);
  others.back().groups[0].layers[1].components[1].cell_bytes = 8;
  others.push_back(small_gqa(2, 8, 4));
  others.push_back(base);
  others.back().groups[0].layers[0].components[0].heads.reset();
  others.push_back(base);
  others.back().groups[0].kind = GroupKind::kSlidingWindow;
  others.back().groups[0].window_tokens = 4;
  others.push_back(base);
  others.back().groups[0].tokens_per_state = 4;
  others.push_back(base);
  others.back().groups[0].name = "swa";
  others.push_back(small_gqa(3));
  others.push_back(base);
  others.back().groups[0].layers[1].name = "blocks.1";
  others.push_back(base);
  others.back().groups[0].layers[0].components[1].name = "value";
  others.push_back(base);
  others.back().groups[0].layers[0].components.pop_back();
  for (const Layout& other : others) {
    expect_same_verdict(base, other);
    expect_same_verdict(other, base);
  }
}

TEST(CompareIdentityTextTest, AgreesWithCheckCompatibleOnEveryPresetPair) {
  std::vector<Layout> layouts;
  for (const std::string& name : preset_names()) {
    Result<Layout> l = make_preset({.name = name});
    ASSERT_TRUE(l.ok()) << l.status().to_string();
    layouts.push_back(*l);
  }
  for (const Layout& a : layouts)
    for (const Layout& b : layouts) expect_same_verdict(a, b);
}

TEST(CompareIdentityTextTest, NamesTheComponentWhoseHeadsDiffer) {
  Result<Layout> a = make_preset({.name = "llama3-8b"});
  ASSERT_TRUE(a.ok());
  Layout b = *a;
  b.groups[0].layers[0].components[0].heads->total = 4;
  Status s = compare_identity_text(identity_text(*a), identity_text(b));
  EXPECT_EQ(s.code(), Code::kIncompatible);
  EXPECT_EQ(s.message(), "group 'full' layer 'layers.0' component 'k': heads.total differs: 8 vs 4");
}

TEST(CompareIdentityTextTest, FallsBackToTheFirstDifferingLine) {
  const std::string a = identity_text(small_gqa());
  Status s = compare_identity_text(a, "kvbridge.identity/2\nwhatever\n");
  EXPECT_EQ(s.code(), Code::kIncompatible);
  EXPECT_EQ(s.message(), "identity line 1 differs: 'kvbridge.identity/1' vs 'kvbridge.identity/2'");
  s = compare_identity_text(a, "");
  EXPECT_EQ(s.message(), "identity line 1 differs: 'kvbridge.identity/1' vs (end of text)");
  s = compare_identity_text(a, a.substr(0, a.size() - 1));
  EXPECT_NE(s.message().find("(no newline)"), std::string::npos) << s.message();
  // A group listed twice parses, and the fields agree; the lines do not.
  Layout twice = small_gqa();
  std::string t = identity_text(twice);
  std::string group = t.substr(t.find("group "));
  s = compare_identity_text(t, t + group);
  EXPECT_EQ(s.code(), Code::kIncompatible);
  EXPECT_NE(s.message().find("identity line"), std::string::npos) << s.message();
}

TEST(CompareIdentityTextTest, CutsAndEscapesPeerBytes) {
  const std::string a = identity_text(small_gqa());
  std::string b = a;
  b.replace(b.find("tiny-gqa"), 8, std::string(5000, 'x') + "\x01\x1b");
  Status s = compare_identity_text(a, b);
  EXPECT_EQ(s.code(), Code::kIncompatible);
  EXPECT_LT(s.message().size(), 400u) << s.message();
  Layout c = small_gqa();
  c.model = "evil\x1b[2J\n";
  s = compare_identity_text(a, identity_text(c));
  EXPECT_EQ(s.message(), "model differs: 'tiny-gqa' vs 'evil\\x1b[2J\\x0a'");
}

TEST(CompareIdentityTextTest, SurvivesEveryTruncationAndByteFlip) {
  const std::string a = identity_text(small_gqa(3));
  for (size_t n = 0; n < a.size(); ++n) {
    Status s = compare_identity_text(a, a.substr(0, n));
    EXPECT_EQ(s.code(), Code::kIncompatible) << n;
    std::string flipped = a;
    flipped[n] = static_cast<char>(flipped[n] ^ 0x5a);
    s = compare_identity_text(a, flipped);
    EXPECT_EQ(s.code(), Code::kIncompatible) << n;
    EXPECT_FALSE(s.message().empty());
  }
  // Length prefixes that point past the end, or hold too many digits.
  for (const char* bad : {"kvbridge.identity/1\nmodel 99999999999999999999:x\n",
                          "kvbridge.identity/1\nmodel 4294967296:x\n", "kvbridge.identity/1\nmodel :\n"}) {
    EXPECT_EQ(compare_identity_text(a, bad).code(), Code::kIncompatible) << bad;
  }
}

}  // namespace
}  // namespace kvbridge
