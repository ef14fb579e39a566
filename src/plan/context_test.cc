// Context parallelism: a group's positions dealt over context shards
// (layout.h, ContextShard); plans between instances sharded any way (or
// not at all) read each position from the shard holding it, and verify.
#include <algorithm>

#include <gtest/gtest.h>

#include "kvbridge/plan.h"
#include "kvbridge/presets.h"
#include "kvbridge/verify.h"
#include "plan/preset_instances.h"
#include "plan/property_support.h"

namespace kvbridge {
namespace {

using testing::expect_every_rank_verifies;
using testing::whole_request;

std::vector<Layout> dcp_instance(const std::string& preset, uint32_t tp, uint32_t dcp = 1, uint64_t interleave = 1,
                                 uint64_t block = 0) {
  Result<std::vector<Layout>> out = testing::preset_instance(
      PresetOptions{
          .name = preset, .block_tokens = block, .num_blocks = 256, .dcp_size = dcp, .dcp_interleave = interleave},
      tp);
  EXPECT_TRUE(out.ok()) << preset << " TP " << tp << " DCP " << dcp << ": " << out.error().to_string();
  return out ? *out : std::vector<Layout>{};
}

// The preset deals heads over TP / DCP and tokens over the DCP group of
// consecutive ranks, as vLLM does; the identity is the unsharded model's.
TEST(ContextTest, DcpPresetsShardTokensOverConsecutiveRanks) {
  const std::vector<Layout> dcp = dcp_instance("llama3-70b", 8, 2, 16);
  const std::vector<Layout> tp4 = dcp_instance("llama3-70b", 4);
  ASSERT_EQ(dcp.size(), 8u);
  for (const Layout& l : dcp) {
    EXPECT_EQ(compatibility_hash(l), compatibility_hash(tp4[0]));
    const Group& g = *l.find_group("full");
    EXPECT_EQ(g.context, (ContextShard{2, l.tp_rank % 2, 16})) << "rank " << l.tp_rank;
    EXPECT_EQ(g.layers[0].components[0].heads, tp4[l.tp_rank / 2].find_group("full")->layers[0].components[0].heads);
  }
  // A size that does not divide the TP size, or an interleave that splits a
  // compressed position, is refused naming the option.
  Result<Layout> bad = make_preset(PresetOptions{.name = "llama3-8b", .tp_size = 2, .dcp_size = 4});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message().find("--dcp 4"), std::string::npos) << bad.error().to_string();
  Result<Layout> split =
      make_preset(PresetOptions{.name = "glm5-flash", .tp_size = 2, .dcp_size = 2, .dcp_interleave = 2});
  ASSERT_FALSE(split.ok());
  EXPECT_EQ(split.error().message(),
            "--dcp-interleave 2: group 'indexer' keeps one position per 4 tokens; the interleave must be a multiple");
}

// A DCP 2 decode instance reading an unsharded prefill, the reverse, and
// both sharded (alike and not), for every preset: every rank verifies.
TEST(ContextTest, EveryPairOfShardingsOfEveryPresetVerifies) {
  std::vector<std::string> names = preset_names();
#ifdef KVB_PROPERTY_SANITIZED
  // The verifier runs ~25x slower there: the three presets of fewest layers
  // (the release build runs them all).
  auto layers = [](const std::string& name) {
    const Result<Layout> l = make_preset(PresetOptions{.name = name, .num_blocks = 8});
    size_t n = 0;
    for (const Group& g : l->groups) n += g.layers.size();
    return n;
  };
  std::stable_sort(names.begin(), names.end(),
                   [&](const std::string& a, const std::string& b) { return layers(a) < layers(b); });
  names.resize(3);
#endif
  for (const std::string& name : names) {
    const std::vector<Layout> plain = dcp_instance(name, 2);
    // Interleave 1, or 4 where a group keeps one position per 4 tokens.
    const uint64_t fine = make_preset(PresetOptions{.name = name, .tp_size = 2, .dcp_size = 2}).ok() ? 1 : 4;
    const std::vector<Layout> dcp1 = dcp_instance(name, 2, 2, fine);
    const std::vector<Layout> dcp16 = dcp_instance(name, 4, 2, 16);
    const std::vector<Layout> dcp4x4 = dcp_instance(name, 4, 4, 4);
    if (plain.empty() || dcp1.empty() || dcp16.empty() || dcp4x4.empty()) continue;
    expect_every_rank_verifies(dcp1, plain, 300, name + " TP2 -> TP2 DCP2/fine");
    expect_every_rank_verifies(plain, dcp1, 300, name + " TP2 DCP2/fine -> TP2");
    expect_every_rank_verifies(dcp16, dcp1, 300, name + " TP2 DCP2/fine -> TP4 DCP2/16");
    expect_every_rank_verifies(dcp1, dcp1, 300, name + " TP2 DCP2/fine -> TP2 DCP2/fine");
    expect_every_rank_verifies(dcp4x4, dcp16, 301, name + " TP4 DCP2/16 -> TP4 DCP4/4");
  }
}

// Same sharding on both sides: each decode rank reads its own shard from
// one rank, in descriptors like an unsharded plan's (one per block run),
// and half the bytes of an unsharded decode rank.
TEST(ContextTest, EqualShardingsReadOwnShardInWholeBlocks) {
  const std::vector<Layout> prefill = dcp_instance("deepseek-v3", 2, 2, 64);
  const std::vector<Layout> decode = dcp_instance("deepseek-v3", 2, 2, 64);
  const std::vector<Layout> plain = dcp_instance("deepseek-v3", 1);
  const Request whole = whole_request(plain[0], plain[0], 4096);
  Result<Plan> unsharded = plan(plain[0], plain, whole);
  ASSERT_TRUE(unsharded.ok());
  for (const Layout& d : decode) {
    Result<std::vector<uint32_t>> s = source_ranks(d, prefill);
    ASSERT_TRUE(s.ok()) << s.error().to_string();
    EXPECT_EQ(*s, (std::vector<uint32_t>{d.tp_rank})) << "decode rank " << d.tp_rank;
    const Request q = whole_request(d, prefill[0], 4096);
    Result<Plan> p = plan(d, prefill, q);
    ASSERT_TRUE(p.ok()) << p.error().to_string();
    EXPECT_EQ(p->bytes * 2, unsharded->bytes);
    EXPECT_LE(p->descriptors.size() * 2, unsharded->descriptors.size() + 61) << "decode rank " << d.tp_rank;
    ASSERT_TRUE(verify(*p, d, prefill, q, true).ok());
  }
}

// An unsharded decode rank reads every shard; a DCP rank reading an
// unsharded prefill reads its positions only. Interleave 1 puts each token
// on the other shard from its neighbours: one descriptor per token per run.
TEST(ContextTest, ReadersAndSourcesFollowTheShards) {
  const std::vector<Layout> prefill = dcp_instance("deepseek-v3", 2, 2, 1);
  const std::vector<Layout> decode = dcp_instance("deepseek-v3", 1);
  Result<std::vector<uint32_t>> s = source_ranks(decode[0], prefill);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, (std::vector<uint32_t>{0, 1}));
  Result<std::vector<SourceReaders>> readers = readers_per_source(decode, prefill);
  ASSERT_TRUE(readers.ok());
  for (const SourceReaders& r : *readers) EXPECT_EQ(r.readers, (std::vector<uint32_t>{0})) << r.rank;
  const Request q = whole_request(decode[0], prefill[0], 128);
  Result<Plan> p = plan(decode[0], prefill, q);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->sources[0].bytes, p->sources[1].bytes);
  // The reverse: each DCP rank reads the one prefill rank, half the tokens.
  Result<std::vector<SourceReaders>> back = readers_per_source(prefill, decode);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ((*back)[0].readers, (std::vector<uint32_t>{0, 1}));
}

