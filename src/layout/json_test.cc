// kvbridge.layout/1: parsing into the expected struct, defaults, exact round
// trips, and one rejection per rule, each checking that the message names the
// culprit's JSON path.
#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"
#include "layout/test_json.h"
#include "layout/test_layouts.h"
#include "testing/contains.h"

namespace kvbridge {
namespace {

using OJson = nlohmann::ordered_json;

// The example of DESIGN.md, "The layout model".
constexpr const char* kDesignExample = R"({
  "format": "kvbridge.layout/1",
  "model": "llama3-8b", "dtype": "bf16",
  "tp_size": 2, "tp_rank": 1,
  "tensors": [{"name": "kv0", "bytes": 268435456, "memory": "host"}],
  "groups": [{
    "name": "full", "kind": "attention",
    "block_tokens": 16, "tokens_per_state": 1,
    "window_tokens": null, "prefix_cacheable": true, "transfer": true,
    "num_blocks": 1024,
    "layers": [{
      "name": "layers.0",
      "components": [{
        "name": "k", "tensor": "kv0", "offset": 0, "cell_bytes": 256,
        "heads": {"total": 8, "first": 4, "count": 4},
        "axes": [{"axis": "block", "size": 1024, "stride": 32768},
                 {"axis": "head",  "size": 4,    "stride": 4096},
                 {"axis": "position", "size": 16, "stride": 256}]
      }]
    }]
  }]
})";

// One group of each kind: an MLA-like latent in kernel pages of 16 tokens
// (two position axes), a compressed indexer (tokens_per_state 4), a sliding
// window with packed K/V on cuda:0, a Mamba-like state with two components in
// one block row, and a scratch ring that is transferred but never cached.
constexpr const char* kHybrid = R"({
  "format": "kvbridge.layout/1", "model": "hybrid-test", "dtype": "fp8",
  "tp_size": 1, "tp_rank": 0,
  "tensors": [{"name": "kv", "bytes": 16384},
              {"name": "idx", "bytes": 2048},
              {"name": "swa", "bytes": 8192, "memory": "cuda:0"},
              {"name": "state", "bytes": 4096, "memory": "cuda:1"},
              {"name": "ring", "bytes": 128}],
  "groups": [
    {"name": "full", "kind": "attention", "block_tokens": 64, "num_blocks": 4,
     "layers": [{"name": "layers.0", "components": [
       {"name": "latent", "tensor": "kv", "offset": 0, "cell_bytes": 64,
        "axes": [{"axis": "block", "size": 4, "stride": 4096},
                 {"axis": "position", "size": 4, "stride": 1024},
                 {"axis": "position", "size": 16, "stride": 64}]}]}]},
    {"name": "indexer", "kind": "attention", "block_tokens": 64, "tokens_per_state": 4, "num_blocks": 4,
     "layers": [{"name": "layers.0", "components": [
       {"name": "index", "tensor": "idx", "offset": 0, "cell_bytes": 32,
        "axes": [{"axis": "block", "size": 4, "stride": 512},
                 {"axis": "position", "size": 16, "stride": 32}]}]}]},
    {"name": "swa", "kind": "sliding_window", "block_tokens": 16, "window_tokens": 128, "num_blocks": 8,
     "layers": [{"name": "layers.1", "components": [
       {"name": "k", "tensor": "swa", "offset": 0, "cell_bytes": 16,
        "heads": {"total": 2, "first": 0, "count": 2},
        "axes": [{"axis": "position", "size": 16, "stride": 64},
                 {"axis": "head", "size": 2, "stride": 32},
                 {"axis": "block", "size": 8, "stride": 1024}]},
       {"name": "v", "tensor": "swa", "offset": 16, "cell_bytes": 16,
        "heads": {"total": 2, "first": 0, "count": 2},
        "axes": [{"axis": "position", "size": 16, "stride": 64},
                 {"axis": "head", "size": 2, "stride": 32},
                 {"axis": "block", "size": 8, "stride": 1024}]}]}]},
    {"name": "mamba", "kind": "state", "block_tokens": 64, "num_blocks": 4,
     "layers": [{"name": "layers.2", "components": [
       {"name": "conv", "tensor": "state", "offset": 0, "cell_bytes": 256,
        "axes": [{"axis": "block", "size": 4, "stride": 1024}]},
       {"name": "ssm", "tensor": "state", "offset": 256, "cell_bytes": 768,
        "axes": [{"axis": "block", "size": 4, "stride": 1024}]}]}]},
    {"name": "ring", "kind": "scratch", "block_tokens": 8, "prefix_cacheable": false, "transfer": false,
     "num_blocks": 2,
     "layers": [{"name": "layers.3", "components": [
       {"name": "tail", "tensor": "ring", "offset": 0, "cell_bytes": 8,
        "axes": [{"axis": "block", "size": 2, "stride": 64},
                 {"axis": "position", "size": 8, "stride": 8}]}]}]}
  ]
})";

