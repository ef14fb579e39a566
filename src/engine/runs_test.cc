// Batches given as runs (Engine::submit with ItemRun): a moved run repeats
// an earlier literal run at other regions, checked as a whole (or as one
// of a prepared table of moves) and expanded by the engine threads that
// copy it. The bytes that land are the expanded
// items', over transports that copy in this process and through a server;
// a bad run posts nothing and names itself; the engine's split of a
// program into shares keeps every copy once.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <span>

#include "engine/transfers.h"
#include "kvbridge/engine.h"
#include "testing/run_transfer.h"

namespace kvbridge {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kLayers = 6, kLayerBytes = 1 << 20, kBlock = 256;

// Two engines; each side has kLayers regions (a layer-major cache).
struct Layers {
  explicit Layers(const std::string& transport, uint32_t threads = 2) {
    EngineOptions o;
    o.transports = {transport};
    o.threads = threads;
    o.name = "a";
    a = std::move(*Engine::create(o));
    o.name = "b";
    b = std::move(*Engine::create(o));
    for (uint64_t l = 0; l < kLayers; ++l) {
      x.emplace_back(kLayerBytes, 0);
      y.emplace_back(kLayerBytes);
      for (uint64_t i = 0; i < kLayerBytes; ++i) y[l][i] = static_cast<uint8_t>(i * 131 + l * 17 + i / 4096);
      rx.push_back(*a->register_memory(x[l].data(), kLayerBytes));
      ry.push_back(*b->register_memory(y[l].data(), kLayerBytes));
    }
    peer = *a->connect(b->metadata());
  }
  std::unique_ptr<Engine> a, b;
  std::vector<std::vector<uint8_t>> x, y;
  std::vector<RegionId> rx, ry;
  PeerId peer = 0;
};

// Layer 0's items: block i of the first half <- a shuffled block of the
// peer's (offset 8 KiB into each remote layer, so that a shift moves it).
std::vector<TransferItem> first_layer(const Layers& p, uint64_t blocks) {
  std::vector<uint64_t> from(blocks);
  std::iota(from.begin(), from.end(), 0);
  std::shuffle(from.begin(), from.end(), std::mt19937_64(7));
  std::vector<TransferItem> items;
  for (uint64_t i = 0; i < blocks; ++i)
    items.push_back({p.rx[0], i * kBlock, p.ry[0], 8192 + from[i] * kBlock, kBlock});
  return items;
}

// What layer `l` of the reader holds once `items` moved into every layer,
// layer 2 moved by a block on the local side and two back on the peer's.
std::vector<uint8_t> expected_layer(const Layers& p, std::span<const TransferItem> items, uint64_t l) {
  const uint64_t lshift = l == 2 ? kBlock : 0;
  const int64_t rshift = l == 2 ? -static_cast<int64_t>(2 * kBlock) : 0;
  std::vector<uint8_t> want(kLayerBytes, 0);
  for (const TransferItem& it : items) {
    std::copy_n(p.y[l].begin() + static_cast<int64_t>(it.remote_offset) + rshift, kBlock,
                want.begin() + static_cast<int64_t>(it.local_offset + lshift));
  }
  return want;
}

class RunsTest : public ::testing::TestWithParam<std::string> {};

TEST_P(RunsTest, MovedRunsLandWhereTheirItemsWould) {
  Layers p(GetParam());
  const uint64_t blocks = 3000;  // past the engine's split threshold: two shares
  const std::vector<TransferItem> items = first_layer(p, blocks);
  std::vector<ItemRun> runs = {{0, blocks}};
  // Layers 1.. repeat layer 0, each at its own regions; layer 2 shifted
  // by a block on the local side and two back on the peer's.
  for (uint64_t l = 1; l < kLayers; ++l) {
    const bool shifted = l == 2;
    runs.push_back({0, blocks, true, p.rx[l], shifted ? kBlock : 0, p.ry[l], 0});
    if (shifted) runs.back().remote_shift = UINT64_MAX - 2 * kBlock + 1;  // -2 blocks, modulo 2^64
  }
  ASSERT_EQ(testing::run_transfer(*p.a, p.a->submit(p.peer, TransferOp::kRead, items, runs, SubmitOptions{})).state,
            TransferState::kDone);
  for (uint64_t l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(p.x[l] == expected_layer(p, items, l)) << GetParam() << ": layer " << l << " differs from its items'";
  }
  const EngineMetrics m = p.a->metrics();
  EXPECT_EQ(m.bytes_read, blocks * kLayers * kBlock);
  EXPECT_EQ(m.descriptors, blocks * kLayers);
}

// A literal run whose first item continues the run before it on both
// sides is still its own copies: a moved run that repeats it moves all
// of its bytes, not what is left once the first was merged away.
TEST_P(RunsTest, ARunThatContinuesTheOneBeforeKeepsItsOwnCopies) {
  Layers p(GetParam());
  const std::vector<TransferItem> items = {{p.rx[0], 0, p.ry[0], 8192, kBlock},
                                           {p.rx[0], kBlock, p.ry[0], 8192 + kBlock, kBlock}};
  const std::vector<ItemRun> runs = {{0, 1}, {1, 1}, {1, 1, true, p.rx[1], 0, p.ry[1], 0}};
  ASSERT_EQ(testing::run_transfer(*p.a, p.a->submit(p.peer, TransferOp::kRead, items, runs, SubmitOptions{})).state,
            TransferState::kDone);
  EXPECT_TRUE(std::equal(p.x[0].begin(), p.x[0].begin() + 2 * kBlock, p.y[0].begin() + 8192));
  EXPECT_TRUE(std::equal(p.x[1].begin() + kBlock, p.x[1].begin() + 2 * kBlock, p.y[1].begin() + 8192 + kBlock))
      << GetParam() << ": the moved run's bytes did not land";
  EXPECT_TRUE(std::all_of(p.x[1].begin(), p.x[1].begin() + kBlock, [](uint8_t b) { return b == 0; }));
}

TEST_P(RunsTest, ABadRunPostsNothingAndNamesItself) {
  Layers p(GetParam());
  const std::vector<TransferItem> items = first_layer(p, 16);
  std::vector<TransferItem> two = items;
  two[3].local = p.rx[1];
  struct Bad {
    std::vector<TransferItem> items;
    std::vector<ItemRun> runs;
    Code code;
    std::string says;
  };
  const std::vector<Bad> bad = {
      {items, {}, Code::kInvalidArgument, "no runs"},
      {items, {{0, 17}}, Code::kInvalidArgument, "run 0 names items [0, 0 + 17) of 16"},
      {items, {{0, 16}, {0, 8, true, p.rx[1], 0, p.ry[1], 0}}, Code::kInvalidArgument, "no earlier literal run"},
      {items, {{0, 8, true, p.rx[1], 0, p.ry[1], 0}, {0, 8}}, Code::kInvalidArgument, "no earlier literal run"},
      {two, {{0, 16}, {0, 16, true, p.rx[2], 0, p.ry[2], 0}}, Code::kInvalidArgument, "more than one"},
      {items, {{0, 16}, {0, 16, true, p.rx[1], kLayerBytes - 4 * kBlock, p.ry[1], 0}}, Code::kOutOfRange, "run 1"},
      {items, {{0, 16}, {0, 16, true, p.rx[1], 0, p.ry[1], kLayerBytes}}, Code::kOutOfRange, "run 1: remote range"},
      {items, {{0, 16}, {0, 16, true, p.rx[1], UINT64_MAX, p.ry[1], 0}}, Code::kOutOfRange, "run 1: local range"},
      {items, {{0, 16}, {0, 16, true, p.rx[1], 0, 9999, 0}}, Code::kNotFound, "run 1: peer 'b' advertises no region"},
      {items, {{0, 16}, {0, 16, true, 9999, 0, p.ry[1], 0}}, Code::kNotFound, "run 1"},
  };
  for (const Bad& c : bad) {
    Result<TransferId> t = p.a->submit(p.peer, TransferOp::kRead, c.items, c.runs, SubmitOptions{});
    ASSERT_FALSE(t.ok()) << c.says;
    EXPECT_EQ(t.error().code(), c.code) << t.error().to_string();
    EXPECT_NE(t.error().message().find(c.says), std::string::npos) << t.error().to_string();
  }
  EXPECT_EQ(p.a->metrics().transfers_submitted, 0u);
  for (const std::vector<uint8_t>& layer : p.x)
    EXPECT_TRUE(std::all_of(layer.begin(), layer.end(), [](uint8_t v) { return v == 0; }));
}

// A peer region that allows no reads refuses a moved run into it.
TEST_P(RunsTest, AMovedRunIntoARegionWithoutAccessIsRefused) {
  Layers p(GetParam());
  std::vector<uint8_t> closed(kLayerBytes, 1);
  const RegionId rc = *p.b->register_memory(closed.data(), closed.size(), "host", RemoteAccess::kWrite);
  p.peer = *p.a->connect(p.b->metadata());
  const std::vector<TransferItem> items = first_layer(p, 16);
  const std::vector<ItemRun> runs = {{0, 16}, {0, 16, true, p.rx[1], 0, rc, 0}};
  Result<TransferId> t = p.a->submit(p.peer, TransferOp::kRead, items, runs, SubmitOptions{});
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.error().code(), Code::kPermissionDenied) << t.error().to_string();
  EXPECT_NE(t.error().message().find("run 1"), std::string::npos) << t.error().to_string();
}

