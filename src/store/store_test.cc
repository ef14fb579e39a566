// The store end to end in one process: cross-TP and cross-block-size reads
// checked byte for byte, group selection, the hybrid lookup rule, visibility
// of multi-part objects, and eviction under pressure with readers.
#include <atomic>
#include <chrono>
#include <thread>

#include <gtest/gtest.h>

#include "kvbridge/store.h"
#include "store/test_support.h"
#include "transport/staging.h"

namespace kvbridge {
namespace {

using testing::Geometry;
using testing::Instance;
using testing::make_request;
using testing::memory_store;
using testing::preset;
using testing::RankMemory;
using testing::stored_view;
using testing::tokens;

struct CrossCase {
  std::string preset;
  uint64_t H;
  Geometry writer, reader;
  uint64_t num_tokens, expect_hit;
};

class CrossGeometryTest : public ::testing::TestWithParam<CrossCase> {};

TEST_P(CrossGeometryTest, ReaderOfAnotherTpAndBlockSizeGetsTheExactBytes) {
  const CrossCase& c = GetParam();
  auto store = memory_store(c.H);
  Instance writer(store, c.preset, c.writer, c.num_tokens);
  Instance reader(store, c.preset, c.reader, c.num_tokens);
  const std::vector<uint32_t> t = tokens(11, c.num_tokens);
  writer.fill(c.num_tokens, 99);
  // Every rank but the last: the objects are not visible yet.
  uint64_t copied = 0;
  for (size_t r = 0; r + 1 < writer.ranks.size(); ++r) copied += writer.put(t, c.num_tokens, r);
  if (writer.ranks.size() > 1) {
    EXPECT_EQ(reader.stores[0].lookup(t)->hit_tokens, 0u);
    EXPECT_EQ(store->stats().memory_objects, 0u);
  }
  copied += writer.put(t, c.num_tokens, writer.ranks.size() - 1);
  const StoreStats s = store->stats();
  EXPECT_EQ(s.staging_objects, 0u);
  EXPECT_GT(s.memory_objects, 0u);
  // Each payload byte was written by exactly one rank (replicated components
  // and shared heads once, not once per rank).
  EXPECT_EQ(copied, s.memory_bytes - 64 * s.memory_objects);
  reader.get_and_check(t, c.num_tokens, 99, c.expect_hit);
  // A second put finds everything present and copies nothing.
  EXPECT_EQ(writer.put(t, c.num_tokens), 0u);
}

INSTANTIATE_TEST_SUITE_P(Presets, CrossGeometryTest,
                         ::testing::Values(CrossCase{"llama3-8b", 16, {8, 32}, {2, 16}, 200, 192},
                                           CrossCase{"llama3-8b", 16, {1, 16}, {4, 64, Order::kBLHNC}, 200, 192},
                                           CrossCase{"deepseek-v3", 64, {4, 128}, {1, 64, Order::kBLHNC}, 320, 320},
                                           CrossCase{"gpt-oss", 16, {8, 32}, {2, 16, Order::kLBNHC}, 400, 400},
                                           CrossCase{"qwen3-next", 16, {8, 64}, {2, 128}, 128, 128},
                                           CrossCase{"mla-with-draft", 32, {2, 64}, {8, 128}, 256, 256}),
                         [](const auto& info) {
                           std::string n = info.param.preset + "_tp" + std::to_string(info.param.writer.tp) + "_to_tp" +
                                           std::to_string(info.param.reader.tp) + "_" + std::to_string(info.index);
                           for (char& ch : n)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

// The parts ranks write when they assemble an object in Redis
// (GroupGeometry::part): over the ranks of an instance they cover the payload
// exactly once, so an object whose every part bit is set is whole.
TEST(StoreTest, PartsOfEveryRankCoverThePayloadExactlyOnce) {
  const std::vector<std::pair<std::string, std::vector<uint32_t>>> cases = {{"llama3-8b", {1, 2, 8, 16}},
                                                                            {"deepseek-v3", {1, 4}},
                                                                            {"qwen3-next", {2, 8}},
                                                                            {"gpt-oss", {8}},
                                                                            {"mla-with-draft", {2, 8}}};
  for (const auto& [name, tps] : cases) {
    for (uint32_t tp : tps) {
      std::vector<store_internal::Canonical> ranks;
      for (uint32_t r = 0; r < tp; ++r) {
        Result<store_internal::Canonical> c = store_internal::Canonical::create(preset(name, tp, r, 64, 2), 16);
        ASSERT_TRUE(c.ok()) << name << " tp " << tp << ": " << c.status().to_string();
        ranks.push_back(std::move(*c));
      }
      for (size_t gi = 0; gi < ranks[0].num_groups(); ++gi) {
        if (!ranks[0].geometry(gi).stored) continue;
        const uint64_t n = ranks[0].geometry(gi).object_bytes;
        std::vector<uint8_t> writes(n, 0);
        for (const auto& c : ranks) {
          for (const auto& [b, e] : c.geometry(gi).part) {
            ASSERT_LE(e, n);
            for (uint64_t i = b; i < e; ++i) ++writes[i];
          }
        }
        for (uint64_t i = 0; i < n; ++i) {
          ASSERT_EQ(writes[i], i < store_internal::kHeaderBytes ? 0 : 1)
              << name << " tp " << tp << " group " << gi << " byte " << i;
        }
      }
    }
  }
}

TEST(StoreTest, ScratchGroupsAreNeverStoredAndIdsStayStable) {
  // glm5-flash: mla, indexer (2 hash blocks each), indexer_tail (scratch:
  // never), kda.0-3 (the state at 1152 each).
  auto store = memory_store(576);
  Instance writer(store, "glm5-flash", {1, 1152}, 1152);
  Instance reader(store, "glm5-flash", {2, 576}, 1152);
  const std::vector<uint32_t> t = tokens(5, 1152);
  writer.fill(1152, 7);
  writer.put(t, 1152);
  EXPECT_EQ(store->stats().memory_objects, 2u * 2 + 4);
  reader.get_and_check(t, 1152, 7, 1152);
}

// A rank of a pipeline stage holds part of the model: refused, saying why.
TEST(StoreTest, APipelineStageRankIsRefusedClearly) {
  auto store = memory_store(16);
  Result<Layout> stage = make_preset(PresetOptions{.name = "llama3-8b", .num_blocks = 8, .pp_size = 2, .pp_rank = 1});
  ASSERT_TRUE(stage.ok()) << stage.error().to_string();
  Result<RankStore> s = RankStore::create(store, *stage);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code(), Code::kInvalidArgument);
  EXPECT_EQ(s.error().message(),
            "store: the layout is a rank of pipeline stage 1 of 2; the prefix store takes ranks that hold every "
            "layer (pp_size 1)");
}

// A rank of a context-parallel instance holds some tokens of each block:
// refused, saying why.
TEST(StoreTest, AContextShardRankIsRefusedClearly) {
  auto store = memory_store(16);
  Result<Layout> shard =
      make_preset(PresetOptions{.name = "llama3-8b", .tp_size = 2, .tp_rank = 1, .num_blocks = 8, .dcp_size = 2});
  ASSERT_TRUE(shard.ok()) << shard.error().to_string();
  Result<RankStore> s = RankStore::create(store, *shard);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().message(),
            "store: group 'full' is context shard 1 of 2; the prefix store takes ranks that hold every token of a "
            "block");
}

TEST(StoreTest, HybridHitNeedsTheStateNotJustTheAttentionBlocks) {
  auto store = memory_store(16);
  Instance inst(store, "qwen3-next", {1, 64}, 128);
  const std::vector<uint32_t> t = tokens(3, 128);
  inst.fill(128, 1);
  Request r = make_request(inst.ranks[0].layout, 128);
  r.blocks["linear"].local = {-1, -1};  // the engine kept no state
  ASSERT_TRUE(inst.stores[0].put(t, r, inst.ranks[0].memory()).ok());
  EXPECT_EQ(inst.stores[0].lookup(t)->hit_tokens, 0u) << "attention blocks alone are no hit";
  Instance reader(store, "qwen3-next", {1, 64}, 128);
  reader.get_and_check(t, 128, 1, 0);
  // With the state at 64 only, the hit is 64.
  r.blocks["linear"].local = {0, -1};
  ASSERT_TRUE(inst.stores[0].put(t, r, inst.ranks[0].memory()).ok());
  EXPECT_EQ(inst.stores[0].lookup(t)->hit_tokens, 64u);
  inst.put(t, 128);
  reader.get_and_check(t, 128, 1, 128);
}

TEST(StoreTest, SlidingWindowKeepsOnlyTheWindow) {
  auto store = memory_store(16);
  Instance inst(store, "gpt-oss", {1, 16}, 320);
  const std::vector<uint32_t> t = tokens(4, 320);
  inst.fill(320, 2);
  inst.put(t, 320);
  EXPECT_EQ(store->stats().memory_objects, 20u + 8u);  // full: 20 blocks; swa: the last 128 tokens
  // A shorter prefix needs a window that was never stored: no hit.
  EXPECT_EQ(inst.stores[0].lookup(t, 160)->hit_tokens, 0u);
  Instance reader(store, "gpt-oss", {2, 32}, 320);
  reader.get_and_check(t, 320, 2, 320);
}

TEST(StoreTest, StatesAreKeptAtHashBlockBoundaries) {
  auto store = memory_store(16);
  Instance inst(store, "qwen3-next", {1, 64}, 144);
  const std::vector<uint32_t> t = tokens(8, 144);
  inst.fill(144, 3);
  inst.put(t, 144);
  // full: 9 hash blocks; linear: the states at 64, 128 and 144.
  EXPECT_EQ(store->stats().memory_objects, 9u + 3u);
  Instance reader(store, "qwen3-next", {2, 64}, 144);
  reader.get_and_check(t, 144, 3, 128);  // hits are multiples of the reader's 64-token blocks
}

TEST(StoreTest, GetSkipsWhatTheRankHasAndPutSkipsWhatIsStored) {
  auto store = memory_store(16);
  Instance inst(store, "llama3-8b", {1, 16}, 128);
  const std::vector<uint32_t> t = tokens(9, 128);
  inst.fill(128, 4);
  inst.put(t, 128);
  Instance reader(store, "llama3-8b", {1, 16}, 128);
  Request r = make_request(reader.ranks[0].layout, 128, 2);
  r.skip_tokens = 64;
  Result<GetResult> g = reader.stores[0].get(t, r, reader.ranks[0].memory());
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->hit_tokens, 128u);
  EXPECT_EQ(g->memory_objects, 4u);
  Result<ContentReport> c = check_request(reader.ranks[0].layout, make_request(reader.ranks[0].layout, 128, 2),
                                          RequestSide::kLocal, 64, 4, reader.ranks[0].memory());
  EXPECT_EQ(c->bad_cells, 0u);
  Result<PutResult> p = inst.stores[0].put(t, make_request(inst.ranks[0].layout, 128), inst.ranks[0].memory());
  EXPECT_EQ(p->objects_present, 8u);
  EXPECT_EQ(p->bytes_copied, 0u);
}

TEST(StoreTest, RejectsAHashBlockThatDoesNotFit) {
  auto store = memory_store(48);
  Result<RankStore> r = RankStore::create(store, preset("llama3-8b", 1, 0, 16, 4));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("does not divide block_tokens 16"), std::string::npos) << r.error().message();
  auto s2 = memory_store(16);
  Instance i(s2, "llama3-8b", {1, 16}, 32);
  const std::vector<uint32_t> t = tokens(1, 32);
  EXPECT_FALSE(i.stores[0].put(t, make_request(i.ranks[0].layout, 64), i.ranks[0].memory()).ok());
}

