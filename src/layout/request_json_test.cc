// kvbridge.request/1: parsing, defaults, exact round trips, and one rejection
// per rule, each checking that the message names the culprit's JSON path.
#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "kvbridge/layout_json.h"
#include "layout/test_json.h"
#include "testing/contains.h"

namespace kvbridge {
namespace {

using OJson = nlohmann::ordered_json;

// The example of DESIGN.md, "What a request transfers".
constexpr const char* kDesignRequest =
    R"({"format": "kvbridge.request/1", "num_tokens": 5000, "skip_tokens": 0,
        "blocks": {"full": {"local": [7, 8, 9], "remote": [40, 41, 42]}}})";

using testing::Contains;

Request hybrid_request() {
  Request r;
  r.num_tokens = 70000;
  r.skip_tokens = 4096;
  r.blocks["full"] = {{3, 4, 5, -1}, {10, 11, 12, 13}};
  r.blocks["swa"] = {{-1, -1, 9}, {-1, 2, 3}};
  r.blocks["mamba"] = {{6}, {1, 2, 3, 4}};
  r.blocks["ring"] = {{}, {}};
  r.blocks["a b"] = {{0}, {INT64_MAX}};
  return r;
}

TEST(RequestJsonTest, ParsesTheDesignExampleIntoTheExpectedStruct) {
  Result<Request> r = parse_request(kDesignRequest);
  ASSERT_TRUE(r.has_value()) << r.error().to_string();
  Request expected;
  expected.num_tokens = 5000;
  expected.blocks["full"] = {{7, 8, 9}, {40, 41, 42}};
  EXPECT_EQ(*r, expected);
}

TEST(RequestJsonTest, SkipTokensDefaultsToZero) {
  Result<Request> r = parse_request(R"({"format": "kvbridge.request/1", "num_tokens": 3, "blocks": {}})");
  ASSERT_TRUE(r.has_value()) << r.error().to_string();
  EXPECT_EQ(r->skip_tokens, 0u);
  EXPECT_EQ(r->num_tokens, 3u);
  EXPECT_TRUE(r->blocks.empty());
}

TEST(RequestJsonTest, AcceptsMinusOneForABlockThatMovesNothing) {
  Result<Request> r = parse_request(
      R"({"format": "kvbridge.request/1", "num_tokens": 48, "skip_tokens": 48,
          "blocks": {"swa": {"local": [-1, -1, 5], "remote": [-1, 0, 9223372036854775807]}}})");
  ASSERT_TRUE(r.has_value()) << r.error().to_string();
  EXPECT_EQ(r->blocks.at("swa").local, (std::vector<int64_t>{-1, -1, 5}));
  EXPECT_EQ(r->blocks.at("swa").remote, (std::vector<int64_t>{-1, 0, INT64_MAX}));
}

TEST(RequestJsonTest, RoundTripIsExactForStructAndText) {
  for (const Request& request : {hybrid_request(), Request{}}) {
    for (int indent : {-1, 0, 2}) {
      const std::string text = to_json(request, indent);
      Result<Request> back = parse_request(text);
      ASSERT_TRUE(back.has_value()) << back.error().to_string() << "\n" << text;
      EXPECT_EQ(*back, request);
      EXPECT_EQ(to_json(*back, indent), text);
    }
  }
}

TEST(RequestJsonTest, WritesEveryFieldInTheDocumentedOrder) {
  Result<Request> r = parse_request(kDesignRequest);
  ASSERT_TRUE(r.has_value()) << r.error().to_string();
  EXPECT_EQ(to_json(*r, -1), R"({"format":"kvbridge.request/1","num_tokens":5000,"skip_tokens":0,)"
                             R"("blocks":{"full":{"local":[7,8,9],"remote":[40,41,42]}}})");
  EXPECT_EQ(to_json(*r, 2),
            "{\n  \"format\": \"kvbridge.request/1\",\n  \"num_tokens\": 5000,\n  \"skip_tokens\": 0,\n"
            "  \"blocks\": {\n    \"full\": {\n      \"local\": [7, 8, 9],\n      \"remote\": [40, 41, 42]\n"
            "    }\n  }\n}");
}

using Rejection = testing::JsonRejection;

class RequestJsonRejectionTest : public ::testing::TestWithParam<Rejection> {};

TEST_P(RequestJsonRejectionTest, RejectsAndNamesTheCulprit) {
  const Rejection& c = GetParam();
  OJson j = OJson::parse(kDesignRequest);
  c.edit(j);
  Result<Request> r = parse_request(j.dump());
  ASSERT_FALSE(r.has_value()) << j.dump();
  EXPECT_EQ(r.error().code(), c.code) << r.error().to_string();
  EXPECT_EQ(r.error().message(), c.message);
}