// The same moves as a prepared table: one moved run names it, and the
// bytes land as the explicit moved runs put them.
TEST_P(RunsTest, ATableOfMovesLandsWhereItsMovedRunsWould) {
  Layers p(GetParam());
  const uint64_t blocks = 3000;
  const std::vector<TransferItem> items = first_layer(p, blocks);
  std::vector<RunMove> moves;
  for (uint64_t l = 1; l < kLayers; ++l) {
    moves.push_back({p.rx[l], l == 2 ? kBlock : 0, p.ry[l], l == 2 ? UINT64_MAX - 2 * kBlock + 1 : 0});
  }
  Result<PreparedId> table = p.a->prepare_moves(p.peer, TransferOp::kRead, moves);
  ASSERT_TRUE(table.ok()) << table.error().to_string();
  ItemRun all{0, blocks, true};
  all.moves = *table;
  const std::vector<ItemRun> runs = {{0, blocks}, all};
  // Two loads of the table, the second into fresh memory.
  for (int round = 0; round < 2; ++round) {
    for (std::vector<uint8_t>& layer : p.x) std::fill(layer.begin(), layer.end(), 0);
    ASSERT_EQ(testing::run_transfer(*p.a, p.a->submit(p.peer, TransferOp::kRead, items, runs, SubmitOptions{})).state,
              TransferState::kDone);
    for (uint64_t l = 0; l < kLayers; ++l) {
      ASSERT_TRUE(p.x[l] == expected_layer(p, items, l)) << GetParam() << ": round " << round << " layer " << l;
    }
  }
  EXPECT_EQ(p.a->metrics().descriptors, 2 * blocks * kLayers);
  // The table holds its local regions until it is released.
  EXPECT_EQ(p.a->deregister_memory(p.rx[3]).code(), Code::kUnavailable);
  ASSERT_TRUE(p.a->release_prepared(*table).ok());
  EXPECT_TRUE(p.a->deregister_memory(p.rx[3]).ok());
}

