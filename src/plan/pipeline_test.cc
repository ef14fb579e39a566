// Pipeline-parallel instances: a rank holds a range of the model's layers
// (layout.h, Layout::pp_size); plans between instances of any PP and TP
// sizes read each layer from the ranks that hold it, and verify.
#include <gtest/gtest.h>

#include "kvbridge/plan.h"
#include "kvbridge/presets.h"
#include "kvbridge/verify.h"
#include "plan/preset_instances.h"

namespace kvbridge {
namespace {

using testing::expect_every_rank_verifies;
using testing::whole_request;

// Every rank of an instance, stage-major.
std::vector<Layout> pp_instance(const std::string& preset, uint32_t tp, uint32_t pp, uint64_t block = 0,
                                Order order = Order::kLBHNC) {
  Result<std::vector<Layout>> out = testing::preset_instance(
      PresetOptions{.name = preset, .block_tokens = block, .order = order, .num_blocks = 64}, tp, pp);
  EXPECT_TRUE(out.ok()) << preset << " PP " << pp << " TP " << tp << ": " << out.error().to_string();
  return out ? *out : std::vector<Layout>{};
}

TEST(PipelineTest, StagesPartitionTheLayersAsEnginesDo) {
  std::vector<std::string> order;
  for (int i = 0; i < 61; ++i) order.push_back("layers." + std::to_string(i));
  // vLLM's get_pp_indices: 61 layers in 2 stages are 31 + 30; 80 in 3 are 27 + 27 + 26.
  EXPECT_EQ(pp_stage_layers(order, 2, 0).size(), 31u);
  EXPECT_EQ(pp_stage_layers(order, 2, 1).size(), 30u);
  EXPECT_EQ(pp_stage_layers(order, 2, 0).count("layers.30"), 1u);
  EXPECT_EQ(pp_stage_layers(order, 2, 1).count("layers.31"), 1u);
  for (int i = 61; i < 80; ++i) order.push_back("layers." + std::to_string(i));
  EXPECT_EQ(pp_stage_layers(order, 3, 0).size(), 27u);
  EXPECT_EQ(pp_stage_layers(order, 3, 1).size(), 27u);
  EXPECT_EQ(pp_stage_layers(order, 3, 2).size(), 26u);
}

// A stage's rank lists the whole model (same identity), holds its own layers
// in tensors of its own, and the stages together hold every layer once.
TEST(PipelineTest, EveryPresetSplitsIntoStagesWithTheWholeModelsIdentity) {
  for (const std::string& name : preset_names()) {
    Result<Layout> whole = make_preset(PresetOptions{.name = name, .num_blocks = 64});
    ASSERT_TRUE(whole.ok()) << name;
    uint64_t whole_bytes = 0, stage_bytes = 0;
    for (const Tensor& t : whole->tensors) whole_bytes += t.bytes;
    std::map<std::string, int> held;
    for (const Layout& s : pp_instance(name, 1, 3)) {
      EXPECT_EQ(compatibility_hash(s), compatibility_hash(*whole)) << name;
      EXPECT_EQ(identity_text(s), identity_text(*whole)) << name;
      for (const Tensor& t : s.tensors) stage_bytes += t.bytes;
      for (const Group& g : s.groups) {
        for (const Layer& l : g.layers) held[g.name + "/" + l.name] += l.held;
      }
    }
    for (const auto& [layer, n] : held) EXPECT_EQ(n, 1) << name << " " << layer << " held by " << n << " stages";
    // Without overlays the stages' tensors are the whole model's bytes; a
    // slot overlaid by layers of two stages is allocated by both.
    if (has_overlay(*whole)) {
      EXPECT_GE(stage_bytes, whole_bytes) << name;
    } else {
      EXPECT_EQ(stage_bytes, whole_bytes) << name << ": the stages' tensors are the whole model's bytes";
    }
    for (const Layout& s : pp_instance(name, 1, 3)) {
      uint64_t bytes = 0;
      for (const Tensor& t : s.tensors) bytes += t.bytes;
      EXPECT_LT(bytes, whole_bytes) << name << " stage " << s.pp_rank << " allocates the whole model";
    }
  }
}

// Prefill PP 2 x TP 4 into decode TP 8 (llama3-70b): each decode rank reads
// its head from one rank of each stage.
TEST(PipelineTest, PipelinePrefillIntoTensorParallelDecode) {
  const std::vector<Layout> prefill = pp_instance("llama3-70b", 4, 2);
  const std::vector<Layout> decode = pp_instance("llama3-70b", 8, 1);
  ASSERT_EQ(prefill.size(), 8u);
  expect_every_rank_verifies(decode, prefill, 300, "PP2xTP4 -> TP8");
  for (const Layout& d : decode) {
    Result<std::vector<uint32_t>> s = source_ranks(d, prefill);
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(*s, (std::vector<uint32_t>{d.tp_rank / 2, 4 + d.tp_rank / 2})) << "decode rank " << d.tp_rank;
  }
  // Each prefill rank is read by the two decode ranks holding its heads.
  Result<std::vector<SourceReaders>> readers = readers_per_source(decode, prefill);
  ASSERT_TRUE(readers.ok());
  for (const SourceReaders& r : *readers) {
    const uint32_t tp = r.rank % 4;
    EXPECT_EQ(r.readers, (std::vector<uint32_t>{2 * tp, 2 * tp + 1})) << "prefill rank " << r.rank;
  }
}

// Decode in stages, prefill in other stages, other TP and block sizes, every
// preset: each decode stage reads its layers from the prefill stages holding
// them.
TEST(PipelineTest, StagesOnBothSidesOfEveryPresetVerify) {
  for (const std::string& name : preset_names()) {
    const std::vector<Layout> prefill = pp_instance(name, 2, 3);
    const std::vector<Layout> decode = pp_instance(name, 1, 2, 0, Order::kBLHNC);
    expect_every_rank_verifies(decode, prefill, 200, name + " PP3xTP2 -> PP2xTP1");
    expect_every_rank_verifies(prefill, decode, 200, name + " PP2xTP1 -> PP3xTP2");
  }
}

// The remote ranks of one stage alone cannot serve a rank that holds layers
// of another: the error names the layer and the stages given.
TEST(PipelineTest, AMissingStageIsNamed) {
  const std::vector<Layout> prefill = pp_instance("llama3-8b", 1, 2);
  const std::vector<Layout> decode = pp_instance("llama3-8b", 1, 1);
  const Request q = whole_request(decode[0], prefill[0], 40);
  Result<Plan> p = plan(decode[0], std::vector<Layout>{prefill[0]}, q);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.error().code(), Code::kIncompatible);
  EXPECT_EQ(p.error().message(),
            "group 'full' layer 'layers.16': no given remote rank holds the layer (the remote ranks given are of "
            "pipeline stage 0 of 2)");
  // A decode stage holding only stage 0's layers needs stage 0 alone.
  const std::vector<Layout> decode_stages = pp_instance("llama3-8b", 1, 2);
  Result<Plan> own = plan(decode_stages[0], std::vector<Layout>{prefill[0]}, q);
  EXPECT_TRUE(own.ok()) << own.error().to_string();
  // Ranks of instances with other PP sizes, or one rank twice, are refused.
  std::vector<Layout> mixed = {prefill[0], decode[0]};
  Result<Plan> m = plan(decode[0], mixed, q);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.error().message().find("pp_size"), std::string::npos) << m.error().to_string();
  std::vector<Layout> twice = {prefill[1], prefill[1]};
  Result<Plan> t = plan(decode_stages[1], twice, q);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.error().message(), "remote rank 1 (pp 1, tp 0) is given twice");
}

}  // namespace
}  // namespace kvbridge