TEST(StoreTest, EvictionUnderPressureNeverTouchesAnObjectBeingRead) {
  // Room for about 12 objects of 2 MiB; a writer floods the store with other
  // prefixes while a reader keeps getting one prefix. Every hit must be
  // byte-exact: an object evicted and reused under the reader would not be.
  const uint64_t object = 2 * 1024 * 1024 + 64;
  auto store = memory_store(16, 12 * object);
  Instance a(store, "llama3-8b", {1, 16}, 96);
  Instance b(store, "llama3-8b", {1, 16}, 96);
  const std::vector<uint32_t> mine = tokens(100, 64);
  a.fill(64, 100);
  a.put(mine, 64);
  std::atomic<bool> stop{false};
  std::atomic<int> hits{0}, bad{0};
  std::thread reader([&] {
    RankMemory m(a.ranks[0].layout);
    while (!stop) {
      Result<GetResult> g = a.stores[0].get(mine, make_request(m.layout, 64, 4), m.memory());
      if (!g.ok()) {
        ++bad;
        continue;
      }
      if (g->hit_tokens == 0) {
        // Evicted between reads (not under one): put it back.
        a.put(mine, 64);
        continue;
      }
      Result<ContentReport> c =
          check_request(m.layout, make_request(m.layout, g->hit_tokens, 4), RequestSide::kLocal, 0, 100, m.memory());
      if (!c.ok() || c->bad_cells != 0) ++bad;
      ++hits;
    }
  });
  // At least 30 other prefixes, and on until the reader has had a few hits
  // (a fast writer on a loaded machine can finish before the reader's first
  // get is scheduled).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (uint64_t i = 0; i < 30 || (hits.load() < 3 && std::chrono::steady_clock::now() < deadline); ++i) {
    const std::vector<uint32_t> other = tokens(1000 + i, 64);
    b.fill(64, 1000 + i);
    b.put(other, 64);
  }
  stop = true;
  reader.join();
  const StoreStats s = store->stats();
  EXPECT_GT(s.evictions, 0u);
  EXPECT_GT(hits.load(), 0);
  EXPECT_EQ(bad.load(), 0);
  EXPECT_LE(s.memory_bytes + s.pooled_bytes, s.capacity_bytes);
  EXPECT_EQ(s.pinned_objects, 0u);
}

}  // namespace
}  // namespace kvbridge