TEST_P(RunsTest, ATableRefusesWhatItsMovesCannotHoldAndWhatItWasNotPreparedFor) {
  Layers p(GetParam());
  const std::vector<TransferItem> items = first_layer(p, 16);
  // A move one block from the end of its region: room for the literal
  // run's first block (local offsets [0, 4 KiB)) only when it starts at 0.
  const std::vector<RunMove> moves = {{p.rx[1], 0, p.ry[1], 0}, {p.rx[2], kLayerBytes - kBlock, p.ry[2], 0}};
  const PreparedId table = *p.a->prepare_moves(p.peer, TransferOp::kRead, moves);
  ItemRun moved{0, 16, true};
  moved.moves = table;
  Result<TransferId> t = p.a->submit(p.peer, TransferOp::kRead, items, std::vector<ItemRun>{{0, 16}, moved}, {});
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.error().code(), Code::kOutOfRange) << t.error().to_string();
  EXPECT_NE(t.error().message().find("run 1: items [0, 16) span local [0, 4096)"), std::string::npos)
      << t.error().to_string();
  // Writes with a table prepared for reads, and an unknown table.
  t = p.a->submit(p.peer, TransferOp::kWrite, items, std::vector<ItemRun>{{0, 16}, moved}, {});
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.error().code(), Code::kInvalidArgument) << t.error().to_string();
  moved.moves = table + 100;
  t = p.a->submit(p.peer, TransferOp::kRead, items, std::vector<ItemRun>{{0, 16}, moved}, {});
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.error().code(), Code::kNotFound) << t.error().to_string();
  EXPECT_EQ(p.a->metrics().transfers_submitted, 0u);
  // prepare_moves' own checks, each naming the move.
  std::vector<uint8_t> closed(4096);
  const RegionId rc = *p.b->register_memory(closed.data(), closed.size(), "host", RemoteAccess::kWrite);
  ASSERT_EQ(*p.a->connect(p.b->metadata()), p.peer);
  struct Bad {
    std::vector<RunMove> moves;
    Code code;
    std::string says;
  };
  const std::vector<Bad> bad = {
      {{}, Code::kInvalidArgument, "no moves"},
      {{{p.rx[1], 0, p.ry[1], 0}, {9999, 0, p.ry[1], 0}}, Code::kNotFound, "move 1: local region 9999"},
      {{{p.rx[1], 0, 9999, 0}}, Code::kNotFound, "move 0: peer 'b' advertises no region 9999"},
      {{{p.rx[1], 0, rc, 0}}, Code::kPermissionDenied, "move 0"},
  };
  for (const Bad& c : bad) {
    Result<PreparedId> r = p.a->prepare_moves(p.peer, TransferOp::kRead, c.moves);
    ASSERT_FALSE(r.ok()) << c.says;
    EXPECT_EQ(r.error().code(), c.code) << r.error().to_string();
    EXPECT_NE(r.error().message().find(c.says), std::string::npos) << r.error().to_string();
  }
}

