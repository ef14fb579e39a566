// Batches as runs against a model, read and written: random items (many continuing the one
// before on both sides, across run boundaries too, so that the engine
// merges them), cut into literal runs, some repeated by moved runs or by a
// prepared table of moves, submitted three ways (items and runs, a
// prepared list and runs of it, runs naming a table), some big enough to
// be split into shares for the engine's threads. Every byte of the
// regions written must be what the model says: the item's source byte
// where an item or a moved run put one, 0 elsewhere; and the transfer's
// bytes the model's. A batch the engine takes and moves otherwise is
// reported done with wrong bytes: the failure this test exists to catch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <random>
#include <span>
#include <tuple>

#include "device/device.h"
#include "kvbridge/engine.h"
#include "testing/run_transfer.h"

namespace kvbridge {
namespace {

constexpr uint64_t kRegions = 3, kRegionBytes = 256 << 10;

// Two engines and kRegions regions on each side, of host memory or of the
// host fake's device memory (the reader's on cuda:0, the peer's on cuda:1,
// moved by `device_copy`).
struct World {
  World(const std::string& transport, const std::string& device_copy) : device(!device_copy.empty()) {
    EngineOptions o;
    o.transports = {transport};
    o.threads = 2;
    if (device) o.device_copy = device_copy;
    o.name = "reader";
    a = std::move(*Engine::create(o));
    o.name = "source";
    b = std::move(*Engine::create(o));
    for (uint64_t r = 0; r < kRegions; ++r) {
      x.push_back(allocate(0));
      y.push_back(allocate(1));
      for (uint64_t i = 0; i < kRegionBytes; ++i) {
        x[r][i] = static_cast<uint8_t>(i * 13 + r * 29 + i / 509 + 3);
        y[r][i] = static_cast<uint8_t>(i * 7 + r * 101 + i / 251 + 1);
      }
      rx.push_back(*a->register_memory(x[r].data(), kRegionBytes, device ? "cuda:0" : "host"));
      ry.push_back(*b->register_memory(y[r].data(), kRegionBytes, device ? "cuda:1" : "host"));
    }
    peer = *a->connect(b->metadata());
  }
  ~World() {
    a.reset();
    b.reset();
    for (std::span<uint8_t> m : x) free(m);
    for (std::span<uint8_t> m : y) free(m);
  }
  std::span<uint8_t> allocate(int on) {
    void* p = nullptr;
    if (device) {
      Result<void*> d = device::current().allocate(on, kRegionBytes);
      EXPECT_TRUE(d.ok()) << d.error().to_string();
      if (d.ok()) p = *d;
    } else {
      p = std::malloc(kRegionBytes);
    }
    EXPECT_NE(p, nullptr);
    return {static_cast<uint8_t*>(p), p == nullptr ? 0 : kRegionBytes};
  }
  void free(std::span<uint8_t> m) {
    if (m.data() == nullptr) return;
    if (device) {
      EXPECT_TRUE(device::current().free(m.data()).ok());
    } else {
      std::free(m.data());
    }
  }
  const bool device;
  std::unique_ptr<Engine> a, b;
  std::vector<std::span<uint8_t>> x, y;
  std::vector<RegionId> rx, ry;
  PeerId peer = 0;
};

// One random batch and what it must leave in the reader's regions.
struct Case {
  std::vector<TransferItem> items;
  std::vector<ItemRun> runs;  // literal runs, and moved runs after what they repeat
  // Per literal run that names one region on each side: its moves (a
  // moved run each, or one table).
  std::vector<std::pair<size_t, std::vector<RunMove>>> moves;
  // Per region of the side written (the reader's for reads, the peer's for
  // writes), per byte: the source byte, or -1.
  std::vector<std::vector<int>> want;
  uint64_t bytes = 0;
};

// Index of a region id in `ids`.
size_t index_of(std::span<const RegionId> ids, RegionId id) {
  return static_cast<size_t>(std::find(ids.begin(), ids.end(), id) - ids.begin());
}

Case make_case(const World& w, TransferOp op, std::mt19937_64& rng) {
  const bool write = op == TransferOp::kWrite;
  Case c;
  c.want.assign(kRegions, std::vector<int>(kRegionBytes, -1));
  auto pick = [&rng](uint64_t n) { return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng); };
  auto chance = [&](int percent) { return pick(100) < static_cast<uint64_t>(percent); };
  // Whether an item may go there: its source in its region, and nothing
  // written where it writes.
  auto free_at = [&](size_t lr, uint64_t lo, size_t rr, uint64_t ro, uint64_t bytes) {
    const size_t region = write ? rr : lr;
    const uint64_t at = write ? ro : lo;
    if (lo + bytes > kRegionBytes || ro + bytes > kRegionBytes || lo + bytes < lo || ro + bytes < ro) return false;
    return std::all_of(c.want[region].begin() + static_cast<int64_t>(at),
                       c.want[region].begin() + static_cast<int64_t>(at + bytes), [](int v) { return v < 0; });
  };
  auto put = [&](size_t lr, uint64_t lo, size_t rr, uint64_t ro, uint64_t bytes) {
    for (uint64_t i = 0; i < bytes; ++i) {
      if (write) {
        c.want[rr][ro + i] = w.x[lr][lo + i];
      } else {
        c.want[lr][lo + i] = w.y[rr][ro + i];
      }
    }
    c.bytes += bytes;
  };
  // One case in eight is big: past the size where the engine splits a
  // batch into shares for its threads, cutting runs and tables.
  const bool big = chance(12);
  const uint64_t literal_runs = 1 + pick(5);
  for (uint64_t k = 0; k < literal_runs; ++k) {
    const bool one_region = chance(75);
    size_t lr = pick(kRegions), rr = pick(kRegions);
    const uint64_t first = c.items.size();
    const uint64_t want_items = big ? 200 + pick(800) : 1 + pick(8);
    for (uint64_t i = 0; i < want_items; ++i) {
      if (!one_region) lr = pick(kRegions), rr = pick(kRegions);
      const uint64_t bytes = 8 * (1 + pick(big ? 4 : 16));
      uint64_t lo = 0, ro = 0;
      bool placed = false;
      // Often right after the item before (of this run or the last one),
      // on both sides: the engine merges the two. A run of one region
      // takes the last item's regions for its first item.
      if (!c.items.empty() && chance(big ? 20 : 60)) {
        const TransferItem& last = c.items.back();
        const size_t llr = index_of(w.rx, last.local), lrr = index_of(w.ry, last.remote);
        if (!one_region || i == 0 || (llr == lr && lrr == rr)) {
          lr = llr;
          rr = lrr;
          lo = last.local_offset + last.bytes;
          ro = last.remote_offset + last.bytes;
          placed = free_at(lr, lo, rr, ro, bytes);
        }
      }
      for (int tries = 0; !placed && tries < 32; ++tries) {
        lo = 8 * pick((kRegionBytes - bytes) / 8 + 1);
        ro = 8 * pick((kRegionBytes - bytes) / 8 + 1);
        placed = free_at(lr, lo, rr, ro, bytes);
      }
      if (!placed) continue;
      c.items.push_back({w.rx[lr], lo, w.ry[rr], ro, bytes});
      put(lr, lo, rr, ro, bytes);
    }
    const uint64_t count = c.items.size() - first;
    if (count == 0) continue;
    c.runs.push_back({first, count});
    if (!one_region || !chance(70)) continue;
    // Moves of this run: each takes every item to another local region and
    // shift and another peer region and shift (where nothing is written).
    uint64_t llo = UINT64_MAX, lhi = 0, rlo = UINT64_MAX, rhi = 0;
    for (uint64_t i = first; i < first + count; ++i) {
      llo = std::min(llo, c.items[i].local_offset);
      lhi = std::max(lhi, c.items[i].local_offset + c.items[i].bytes);
      rlo = std::min(rlo, c.items[i].remote_offset);
      rhi = std::max(rhi, c.items[i].remote_offset + c.items[i].bytes);
    }
    std::vector<RunMove> moves;
    const uint64_t n = 1 + pick(3);
    for (uint64_t m = 0; m < n; ++m) {
      for (int tries = 0; tries < 32; ++tries) {
        const size_t to_l = pick(kRegions), to_r = pick(kRegions);
        const uint64_t new_llo = 8 * pick((kRegionBytes - (lhi - llo)) / 8 + 1);
        const uint64_t new_rlo = 8 * pick((kRegionBytes - (rhi - rlo)) / 8 + 1);
        const uint64_t lshift = new_llo - llo, rshift = new_rlo - rlo;  // modulo 2^64
        bool fits = true;
        for (uint64_t i = first; fits && i < first + count; ++i) {
          fits = free_at(to_l, c.items[i].local_offset + lshift, to_r, c.items[i].remote_offset + rshift,
                         c.items[i].bytes);
        }
        if (!fits) continue;
        for (uint64_t i = first; i < first + count; ++i) {
          put(to_l, c.items[i].local_offset + lshift, to_r, c.items[i].remote_offset + rshift, c.items[i].bytes);
        }
        moves.push_back({w.rx[to_l], lshift, w.ry[to_r], rshift});
        break;
      }
    }
    if (!moves.empty()) c.moves.emplace_back(c.runs.size() - 1, std::move(moves));
  }
  return c;
}

enum class Way { kItems, kPreparedList, kTable };

// (transport, op, "" for host memory or the device copy method)
class RunsPropertyTest : public ::testing::TestWithParam<std::tuple<std::string, TransferOp, std::string>> {};

TEST_P(RunsPropertyTest, EveryByteIsWhereTheModelPutsIt) {
  const auto& [transport, op, device_copy] = GetParam();
  if (!device_copy.empty() && device::current().name() != "fake") {
    GTEST_FAIL() << "engine_test runs with KVB_DEVICE=fake (CMakeLists.txt)";
  }
  World w(transport, device_copy);
  const std::string what = transport + (op == TransferOp::kRead ? " reads" : " writes") +
                           (device_copy.empty() ? "" : " of device memory by " + device_copy);
  std::vector<std::span<uint8_t>>& written = op == TransferOp::kRead ? w.x : w.y;
  uint64_t merged_across = 0;  // runs that continue the run before (the engine merges them)
  uint64_t past_split = 0;     // cases of more copies than the engine moves in one share
  for (uint64_t seed = 0; seed < 100; ++seed) {
    std::mt19937_64 rng(seed);
    const Case c = make_case(w, op, rng);
    if (c.items.empty()) continue;
    for (size_t k = 1; k < c.runs.size(); ++k) {
      const TransferItem& a = c.items[c.runs[k].first - 1];
      const TransferItem& b = c.items[c.runs[k].first];
      merged_across += a.local == b.local && a.remote == b.remote && a.local_offset + a.bytes == b.local_offset &&
                       a.remote_offset + a.bytes == b.remote_offset;
    }
    uint64_t copies = c.items.size();
    for (const auto& [run, moves] : c.moves) copies += c.runs[run].count * moves.size();
    past_split += copies > 2048;
    const Way way = static_cast<Way>(seed % 3);
    std::vector<ItemRun> runs = c.runs;
    std::vector<PreparedId> prepared;
    for (const auto& [run, moves] : c.moves) {
      const ItemRun& l = c.runs[run];
      if (way == Way::kTable) {
        Result<PreparedId> t = w.a->prepare_moves(w.peer, op, moves);
        ASSERT_TRUE(t.ok()) << "seed " << seed << ": " << t.error().to_string();
        prepared.push_back(*t);
        ItemRun r{l.first, l.count, true};
        r.moves = *t;
        runs.push_back(r);
        continue;
      }
      for (const RunMove& m : moves) {
        runs.push_back({l.first, l.count, true, m.local, m.local_shift, m.remote, m.remote_shift});
      }
    }
    for (std::span<uint8_t> r : written) std::fill(r.begin(), r.end(), 0);
    Result<TransferId> id = Status::internal("not submitted");
    if (way == Way::kPreparedList) {
      Result<PreparedId> list = w.a->prepare(w.peer, op, c.items);
      ASSERT_TRUE(list.ok()) << "seed " << seed << ": " << list.error().to_string();
      prepared.push_back(*list);
      id = w.a->submit_runs(*list, runs, SubmitOptions{});
    } else {
      id = w.a->submit(w.peer, op, c.items, runs, SubmitOptions{});
    }
    const TransferStatus st = testing::run_transfer(*w.a, std::move(id));
    ASSERT_EQ(st.state, TransferState::kDone) << what << " seed " << seed << ": " << st.error.to_string();
    EXPECT_EQ(st.bytes_total, c.bytes) << what << " seed " << seed;
    for (uint64_t r = 0; r < kRegions; ++r) {
      for (uint64_t i = 0; i < kRegionBytes; ++i) {
        const int want = c.want[r][i] < 0 ? 0 : c.want[r][i];
        ASSERT_EQ(written[r][i], want) << what << " seed " << seed << ": region " << r << " byte " << i
                                       << (c.want[r][i] < 0 ? " (nothing goes there)" : "");
      }
    }
    for (PreparedId p : prepared) ASSERT_TRUE(w.a->release_prepared(p).ok());
  }
  // The cases reach what they are for.
  EXPECT_GT(merged_across, 20u);
  EXPECT_GT(past_split, 3u);
}

INSTANTIATE_TEST_SUITE_P(HostMemory, RunsPropertyTest,
                         ::testing::Combine(::testing::Values("local", "tcp"),
                                            ::testing::Values(TransferOp::kRead, TransferOp::kWrite),
                                            ::testing::Values("")));
// Device memory in one process: the local transport's batched device copy,
// by the copy engines and by the gather kernel (on the host fake).
INSTANTIATE_TEST_SUITE_P(DeviceMemory, RunsPropertyTest,
                         ::testing::Combine(::testing::Values("local"),
                                            ::testing::Values(TransferOp::kRead, TransferOp::kWrite),
                                            ::testing::Values("copy_engine", "kernel")));

}  // namespace
}  // namespace kvbridge
