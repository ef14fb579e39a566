// Token-ordered chunks (plan_chunks(), plan.h) over random layouts
// (random_layout.h) and presets: the chunks together move exactly what
// plan() moves; they follow each other in token order from skip_tokens to
// num_tokens; where the request is resumable, the chunks before any chunk
// move exactly the request cut at that chunk's first token (so a load that
// fails in a chunk has every token before it whole); where it is not (state,
// scratch, a window moved only in part) there is one chunk resuming at
// skip_tokens.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>

#include "kvbridge/content.h"
#include "kvbridge/execute.h"
#include "kvbridge/presets.h"
#include "plan/preset_instances.h"
#include "plan/property_support.h"

namespace kvbridge {
namespace {

using namespace ::kvbridge::property;

Plan concat(std::span<const PlanChunk> chunks, size_t sources) {
  Plan p;
  p.sources.resize(sources);
  for (const PlanChunk& c : chunks) {
    p.descriptors.insert(p.descriptors.end(), c.plan.descriptors.begin(), c.plan.descriptors.end());
    p.bytes += c.plan.bytes;
    for (size_t s = 0; s < sources; ++s) {
      p.sources[s].tp_rank = c.plan.sources[s].tp_rank;
      p.sources[s].bytes += c.plan.sources[s].bytes;
      p.sources[s].descriptors += c.plan.sources[s].descriptors;
    }
  }
  return p;
}

// Whether plan_chunks() may cut the request (plan.h, resume_token).
bool resumable(const Layout& local, const Request& r) {
  if (r.skip_tokens >= r.num_tokens) return false;
  for (const Group& g : local.groups) {
    if (!g.transfer) continue;
    if (g.kind == GroupKind::kState || g.kind == GroupKind::kScratch) return false;
    if (g.kind == GroupKind::kSlidingWindow && r.num_tokens > r.skip_tokens + *g.window_tokens) return false;
  }
  return true;
}

// Empty when the chunks of `request` keep every promise of plan.h.
std::string check_chunks(const Layout& local, std::span<const Layout> remotes, const Request& request,
                         uint64_t chunk_tokens, gen::Rng& rng, uint64_t* cuts) {
  Result<Plan> whole = plan(local, remotes, request);
  Result<std::vector<PlanChunk>> chunks = plan_chunks(local, remotes, request, chunk_tokens);
  if (whole.has_value() != chunks.has_value()) {
    return "plan() " + std::string(whole ? "plans" : "fails: " + whole.error().to_string()) + ", plan_chunks() " +
           (chunks ? "plans" : "fails: " + chunks.error().to_string());
  }
  if (!whole) {
    return whole.error().message() == chunks.error().message() ? "" : "errors differ: " + chunks.error().to_string();
  }
  if (chunks->empty()) return "no chunk";
  const std::string at = " (chunk_tokens " + std::to_string(chunk_tokens) + ")";
  const bool cut = resumable(local, request) && chunk_tokens > 0;
  if (!cut && chunks->size() != 1) return std::to_string(chunks->size()) + " chunks of a request not resumable" + at;
  if (chunks->front().first_token != request.skip_tokens) return "the first chunk does not start at skip_tokens" + at;
  if (chunks->back().end_token != request.num_tokens) return "the last chunk does not end at num_tokens" + at;
  for (size_t k = 0; k < chunks->size(); ++k) {
    const PlanChunk& c = (*chunks)[k];
    if (k > 0 && c.first_token != (*chunks)[k - 1].end_token)
      return "chunk " + std::to_string(k) + " leaves a gap" + at;
    if (c.first_token > c.end_token) return "chunk " + std::to_string(k) + " ends before it starts" + at;
    if (c.resume_token != (cut ? c.first_token : request.skip_tokens)) {
      return "chunk " + std::to_string(k) + " resumes at " + std::to_string(c.resume_token) + at;
    }
  }
  const Plan all = concat(*chunks, remotes.size());
  if (all.bytes != whole->bytes) {
    return "the chunks move " + std::to_string(all.bytes) + " bytes, plan() " + std::to_string(whole->bytes) + at;
  }
  Result<VerifyReport> v = verify(all, local, remotes, request, /*check_minimal=*/false);
  if (!v) return "the chunks together fail verification: " + v.error().to_string() + at;
  // A few cuts: the chunks before chunk k are exactly the request cut at
  // its first token.
  for (int tries = 0; cut && chunks->size() > 1 && tries < 3; ++tries) {
    const size_t k = gen::draw(rng, 1, chunks->size() - 1);
    Request before = request;
    before.num_tokens = (*chunks)[k].first_token;
    const Plan prefix = concat(std::span(*chunks).first(k), remotes.size());
    Result<VerifyReport> pv = verify(prefix, local, remotes, before, /*check_minimal=*/false);
    if (!pv) {
      return "chunks before " + std::to_string(k) + " are not the request cut at token " +
             std::to_string(before.num_tokens) + ": " + pv.error().to_string() + at;
    }
    ++*cuts;
  }
  return "";
}

TEST(PlanChunksTest, ChunksAreThePlanInTokenOrderAndEachPrefixIsTheRequestCutThere) {
  const auto start = std::chrono::steady_clock::now();
  uint64_t passed = 0, failures = 0, multi = 0, cuts = 0;
  for (uint64_t i : case_indices(std::max<uint64_t>(num_cases() / 2, 1))) {
    if (failures >= 3) break;
    gen::Rng rng(gen::case_seed(base_seed() ^ 0xc4c, i));
    const Case c = make_case(base_seed(), i, rng);
    uint64_t largest = 1;
    for (const Group& g : c.local.groups) largest = std::max(largest, g.block_tokens);
    const uint64_t chunk_tokens = gen::chance(rng, 10) ? 0 : gen::draw(rng, 1, 3 * largest);
    const std::string d = check_chunks(c.local, c.remotes, c.request, chunk_tokens, rng, &cuts);
    if (!d.empty()) {
      const std::string dir = dump(c, {c.local, c.remotes, c.request}, d);
      ADD_FAILURE() << c.describe() << " (chunks): " << d << "\n  written to " << dir;
      ++failures;
      continue;
    }
    multi += plan_chunks(c.local, c.remotes, c.request, chunk_tokens)->size() > 1;
    ++passed;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "[ chunks    ] %llu requests: chunks are the plan in token order (%llu cut in several, %llu prefixes "
      "verified as the request cut there) in %.2f s, seed %llu\n",
      (unsigned long long)passed, (unsigned long long)multi, (unsigned long long)cuts, seconds,
      (unsigned long long)base_seed());
  if (std::getenv("KVB_PROPERTY_CASE") == nullptr && passed >= 100) {
    EXPECT_GT(multi, passed / 10) << "the generator reaches requests cut in several chunks";
    EXPECT_GT(cuts, 0u);
  }
}

using testing::preset;

Request request_of(const Layout& local, const Layout& remote, uint64_t n, uint64_t skip) {
  Request q;
  q.num_tokens = n;
  q.skip_tokens = skip;
  int64_t base = 0;  // distinct ids per group: groups may share tensor slots
  for (const Group& g : local.groups) {
    if (!g.transfer) continue;
    const Group* rg = remote.find_group(g.name);
    GroupBlocks b;
    const uint64_t ln = g.kind == GroupKind::kScratch ? 1 : (n + g.block_tokens - 1) / g.block_tokens;
    const uint64_t rn = g.kind == GroupKind::kScratch ? 1 : (n + rg->block_tokens - 1) / rg->block_tokens;
    for (uint64_t i = 0; i < ln; ++i) b.local.push_back(base + static_cast<int64_t>(ln - 1 - i));  // descending
    for (uint64_t i = 0; i < rn; ++i) b.remote.push_back(base + static_cast<int64_t>(3 + i));
    base += static_cast<int64_t>(std::max(ln, rn + 3));
    q.blocks[g.name] = b;
  }
  return q;
}

// Real bytes: a pattern on the prefill ranks, the chunks before chunk k run
// with the host executor, and the decode rank holds every token before that
// chunk's first byte-exact, and none of the chunk's own.
TEST(PlanChunksTest, RunningTheChunksBeforeOneLeavesEveryTokenBeforeItWhole) {
  struct Pair {
    std::string preset;
    uint32_t ptp, dtp;
    uint64_t pblock, dblock;
    uint64_t tokens, skip;
    bool cut;             // whether the request is resumable (several chunks)
    uint64_t num_blocks;  // enough for every group's distinct ids
  };
  const Pair pairs[] = {
      {"llama3-8b", 2, 4, 16, 32, 300, 20, true, 24},
      {"deepseek-v3", 1, 2, 64, 128, 400, 0, true, 12},
      {"deepseek-v3.2", 4, 1, 64, 64, 400, 100, true, 24},
      {"gpt-oss", 2, 1, 16, 32, 120, 10, true, 24},      // every window moved from skip
      {"gpt-oss", 2, 1, 16, 32, 400, 10, false, 60},     // windows moved in part
      {"qwen3-next", 2, 4, 64, 128, 500, 0, false, 40},  // state and ring scratch
  };
  for (const Pair& p : pairs) {
    std::vector<Layout> remotes;
    for (uint32_t r = 0; r < p.ptp; ++r)
      remotes.push_back(preset(p.preset, p.ptp, r, p.pblock, Order::kBLHNC, p.num_blocks));
    const Layout local = preset(p.preset, p.dtp, p.dtp - 1, p.dblock, Order::kLBHNC, p.num_blocks);
    const Request q = request_of(local, remotes[0], p.tokens, p.skip);
    const std::string where = p.preset + " " + std::to_string(p.tokens) + " tokens";
    Result<std::vector<PlanChunk>> chunks = plan_chunks(local, remotes, q, 32);
    ASSERT_TRUE(chunks.ok()) << where << ": " << chunks.error().to_string();
    if (!p.cut) {
      ASSERT_EQ(chunks->size(), 1u) << where;
      EXPECT_EQ(chunks->front().resume_token, p.skip) << where;
      continue;
    }
    ASSERT_GT(chunks->size(), 2u) << where;
    std::vector<std::vector<std::vector<uint8_t>>> rbytes(remotes.size());
    std::vector<std::vector<std::span<const uint8_t>>> rspans(remotes.size());
    std::vector<ConstTensorMemory> sources;
    for (size_t r = 0; r < remotes.size(); ++r) {
      for (const Tensor& t : remotes[r].tensors) rbytes[r].emplace_back(t.bytes, 0);
      std::vector<std::span<uint8_t>> w;
      for (auto& b : rbytes[r]) w.emplace_back(b);
      ASSERT_TRUE(fill_request(remotes[r], q, RequestSide::kRemote, 0, 77, w).ok());
      for (auto& b : rbytes[r]) rspans[r].emplace_back(b);
      sources.push_back(rspans[r]);
    }
    for (size_t k : {size_t{1}, chunks->size() / 2, chunks->size() - 1}) {
      std::vector<std::vector<uint8_t>> lbytes;
      std::vector<std::span<uint8_t>> lspans;
      for (const Tensor& t : local.tensors) lbytes.emplace_back(t.bytes, 0xa5);
      for (auto& b : lbytes) lspans.emplace_back(b);
      for (size_t j = 0; j < k; ++j) {
        ASSERT_TRUE(execute_read((*chunks)[j].plan.descriptors, lspans, sources).ok()) << where;
      }
      const uint64_t first = (*chunks)[k].first_token;
      EXPECT_EQ((*chunks)[k].resume_token, first) << where;
      Request before = q;
      before.num_tokens = first;
      Result<ContentReport> whole = check_request(local, before, RequestSide::kLocal, p.skip, 77, lspans);
      ASSERT_TRUE(whole.ok()) << where;
      EXPECT_EQ(whole->bad_cells, 0u) << where << " before token " << first << ": " << whole->first_error;
      EXPECT_GT(whole->cells, 0u) << where;
      Result<ContentReport> after = check_request(local, q, RequestSide::kLocal, first, 77, lspans);
      ASSERT_TRUE(after.ok()) << where;
      EXPECT_EQ(after->bad_cells, after->cells) << where << ": no token from " << first << " arrived";
      EXPECT_EQ(after->first_bad_token, first) << where;
    }
  }
}

TEST(PlanChunksTest, ChunkBoundariesFallOnBlockBoundariesOfBothSides) {
  const std::vector<Layout> remotes = {preset("llama3-8b", 1, 0, 16, Order::kBLHNC, 40)};
  const Layout local = preset("llama3-8b", 1, 0, 48, Order::kBLHNC, 40);
  const Request q = request_of(local, remotes[0], 500, 7);
  Result<std::vector<PlanChunk>> chunks = plan_chunks(local, remotes, q, 100);
  ASSERT_TRUE(chunks.ok()) << chunks.error().to_string();
  // 100 rounded up to a multiple of 16 and 48: 144.
  std::vector<uint64_t> firsts;
  for (const PlanChunk& c : *chunks) firsts.push_back(c.first_token);
  EXPECT_EQ(firsts, (std::vector<uint64_t>{7, 144, 288, 432}));
  EXPECT_EQ(chunks->back().end_token, 500u);
  Result<std::vector<PlanChunk>> one = plan_chunks(local, remotes, q, 0);
  ASSERT_TRUE(one.ok());
  ASSERT_EQ(one->size(), 1u);
  EXPECT_EQ(one->front().plan.descriptors, plan(local, remotes, q)->descriptors);
  // plan()'s errors, word for word.
  Request bad = q;
  bad.blocks["full"].local[2] = 1000;
  Result<std::vector<PlanChunk>> e = plan_chunks(local, remotes, bad, 100);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.error().message(), plan(local, remotes, bad).error().message());
}

}  // namespace
}  // namespace kvbridge
