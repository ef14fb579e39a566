// Stages (plan_stages(), plan.h) over random layouts (random_layout.h) and
// presets: each stage is exactly and minimally the request's bytes of its
// layers and token chunk (verify() on the layouts with every other layer
// emptied, and the request cut to the chunk); the stages follow each other
// chunk by chunk and layer by layer; together they move exactly what plan()
// moves; and plan()'s errors come back word for word.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <set>

#include "kvbridge/presets.h"
#include "plan/preset_instances.h"
#include "plan/property_support.h"

namespace kvbridge {
namespace {

using namespace ::kvbridge::property;

// Empty when the stages of `request` keep every promise of plan.h.
std::string check_stages(const Layout& local, std::span<const Layout> remotes, const Request& request,
                         const StageOptions& options, uint64_t* stages_seen) {
  const std::string at = " (layers_per_stage " + std::to_string(options.layers_per_stage) + ", chunk_tokens " +
                         std::to_string(options.chunk_tokens) + ")";
  Result<Plan> whole = plan(local, remotes, request);
  Result<std::vector<PlanStage>> stages = plan_stages(local, remotes, request, options);
  if (whole.has_value() != stages.has_value()) {
    return "plan() " + std::string(whole ? "plans" : "fails: " + whole.error().to_string()) + ", plan_stages() " +
           (stages ? "plans" : "fails: " + stages.error().to_string()) + at;
  }
  if (!whole) {
    return whole.error().message() == stages.error().message() ? "" : "errors differ: " + stages.error().to_string();
  }
  if (stages->empty()) return "no stage" + at;
  Result<std::vector<PlanChunk>> chunks = plan_chunks(local, remotes, request, options.chunk_tokens);
  if (!chunks) return "plan_chunks() fails: " + chunks.error().to_string();
  const std::vector<std::string> order = layer_order(local);
  Plan all;
  all.sources.resize(remotes.size());
  uint64_t bytes = 0;
  for (size_t k = 0; k < stages->size(); ++k) {
    const PlanStage& s = (*stages)[k];
    const std::string which = "stage " + std::to_string(k) + at;
    if (s.end_layer > order.size() || s.first_layer >= s.end_layer) return which + ": bad layer range";
    if (s.layers != std::vector<std::string>(order.begin() + s.first_layer, order.begin() + s.end_layer)) {
      return which + ": its layer names are not its range of layer_order()";
    }
    if (s.plan.descriptors.empty()) {
      // Only a request that moves nothing has a stage that moves nothing:
      // its one stage, of every layer.
      if (stages->size() > 1 || whole->bytes != 0 || s.end_layer != order.size() || s.first_layer != 0) {
        return which + " moves nothing";
      }
      continue;
    }
    if (options.layers_per_stage > 0 && s.end_layer - s.first_layer > options.layers_per_stage) {
      return which + ": more layers than layers_per_stage";
    }
    if (k > 0) {
      const PlanStage& p = (*stages)[k - 1];
      const bool next_layers = s.first_token == p.first_token && s.first_layer >= p.end_layer;
      const bool next_chunk = s.first_token >= p.end_token;
      if (!next_layers && !next_chunk) return which + ": not after stage " + std::to_string(k - 1);
    }
    // Its chunk is one of plan_chunks()'s (or inside one that absorbed
    // empty neighbours), and it resumes where that chunk does.
    bool in_chunk = false;
    for (const PlanChunk& c : *chunks) {
      in_chunk = in_chunk ||
                 (c.first_token <= s.first_token && s.end_token <= c.end_token && c.resume_token <= s.resume_token);
    }
    if (!in_chunk) return which + ": its tokens are not inside one chunk of plan_chunks()";
    // Exact and minimal on its own: the request's bytes of its layers and
    // tokens, nothing else.
    const bool cut = s.resume_token == s.first_token && chunks->size() > 1;
    Request part = request;
    if (cut) {
      part.skip_tokens = s.first_token;
      part.num_tokens = s.end_token;
    }
    const std::set<std::string, std::less<>> keep(s.layers.begin(), s.layers.end());
    std::vector<Layout> rs;
    for (const Layout& r : remotes) rs.push_back(keep_layers(r, keep));
    Result<VerifyReport> v = verify(s.plan, keep_layers(local, keep), rs, part, /*check_minimal=*/true);
    if (!v) return which + " is not exactly and minimally its layers' bytes: " + v.error().to_string();
    all.descriptors.insert(all.descriptors.end(), s.plan.descriptors.begin(), s.plan.descriptors.end());
    bytes += s.plan.bytes;
  }
  if (bytes != whole->bytes) {
    return "the stages move " + std::to_string(bytes) + " bytes, plan() " + std::to_string(whole->bytes) + at;
  }
  Result<VerifyReport> v = verify(all, local, remotes, request, /*check_minimal=*/false);
  if (!v) return "the stages together fail verification: " + v.error().to_string() + at;
  *stages_seen += stages->size();
  return "";
}

TEST(PlanStagesTest, StagesAreExactlyTheirLayersAndChunksAndTogetherThePlan) {
  const auto start = std::chrono::steady_clock::now();
  uint64_t passed = 0, failures = 0, multi = 0, stages = 0;
  for (uint64_t i : case_indices(std::max<uint64_t>(num_cases() / 2, 1))) {
    if (failures >= 3) break;
    gen::Rng rng(gen::case_seed(base_seed() ^ 0x57a6e, i));
    const Case c = make_case(base_seed(), i, rng);
    const StageOptions o = random_stage_options(rng, c.local);
    uint64_t seen = 0;
    const std::string d = check_stages(c.local, c.remotes, c.request, o, &seen);
    if (!d.empty()) {
      const std::string dir = dump(c, {c.local, c.remotes, c.request}, d);
      ADD_FAILURE() << c.describe() << " (stages): " << d << "\n  written to " << dir;
      ++failures;
      continue;
    }
    multi += seen > 1;
    stages += seen;
    ++passed;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "[ stages    ] %llu requests in %llu stages: each exactly its layers and chunk, together the plan (%llu cut "
      "in several) in %.2f s, seed %llu\n",
      (unsigned long long)passed, (unsigned long long)stages, (unsigned long long)multi, seconds,
      (unsigned long long)base_seed());
  if (std::getenv("KVB_PROPERTY_CASE") == nullptr && passed >= 100) {
    EXPECT_GT(multi, passed / 4) << "the generator reaches requests cut in several stages";
  }
}

using testing::preset;

TEST(PlanStagesTest, LayerOrderIsTheModelsByTheNumberEachNameEndsWith) {
  const Layout q = preset("qwen3-next", 1, 0, 64, Order::kLBHNC, 8);
  const std::vector<std::string> order = layer_order(q);
  ASSERT_EQ(order.size(), 48u);  // 12 attention + 36 state layers, the ring sharing the attention layers' names
  for (size_t i = 0; i < order.size(); ++i) EXPECT_EQ(order[i], "layers." + std::to_string(i));
  const std::vector<std::string> draft = layer_order(preset("mla-with-draft", 1, 0, 64, Order::kLBHNC, 8));
  ASSERT_EQ(draft.size(), 62u);
  EXPECT_EQ(draft[0], "draft.layers.0");  // a tie on the number: by name
  EXPECT_EQ(draft[1], "layers.0");
  EXPECT_EQ(draft.back(), "layers.60");
}

// qwen3-next by layer: each attention layer's stage carries its ring scratch
// block too (same layer), each state layer's stage its state, and the
// request stays one chunk (state cannot resume mid-way).
TEST(PlanStagesTest, StateAndScratchMoveInTheirLayersStage) {
  std::vector<Layout> remotes;
  for (uint32_t r = 0; r < 2; ++r) remotes.push_back(preset("qwen3-next", 2, r, 64, Order::kBLHNC, 40));
  const Layout local = preset("qwen3-next", 4, 1, 128, Order::kLBHNC, 40);
  Request q;
  q.num_tokens = 1000;
  q.blocks["full"] = {{0, 1, 2, 3, 4, 5, 6, 7}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}};
  q.blocks["linear"] = {{20}, {20}};
  q.blocks["ring"] = {{30}, {30}};
  Result<std::vector<PlanStage>> stages = plan_stages(local, remotes, q, StageOptions{1, 256});
  ASSERT_TRUE(stages.ok()) << stages.error().to_string();
  ASSERT_EQ(stages->size(), 48u);
  for (const PlanStage& s : *stages) {
    EXPECT_EQ(s.first_token, 0u);
    EXPECT_EQ(s.end_token, 1000u);
    EXPECT_EQ(s.resume_token, 0u);
    EXPECT_EQ(s.end_layer, s.first_layer + 1);
  }
  uint64_t seen = 0;
  EXPECT_EQ(check_stages(local, remotes, q, StageOptions{1, 256}, &seen), "");
  EXPECT_EQ(check_stages(local, remotes, q, StageOptions{5, 0}, &seen), "");
  // plan()'s errors, word for word.
  Request bad = q;
  bad.blocks["full"].local[2] = 1000;
  Result<std::vector<PlanStage>> e = plan_stages(local, remotes, bad, StageOptions{});
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.error().message(), plan(local, remotes, bad).error().message());
}

