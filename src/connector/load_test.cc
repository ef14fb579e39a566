// load_stage(): a stage's compact plan as each source's items and runs,
// against a model that reads the plan descriptor by descriptor.
#include "connector/load.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <tuple>
#include <vector>

namespace kvbridge::connector {
namespace {

// Items and runs as tuples, which gtest compares and prints.
using ItemTuple = std::tuple<RegionId, uint64_t, RegionId, uint64_t, uint64_t>;
using RunTuple = std::tuple<uint64_t, uint64_t, bool, RegionId, uint64_t, RegionId, uint64_t, PreparedId>;
std::vector<ItemTuple> tuples(const std::vector<TransferItem>& items) {
  std::vector<ItemTuple> out;
  for (const TransferItem& i : items) out.emplace_back(i.local, i.local_offset, i.remote, i.remote_offset, i.bytes);
  return out;
}
std::vector<RunTuple> tuples(const std::vector<ItemRun>& runs) {
  std::vector<RunTuple> out;
  for (const ItemRun& r : runs) {
    out.emplace_back(r.first, r.count, r.moved, r.local, r.local_shift, r.remote, r.remote_shift, r.moves);
  }
  return out;
}

constexpr size_t kSources = 3;
constexpr uint16_t kLocalTensors = 4, kRemoteTensors = 3;

// Local tensor t is region 10 + t, source s's remote tensor t region
// 100 * (s + 1) + t; local tensor 3 and source 2's tensor 2 are device
// memory.
struct World {
  std::vector<RegionId> local_regions;
  Layout local;
  std::vector<Layout> remotes;
  std::vector<RankInfo> infos;
  World() {
    for (uint16_t t = 0; t < kLocalTensors; ++t) {
      local_regions.push_back(10 + t);
      local.tensors.push_back({"l" + std::to_string(t), 1 << 20, t == 3 ? "cuda:0" : "host"});
    }
    for (size_t s = 0; s < kSources; ++s) {
      Layout r;
      RankInfo info;
      for (uint16_t t = 0; t < kRemoteTensors; ++t) {
        r.tensors.push_back({"r" + std::to_string(t), 1 << 20, s == 2 && t == 2 ? "cuda:0" : "host"});
        info.tensors.push_back({"r" + std::to_string(t), static_cast<uint32_t>(100 * (s + 1) + t), 0, 1 << 20});
      }
      remotes.push_back(r);
      infos.push_back(info);
    }
  }
  RegionId remote(size_t s, uint16_t t) const { return infos[s].tensors[t].region; }
  bool device(size_t s, uint16_t lt, uint16_t rt) const { return lt == 3 || (s == 2 && rt == 2); }
};

// A random stage: two literal runs (the first of one pair of tensors, so
// that later runs may move it; the second of any), then runs that move the
// first (one by its own shifts, one by a table), one that moves a range no
// literal run holds (taken as items), and a third literal run.
CompactStage random_stage(std::mt19937_64& rng, bool one_source) {
  CompactStage st;
  CompactPlan& p = st.plan;
  auto descriptor = [&](uint16_t lt, uint16_t rt) {
    Descriptor d;
    d.source = one_source ? 1 : static_cast<uint16_t>(rng() % kSources);
    d.local_tensor = lt;
    d.remote_tensor = rt;
    d.local_offset = rng() % 4096;
    d.remote_offset = rng() % 4096;
    d.bytes = 1 + rng() % 64;
    p.literal.push_back(d);
  };
  auto literal_run = [&](uint64_t n, bool one_pair) {
    const uint64_t first = p.literal.size();
    for (uint64_t k = 0; k < n; ++k) {
      descriptor(one_pair ? 0 : static_cast<uint16_t>(rng() % kLocalTensors),
                 one_pair ? 1 : static_cast<uint16_t>(rng() % kRemoteTensors));
    }
    p.runs.push_back({first, n});
  };
  literal_run(1 + rng() % 40, true);
  literal_run(1 + rng() % 40, false);
  const DescriptorRun a = p.runs[0];
  auto lt = [&] { return static_cast<uint16_t>(rng() % kLocalTensors); };
  auto rt = [&] { return static_cast<uint16_t>(rng() % kRemoteTensors); };
  DescriptorRun moved{a.first, a.count, true, lt(), rt(), 1000 + rng() % 100, 2000 + rng() % 100};
  p.runs.push_back(moved);
  auto shifts = std::make_shared<std::vector<TensorShift>>();
  for (uint64_t k = 0, n = 1 + rng() % 3; k < n; ++k) shifts->push_back({lt(), rt(), 5000 * (k + 1), 6000 * (k + 1)});
  DescriptorRun table = moved;
  table.table = shifts;
  table.local_tensor = shifts->front().local_tensor, table.remote_tensor = shifts->front().remote_tensor;
  table.local_shift = shifts->front().local_shift, table.remote_shift = shifts->front().remote_shift;
  p.runs.push_back(table);
  // Descriptors [1, a.count) of the first run: no literal run's range.
  if (a.count > 1) p.runs.push_back({a.first + 1, a.count - 1, true, 1, 0, 300, 400});
  literal_run(1 + rng() % 10, false);
  return st;
}

// What load_stage() should make of `st`, read descriptor by descriptor;
// `literal_out`: each literal run's items per source.
LoadStage model(const World& w, const CompactStage& st, size_t only_source, std::vector<bool>* used,
                std::vector<LiteralItems>* literal_out) {
  const CompactPlan& p = st.plan;
  LoadStage ls;
  ls.items.resize(kSources);
  ls.runs.resize(kSources);
  ls.tables.resize(kSources);
  ls.device.assign(kSources, 0);
  auto wanted = [&](size_t s) { return only_source == SIZE_MAX || s == only_source; };
  // Per literal run (by first descriptor): each source's range of items.
  std::vector<std::pair<uint64_t, std::vector<ItemRun>>> literal;
  for (const DescriptorRun& run : p.runs) {
    const Descriptor* ds = p.literal.data() + run.first;
    auto held = std::find_if(literal.begin(), literal.end(), [&](const auto& l) { return l.first == run.first; });
    if (run.moved && held != literal.end()) {
      for (size_t s = 0; s < kSources; ++s) {
        const ItemRun& l = held->second[s];
        if (l.count == 0) continue;
        if (run.table != nullptr) {
          ls.tables[s].push_back({ls.runs[s].size(), run.table});
          ls.runs[s].push_back({l.first, l.count, true});
          for (const TensorShift& m : *run.table) ls.device[s] |= w.device(s, m.local_tensor, m.remote_tensor);
          continue;
        }
        ls.runs[s].push_back({l.first, l.count, true, w.local_regions[run.local_tensor], run.local_shift,
                              w.remote(s, run.remote_tensor), run.remote_shift});
        ls.device[s] |= w.device(s, run.local_tensor, run.remote_tensor);
      }
      continue;
    }
    std::vector<ItemRun> per(kSources);
    for (size_t s = 0; s < kSources; ++s) per[s].first = ls.items[s].size();
    for (uint64_t k = 0; k < run.count; ++k) {
      const Descriptor& d = ds[k];
      if (!wanted(d.source)) continue;
      const uint16_t lt = run.moved ? run.local_tensor : d.local_tensor;
      const uint16_t rt = run.moved ? run.remote_tensor : d.remote_tensor;
      const uint64_t lo = d.local_offset + (run.moved ? run.local_shift : 0);
      const uint64_t ro = d.remote_offset + (run.moved ? run.remote_shift : 0);
      ls.items[d.source].push_back({w.local_regions[lt], lo, w.remote(d.source, rt), ro, d.bytes});
      ls.device[d.source] |= w.device(d.source, lt, rt);
    }
    for (size_t s = 0; s < kSources; ++s) {
      per[s].count = ls.items[s].size() - per[s].first;
      if (per[s].count > 0) ls.runs[s].push_back(per[s]);
    }
    if (!run.moved) {
      literal_out->push_back({run.first, run.count, per});
      literal.emplace_back(run.first, per);
    }
  }
  for (size_t s = 0; s < kSources; ++s) {
    if (!ls.items[s].empty()) (*used)[s] = true;
    if (std::none_of(ls.runs[s].begin(), ls.runs[s].end(), [](const ItemRun& r) { return r.moved; })) {
      ls.runs[s].clear();
    }
  }
  return ls;
}

TEST(LoadStageTest, EachSourcesItemsAndRunsAreThePlansReadInOrder) {
  const World w;
  const LoadTensors tensors(w.local_regions, w.local, w.infos, w.remotes);
  uint64_t interleaved = 0;  // stages whose first run names more than one source
  for (uint64_t seed = 0; seed < 300; ++seed) {
    std::mt19937_64 rng(seed);
    const CompactStage st = random_stage(rng, seed % 5 == 4);
    const size_t only = seed % 3 == 2 ? static_cast<size_t>(rng() % kSources) : SIZE_MAX;
    const std::string what =
        "seed " + std::to_string(seed) + (only == SIZE_MAX ? "" : ", only source " + std::to_string(only));
    Load load;
    load.used.assign(kSources, false);
    std::vector<LiteralItems> literal;
    const LoadStage got = load_stage(load, st, tensors, only, &literal);
    std::vector<bool> used(kSources, false);
    std::vector<LiteralItems> want_literal;
    const LoadStage want = model(w, st, only, &used, &want_literal);
    for (size_t s = 0; s < kSources; ++s) {
      EXPECT_EQ(tuples(got.items[s]), tuples(want.items[s])) << what << ", source " << s;
      EXPECT_EQ(tuples(got.runs[s]), tuples(want.runs[s])) << what << ", source " << s;
      ASSERT_EQ(got.tables[s].size(), want.tables[s].size()) << what << ", source " << s;
      for (size_t t = 0; t < got.tables[s].size(); ++t) {
        EXPECT_EQ(got.tables[s][t].run, want.tables[s][t].run) << what;
        EXPECT_EQ(got.tables[s][t].table, want.tables[s][t].table) << what;
      }
      EXPECT_EQ(got.device[s], want.device[s]) << what << ", source " << s;
    }
    EXPECT_EQ(load.used, used) << what;
    // Each literal run's items per source, as the stages moved from this
    // one name them.
    ASSERT_EQ(literal.size(), want_literal.size()) << what;
    for (size_t k = 0; k < literal.size(); ++k) {
      EXPECT_EQ(literal[k].first, want_literal[k].first) << what;
      EXPECT_EQ(literal[k].count, want_literal[k].count) << what;
      EXPECT_EQ(tuples(literal[k].sources), tuples(want_literal[k].sources)) << what << ", literal run " << k;
    }
    const std::vector<Descriptor>& ds = st.plan.literal;
    const DescriptorRun& a = st.plan.runs[0];
    interleaved += std::any_of(ds.begin() + a.first, ds.begin() + a.first + a.count,
                               [&](const Descriptor& d) { return d.source != ds[a.first].source; });
  }
  // The cases the fast path's per-source counts are for: items of several
  // sources in one run.
  EXPECT_GT(interleaved, 100u);
}

}  // namespace
}  // namespace kvbridge::connector