Layout design_layout() {
  Layout l;
  l.model = "llama3-8b";
  l.dtype = "bf16";
  l.tp_size = 2;
  l.tp_rank = 1;
  l.tensors = {{"kv0", 268435456, "host"}};
  Group g;
  g.name = "full";
  g.kind = GroupKind::kAttention;
  g.block_tokens = 16;
  g.num_blocks = 1024;
  Component k;
  k.name = "k";
  k.tensor = "kv0";
  k.cell_bytes = 256;
  k.heads = HeadMap{8, 4, 4};
  k.axes = {{AxisKind::kBlock, 1024, 32768}, {AxisKind::kHead, 4, 4096}, {AxisKind::kPosition, 16, 256}};
  g.layers = {Layer{"layers.0", {k}}};
  l.groups = {g};
  return l;
}

using testing::Contains;

// Parses the design example after `edit`; the result must be an error.
Status parse_edited(const std::function<void(OJson&)>& edit) {
  OJson j = OJson::parse(kDesignExample);
  edit(j);
  Result<Layout> r = parse_layout(j.dump());
  EXPECT_FALSE(r.has_value()) << j.dump();
  return r.status();
}

OJson& component(OJson& j) { return j["groups"][0]["layers"][0]["components"][0]; }

constexpr const char* kK = "groups[0] ('full').layers[0] ('layers.0').components[0] ('k')";

TEST(LayoutJsonTest, ParsesTheDesignExampleIntoTheExpectedStruct) {
  Result<Layout> r = parse_layout(kDesignExample);
  ASSERT_TRUE(r.has_value()) << r.error().to_string();
  EXPECT_EQ(*r, design_layout());
}

TEST(LayoutJsonTest, AppliesDefaultsForOmittedOptionalFields) {
  OJson j = OJson::parse(kDesignExample);
  j["tensors"][0].erase("memory");
  for (const char* key : {"tokens_per_state", "window_tokens", "prefix_cacheable", "transfer"}) {
    j["groups"][0].erase(key);
  }
  // Without heads and a head axis the component is replicated.
  component(j).erase("heads");
  component(j)["axes"].erase(1);
  Result<Layout> r = parse_layout(j.dump());
  ASSERT_TRUE(r.has_value()) << r.error().to_string();
  const Group& g = r->groups[0];
  EXPECT_EQ(r->tensors[0].memory, "host");
  EXPECT_EQ(g.tokens_per_state, 1u);
  EXPECT_EQ(g.window_tokens, std::nullopt);
  EXPECT_TRUE(g.prefix_cacheable);
  EXPECT_TRUE(g.transfer);
  EXPECT_EQ(g.layers[0].components[0].heads, std::nullopt);
  EXPECT_EQ(g.layers[0].components[0].axes.size(), 2u);
}

TEST(LayoutJsonTest, AcceptsNullHeadsAsReplicated) {
  OJson j = OJson::parse(kDesignExample);
  component(j)["heads"] = nullptr;
  component(j)["axes"].erase(1);
  Result<Layout> r = parse_layout(j.dump());
  ASSERT_TRUE(r.has_value()) << r.error().to_string();
  EXPECT_EQ(r->groups[0].layers[0].components[0].heads, std::nullopt);
}

TEST(LayoutJsonTest, ParsesEveryGroupKindAndMixedRadixPositions) {
  Result<Layout> r = parse_layout(kHybrid);
  ASSERT_TRUE(r.has_value()) << r.error().to_string();
  ASSERT_EQ(r->groups.size(), 5u);
  EXPECT_EQ(r->groups[0].layers[0].components[0].positions_per_block(), 64u);
  EXPECT_EQ(r->groups[1].tokens_per_state, 4u);
  EXPECT_EQ(r->groups[2].kind, GroupKind::kSlidingWindow);
  EXPECT_EQ(r->groups[2].window_tokens, std::optional<uint64_t>(128));
  EXPECT_EQ(r->groups[3].kind, GroupKind::kState);
  EXPECT_EQ(r->groups[4].kind, GroupKind::kScratch);
  EXPECT_FALSE(r->groups[4].prefix_cacheable);
  EXPECT_FALSE(r->groups[4].transfer);
  EXPECT_EQ(r->tensors[2].memory, "cuda:0");
  const Component& latent = r->groups[0].layers[0].components[0];
  ASSERT_EQ(latent.axes.size(), 3u);
  EXPECT_EQ(latent.axes[1], (Axis{AxisKind::kPosition, 4, 1024}));
  EXPECT_EQ(latent.axes[2], (Axis{AxisKind::kPosition, 16, 64}));
}

