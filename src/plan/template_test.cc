// Plan templates (plan.h) on hand-picked cases: instances equal plan() for
// other ids of the shape, merging follows the ids, errors are plan()'s or
// name the difference from the shape, and a template that is not uniform
// falls back to plan(). The random cases are in template_property_test.cc.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kvbridge/plan.h"
#include "kvbridge/presets.h"
#include "kvbridge/verify.h"
#include "plan/preset_instances.h"
#include "plan/template.h"

namespace kvbridge {
namespace {

std::vector<Layout> tp_instance(const std::string& name, uint32_t tp, Order order = Order::kLBHNC,
                                uint64_t num_blocks = 64, uint64_t block_tokens = 16) {
  Result<std::vector<Layout>> out = testing::preset_instance(
      PresetOptions{.name = name, .block_tokens = block_tokens, .order = order, .num_blocks = num_blocks}, tp);
  EXPECT_TRUE(out.ok()) << name << " TP " << tp << ": " << out.error().to_string();
  return out ? *out : std::vector<Layout>{};
}

Request attention_request(uint64_t num_tokens, uint64_t skip_tokens, std::vector<int64_t> local,
                          std::vector<int64_t> remote) {
  Request r;
  r.num_tokens = num_tokens;
  r.skip_tokens = skip_tokens;
  r.blocks["full"] = {std::move(local), std::move(remote)};
  return r;
}

void expect_same(const Result<Plan>& instance, const Result<Plan>& planned) {
  ASSERT_EQ(instance.has_value(), planned.has_value())
      << (instance ? "" : instance.error().to_string()) << (planned ? "" : planned.error().to_string());
  if (!instance) {
    EXPECT_EQ(instance.error().code(), planned.error().code());
    EXPECT_EQ(instance.error().message(), planned.error().message());
    return;
  }
  EXPECT_EQ(instance->descriptors, planned->descriptors);
  EXPECT_EQ(instance->bytes, planned->bytes);
  ASSERT_EQ(instance->sources.size(), planned->sources.size());
  for (size_t s = 0; s < planned->sources.size(); ++s) {
    EXPECT_EQ(instance->sources[s].tp_rank, planned->sources[s].tp_rank);
    EXPECT_EQ(instance->sources[s].descriptors, planned->sources[s].descriptors);
    EXPECT_EQ(instance->sources[s].bytes, planned->sources[s].bytes);
  }
}

TEST(PlanTemplateTest, InstancesAreWhatPlanReturnsForOtherIdsOfTheShape) {
  const std::vector<Layout> prefill = tp_instance("llama3-8b", 4);
  const std::vector<Layout> decode = tp_instance("llama3-8b", 2, Order::kBLHNC);
  const Request first = attention_request(70, 20, {-1, 3, 4, 5, 6}, {-1, 10, 11, 12, 13});
  Result<PlanTemplate> t = PlanTemplate::create(decode[1], prefill, shape_of(first));
  ASSERT_TRUE(t.ok()) << t.error().to_string();
  EXPECT_TRUE(t->uniform()) << t->fallback_reason();
  EXPECT_TRUE(t->fallback_reason().empty());
  EXPECT_GT(t->pieces(), 0u);
  for (const Request& r : {first, attention_request(70, 20, {-1, 9, 2, 40, 7}, {-1, 0, 63, 5, 6}),
                           attention_request(70, 20, {-1, 60, 61, 62, 63}, {-1, 1, 2, 3, 4})}) {
    const Result<Plan> got = t->instantiate(r);
    expect_same(got, plan(decode[1], prefill, r));
    ASSERT_TRUE(got.ok());
    EXPECT_TRUE(verify(*got, decode[1], prefill, r).ok());
  }
}

TEST(PlanTemplateTest, ConsecutiveIdsMergeAcrossBlocksAndShuffledOnesDoNot) {
  const std::vector<Layout> prefill = tp_instance("llama3-8b", 1);
  const std::vector<Layout> decode = tp_instance("llama3-8b", 1);
  Result<PlanTemplate> t =
      PlanTemplate::create(decode[0], prefill, shape_of(attention_request(64, 0, {0, 1, 2, 3}, {0, 1, 2, 3})));
  ASSERT_TRUE(t.ok());
  const Result<Plan> merged = t->instantiate(attention_request(64, 0, {8, 9, 10, 11}, {20, 21, 22, 23}));
  const Result<Plan> apart = t->instantiate(attention_request(64, 0, {8, 30, 10, 2}, {20, 21, 22, 23}));
  ASSERT_TRUE(merged.ok() && apart.ok());
  // One tensor per layer with K|V rows: one descriptor per layer, or one per
  // (layer, block) when the ids do not continue.
  const uint64_t layers = decode[0].groups[0].layers.size();
  EXPECT_EQ(merged->descriptors.size(), layers);
  EXPECT_EQ(apart->descriptors.size(), 4 * layers);
  EXPECT_EQ(merged->bytes, apart->bytes);
  expect_same(apart, plan(decode[0], prefill, attention_request(64, 0, {8, 30, 10, 2}, {20, 21, 22, 23})));
}

TEST(PlanTemplateTest, InstantiatingIntoAUsedPlanGivesTheSamePlan) {
  const std::vector<Layout> prefill = tp_instance("deepseek-v3", 2, Order::kLBHNC, 64, 64);
  const std::vector<Layout> decode = tp_instance("deepseek-v3", 4, Order::kBLHNC, 64, 64);
  Request r;
  r.num_tokens = 300;
  r.blocks["mla"] = {{5, 7, 9, 11, 13}, {1, 2, 3, 4, 6}};
  Result<PlanTemplate> t = PlanTemplate::create(decode[3], prefill, shape_of(r));
  ASSERT_TRUE(t.ok()) << t.error().to_string();
  Plan reused;
  ASSERT_TRUE(t->instantiate(r, &reused).ok());
  r.blocks["mla"] = {{40, 41, 42, 43, 44}, {6, 4, 3, 2, 1}};
  ASSERT_TRUE(t->instantiate(r, &reused).ok());
  expect_same(Result<Plan>(reused), plan(decode[3], prefill, r));
}

// A request far smaller than its cache: its ids are put in order by a
// radix sort, one pass per 8 bits of the largest block id (`blocks`: two
// passes of 8 bits for 20,000, three of 7 for 300,000). Ids that
// share their low digits, or differ only in the top one, must still come
// out in order, and the compact instance must be the plan.
void few_shuffled_ids_emit_in_id_order(const uint64_t kBlocks) {
  SCOPED_TRACE(std::to_string(kBlocks) + " blocks");
  const std::vector<Layout> prefill = tp_instance("llama3-8b", 2, Order::kLBHNC, kBlocks);
  const std::vector<Layout> decode = tp_instance("llama3-8b", 1, Order::kLBHNC, kBlocks);
  std::vector<int64_t> local, remote;
  for (int64_t i = 0; i < 64; ++i) {
    // Distinct low digits (7919 is odd), below kBlocks - 1; distinct remote
    // ids above 7.
    local.push_back((i * 7919 + 13) % 256 + 256 * ((i * 37) % static_cast<int64_t>((kBlocks - 2) / 256)));
    remote.push_back(static_cast<int64_t>(kBlocks) - 1 - (i * 4099) % static_cast<int64_t>(kBlocks - 8));
  }
  local.push_back(static_cast<int64_t>(kBlocks) - 1);
  local.push_back(0);
  remote.push_back(5);
  remote.push_back(6);
  const Request r = attention_request(16 * local.size(), 0, local, remote);
  Result<PlanTemplate> t = PlanTemplate::create(decode[0], prefill, shape_of(r));
  ASSERT_TRUE(t.ok()) << t.error().to_string();
  const Result<Plan> planned = plan(decode[0], prefill, r);
  expect_same(t->instantiate(r), planned);
  Result<StageTemplate> st = StageTemplate::create(decode[0], prefill, shape_of(r), StageOptions{0, 256});
  ASSERT_TRUE(st.ok()) << st.error().to_string();
  Result<std::vector<CompactStage>> compact = st->instantiate_compact(r);
  Result<std::vector<PlanStage>> stages = plan_stages(decode[0], prefill, r, StageOptions{0, 256});
  ASSERT_TRUE(compact.ok() && stages.ok());
  ASSERT_EQ(compact->size(), stages->size());
  ASSERT_GT(stages->size(), 1u);
  // The later layers of each stage are one table run, and the stages share
  // its table (one object: StageTemplate interns them).
  const TensorShift* table = nullptr;
  for (size_t k = 0; k < stages->size(); ++k) {
    const CompactPlan& c = (*compact)[k].plan;
    EXPECT_EQ(expand(c).descriptors, (*stages)[k].plan.descriptors) << "stage " << k;
    EXPECT_LT(c.literal.size(), (*stages)[k].plan.descriptors.size()) << "stage " << k;
    ASSERT_EQ(c.runs.size(), 2u) << "stage " << k;
    ASSERT_NE(c.runs[1].table, nullptr) << "stage " << k;
    EXPECT_EQ(c.runs[1].table->size(), decode[0].groups[0].layers.size() - 1) << "stage " << k;
    if (table == nullptr) table = c.runs[1].table->data();
    EXPECT_EQ(c.runs[1].table->data(), table) << "stage " << k;
  }
}

TEST(PlanTemplateTest, FewShuffledIdsOfAHugeCacheEmitInIdOrder) {
  few_shuffled_ids_emit_in_id_order(20000);
  few_shuffled_ids_emit_in_id_order(300000);
}

TEST(PlanTemplateTest, StateScratchAndWindowGroupsFollowTheirIds) {
  // qwen3-next: full attention, a state group (the last listed block moves,
  // lists of different lengths) and a scratch ring (one block).
  const std::vector<Layout> prefill = tp_instance("qwen3-next", 2, Order::kLBHNC, 16, 64);
  const std::vector<Layout> decode = tp_instance("qwen3-next", 1, Order::kLBNHC, 16, 64);
  Request r;
  r.num_tokens = 150;
  r.skip_tokens = 64;
  r.blocks["full"] = {{-1, 4, 5}, {-1, 8, 9}};
  r.blocks["linear"] = {{-1, 2}, {3}};
  r.blocks["ring"] = {{7}, {1}};
  Result<PlanTemplate> t = PlanTemplate::create(decode[0], prefill, shape_of(r));
  ASSERT_TRUE(t.ok()) << t.error().to_string();
  expect_same(t->instantiate(r), plan(decode[0], prefill, r));
  r.blocks["full"] = {{-1, 11, 3}, {-1, 0, 15}};
  r.blocks["linear"] = {{-1, 13}, {6}};
  r.blocks["ring"] = {{0}, {12}};
  const Result<Plan> got = t->instantiate(r);
  expect_same(got, plan(decode[0], prefill, r));
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(verify(*got, decode[0], prefill, r).ok());
  // gpt-oss: a sliding window cut to its last tokens.
  const std::vector<Layout> p2 = tp_instance("gpt-oss", 2, Order::kLBHNC, 64, 16);
  const std::vector<Layout> d2 = tp_instance("gpt-oss", 2, Order::kBLHNC, 64, 16);
  Request w;
  w.num_tokens = 200;
  for (const char* g : {"full", "swa"}) {
    std::vector<int64_t> ids;
    for (int64_t i = 0; i < 13; ++i) ids.push_back(std::string(g) == "full" ? i : 20 + i);
    w.blocks[g] = {ids, ids};
  }
  Result<PlanTemplate> tw = PlanTemplate::create(d2[0], p2, shape_of(w));
  ASSERT_TRUE(tw.ok()) << tw.error().to_string();
  std::reverse(w.blocks["swa"].local.begin(), w.blocks["swa"].local.end());
  expect_same(tw->instantiate(w), plan(d2[0], p2, w));
}

TEST(PlanTemplateTest, BadIdsGetPlansErrorsWordForWord) {
  const std::vector<Layout> prefill = tp_instance("llama3-8b", 2);
  const std::vector<Layout> decode = tp_instance("llama3-8b", 2);
  const Request good = attention_request(40, 0, {0, 1, 2}, {3, 4, 5});
  Result<PlanTemplate> t = PlanTemplate::create(decode[0], prefill, shape_of(good));
  ASSERT_TRUE(t.ok());
  struct Case {
    Request r;
    Code code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {attention_request(40, 0, {0, 64, 2}, {3, 4, 5}), Code::kOutOfRange,
       "group 'full' local[1] = 64 is beyond num_blocks 64"},
      {attention_request(40, 0, {0, 1, 2}, {3, -1, 5}), Code::kInvalidArgument,
       "group 'full' remote[1] is -1 but that block's positions move"},
      {attention_request(40, 0, {0, 1, 0}, {3, 4, 5}), Code::kInvalidArgument,
       "group 'full' local block 0 is listed twice (entries 0 and 2)"},
      {attention_request(40, 0, {0, 1}, {3, 4, 5}), Code::kInvalidArgument,
       "group 'full' local block list has 2 entries but the request's positions need 3"},
  };
  for (const Case& c : cases) {
    const Result<Plan> got = t->instantiate(c.r);
    ASSERT_FALSE(got.ok()) << c.message;
    EXPECT_EQ(got.error().code(), c.code);
    EXPECT_EQ(got.error().message(), c.message);
    expect_same(got, plan(decode[0], prefill, c.r));
  }
}

TEST(PlanTemplateTest, RequestsOffTheShapeAreRejectedNamingTheDifference) {
  const std::vector<Layout> prefill = tp_instance("llama3-8b", 1);
  const std::vector<Layout> decode = tp_instance("llama3-8b", 1);
  Result<PlanTemplate> t =
      PlanTemplate::create(decode[0], prefill, shape_of(attention_request(40, 20, {-1, 1, 2}, {-1, 4, 5})));
  ASSERT_TRUE(t.ok());
  // Each of these is a request plan() accepts.
  const std::vector<std::pair<Request, std::string>> cases = {
      {attention_request(41, 20, {-1, 1, 2}, {-1, 4, 5}), "num_tokens 41 differs from the template's 40"},
      {attention_request(40, 17, {-1, 1, 2}, {-1, 4, 5}), "skip_tokens 17 differs from the template's 20"},
      {attention_request(40, 20, {-1, 1, 2, -1}, {-1, 4, 5}),
       "group 'full' local block list has 4 entries, the template's shape 3"},
      {attention_request(40, 20, {0, 1, 2}, {-1, 4, 5}),
       "group 'full' local[0] is 0 but the template's shape has -1 there"},
  };
  for (const auto& [r, message] : cases) {
    ASSERT_TRUE(plan(decode[0], prefill, r).ok()) << message;
    const Result<Plan> got = t->instantiate(r);
    ASSERT_FALSE(got.ok()) << message;
    EXPECT_EQ(got.error().code(), Code::kInvalidArgument);
    EXPECT_EQ(got.error().message(), message);
  }
  // -1 where the shape lists a block that moves nothing.
  Result<PlanTemplate> t2 =
      PlanTemplate::create(decode[0], prefill, shape_of(attention_request(40, 20, {0, 1, 2}, {3, 4, 5})));
  ASSERT_TRUE(t2.ok());
  const Result<Plan> got = t2->instantiate(attention_request(40, 20, {-1, 1, 2}, {3, 4, 5}));
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.error().message(), "group 'full' local[0] is -1 but the template's shape lists a block there");
}

TEST(PlanTemplateTest, CreateReportsPlansErrorsAndShapesNoRequestCanFill) {
  const std::vector<Layout> prefill = tp_instance("llama3-8b", 1, Order::kLBHNC, 4);
  const std::vector<Layout> decode = tp_instance("llama3-8b", 1, Order::kLBHNC, 4);
  Result<PlanTemplate> short_list =
      PlanTemplate::create(decode[0], prefill, shape_of(attention_request(40, 0, {0, 1}, {0, 1, 2})));
  ASSERT_FALSE(short_list.ok());
  EXPECT_EQ(short_list.error().message(),
            "group 'full' local block list has 2 entries but the request's positions need 3");
  Result<PlanTemplate> moving_minus_one =
      PlanTemplate::create(decode[0], prefill, shape_of(attention_request(40, 0, {0, -1, 2}, {0, 1, 2})));
  ASSERT_FALSE(moving_minus_one.ok());
  EXPECT_EQ(moving_minus_one.error().message(), "group 'full' local[1] is -1 but that block's positions move");
  Result<PlanTemplate> too_many =
      PlanTemplate::create(decode[0], prefill, shape_of(attention_request(80, 0, {0, 1, 2, 3, 4}, {0, 1, 2, 3, 4})));
  ASSERT_FALSE(too_many.ok());
  EXPECT_EQ(too_many.error().code(), Code::kInvalidArgument);
  EXPECT_EQ(too_many.error().message(),
            "group 'full' local block list of the shape lists 5 blocks but the group has num_blocks 4; no request "
            "of this shape is valid");
  Layout other = prefill[0];
  other.model = "llama3-70b";
  Result<PlanTemplate> incompatible = PlanTemplate::create(decode[0], std::vector<Layout>{other},
                                                           shape_of(attention_request(40, 0, {0, 1, 2}, {0, 1, 2})));
  ASSERT_FALSE(incompatible.ok());
  EXPECT_EQ(incompatible.error().code(), Code::kIncompatible);
}

TEST(PlanTemplateTest, OverlaidGroupsGivenOneIdFailAsInPlan) {
  // gpt-oss's full and swa groups share tensors: one block id in both writes
  // the same bytes twice.
  const std::vector<Layout> ranks = tp_instance("gpt-oss", 1, Order::kLBHNC, 64, 16);
  Request r;
  r.num_tokens = 16;
  r.blocks["full"] = {{3}, {3}};
  r.blocks["swa"] = {{4}, {4}};
  Result<PlanTemplate> t = PlanTemplate::create(ranks[0], ranks, shape_of(r));
  ASSERT_TRUE(t.ok()) << t.error().to_string();
  ASSERT_TRUE(t->instantiate(r).ok());
  r.blocks["swa"] = {{3}, {4}};
  const Result<Plan> got = t->instantiate(r);
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.error().message().find("would be written twice"), std::string::npos) << got.error().message();
  expect_same(got, plan(ranks[0], ranks, r));
}

