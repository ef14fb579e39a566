// Source choice: the fewest remote ranks holding what a local rank needs,
// spread over the remote ranks, and who reads whom (docs/planner.md,
// "Sources"). The brute-force check over the preset matrix is in
// tests/plan_matrix_test.cc.
#include <gtest/gtest.h>

#include "kvbridge/plan.h"
#include "kvbridge/presets.h"
#include "kvbridge/verify.h"

namespace kvbridge {
namespace {

std::vector<Layout> ranks(const std::string& preset, uint32_t tp, uint64_t num_blocks = 8) {
  std::vector<Layout> out;
  for (uint32_t r = 0; r < tp; ++r) {
    Result<Layout> l =
        make_preset(PresetOptions{.name = preset, .tp_size = tp, .tp_rank = r, .num_blocks = num_blocks});
    EXPECT_TRUE(l.ok()) << preset << " TP " << tp << " rank " << r << ": " << l.error().to_string();
    if (l) out.push_back(std::move(*l));
  }
  return out;
}

// glm5-flash: MLA and the indexer replicated, the KDA state sharded by head.
// Decode TP 2 rank 1 needs the second half of the KDA heads, which prefill
// TP 4 ranks 2 and 3 hold; they hold the replicated groups too, so those two
// ranks are all it reads (the rank-spreading rule alone would add rank 1).
TEST(SourcesTest, Glm5FlashDecodeRankReadsOnlyTheRanksItNeeds) {
  const std::vector<Layout> prefill = ranks("glm5-flash", 4);
  const std::vector<Layout> decode = ranks("glm5-flash", 2);
  ASSERT_EQ(prefill.size(), 4u);
  ASSERT_EQ(decode.size(), 2u);
  Result<std::vector<uint32_t>> s1 = source_ranks(decode[1], prefill);
  ASSERT_TRUE(s1.ok()) << s1.error().to_string();
  EXPECT_EQ(*s1, (std::vector<uint32_t>{2, 3}));
  Result<std::vector<uint32_t>> s0 = source_ranks(decode[0], prefill);
  ASSERT_TRUE(s0.ok()) << s0.error().to_string();
  EXPECT_EQ(*s0, (std::vector<uint32_t>{0, 1}));

  Request q;
  q.num_tokens = 3000;
  auto both = [](std::vector<int64_t> ids) { return GroupBlocks{ids, ids}; };
  q.blocks["mla"] = both({0, 1});
  q.blocks["indexer"] = both({0, 1});
  q.blocks["indexer_tail"] = both({2});
  for (int i = 0; i < 4; ++i) q.blocks["kda." + std::to_string(i)] = both({3 + i});
  Result<Plan> p = plan(decode[1], prefill, q);
  ASSERT_TRUE(p.ok()) << p.error().to_string();
  EXPECT_EQ(p->sources[0].bytes, 0u);
  EXPECT_EQ(p->sources[1].bytes, 0u);
  // The replicated layers are cut between the two sources, so neither
  // carries the whole MLA cache: each has at least a third of the bytes.
  EXPECT_GT(p->sources[2].bytes * 3, p->bytes);
  EXPECT_GT(p->sources[3].bytes * 3, p->bytes);
  Result<VerifyReport> v = verify(*p, decode[1], prefill, q, /*check_minimal=*/true);
  EXPECT_TRUE(v.ok()) << v.error().to_string();

  Result<std::vector<SourceReaders>> readers = readers_per_source(decode, prefill);
  ASSERT_TRUE(readers.ok()) << readers.error().to_string();
  ASSERT_EQ(readers->size(), 4u);
  for (uint32_t r = 0; r < 4; ++r) {
    EXPECT_EQ((*readers)[r].rank, r);
    EXPECT_EQ((*readers)[r].readers, (std::vector<uint32_t>{r / 2})) << "prefill rank " << r;
  }
}

// Everything replicated (MLA): one source each, and the decode ranks spread
// over the prefill ranks instead of all reading rank 0.
TEST(SourcesTest, ReplicatedCachesSpreadOneSourcePerLocalRank) {
  const std::vector<Layout> prefill = ranks("deepseek-v3", 4);
  const std::vector<Layout> decode = ranks("deepseek-v3", 8);
  ASSERT_EQ(prefill.size(), 4u);
  ASSERT_EQ(decode.size(), 8u);
  for (const Layout& d : decode) {
    Result<std::vector<uint32_t>> s = source_ranks(d, prefill);
    ASSERT_TRUE(s.ok()) << s.error().to_string();
    EXPECT_EQ(*s, (std::vector<uint32_t>{d.tp_rank % 4})) << "decode rank " << d.tp_rank;
  }
  Result<std::vector<SourceReaders>> readers = readers_per_source(decode, prefill);
  ASSERT_TRUE(readers.ok());
  for (const SourceReaders& s : *readers) {
    EXPECT_EQ(s.readers, (std::vector<uint32_t>{s.rank, s.rank + 4})) << "prefill rank " << s.rank;
  }
}

// The order the remote layouts come in changes nothing.
TEST(SourcesTest, TheChoiceDoesNotDependOnTheOrderOfTheRemotes) {
  std::vector<Layout> prefill = ranks("glm5-flash", 4);
  const std::vector<Layout> decode = ranks("glm5-flash", 2);
  ASSERT_EQ(prefill.size(), 4u);
  Result<std::vector<uint32_t>> in_order = source_ranks(decode[1], prefill);
  std::reverse(prefill.begin(), prefill.end());
  Result<std::vector<uint32_t>> reversed = source_ranks(decode[1], prefill);
  ASSERT_TRUE(in_order.ok() && reversed.ok());
  EXPECT_EQ(*in_order, *reversed);
  Result<std::vector<SourceReaders>> readers = readers_per_source(decode, prefill);
  ASSERT_TRUE(readers.ok());
  EXPECT_EQ((*readers)[0].rank, 3u);  // in the order given
  EXPECT_EQ((*readers)[0].readers, (std::vector<uint32_t>{1}));
}

// A remote set that lacks a head the local rank needs is refused, naming the
// head and, for readers_per_source(), the local rank.
TEST(SourcesTest, AMissingHeadIsNamed) {
  const std::vector<Layout> prefill = ranks("llama3-8b", 4);
  const std::vector<Layout> decode = ranks("llama3-8b", 1);
  ASSERT_EQ(prefill.size(), 4u);
  const std::vector<Layout> three(prefill.begin(), prefill.begin() + 3);
  Result<std::vector<uint32_t>> s = source_ranks(decode[0], three);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code(), Code::kIncompatible);
  EXPECT_NE(s.error().message().find("global head 6"), std::string::npos) << s.error().to_string();
  Result<std::vector<SourceReaders>> r = readers_per_source(decode, three);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("local rank 0"), std::string::npos) << r.error().to_string();
}

}  // namespace
}  // namespace kvbridge