void expect_exact_round_trip(const Layout& layout) {
  for (int indent : {-1, 0, 2, 4}) {
    const std::string text = to_json(layout, indent);
    Result<Layout> back = parse_layout(text);
    ASSERT_TRUE(back.has_value()) << back.error().to_string() << "\n" << text;
    EXPECT_EQ(*back, layout) << "indent " << indent;
    EXPECT_EQ(to_json(*back, indent), text) << "indent " << indent;
  }
}

TEST(LayoutJsonTest, RoundTripIsExactForTheDesignExample) { expect_exact_round_trip(design_layout()); }

TEST(LayoutJsonTest, RoundTripIsExactForEveryGroupKind) {
  Result<Layout> r = parse_layout(kHybrid);
  ASSERT_TRUE(r.has_value()) << r.error().to_string();
  expect_exact_round_trip(*r);
}

TEST(LayoutJsonTest, RoundTripIsExactForGeneratedLayouts) {
  for (uint32_t layers : {1u, 3u}) {
    for (uint32_t heads : {1u, 2u, 4u}) {
      for (uint64_t positions : {1u, 16u}) {
        Layout l = testing::small_gqa(layers, 4, heads, 4 - heads, positions, 3);
        ASSERT_TRUE(validate(l).ok()) << validate(l).to_string();
        expect_exact_round_trip(l);
      }
    }
  }
}

TEST(LayoutJsonTest, RoundTripKeepsValuesAtTheLimits) {
  Layout l = testing::small_gqa(1, kMaxHeads, 1, kMaxHeads - 1, 1, 1);
  l.tp_size = kMaxTpSize;
  l.tp_rank = kMaxTpSize - 1;
  l.tensors[0].bytes = kMaxTensorBytes;
  l.tensors[0].memory = "cuda:99999";
  l.groups[0].kind = GroupKind::kSlidingWindow;
  l.groups[0].window_tokens = UINT64_MAX;
  ASSERT_TRUE(validate(l).ok()) << validate(l).to_string();
  expect_exact_round_trip(l);
}

TEST(LayoutJsonTest, WritesEveryFieldInTheDocumentedOrder) {
  Layout l = design_layout();
  l.groups[0].layers[0].components[0].axes.resize(1);
  l.groups[0].layers[0].components[0].heads.reset();
  l.groups[0].num_blocks = 1024;
  l.groups[0].block_tokens = 1;
  EXPECT_EQ(to_json(l, -1),
            R"({"format":"kvbridge.layout/1","model":"llama3-8b","dtype":"bf16","tp_size":2,"tp_rank":1,)"
            R"("tensors":[{"name":"kv0","bytes":268435456,"memory":"host"}],)"
            R"("groups":[{"name":"full","kind":"attention","block_tokens":1,"tokens_per_state":1,)"
            R"("window_tokens":null,"prefix_cacheable":true,"transfer":true,"num_blocks":1024,)"
            R"("layers":[{"name":"layers.0","components":[{"name":"k","tensor":"kv0","offset":0,)"
            R"("cell_bytes":256,"axes":[{"axis":"block","size":1024,"stride":32768}]}]}]}]})");
}

// A PP stage's rank: /2, with pp_size and pp_rank, and the layers it does
// not hold written with their identity only; read back exactly.
TEST(LayoutJsonTest, APipelineStageIsWrittenAsVersion2AndReadBackExactly) {
  Layout l = design_layout();
  Layer other = l.groups[0].layers[0];
  other.name = "layers.1";
  l.groups[0].layers.push_back(other);
  l = as_pp_stage(l, 2, 1, {"layers.1"});
  ASSERT_TRUE(validate(l).ok()) << validate(l).to_string();
  EXPECT_EQ(to_json(l, -1),
            R"({"format":"kvbridge.layout/2","model":"llama3-8b","dtype":"bf16","tp_size":2,"tp_rank":1,)"
            R"("pp_size":2,"pp_rank":1,"tensors":[{"name":"kv0","bytes":268435456,"memory":"host"}],)"
            R"("groups":[{"name":"full","kind":"attention","block_tokens":16,"tokens_per_state":1,)"
            R"("window_tokens":null,"prefix_cacheable":true,"transfer":true,"num_blocks":1024,)"
            R"("layers":[{"name":"layers.0","held":false,"components":[{"name":"k","cell_bytes":256,)"
            R"("heads":{"total":8,"first":4,"count":4}}]},{"name":"layers.1","components":[{"name":"k","tensor":"kv0",)"
            R"("offset":0,"cell_bytes":256,"heads":{"total":8,"first":4,"count":4},"axes":[{"axis":"block",)"
            R"("size":1024,"stride":32768},{"axis":"head","size":4,"stride":4096},{"axis":"position","size":16,)"
            R"("stride":256}]}]}]}]})");
  expect_exact_round_trip(l);
  // The identity is the whole model's.
  Layout whole = design_layout();
  whole.groups[0].layers.push_back(other);
  EXPECT_EQ(compatibility_hash(l), compatibility_hash(whole));
  EXPECT_TRUE(check_compatible(l, whole).ok());
}