TEST(PlanTemplateTest, ATemplateThatIsNotUniformFallsBackToPlan) {
  const std::vector<Layout> prefill = tp_instance("llama3-8b", 2);
  const std::vector<Layout> decode = tp_instance("llama3-8b", 1, Order::kBLHNC);
  const Request r = attention_request(50, 0, {0, 1, 2, 3}, {4, 5, 6, 7});
  Result<PlanTemplate> uniform = PlanTemplate::create(decode[0], prefill, shape_of(r));
  ASSERT_TRUE(uniform.ok());
  const PlanTemplate fallback = plan_internal::TemplateAccess::not_uniform(*uniform, "for the test");
  EXPECT_FALSE(fallback.uniform());
  EXPECT_EQ(fallback.fallback_reason(), "for the test");
  EXPECT_TRUE(uniform->uniform()) << "the copy does not change the original";
  for (const Request& q : {r, attention_request(50, 0, {9, 1, 22, 3}, {4, 5, 60, 7}),
                           attention_request(50, 0, {0, 99, 2, 3}, {4, 5, 6, 7}),
                           attention_request(50, 0, {0, 1, 2, 3, -1}, {4, 5, 6, 7})}) {
    const Result<Plan> got = fallback.instantiate(q);
    const Result<Plan> planned = plan(decode[0], prefill, q);
    if (q.blocks.at("full").local.size() == 5) {
      ASSERT_FALSE(got.ok()) << "a request off the shape fails although plan() accepts it";
      EXPECT_EQ(got.error().message(), "group 'full' local block list has 5 entries, the template's shape 4");
      continue;
    }
    expect_same(got, planned);
  }
}

}  // namespace
}  // namespace kvbridge