// llama3-8b with chunked prefill: chunk-major, then layer by layer; each
// stage resumes at its chunk's first token.
TEST(PlanStagesTest, ChunkedRequestsStageChunkByChunkThenLayerByLayer) {
  const std::vector<Layout> remotes = {preset("llama3-8b", 1, 0, 16, Order::kBLHNC, 40)};
  const Layout local = preset("llama3-8b", 2, 0, 32, Order::kLBHNC, 40);
  Request q;
  q.num_tokens = 500;
  q.skip_tokens = 7;
  for (int64_t i = 0; i < 16; ++i) q.blocks["full"].local.push_back(15 - i);
  for (int64_t i = 0; i < 32; ++i) q.blocks["full"].remote.push_back(i + 3);
  Result<std::vector<PlanStage>> stages = plan_stages(local, remotes, q, StageOptions{8, 200});
  ASSERT_TRUE(stages.ok()) << stages.error().to_string();
  // 200 tokens rounded up to a multiple of 16 and 32: 224; 32 layers in 4 stages each.
  std::vector<std::pair<uint64_t, uint32_t>> seen;
  for (const PlanStage& s : *stages) seen.emplace_back(s.first_token, s.first_layer);
  const std::vector<std::pair<uint64_t, uint32_t>> want = {{7, 0},   {7, 8},   {7, 16},   {7, 24},
                                                           {224, 0}, {224, 8}, {224, 16}, {224, 24},
                                                           {448, 0}, {448, 8}, {448, 16}, {448, 24}};
  EXPECT_EQ(seen, want);
  for (const PlanStage& s : *stages) EXPECT_EQ(s.resume_token, s.first_token);
  uint64_t n = 0;
  EXPECT_EQ(check_stages(local, remotes, q, StageOptions{8, 200}, &n), "");
}

}  // namespace
}  // namespace kvbridge