// A context shard: /3, with the group's "context", read back exactly; the
// identity does not depend on it.
TEST(LayoutJsonTest, AContextShardIsWrittenAsVersion3AndReadBackExactly) {
  Layout l = design_layout();
  l.groups[0].context = {2, 1, 16};
  ASSERT_TRUE(validate(l).ok()) << validate(l).to_string();
  const std::string text = to_json(l, -1);
  EXPECT_TRUE(Contains(text, R"({"format":"kvbridge.layout/3",)")) << text;
  EXPECT_TRUE(Contains(text, R"("num_blocks":1024,"context":{"size":2,"rank":1,"interleave":16},"layers")")) << text;
  expect_exact_round_trip(l);
  EXPECT_EQ(compatibility_hash(l), compatibility_hash(design_layout()));
  // interleave may be left out: 1.
  OJson j = OJson::parse(text);
  j["groups"][0]["context"].erase("interleave");
  Result<Layout> back = parse_layout(j.dump());
  ASSERT_TRUE(back.ok()) << back.error().to_string();
  EXPECT_EQ(back->groups[0].context, (ContextShard{2, 1, 1}));
}

// A /2 document without PP fields reads as one stage, like its /1 twin.
TEST(LayoutJsonTest, Version2WithoutPipelineFieldsReadsLikeVersion1) {
  OJson j = OJson::parse(kDesignExample);
  j["format"] = "kvbridge.layout/2";
  Result<Layout> v2 = parse_layout(j.dump());
  ASSERT_TRUE(v2.ok()) << v2.error().to_string();
  EXPECT_EQ(*v2, design_layout());
  EXPECT_EQ(v2->pp_size, 1u);
}

TEST(LayoutJsonTest, PrettyOutputKeepsEachAxisAndHeadMapOnOneLine) {
  const std::string text = to_json(design_layout(), 2);
  EXPECT_TRUE(Contains(text, "\n                {\"axis\": \"block\", \"size\": 1024, \"stride\": 32768},\n"));
  EXPECT_TRUE(Contains(text, "\"heads\": {\"total\": 8, \"first\": 4, \"count\": 4},\n"));
  EXPECT_TRUE(
      Contains(text, "\n  \"tensors\": [\n    {\"name\": \"kv0\", \"bytes\": 268435456, \"memory\": \"host\"}\n"));
  EXPECT_EQ(text.find('\n'), 1u);
}

TEST(LayoutJsonTest, WritesBytesThatAreNotUtf8AsReplacementCharacters) {
  // JSON text is Unicode, so such a name cannot survive a round trip; the
  // writer must still produce valid JSON rather than throw.
  Layout l = design_layout();
  l.model = "bad\xff";
  const std::string text = to_json(l, -1);
  EXPECT_TRUE(Contains(text, "\"model\":\"bad\xef\xbf\xbd\""));
  Result<Layout> back = parse_layout(text);
  ASSERT_TRUE(back.has_value()) << back.error().to_string();
  EXPECT_EQ(back->model, "bad\xef\xbf\xbd");
}

// ---------------------------------------------------------------------------
// Rejections. Each names the culprit.

using Rejection = testing::JsonRejection;

class LayoutJsonRejectionTest : public ::testing::TestWithParam<Rejection> {};

TEST_P(LayoutJsonRejectionTest, RejectsAndNamesTheCulprit) {
  const Rejection& c = GetParam();
  Status s = parse_edited(c.edit);
  EXPECT_EQ(s.code(), c.code) << s.to_string();
  if (c.partial) {
    EXPECT_TRUE(Contains(s.message(), c.message));
  } else {
    EXPECT_EQ(s.message(), c.message);
  }
}

const std::string kComp = kK;
const std::string kAxis2 = kComp + ".axes[2]";

