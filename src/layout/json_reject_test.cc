// kvbridge.layout/1 rejections: one per rule, each an edit of the design
// example that must fail with its code and a message naming the culprit's
// JSON path.
#include <gtest/gtest.h>

#include <string>

#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"
#include "layout/json_test_util.h"
#include "layout/test_json.h"
#include "testing/contains.h"

namespace kvbridge {
namespace {

using namespace layout_json_testing;
using testing::Contains;

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

}  // namespace
}  // namespace kvbridge