TEST(ContextTest, AMissingShardOrMixedShardingIsNamed) {
  const std::vector<Layout> prefill = dcp_instance("llama3-8b", 2, 2, 1);
  const std::vector<Layout> decode = dcp_instance("llama3-8b", 1);
  const Request q = whole_request(decode[0], prefill[0], 64);
  Result<Plan> p = plan(decode[0], std::vector<Layout>{prefill[0]}, q);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.error().code(), Code::kIncompatible);
  EXPECT_EQ(p.error().message(),
            "group 'full' layer 'layers.0' component 'k': no given remote rank holds global head 0 of context shard 1");
  std::vector<Layout> mixed = prefill;
  mixed[1].groups[0].context.interleave = 2;
  Result<Plan> m = plan(decode[0], mixed, q);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.error().message(),
            "remote rank 1 group 'full' has 2 context shards of interleave 2 but remote rank 0 has 2 of interleave 1; "
            "one instance shards its context one way");
  // A DCP rank whose list is shorter than the instance's (shard 0's) is told.
  const std::vector<Layout> dcp = dcp_instance("llama3-8b", 2, 2, 1);
  Request shortq = whole_request(dcp[1], decode[0], 33);
  ASSERT_EQ(shortq.blocks.at("full").local.size(), 2u);  // 17 tokens of shard 0 in 16-token blocks
  shortq.blocks.at("full").local.pop_back();
  Result<Plan> sh = plan(dcp[1], decode, shortq);
  ASSERT_FALSE(sh.ok());
  EXPECT_EQ(sh.error().message(), "group 'full' local block list has 1 entries but the request's positions need 2");
}

// Chunked and staged plans of a sharded pair move the whole plan's bytes.
TEST(ContextTest, ChunksAndStagesOfAShardedPlanVerify) {
  const std::vector<Layout> prefill = dcp_instance("llama3-8b", 1);
  const std::vector<Layout> decode = dcp_instance("llama3-8b", 2, 2, 1);
  for (const Layout& d : decode) {
    const Request q = whole_request(d, prefill[0], 200);
    Result<Plan> whole = plan(d, prefill, q);
    ASSERT_TRUE(whole.ok());
    Result<std::vector<PlanChunk>> chunks = plan_chunks(d, prefill, q, 48);
    ASSERT_TRUE(chunks.ok()) << chunks.error().to_string();
    EXPECT_GT(chunks->size(), 1u);
    uint64_t bytes = 0;
    for (const PlanChunk& c : *chunks) bytes += c.plan.bytes;
    EXPECT_EQ(bytes, whole->bytes);
    Result<std::vector<PlanStage>> stages = plan_stages(d, prefill, q, StageOptions{4, 64});
    ASSERT_TRUE(stages.ok());
    bytes = 0;
    for (const PlanStage& s : *stages) bytes += s.plan.bytes;
    EXPECT_EQ(bytes, whole->bytes);
  }
}

}  // namespace
}  // namespace kvbridge