INSTANTIATE_TEST_SUITE_P(
    Layout, LayoutJsonRejectionTest,
    ::testing::Values(
        // Unknown fields, at every level, with a suggestion for typos.
        Rejection{"UnknownTopLevelField", [](OJson& j) { j["modle"] = "x"; }, Code::kInvalidArgument,
                  R"(unknown field "modle" (did you mean "model"?))"},
        Rejection{"UnknownTensorField", [](OJson& j) { j["tensors"][0]["location"] = "x"; }, Code::kInvalidArgument,
                  R"(tensors[0] ('kv0'): unknown field "location")"},
        Rejection{"UnknownGroupField", [](OJson& j) { j["groups"][0]["window"] = 4; }, Code::kInvalidArgument,
                  R"(groups[0] ('full'): unknown field "window")"},
        Rejection{"UnknownLayerField", [](OJson& j) { j["groups"][0]["layers"][0]["index"] = 0; },
                  Code::kInvalidArgument, R"(groups[0] ('full').layers[0] ('layers.0'): unknown field "index")"},
        Rejection{"UnknownComponentField", [](OJson& j) { component(j)["strde"] = 1; }, Code::kInvalidArgument,
                  kComp + R"(: unknown field "strde")"},
        Rejection{"UnknownHeadsField", [](OJson& j) { component(j)["heads"]["cont"] = 4; }, Code::kInvalidArgument,
                  kComp + R"(.heads: unknown field "cont" (did you mean "count"?))"},
        Rejection{"UnknownAxisField", [](OJson& j) { component(j)["axes"][2]["strde"] = 1; }, Code::kInvalidArgument,
                  kAxis2 + R"(: unknown field "strde" (did you mean "stride"?))"},
        // Wrong types.
        Rejection{"StringForANumber", [](OJson& j) { j["tp_size"] = "2"; }, Code::kInvalidArgument,
                  R"(tp_size: expected an unsigned integer, got the string "2")"},
        Rejection{"BooleanForANumber", [](OJson& j) { j["groups"][0]["num_blocks"] = true; }, Code::kInvalidArgument,
                  "groups[0] ('full').num_blocks: expected an unsigned integer, got true"},
        Rejection{"NumberForABoolean", [](OJson& j) { j["groups"][0]["prefix_cacheable"] = 1; }, Code::kInvalidArgument,
                  "groups[0] ('full').prefix_cacheable: expected true or false, got 1"},
        Rejection{"NullForABoolean", [](OJson& j) { j["groups"][0]["transfer"] = nullptr; }, Code::kInvalidArgument,
                  "groups[0] ('full').transfer: expected true or false, got null"},
        Rejection{"ObjectForAnArray", [](OJson& j) { j["tensors"] = OJson::object(); }, Code::kInvalidArgument,
                  "tensors: expected an array, got an object"},
        Rejection{"ArrayForAnObject",
                  [](OJson& j) {
                    component(j)["heads"] = {8, 4, 4};
                  },
                  Code::kInvalidArgument, kComp + ".heads: expected an object, got an array"},
        Rejection{"NumberForAGroup", [](OJson& j) { j["groups"][0] = 3; }, Code::kInvalidArgument,
                  "groups[0]: expected an object, got 3"},
        Rejection{"NumberForAName", [](OJson& j) { j["groups"][0]["layers"][0]["name"] = 3; }, Code::kInvalidArgument,
                  "groups[0] ('full').layers[0].name: expected a name (a non-empty string), got 3"},
        Rejection{"StringForWindowTokens", [](OJson& j) { j["groups"][0]["window_tokens"] = "128"; },
                  Code::kInvalidArgument,
                  R"(groups[0] ('full').window_tokens: expected an unsigned integer or null, got the string "128")"},
        Rejection{"EmptyName", [](OJson& j) { component(j)["name"] = ""; }, Code::kInvalidArgument,
                  "groups[0] ('full').layers[0] ('layers.0').components[0].name: expected a name (a non-empty "
                  "string), got the empty string"},
        Rejection{"NameLongerThanTheLimit", [](OJson& j) { j["model"] = std::string(kMaxNameBytes + 1, 'm'); },
                  Code::kResourceExhausted, "model: the name is 257 bytes, longer than the limit of 256"},
        // Numbers that are not unsigned integers.
        Rejection{"NegativeNumber", [](OJson& j) { component(j)["axes"][2]["stride"] = -4; }, Code::kInvalidArgument,
                  kAxis2 + ".stride: expected an unsigned integer, got -4"},
        Rejection{"FractionalNumber", [](OJson& j) { component(j)["cell_bytes"] = 2.5; }, Code::kInvalidArgument,
                  kComp + ".cell_bytes: expected an unsigned integer, got 2.5"},
        Rejection{"IntegralFloat", [](OJson& j) { component(j)["cell_bytes"] = 256.0; }, Code::kInvalidArgument,
                  kComp + ".cell_bytes: expected an unsigned integer, got 256.0"},
        Rejection{"NumberPast64Bits", [](OJson& j) { j["tensors"][0]["bytes"] = OJson::parse("18446744073709551616"); },
                  Code::kInvalidArgument,
                  "tensors[0] ('kv0').bytes: expected an unsigned integer, got 1.8446744073709552e+19"},
        // Values above the bounds of layout.h.
        Rejection{"TensorBytesAboveTheLimit", [](OJson& j) { j["tensors"][0]["bytes"] = kMaxTensorBytes + 1; },
                  Code::kResourceExhausted,
                  "tensors[0] ('kv0').bytes: 72057594037927937 is larger than the limit 72057594037927936"},
        Rejection{"TpSizeAboveTheLimit", [](OJson& j) { j["tp_size"] = kMaxTpSize + 1; }, Code::kResourceExhausted,
                  "tp_size: 65537 is larger than the limit 65536"},
        Rejection{"TpRankAboveTheLimit", [](OJson& j) { j["tp_rank"] = uint64_t{1} << 32; }, Code::kResourceExhausted,
                  "tp_rank: 4294967296 is larger than the limit 65535"},
        Rejection{"HeadsAboveTheLimit", [](OJson& j) { component(j)["heads"]["total"] = kMaxHeads + 1; },
                  Code::kResourceExhausted, kComp + ".heads.total: 65537 is larger than the limit 65536"},
        Rejection{"NumBlocksAboveTheLimit", [](OJson& j) { j["groups"][0]["num_blocks"] = kMaxNumBlocks + 1; },
                  Code::kResourceExhausted,
                  "groups[0] ('full').num_blocks: 4294967297 is larger than the limit 4294967296"},
        Rejection{"BlockTokensAboveTheLimit", [](OJson& j) { j["groups"][0]["block_tokens"] = kMaxBlockTokens + 1; },
                  Code::kResourceExhausted,
                  "groups[0] ('full').block_tokens: 16777217 is larger than the limit 16777216"},
        Rejection{"CellBytesAboveTheLimit", [](OJson& j) { component(j)["cell_bytes"] = kMaxCellBytes + 1; },
                  Code::kResourceExhausted, kComp + ".cell_bytes: 4294967297 is larger than the limit 4294967296"},
        Rejection{"TooManyAxes",
                  [](OJson& j) {
                    for (int i = 0; i < 4; ++i)
                      component(j)["axes"].push_back({{"axis", "position"}, {"size", 1}, {"stride", 0}});
                  },
                  Code::kResourceExhausted, kComp + ".axes: has 7 entries, more than the limit of 6"},
        // Missing required fields, at every level.
        Rejection{"MissingTopLevelField", [](OJson& j) { j.erase("dtype"); }, Code::kInvalidArgument,
                  R"(missing required field "dtype")"},
        Rejection{"MissingTensorField", [](OJson& j) { j["tensors"][0].erase("bytes"); }, Code::kInvalidArgument,
                  R"(tensors[0] ('kv0'): missing required field "bytes")"},
        Rejection{"MissingGroupField", [](OJson& j) { j["groups"][0].erase("num_blocks"); }, Code::kInvalidArgument,
                  R"(groups[0] ('full'): missing required field "num_blocks")"},
        Rejection{"MissingGroupName", [](OJson& j) { j["groups"][0].erase("name"); }, Code::kInvalidArgument,
                  R"(groups[0]: missing required field "name")"},
        Rejection{"MissingLayerField", [](OJson& j) { j["groups"][0]["layers"][0].erase("components"); },
                  Code::kInvalidArgument,
                  R"(groups[0] ('full').layers[0] ('layers.0'): missing required field "components")"},
        Rejection{"MissingComponentField", [](OJson& j) { component(j).erase("cell_bytes"); }, Code::kInvalidArgument,
                  kComp + R"(: missing required field "cell_bytes")"},
        Rejection{"MissingHeadsField", [](OJson& j) { component(j)["heads"].erase("count"); }, Code::kInvalidArgument,
                  kComp + R"(.heads: missing required field "count")"},
        Rejection{"MissingAxisField", [](OJson& j) { component(j)["axes"][2].erase("stride"); }, Code::kInvalidArgument,
                  kAxis2 + R"(: missing required field "stride")"},
        // Enumerations and the format.
        Rejection{"WrongFormat", [](OJson& j) { j["format"] = "kvbridge.layout/4"; }, Code::kInvalidArgument,
                  R"(format: expected "kvbridge.layout/3" (or "kvbridge.layout/2" or "kvbridge.layout/1"), got )"
                  R"("kvbridge.layout/4")"},
        // A /2 document has no context shards.
        Rejection{"ContextInVersion2",
                  [](OJson& j) {
                    j["format"] = "kvbridge.layout/2";
                    j["groups"][0]["context"] = {{"size", 2}, {"rank", 0}};
                  },
                  Code::kInvalidArgument, R"(groups[0] ('full'): unknown field "context")"},
        Rejection{"ContextRankPastSize",
                  [](OJson& j) {
                    j["format"] = "kvbridge.layout/3";
                    j["groups"][0]["context"] = {{"size", 2}, {"rank", 2}};
                  },
                  Code::kInvalidArgument, R"(group 'full': context.rank 2 must be below context.size 2)"},
        // An unsharded context is never written, so an interleave there could not round-trip.
        Rejection{"ContextInterleaveWithOneShard",
                  [](OJson& j) {
                    j["format"] = "kvbridge.layout/3";
                    j["groups"][0]["context"] = {{"size", 1}, {"rank", 0}, {"interleave", 16}};
                  },
                  Code::kInvalidArgument,
                  R"(group 'full': context.interleave 16 needs context.size above 1 (one shard holds every )"
                  R"(position in order); leave the interleave at 1 or the context out)"},
        Rejection{"ContextUnknownField",
                  [](OJson& j) {
                    j["format"] = "kvbridge.layout/3";
                    j["groups"][0]["context"] = {{"size", 2}, {"rank", 0}, {"stride", 1}};
                  },
                  Code::kInvalidArgument, R"(groups[0] ('full').context: unknown field "stride")"},
        // A /1 document has no /2 fields.
        Rejection{"PpFieldInVersion1", [](OJson& j) { j["pp_size"] = 2; }, Code::kInvalidArgument,
                  R"(unknown field "pp_size")", true},
        Rejection{"HeldInVersion1", [](OJson& j) { j["groups"][0]["layers"][0]["held"] = false; },
                  Code::kInvalidArgument, R"(unknown field "held")", true},
        // /2: a layer not held carries its identity only, and pp_size 1 holds all.
        Rejection{"UnheldWithGeometry",
                  [](OJson& j) {
                    j["format"] = "kvbridge.layout/2";
                    j["pp_size"] = 2;
                    j["groups"][0]["layers"][0]["held"] = false;
                  },
                  Code::kInvalidArgument, R"(components[0] ('k'): unknown field)", true},
        Rejection{"UnheldWithOneStage",
                  [](OJson& j) {
                    j["format"] = "kvbridge.layout/2";
                    OJson& c = component(j);
                    c.erase("tensor");
                    c.erase("offset");
                    c.erase("axes");
                    j["groups"][0]["layers"][0]["held"] = false;
                  },
                  Code::kInvalidArgument, R"(is not held, but pp_size is 1)", true},
        Rejection{"NothingHeld",
                  [](OJson& j) {
                    j["format"] = "kvbridge.layout/2";
                    j["pp_size"] = 2;
                    OJson& c = component(j);
                    c.erase("tensor");
                    c.erase("offset");
                    c.erase("axes");
                    j["groups"][0]["layers"][0]["held"] = false;
                  },
                  Code::kInvalidArgument, R"(the layout holds no layer)", true},
        Rejection{"PpRankPastSize",
                  [](OJson& j) {
                    j["format"] = "kvbridge.layout/2";
                    j["pp_size"] = 2;
                    j["pp_rank"] = 2;
                  },
                  Code::kInvalidArgument, R"(pp_rank 2 must be below pp_size 2)", true},
        Rejection{"MissingFormat", [](OJson& j) { j.erase("format"); }, Code::kInvalidArgument,
                  R"(missing required field "format")"},
        Rejection{"RequestFormat", [](OJson& j) { j["format"] = "kvbridge.request/1"; }, Code::kInvalidArgument,
                  R"(format: expected "kvbridge.layout/3" (or "kvbridge.layout/2" or "kvbridge.layout/1"), got )"
                  R"("kvbridge.request/1")"},
        Rejection{
            "BadKind", [](OJson& j) { j["groups"][0]["kind"] = "mla"; }, Code::kInvalidArgument,
            R"(groups[0] ('full').kind: unknown kind "mla"; expected attention, sliding_window, state or scratch)"},
        Rejection{"BadAxisName", [](OJson& j) { component(j)["axes"][2]["axis"] = "token"; }, Code::kInvalidArgument,
                  kAxis2 + R"(.axis: unknown axis "token"; expected block, head or position)"},
        Rejection{"BadMemory", [](OJson& j) { j["tensors"][0]["memory"] = "gpu0"; }, Code::kInvalidArgument,
                  R"(tensors[0] ('kv0').memory: unknown memory "gpu0"; expected "host" or "cuda:N" (N: 0 to 99999))"},
        Rejection{"CudaWithoutDevice", [](OJson& j) { j["tensors"][0]["memory"] = "cuda:"; }, Code::kInvalidArgument,
                  R"(tensors[0] ('kv0').memory: unknown memory "cuda:")", true},
        Rejection{"CudaWithNonDecimalDevice", [](OJson& j) { j["tensors"][0]["memory"] = "cuda:0x1"; },
                  Code::kInvalidArgument, R"(tensors[0] ('kv0').memory: unknown memory "cuda:0x1")", true},
        Rejection{"TopLevelArray", [](OJson& j) { j = OJson::array(); }, Code::kInvalidArgument,
                  "expected a JSON object at the top level, got an array"},
        // Structurally fine, semantically wrong: validate() names the component.
        Rejection{"BlockAxisSizeDiffersFromNumBlocks", [](OJson& j) { component(j)["axes"][0]["size"] = 1023; },
                  Code::kInvalidArgument,
                  "group 'full': layer 'layers.0' component 'k': block axis size 1023 differs from the group's "
                  "num_blocks 1024"},
        Rejection{"CellsPastTheTensor", [](OJson& j) { j["tensors"][0]["bytes"] = 32768 * 1023; }, Code::kOutOfRange,
                  "group 'full': layer 'layers.0' component 'k': cells end at byte", true}),
    [](const ::testing::TestParamInfo<Rejection>& info) { return std::string(info.param.name); });