// A table whose peer region is gone says "prepare again"; one whose peer
// only registered more goes on.
TEST_P(RunsTest, ATableWhosePeerRegionIsGoneSaysPrepareAgain) {
  Layers p(GetParam());
  const std::vector<TransferItem> items = first_layer(p, 16);
  const PreparedId table =
      *p.a->prepare_moves(p.peer, TransferOp::kRead, std::vector<RunMove>{{p.rx[1], 0, p.ry[1], 0}});
  ItemRun moved{0, 16, true};
  moved.moves = table;
  const std::vector<ItemRun> runs = {{0, 16}, moved};
  std::vector<uint8_t> more(4096);
  (void)*p.b->register_memory(more.data(), more.size());
  ASSERT_EQ(*p.a->connect(p.b->metadata()), p.peer);
  EXPECT_EQ(testing::run_transfer(*p.a, p.a->submit(p.peer, TransferOp::kRead, items, runs, {})).state,
            TransferState::kDone);
  ASSERT_TRUE(p.b->deregister_memory(p.ry[1]).ok());
  ASSERT_EQ(*p.a->connect(p.b->metadata()), p.peer);
  Result<TransferId> stale = p.a->submit(p.peer, TransferOp::kRead, items, runs, {});
  ASSERT_FALSE(stale.ok());
  EXPECT_EQ(stale.error().code(), Code::kUnavailable) << stale.error().to_string();
  EXPECT_NE(stale.error().message().find("prepare again"), std::string::npos) << stale.error().to_string();
}