namespace kvbridge {
namespace {

TEST(StoreTest, LayoutsWithOneBlockPerGroupPutAndGetExactBytes) {
  // One block per group: the copies of objects are planned from the layouts
  // alone, with no second block to compare with (canonical.h).
  auto store = memory_store(8);
  for (const std::string name : {"llama3-8b", "gpt-oss"}) {
    RankMemory w(preset(name, 2, 1, 16, name == "gpt-oss" ? 2 : 1));
    RankMemory r(preset(name, 1, 0, 16, name == "gpt-oss" ? 2 : 1));
    const int64_t stride = name == "gpt-oss" ? 1 : 0;
    const std::vector<uint32_t> t = tokens(61, 16);
    RankStore ws = *RankStore::create(store, w.layout);
    RankStore rs = *RankStore::create(store, r.layout);
    // TP 2 rank 1 alone does not complete the objects; rank 0 of TP 2 too.
    RankMemory w0(preset(name, 2, 0, 16, name == "gpt-oss" ? 2 : 1));
    RankStore ws0 = *RankStore::create(store, w0.layout);
    for (auto* m : {&w, &w0}) {
      ASSERT_TRUE(
          fill_request(m->layout, make_request(m->layout, 16, 0, stride), RequestSide::kLocal, 0, 5, m->memory()).ok());
    }
    ASSERT_TRUE(ws.put(t, make_request(w.layout, 16, 0, stride), w.memory()).ok());
    ASSERT_TRUE(ws0.put(t, make_request(w0.layout, 16, 0, stride), w0.memory()).ok());
    Result<GetResult> g = rs.get(t, make_request(r.layout, 16, 0, stride), r.memory());
    ASSERT_TRUE(g.ok()) << g.status().to_string();
    EXPECT_EQ(g->hit_tokens, 16u) << name;
    Result<ContentReport> c = check_request(stored_view(r.layout), make_request(r.layout, 16, 0, stride),
                                            RequestSide::kLocal, 0, 5, r.memory());
    ASSERT_TRUE(c.ok());
    EXPECT_GT(c->cells, 0u);
    EXPECT_EQ(c->bad_cells, 0u) << name << ": " << c->first_error;
  }
}

// Rank memory on a device (the fake: ctest sets KVB_DEVICE=fake): puts and
// gets move it through pinned host memory, a chunk per batched device copy,
// after the producer's event; a cross-TP, cross-block-size reader gets the
// exact bytes, a hybrid's states included.
TEST(StoreDeviceTest, DeviceMemoryGoesInAndOutThroughPinnedChunksAfterItsEvents) {
  const uint64_t before = transport::staged_chunks();
  auto store = memory_store(16);
  EXPECT_EQ(testing::device_round_trip(store, store, "llama3-8b", {8, 32}, {2, 16}, 256, 5), 256u);
  EXPECT_GT(transport::staged_chunks(), before) << "nothing went through the staging pool";
  auto hybrid = memory_store(16);
  EXPECT_EQ(testing::device_round_trip(hybrid, hybrid, "qwen3-next", {2, 64}, {1, 128}, 128, 6), 128u);
  // The gather/scatter kernel reaches only device and pinned memory (the
  // fake refuses anything else as CUDA does): staged, it moves every byte.
  RankStoreOptions kernel{"cuda:0"};
  kernel.device_copy = "kernel";
  kernel.staging_chunk_bytes = 64 << 10;  // many chunks, both slots reused
  kernel.staging_bytes = 256 << 10;
  auto small = memory_store(16);
  const size_t kernels = device::fake_kernel_copies();
  EXPECT_EQ(testing::device_round_trip(small, small, "deepseek-v3", {1, 64}, {1, 32}, 256, 7, kernel), 256u);
  EXPECT_GT(device::fake_kernel_copies(), kernels + 4);
}

// A producer that does not finish within the timeout: the put fails naming
// the wait and stores nothing (no object with bytes the producer had not
// written yet).
TEST(StoreDeviceTest, APutWhoseProducerDoesNotFinishTimesOutAndStoresNothing) {
  using namespace std::chrono_literals;
  auto store = memory_store(16);
  testing::DeviceRank m(preset("llama3-8b", 1, 0, 16, 8));
  RankStoreOptions options{"cuda:0"};
  options.timeout = 100ms;
  Result<RankStore> rs = RankStore::create(store, m.layout(), options);
  ASSERT_TRUE(rs.ok()) << rs.status().to_string();
  const Readiness slow = m.upload(600ms);
  const auto t0 = std::chrono::steady_clock::now();
  Result<PutResult> p = rs->put(tokens(4, 64), make_request(m.layout(), 64), m.memory(), slow);
  ASSERT_FALSE(p.ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 500ms);
  EXPECT_EQ(p.status().code(), Code::kTimeout) << p.status().to_string();
  EXPECT_NE(p.status().message().find("store: put from cuda:0"), std::string::npos) << p.status().to_string();
  EXPECT_EQ(store->stats().memory_objects, 0u);
  EXPECT_EQ(store->stats().staging_objects, 0u) << "a failed part was left staged";
}

TEST(StoreDeviceTest, MemoryOfAnotherKindOrAnEventForHostMemoryIsRefusedByName) {
  auto store = memory_store(16);
  testing::RankMemory host(preset("llama3-8b", 1, 0, 16, 8));
  const std::vector<uint32_t> t = tokens(3, 64);
  Result<RankStore> on_device = RankStore::create(store, host.layout, RankStoreOptions{"cuda:0"});
  ASSERT_TRUE(on_device.ok()) << on_device.status().to_string();
  Result<PutResult> p = on_device->put(t, make_request(host.layout, 64), host.memory());
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), Code::kInvalidArgument);
  EXPECT_NE(p.status().message().find("tensor '" + host.layout.tensors[0].name + "'"), std::string::npos)
      << p.status().to_string();
  EXPECT_NE(p.status().message().find("byte 0 of the range is host memory, not cuda:0"), std::string::npos)
      << p.status().to_string();
  Result<RankStore> on_host = RankStore::create(store, host.layout);
  ASSERT_TRUE(on_host.ok());
  Readiness ready;
  ready.event = 1;
  Result<GetResult> g = on_host->get(t, make_request(host.layout, 64), host.memory(), ready);
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("a ready event is for device memory"), std::string::npos)
      << g.status().to_string();
  EXPECT_EQ(store->stats().memory_objects, 0u);
  const std::vector<std::pair<RankStoreOptions, std::string>> bad = {
      {{"gpu0"}, "unknown memory kind 'gpu0'"},
      {{"cuda:x"}, "is not cuda:N"},
      {{"cuda:7"}, "cuda:7: there is no such device"},
      {{"cuda:0", 1 << 20, 1 << 20}, "must hold at least three chunks"},
      {{"cuda:0", 8 << 20, 2 << 20, "fast"}, "device_copy"},
  };
  for (const auto& [options, why] : bad) {
    Result<RankStore> r = RankStore::create(store, host.layout, options);
    ASSERT_FALSE(r.ok()) << why;
    EXPECT_NE(r.status().message().find(why), std::string::npos) << r.status().to_string();
  }
}

}  // namespace
}  // namespace kvbridge