TEST(LayoutJsonTest, RejectsDuplicateFieldAndNamesIt) {
  std::string text = to_json(design_layout(), -1);
  const std::string once = R"("offset":0,)";
  const size_t at = text.find(once);
  ASSERT_NE(at, std::string::npos);
  text.insert(at, R"("offset":64,)");
  Result<Layout> r = parse_layout(text);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().message(), R"(groups[0].layers[0].components[0]: duplicate field "offset")");
}

TEST(LayoutJsonTest, RejectsNegativeZeroAsNotUnsigned) {
  std::string text = to_json(design_layout(), -1);
  const size_t at = text.find(R"("offset":0)");
  ASSERT_NE(at, std::string::npos);
  text.insert(at + 9, "-");
  Result<Layout> r = parse_layout(text);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().message(), std::string(kK) + ".offset: expected an unsigned integer, got -0");
}

TEST(LayoutJsonTest, RejectsInvalidJsonWithLineAndColumn) {
  Result<Layout> r = parse_layout("{\"format\": \"kvbridge.layout/1\",\n \"model\": }");
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), Code::kInvalidArgument);
  EXPECT_TRUE(Contains(r.error().message(), "invalid JSON: parse error at line 2, column 11"));
}

TEST(LayoutJsonTest, RejectsANumberTooLargeForADouble) {
  std::string text = to_json(design_layout(), -1);
  const size_t at = text.find(R"("offset":0)");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 10, R"("offset":1e400)");
  Result<Layout> r = parse_layout(text);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), Code::kInvalidArgument);
  EXPECT_TRUE(Contains(r.error().message(), "invalid JSON: number overflow parsing '1e400'")) << r.error().message();
}