INSTANTIATE_TEST_SUITE_P(Transports, RunsTest, ::testing::Values("local", "tcp"));

// split_runs(): every copy once, in order, in shares of about equal bytes.
TEST(SplitRunsTest, SharesHoldEveryCopyOnceInOrder) {
  // Literal, moved and table runs (a table's moves are cut at whole moves,
  // and inside a move where less than a move's bytes are left).
  std::mt19937_64 rng(11);
  uint64_t cut_tables = 0;
  for (int round = 0; round < 200; ++round) {
    engine_internal::CopyProgram program;
    const size_t n = 1 + rng() % 3000;
    auto literal = std::make_shared<engine_internal::CopyList>();
    for (size_t i = 0; i < n; ++i) {
      literal->copies.push_back(
          {reinterpret_cast<uint8_t*>(uintptr_t{4096} + i * 8192), 1 << 20 | i * 8192, 1 + rng() % 4096, 0});
    }
    literal->count_ends();
    program.literal = literal;
    for (size_t r = 0; r < 1 + rng() % 40; ++r) {
      const uint64_t first = rng() % n;
      const uint64_t count = 1 + rng() % (n - first);
      engine_internal::CopyRun run{first, count, rng() % 2 == 0, rng(), rng(), static_cast<uint32_t>(r)};
      if (rng() % 3 == 0) {
        auto table = std::make_shared<std::vector<engine_internal::CopyMove>>();
        for (size_t m = 0; m < 1 + rng() % 100; ++m) table->push_back({rng(), rng(), static_cast<uint32_t>(m)});
        run.moved = false;
        run.moves = table->data();
        run.move_count = table->size();
        program.tables.push_back(table);
      }
      program.runs.push_back(run);
    }
    std::vector<transport::Copy> whole;
    engine_internal::expand_runs(program, program.runs, &whole);
    const size_t parts = 1 + rng() % 4;
    std::vector<std::vector<engine_internal::CopyRun>> shares = engine_internal::split_runs(program, parts);
    ASSERT_LE(shares.size(), parts);
    std::vector<transport::Copy> joined;
    uint64_t total = 0, largest = 0, biggest_copy = 0;
    for (const transport::Copy& c : whole) total += c.bytes, biggest_copy = std::max(biggest_copy, c.bytes);
    size_t table_runs = 0, shared_runs = 0;
    for (const engine_internal::CopyRun& r : program.runs) table_runs += r.moves != nullptr;
    for (const auto& share : shares) {
      for (const engine_internal::CopyRun& r : share) shared_runs += r.moves != nullptr;
    }
    cut_tables += shared_runs > table_runs;
    for (const auto& share : shares) {
      ASSERT_FALSE(share.empty());
      const size_t before = joined.size();
      engine_internal::expand_runs(program, share, &joined);
      uint64_t bytes = 0;
      for (size_t i = before; i < joined.size(); ++i) bytes += joined[i].bytes;
      largest = std::max(largest, bytes);
    }
    ASSERT_EQ(joined.size(), whole.size());
    for (size_t i = 0; i < whole.size(); ++i) {
      ASSERT_TRUE(joined[i].local == whole[i].local && joined[i].remote == whole[i].remote &&
                  joined[i].bytes == whole[i].bytes && joined[i].segment == whole[i].segment)
          << "round " << round << " copy " << i;
    }
    if (shares.size() > 1) {
      // Each share but the last stops short of its due by less than a
      // copy; the last takes what they left.
      EXPECT_LE(largest, total / parts + 1 + parts * biggest_copy) << "round " << round;
    }
  }
  EXPECT_GT(cut_tables, 10u);  // table runs were cut between shares
}

}  // namespace
}  // namespace kvbridge
