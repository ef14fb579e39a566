// kvbridge.layout/1: parsing into the expected struct, defaults, exact round
// trips, and the rejections of what is not JSON or breaks its limits (one
// rejection per layout rule is json_reject_test.cc's), each checking that
// the message names the culprit.
#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"
#include "layout/json_test_util.h"
#include "layout/test_layouts.h"
#include "testing/contains.h"

namespace kvbridge {
namespace {

using namespace layout_json_testing;

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

using testing::Contains;

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