TEST(LayoutJsonTest, RejectsTrailingText) {
  Result<Layout> r = parse_layout(std::string(kDesignExample) + " {}");
  ASSERT_FALSE(r.has_value());
  EXPECT_TRUE(Contains(r.error().message(), "invalid JSON"));
}

TEST(LayoutJsonTest, RejectsNestingDeeperThanTheLimitBeforeParsing) {
  // Valid JSON apart from its depth: the pre-scan must catch it.
  const std::string deep = "{\"format\": " + std::string(kMaxJsonDepth, '[') + std::string(kMaxJsonDepth, ']') + "}";
  Result<Layout> r = parse_layout(deep);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), Code::kResourceExhausted);
  EXPECT_EQ(r.error().message(), "JSON nests deeper than 32 levels (at byte 42)");
  // One level less is parsed (and rejected for its type, not its depth).
  const std::string ok =
      "{\"format\": " + std::string(kMaxJsonDepth - 1, '[') + std::string(kMaxJsonDepth - 1, ']') + "}";
  Result<Layout> r2 = parse_layout(ok);
  ASSERT_FALSE(r2.has_value());
  EXPECT_EQ(r2.error().message(), "format: expected a string, got an array");
}

TEST(LayoutJsonTest, IgnoresBracketsAndEscapedQuotesInsideStringsWhenMeasuringDepth) {
  OJson j = OJson::parse(kDesignExample);
  j["model"] = "a\\\"" + std::string(100, '[') + "\"{{{{";
  Result<Layout> r = parse_layout(j.dump());
  ASSERT_TRUE(r.has_value()) << r.error().to_string();
  EXPECT_EQ(r->model, j["model"].get<std::string>());
}

TEST(LayoutJsonTest, RejectsInputLargerThanTheLimit) {
  std::string big(kMaxJsonBytes + 1, ' ');
  big.replace(0, 2, "{}");
  Result<Layout> r = parse_layout(big);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), Code::kResourceExhausted);
  EXPECT_EQ(r.error().message(), "the JSON text is 67108865 bytes, more than the limit of 67108864");
}

TEST(LayoutJsonTest, RejectsEmptyAndNonJsonInput) {
  for (const char* text : {"", "   ", "null", "kvbridge", "\xff"}) {
    Result<Layout> r = parse_layout(text);
    ASSERT_FALSE(r.has_value()) << text;
    EXPECT_EQ(r.error().code(), Code::kInvalidArgument) << text;
  }
}

}  // namespace
}  // namespace kvbridge
