// ConnectorWorker and its planner: loads planned from stage templates, and
// plans checked with the verifier before they run.
#include <gtest/gtest.h>

#include <algorithm>

#include "connector/worker_test_util.h"
#include "kvbridge/connector.h"
#include "kvbridge/content.h"
#include "transport/fault/fault.h"

namespace kvbridge {
namespace {

using namespace std::chrono_literals;
using namespace worker_test;

// Loads of one shape (token counts, list lengths, -1 entries) are planned
// from one stage template from the second on, whatever their ids.
TEST(WorkerPlanTest, LoadsOfOneShapeArePlannedFromOneTemplateWhateverTheirIds) {
  auto prefill = instance(opts("prefill", 2));
  auto decode = instance(opts("decode", 1));
  ConnectorWorker& d = *decode[0]->worker;
  ASSERT_TRUE(d.add_remote("prefill", addresses(prefill)).ok());
  Request other = request();
  other.blocks["full"] = {{7, 0, 5}, {2, 6, 0}};
  Request third = request();
  third.blocks["full"] = {{3, 4, 6}, {5, 1, 7}};
  const std::vector<std::pair<RequestId, Request>> loads = {
      {"a", request()}, {"b", other}, {"c", request(16)}, {"d", third}};
  uint64_t pattern = 20;
  for (const auto& [id, q] : loads) {
    for (auto& r : prefill) ASSERT_TRUE(fill_request(r->layout, q, RequestSide::kRemote, 0, pattern, r->spans).ok());
    ASSERT_TRUE(d.start_load(id, "prefill", q).ok());
    LoadResult r = wait_one(d);
    ASSERT_TRUE(r.error.ok()) << r.error.to_string();
    Result<ContentReport> c =
        check_request(decode[0]->layout, q, RequestSide::kLocal, q.skip_tokens, pattern++, decode[0]->spans);
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(c->bad_cells, 0u) << id << ": " << c->first_error;
  }
  const WorkerStats s = d.stats();
  // a, the first of its shape, is planned as it comes; b, the second, builds
  // the template, and b and d are its instances; c (16 tokens skipped) is
  // another shape, seen once.
  EXPECT_EQ(s.plan_templates, 1u);
  EXPECT_EQ(s.plans_from_templates, 2u);
  EXPECT_EQ(s.plans_not_templated, 2u);
  EXPECT_EQ(s.plan_template_fallback, "");
  // The template's instances hold the later layers as moved runs of the
  // first, and their reads go to the engine so (the content check above
  // saw every byte land); the loads planned afresh are read as items.
  EXPECT_GT(s.reads_as_runs, 0u);
  EXPECT_GE(s.moved_runs, s.reads_as_runs * (decode[0]->layout.tensors.size() - 1));
  // Through tables the engine prepared once per source and moves, kept.
  EXPECT_GT(s.move_tables, 0u);
  EXPECT_LE(s.move_tables, 2u * 2u) << "one per source rank and stage shape, not one per read";
  EXPECT_EQ(s.move_tables_kept, s.move_tables);
}

// Streamed loads of a shape seen before: a later layer's stage is the
// first layer's stage moved, read as runs of the first layer's items,
// prepared once per load and source, and released when the load is over;
// a streamed pull load is cut by layers only (one read per layer and
// source), whatever load_chunk_tokens says. Every byte lands, also when the
// layers are saved last to first (a moved stage read before the stage it
// is moved from).
class WorkerMovedStageTest : public ::testing::TestWithParam<std::string> {};

TEST_P(WorkerMovedStageTest, LaterLayersAreReadAsTheFirstLayersItemsMoved) {
  InstanceOptions po = opts("prefill", 2), dopt = opts("decode", 1);
  po.transport = dopt.transport = GetParam();
  dopt.worker.load_chunk_tokens = 16;  // a whole load's chunks: a block each; not a streamed load's
  auto faults = std::make_shared<transport::Faults>();
  if (GetParam() == "local") dopt.faults = faults;
  auto prefill = instance(po);
  auto decode = instance(dopt);
  ConnectorWorker& d = *decode[0]->worker;
  ASSERT_TRUE(d.add_remote("prefill", addresses(prefill)).ok());
  for (auto& r : prefill) ASSERT_TRUE(r->worker->add_remote("decode", addresses(decode)).ok());
  std::vector<std::string> layers = layer_order(decode[0]->layout);
  Request other = request();
  other.blocks["full"] = {{7, 0, 5}, {2, 6, 0}};
  Request third = request();
  third.blocks["full"] = {{3, 4, 6}, {5, 1, 7}};
  uint64_t pattern = 60;
  int n = 0;
  for (const Request& q : {request(), other, third, request()}) {
    const RequestId id = "s" + std::to_string(n++);
    for (auto& r : prefill) ASSERT_TRUE(fill_request(r->layout, q, RequestSide::kRemote, 0, pattern, r->spans).ok());
    const uint64_t reads0 = decode[0]->engine->metrics().transfers_submitted;
    ASSERT_TRUE(d.start_load(id, "prefill", q, LoadOptions::streaming(true)).ok());
    for (auto& r : prefill) ASSERT_TRUE(r->worker->stream_to(id, "decode").ok());
    if (n == 3) std::reverse(layers.begin(), layers.end());
    for (const std::string& l : layers) {
      for (auto& r : prefill) ASSERT_TRUE(r->worker->save_layer(id, l).ok());
    }
    LoadResult r = wait_one(d);
    ASSERT_TRUE(r.error.ok()) << r.error.to_string();
    Result<ContentReport> c = check_request(decode[0]->layout, q, RequestSide::kLocal, 0, pattern++, decode[0]->spans);
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(c->bad_cells, 0u) << id << ": " << c->first_error;
    for (auto& p : prefill) EXPECT_TRUE(p->worker->wait_for_save(id, 5s).ok());
    EXPECT_EQ(r.stages, layers.size());
    EXPECT_EQ(decode[0]->engine->metrics().transfers_submitted - reads0, 2u * layers.size()) << id;
  }
  const WorkerStats s = d.stats();
  EXPECT_EQ(s.plans_from_templates, 3u);
  // Three loads from the template, each a stage per layer: the later
  // layers' stages from each of the two sources are moved stages.
  EXPECT_EQ(s.moved_stage_reads, 3u * 2u * (layers.size() - 1));
  EXPECT_EQ(s.prepared_lists, 3u * 2u);
  EXPECT_EQ(s.prepared_lists_held, 0u) << "a load over still holds prepared lists";
  if (GetParam() != "local") return;
  // A read that fails fails its layer: the load fails naming a layer, and
  // holds no list once over.
  faults->fail_run(9, Status::io_error("link down"));
  ASSERT_TRUE(d.start_load("f", "prefill", third, LoadOptions::streaming(true)).ok());
  for (auto& r : prefill) ASSERT_TRUE(r->worker->stream_to("f", "decode").ok());
  for (const std::string& l : layers) {
    for (auto& r : prefill) ASSERT_TRUE(r->worker->save_layer("f", l).ok());
  }
  LoadResult r = wait_one(d);
  ASSERT_FALSE(r.error.ok());
  EXPECT_NE(r.error.message().find("link down"), std::string::npos) << r.error.to_string();
  EXPECT_FALSE(r.first_bad_layer.empty());
  EXPECT_LT(r.first_bad_token, third.num_tokens);
  EXPECT_EQ(d.stats().prepared_lists_held, 0u);
}

INSTANTIATE_TEST_SUITE_P(Transports, WorkerMovedStageTest, ::testing::Values("local", "tcp"));

// A prepared table the engine refuses (as it does when the source's regions
// moved: kUnavailable, "prepare again") is released with the others; the
// read goes with its table run as moved runs, checked one by one, and the
// next read prepares the table again. No byte lands wrong.
TEST(WorkerPlanTest, ARefusedTableGoesAsMovedRunsAndIsPreparedAgain) {
  auto prefill = instance(opts("prefill", 2));
  InstanceOptions o = opts("decode", 1);
  o.worker.load_chunk_tokens = 16;  // a stage per block: several reads a load
  o.engine_faults = "refuse-tables=2";
  auto decode = instance(o);
  ConnectorWorker& d = *decode[0]->worker;
  ASSERT_TRUE(d.add_remote("prefill", addresses(prefill)).ok());
  Request third = request();
  third.blocks["full"] = {{3, 4, 6}, {5, 1, 7}};
  Request fourth = request();
  fourth.blocks["full"] = {{7, 0, 5}, {2, 6, 0}};
  uint64_t pattern = 40;
  for (const Request& q : {request(), third, fourth, third}) {
    for (auto& r : prefill) ASSERT_TRUE(fill_request(r->layout, q, RequestSide::kRemote, 0, pattern, r->spans).ok());
    ASSERT_TRUE(d.start_load("r" + std::to_string(pattern), "prefill", q).ok());
    LoadResult r = wait_one(d);
    ASSERT_TRUE(r.error.ok()) << r.error.to_string();
    Result<ContentReport> c =
        check_request(decode[0]->layout, q, RequestSide::kLocal, q.skip_tokens, pattern++, decode[0]->spans);
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(c->bad_cells, 0u) << c->first_error;
  }
  const WorkerStats s = d.stats();
  EXPECT_EQ(s.plans_from_templates, 3u);
  EXPECT_GT(s.reads_as_runs, 2u);
  // Two refusals, each releasing every table: prepared again after each.
  EXPECT_GE(s.move_tables, 3u);
  EXPECT_LT(s.move_tables_kept, s.move_tables);
}

TEST(WorkerPlanTest, VerifiesEveryPlanBeforeItRunsWhenAsked) {
  auto prefill = instance(opts("prefill", 2));
  InstanceOptions o = opts("decode", 1);
  o.worker.verify_plans = true;
  auto decode = instance(o);
  for (auto& r : prefill) ASSERT_TRUE(fill_request(r->layout, request(), RequestSide::kRemote, 0, 5, r->spans).ok());
  ConnectorWorker& d = *decode[0]->worker;
  ASSERT_TRUE(d.add_remote("prefill", addresses(prefill)).ok());
  ASSERT_TRUE(d.start_load("1", "prefill", request()).ok());
  LoadResult r = wait_one(d);
  ASSERT_TRUE(r.error.ok()) << r.error.to_string();
  EXPECT_EQ(d.stats().plans_verified, 1u);
  EXPECT_EQ(d.stats().plans_rejected, 0u);
  Result<ContentReport> c = check_request(decode[0]->layout, request(), RequestSide::kLocal, 0, 5, decode[0]->spans);
  EXPECT_EQ(c->bad_cells, 0u) << c->first_error;
}

}  // namespace
}  // namespace kvbridge
