// content.h: a pattern written on the remote ranks, moved by a plan, checks
// on the local rank for presets across TP pairs, block sizes and orders; any
// stale, missing or misplaced byte is found and located.
#include "kvbridge/content.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <set>

#include "kvbridge/execute.h"
#include "kvbridge/plan.h"
#include "kvbridge/presets.h"
#include "plan/preset_instances.h"
#include "plan/random_request.h"

namespace kvbridge {
namespace {

struct Rank {
  Layout layout;
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<std::span<uint8_t>> spans;
  std::vector<std::span<const uint8_t>> cspans;
  explicit Rank(Layout l) : layout(std::move(l)) {
    for (const Tensor& t : layout.tensors) bytes.emplace_back(t.bytes, 0xa5);
    for (auto& b : bytes) {
      spans.emplace_back(b);
      cspans.emplace_back(b);
    }
  }
};

using testing::preset;

// Fills the remote ranks, executes the plan (execute.h), checks the local rank.
ContentReport move_and_check(const std::string& name, uint32_t ptp, uint32_t dtp, uint64_t pblock, uint64_t dblock,
                             uint64_t seed, bool stale = false, uint64_t blocks = 16) {
  std::vector<Rank> remote;
  std::vector<Layout> remote_layouts;
  for (uint32_t r = 0; r < ptp; ++r) {
    remote.emplace_back(preset(name, ptp, r, pblock, Order::kBLHNC, blocks));
    remote_layouts.push_back(remote.back().layout);
  }
  Rank local(preset(name, dtp, dtp - 1, dblock, Order::kLBHNC, blocks));
  testing::Rng rng(seed);
  testing::RequestOptions ro;
  ro.num_tokens =
      1 + rng() % (2 * std::max(remote_layouts[0].groups[0].block_tokens, local.layout.groups[0].block_tokens));
  ro.skip_tokens = seed % 2 ? rng() % ro.num_tokens : 0;
  ro.max_state_blocks = 2;
  const Request q = testing::make_request(rng, local.layout, remote_layouts, ro);
  for (Rank& r : remote) {
    EXPECT_TRUE(fill_request(r.layout, q, RequestSide::kRemote, 0, stale ? seed + 1 : seed, r.spans).ok());
  }
  Result<Plan> p = plan(local.layout, remote_layouts, q);
  EXPECT_TRUE(p.ok()) << p.error().to_string();
  std::vector<ConstTensorMemory> sources;
  for (const Layout& r : remote_layouts) sources.push_back(remote[r.tp_rank].cspans);
  Result<uint64_t> copied = execute_read(p->descriptors, local.spans, sources);
  EXPECT_TRUE(copied.ok()) << copied.error().to_string();
  EXPECT_EQ(*copied, p->bytes);
  Result<ContentReport> c = check_request(local.layout, q, RequestSide::kLocal, q.skip_tokens, seed, local.spans);
  EXPECT_TRUE(c.ok()) << c.error().to_string();
  return *c;
}

// A seed changes the bytes, not the plan or the addresses: a sanitizer
// build (several times slower, looking for bad accesses) runs one.
#ifdef KVB_PROPERTY_SANITIZED
constexpr uint64_t kSeeds = 1;
#else
constexpr uint64_t kSeeds = 3;
#endif

TEST(ContentTest, PlannedPullsCheckCleanAcrossPresetsAndTp) {
  for (std::string name : {"llama3-8b", "gpt-oss", "mla-with-draft", "deepseek-v3.2"}) {
    for (auto [ptp, dtp] : {std::pair{1u, 2u}, {2u, 1u}, {2u, 4u}, {4u, 2u}}) {
      for (uint64_t seed = 1; seed <= kSeeds; ++seed) {
        const ContentReport r = move_and_check(name, ptp, dtp, 0, 0, seed);
        EXPECT_EQ(r.bad_cells, 0u) << name << " TP" << ptp << "->" << dtp << " seed " << seed << ": " << r.first_error;
        EXPECT_GT(r.cells, 0u) << name;
      }
    }
  }
}

// The hybrid presets are large per block: one TP pair each, few blocks.
TEST(ContentTest, PlannedPullsCheckCleanForHybridPresets) {
  for (std::string name : {"qwen3-next", "glm5-flash"}) {
    for (uint64_t seed = 1; seed <= std::min<uint64_t>(kSeeds, 2); ++seed) {
      const ContentReport r = move_and_check(name, 2, 4, 0, 0, seed, false, 10);
      EXPECT_EQ(r.bad_cells, 0u) << name << " seed " << seed << ": " << r.first_error;
      EXPECT_GT(r.cells, 0u) << name;
    }
  }
}

TEST(ContentTest, DataOfAnotherRequestNeverPasses) {
  const ContentReport r = move_and_check("llama3-8b", 2, 4, 0, 0, 4, /*stale=*/true);
  EXPECT_EQ(r.bad_cells, r.cells);
  EXPECT_NE(r.first_error.find("group 'full' layer 'layers.0' component 'k'"), std::string::npos) << r.first_error;
}

TEST(ContentTest, ACorruptByteIsLocatedWithItsToken) {
  Rank local(preset("llama3-8b", 1, 0, 16, Order::kLBHNC));
  Request q;
  q.num_tokens = 40;
  q.blocks["full"] = {{3, 5, 7}, {0, 1, 2}};
  ASSERT_TRUE(fill_request(local.layout, q, RequestSide::kLocal, 0, 9, local.spans).ok());
  Result<ContentReport> clean = check_request(local.layout, q, RequestSide::kLocal, 0, 9, local.spans);
  ASSERT_TRUE(clean.ok());
  EXPECT_EQ(clean->bad_cells, 0u);
  // Corrupt one byte of token 20 (block entry 1 = id 5, position 4), layer 0, k, head 0.
  const Component& k = local.layout.groups[0].layers[0].components[0];
  const uint64_t off = *cell_offset(k, {5, 0, 4});
  local.spans[0][off + 3] ^= 0xff;
  Result<ContentReport> bad = check_request(local.layout, q, RequestSide::kLocal, 0, 9, local.spans);
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ(bad->bad_cells, 1u);
  EXPECT_EQ(bad->first_bad_token, 20u);
  EXPECT_NE(bad->first_error.find("position 20"), std::string::npos) << bad->first_error;
  EXPECT_NE(bad->first_error.find("byte 3"), std::string::npos) << bad->first_error;
  // From token 32 on, the corrupt cell is not part of the check.
  Result<ContentReport> tail = check_request(local.layout, q, RequestSide::kLocal, 32, 9, local.spans);
  EXPECT_EQ(tail->bad_cells, 0u);
}

// Every cell of a request starts with its own word, so a cell that lands at
// another position, head, layer or component (k for v) never passes: the
// per-cell seed folds in every coordinate and the request seed.
TEST(ContentTest, EveryCellStartsWithItsOwnWordAndMisplacedCellsNeverPass) {
  for (const char* name : {"llama3-8b", "qwen3-next"}) {
    Rank local(preset(name, 1, 0, 16, Order::kLBHNC, 8));
    testing::Rng rng(11);
    testing::RequestOptions ro;
    ro.num_tokens = 40;
    const std::vector<Layout> remotes{local.layout};
    const Request q = testing::make_request(rng, local.layout, remotes, ro);
    ASSERT_TRUE(fill_request(local.layout, q, RequestSide::kLocal, 0, 9, local.spans).ok());
    struct Cell {
      size_t tensor;
      uint64_t offset, bytes;
    };
    std::vector<Cell> cells;
    std::set<uint64_t> first_words;
    ASSERT_TRUE(
        for_each_cell(local.layout, q, RequestSide::kLocal, 0, [&](size_t t, uint64_t off, uint64_t n, uint64_t) {
          uint64_t w = 0;
          std::memcpy(&w, local.spans[t].data() + off, std::min<uint64_t>(n, 8));
          first_words.insert(w);
          cells.push_back({t, off, n});
        }).ok());
    EXPECT_EQ(first_words.size(), cells.size()) << name;
    // Swap cell 0 with cells of the same size further on: each swap is two bad cells.
    int swaps = 0;
    for (size_t other : {size_t{1}, size_t{2}, cells.size() / 3, cells.size() / 2, cells.size() - 1}) {
      if (cells[other].bytes != cells[0].bytes) continue;
      auto a = local.spans[cells[0].tensor].subspan(cells[0].offset, cells[0].bytes);
      auto b = local.spans[cells[other].tensor].subspan(cells[other].offset, cells[other].bytes);
      std::swap_ranges(a.begin(), a.end(), b.begin());
      ++swaps;
      Result<ContentReport> r = check_request(local.layout, q, RequestSide::kLocal, 0, 9, local.spans);
      ASSERT_TRUE(r.ok());
      EXPECT_EQ(r->bad_cells, 2u) << name << " cell 0 swapped with cell " << other;
      std::swap_ranges(a.begin(), a.end(), b.begin());
    }
    EXPECT_GE(swaps, 2) << name;
    Result<ContentReport> clean = check_request(local.layout, q, RequestSide::kLocal, 0, 9, local.spans);
    EXPECT_EQ(clean->bad_cells, 0u) << name;
  }
}

// A layer's components are visited together, a block at a time: in every
// axis order the presets build, a layer's cells of one block follow each
// other in memory (a token's k and v included), so that the fill writes in
// address order. Each cell is visited once.
TEST(ContentTest, CellsAreVisitedInAddressOrderWithinALayersBlock) {
  for (const char* name : {"llama3-8b", "qwen3-next", "deepseek-v3", "gpt-oss", "mla-with-draft"}) {
    for (Order order : {Order::kLBHNC, Order::kBLHNC, Order::kLBNHC}) {
      const Layout l = preset(name, 1, 0, 16, order, 64);
      testing::Rng rng(3);
      testing::RequestOptions o;
      o.num_tokens = 16 * 16;
      const std::vector<Layout> remotes{l};
      const Request q = testing::make_request(rng, l, remotes, o);
      size_t last_tensor = ~size_t{0};
      uint64_t last_end = 0, jumps = 0;
      std::set<std::pair<size_t, uint64_t>> seen;
      Status s = for_each_cell(l, q, RequestSide::kLocal, 0, [&](size_t t, uint64_t off, uint64_t bytes, uint64_t) {
        if (t != last_tensor || off != last_end) ++jumps;
        last_tensor = t;
        last_end = off + bytes;
        EXPECT_TRUE(seen.insert({t, off}).second) << name << ": tensor " << t << " offset " << off << " twice";
      });
      ASSERT_TRUE(s.ok()) << s.to_string();
      uint64_t runs = 0;  // (layer, block) pairs the request holds
      for (const Group& g : l.groups) {
        if (!g.transfer) continue;
        const auto& ids = q.blocks.at(g.name).local;
        runs += g.layers.size() * (g.kind == GroupKind::kState ? 1 : ids.size());
      }
      EXPECT_LE(jumps, runs) << name << " order " << static_cast<int>(order);
    }
  }
}

TEST(ContentTest, RejectsMemoryThatDoesNotMatchTheLayout) {
  Rank local(preset("llama3-8b", 1, 0, 16, Order::kLBHNC));
  Request q;
  q.num_tokens = 4;
  q.blocks["full"] = {{0}, {0}};
  std::vector<std::span<uint8_t>> few(local.spans.begin(), local.spans.begin() + 1);
  Status s = fill_request(local.layout, q, RequestSide::kLocal, 0, 1, few);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  q.blocks["full"] = {{99}, {0}};
  s = fill_request(local.layout, q, RequestSide::kLocal, 0, 1, local.spans);
  EXPECT_NE(s.message().find("past num_blocks"), std::string::npos) << s.to_string();
}

}  // namespace
}  // namespace kvbridge