INSTANTIATE_TEST_SUITE_P(
    Request, RequestJsonRejectionTest,
    ::testing::Values(
        Rejection{"UnknownTopLevelField", [](OJson& j) { j["skip_token"] = 1; }, Code::kInvalidArgument,
                  R"(unknown field "skip_token" (did you mean "skip_tokens"?))"},
        Rejection{"UnknownGroupField", [](OJson& j) { j["blocks"]["full"]["locals"] = OJson::array(); },
                  Code::kInvalidArgument, R"(blocks.full: unknown field "locals" (did you mean "local"?))"},
        Rejection{"IdBelowMinusOne", [](OJson& j) { j["blocks"]["full"]["remote"].push_back(-2); },
                  Code::kInvalidArgument,
                  "blocks.full.remote[3]: expected a block id (an integer from -1 to 2^63-1), got -2"},
        Rejection{"FractionalId", [](OJson& j) { j["blocks"]["full"]["local"][1] = 8.5; }, Code::kInvalidArgument,
                  "blocks.full.local[1]: expected a block id (an integer from -1 to 2^63-1), got 8.5"},
        Rejection{"StringId", [](OJson& j) { j["blocks"]["full"]["local"][0] = "7"; }, Code::kInvalidArgument,
                  R"(blocks.full.local[0]: expected a block id (an integer from -1 to 2^63-1), got the string "7")"},
        Rejection{"IdPastInt64", [](OJson& j) { j["blocks"]["full"]["local"][2] = uint64_t{1} << 63; },
                  Code::kInvalidArgument,
                  "blocks.full.local[2]: expected a block id (an integer from -1 to 2^63-1), got 9223372036854775808"},
        Rejection{"IdInAGroupWithAnOddName",
                  [](OJson& j) {
                    j["blocks"]["a b"] = {{"local", {true}}, {"remote", OJson::array()}};
                  },
                  Code::kInvalidArgument,
                  R"(blocks["a b"].local[0]: expected a block id (an integer from -1 to 2^63-1), got true)"},
        Rejection{"SkipTokensPastNumTokens", [](OJson& j) { j["skip_tokens"] = 5001; }, Code::kInvalidArgument,
                  "skip_tokens: 5001 is larger than num_tokens 5000"},
        Rejection{"NegativeNumTokens", [](OJson& j) { j["num_tokens"] = -1; }, Code::kInvalidArgument,
                  "num_tokens: expected an unsigned integer, got -1"},
        Rejection{"FractionalSkipTokens", [](OJson& j) { j["skip_tokens"] = 0.5; }, Code::kInvalidArgument,
                  "skip_tokens: expected an unsigned integer, got 0.5"},
        Rejection{"MissingNumTokens", [](OJson& j) { j.erase("num_tokens"); }, Code::kInvalidArgument,
                  R"(missing required field "num_tokens")"},
        Rejection{"MissingBlocks", [](OJson& j) { j.erase("blocks"); }, Code::kInvalidArgument,
                  R"(missing required field "blocks")"},
        Rejection{"MissingRemoteList", [](OJson& j) { j["blocks"]["full"].erase("remote"); }, Code::kInvalidArgument,
                  R"(blocks.full: missing required field "remote")"},
        Rejection{"BlocksAsAnArray", [](OJson& j) { j["blocks"] = OJson::array(); }, Code::kInvalidArgument,
                  "blocks: expected an object, got an array"},
        Rejection{"GroupEntryAsAnArray",
                  [](OJson& j) {
                    j["blocks"]["full"] = {7, 8};
                  },
                  Code::kInvalidArgument, "blocks.full: expected an object, got an array"},
        Rejection{"ListAsANumber", [](OJson& j) { j["blocks"]["full"]["local"] = 7; }, Code::kInvalidArgument,
                  "blocks.full.local: expected an array, got 7"},
        Rejection{"EmptyGroupName", [](OJson& j) { j["blocks"][""] = j["blocks"]["full"]; }, Code::kInvalidArgument,
                  R"(blocks[""]: expected a name (a non-empty string), got the empty string)"},
        Rejection{"TooManyGroups",
                  [](OJson& j) {
                    for (size_t i = 0; i < kMaxGroups; ++i) j["blocks"]["g" + std::to_string(i)] = j["blocks"]["full"];
                  },
                  Code::kResourceExhausted, "blocks: has 257 groups, more than the limit of 256"},
        Rejection{"WrongFormat", [](OJson& j) { j["format"] = "kvbridge.layout/1"; }, Code::kInvalidArgument,
                  R"(format: expected "kvbridge.request/1", got "kvbridge.layout/1")"},
        Rejection{"FormatAsANumber", [](OJson& j) { j["format"] = 1; }, Code::kInvalidArgument,
                  "format: expected a string, got 1"}),
    [](const ::testing::TestParamInfo<Rejection>& info) { return std::string(info.param.name); });

TEST(RequestJsonTest, RejectsADuplicateGroupAndNamesIt) {
  Result<Request> r = parse_request(
      R"({"format": "kvbridge.request/1", "num_tokens": 1,
          "blocks": {"full": {"local": [1], "remote": [2]}, "full": {"local": [3], "remote": [4]}}})");
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().message(), R"(blocks: duplicate field "full")");
}

TEST(RequestJsonTest, RejectsNestingDeeperThanTheLimit) {
  const std::string deep = R"({"format": "kvbridge.request/1", "num_tokens": 1, "blocks": {"full": {"local": )" +
                           std::string(40, '[') + std::string(40, ']') + "}}}";
  Result<Request> r = parse_request(deep);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), Code::kResourceExhausted);
  EXPECT_TRUE(Contains(r.error().message(), "JSON nests deeper than 32 levels"));
}

TEST(RequestJsonTest, RejectsInputLargerThanTheLimit) {
  std::string big(kMaxJsonBytes + 1, ' ');
  big.replace(0, 2, "{}");
  Result<Request> r = parse_request(big);
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), Code::kResourceExhausted);
  EXPECT_EQ(r.error().message(), "the JSON text is 67108865 bytes, more than the limit of 67108864");
}

TEST(RequestJsonTest, RejectsInvalidJson) {
  Result<Request> r = parse_request(R"({"format": "kvbridge.request/1", "num_tokens": 1,)");
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), Code::kInvalidArgument);
  EXPECT_TRUE(Contains(r.error().message(), "invalid JSON: parse error at line 1"));
}

}  // namespace
}  // namespace kvbridge
