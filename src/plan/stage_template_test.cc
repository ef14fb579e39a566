// Stage templates (StageTemplate, plan.h) against plan_stages() over random
// layouts (random_layout.h) and a preset: a template of each case's request
// shape and random stage options, instantiated with the case's ids, with
// other ids of the same shape and with one id broken, returns exactly what
// plan_stages() returns (the same stages, descriptors and totals, or the
// same error), and says once why it falls back where it cannot serve; its
// compact stages expand to the same.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <set>

#include "plan/preset_instances.h"
#include "plan/property_support.h"

namespace kvbridge {
namespace {

using namespace ::kvbridge::property;

// Empty when `a` (the template's) is `b` (plan_stages()').
std::string stages_diff(const Result<std::vector<PlanStage>>& a, const Result<std::vector<PlanStage>>& b) {
  if (a.has_value() != b.has_value()) {
    return std::string("the template ") + (a ? "returned stages" : "failed: " + a.error().to_string()) +
           ", plan_stages() " + (b ? "returned stages" : "failed: " + b.error().to_string());
  }
  if (!a) {
    return a.error().code() == b.error().code() && a.error().message() == b.error().message()
               ? ""
               : "errors differ: template " + a.error().to_string() + ", plan_stages() " + b.error().to_string();
  }
  if (a->size() != b->size()) {
    return "the template made " + std::to_string(a->size()) + " stages, plan_stages() " + std::to_string(b->size());
  }
  for (size_t k = 0; k < a->size(); ++k) {
    const PlanStage& x = (*a)[k];
    const PlanStage& y = (*b)[k];
    const std::string which = "stage " + std::to_string(k);
    if (x.first_layer != y.first_layer || x.end_layer != y.end_layer || x.layers != y.layers) {
      return which + ": other layers";
    }
    if (x.first_token != y.first_token || x.end_token != y.end_token || x.resume_token != y.resume_token) {
      return which + ": other tokens";
    }
    if (std::string d = plan_diff(x.plan, y.plan); !d.empty()) return which + ": " + d;
  }
  return "";
}

// Empty when the compact stages `a` expand to the stages `b` and hold the
// compact plans' invariants (plan.h): runs in range, a moved run repeating
// exactly an earlier literal run of one local and one remote tensor, the
// counts and totals the expanded plan's. Adds the moved runs to *moved
// (a table run's each), the table runs to *tables and their moved runs to
// *tables_moved.
std::string compact_diff(const Result<std::vector<CompactStage>>& a, const Result<std::vector<PlanStage>>& b,
                         uint64_t* moved, uint64_t* tables, uint64_t* tables_moved) {
  if (a.has_value() != b.has_value()) return "the compact stages and the stages differ in success";
  if (!a) return a.error().message() == b.error().message() ? "" : "errors differ";
  if (a->size() != b->size()) return "other number of compact stages";
  for (size_t k = 0; k < a->size(); ++k) {
    const CompactStage& x = (*a)[k];
    const PlanStage& y = (*b)[k];
    const std::string which = "compact stage " + std::to_string(k);
    if (x.first_layer != y.first_layer || x.end_layer != y.end_layer || x.first_token != y.first_token ||
        x.end_token != y.end_token || x.resume_token != y.resume_token) {
      return which + ": other layers or tokens";
    }
    const CompactPlan& c = x.plan;
    std::set<std::pair<uint64_t, uint64_t>> literal;
    uint64_t count = 0;
    for (const DescriptorRun& run : c.runs) {
      count += run.descriptors();
      if (run.count == 0 || run.first + run.count > c.literal.size()) return which + ": a run out of range";
      if (!run.moved) {
        if (run.table != nullptr) return which + ": a literal run has a table";
        literal.insert({run.first, run.count});
        continue;
      }
      if (run.table != nullptr) {
        if (run.table->size() < 2) return which + ": a table run of fewer than two shifts";
        const TensorShift& f = run.table->front();
        if (f.local_tensor != run.local_tensor || f.remote_tensor != run.remote_tensor ||
            f.local_shift != run.local_shift || f.remote_shift != run.remote_shift) {
          return which + ": a table run whose fields are not its first shift's";
        }
        *tables += 1;
        *tables_moved += run.table->size();
      }
      *moved += run.table != nullptr ? run.table->size() : 1;
      if (!literal.contains({run.first, run.count})) return which + ": a moved run is no earlier literal run";
      for (uint64_t i = run.first; i < run.first + run.count; ++i) {
        if (c.literal[i].local_tensor != c.literal[run.first].local_tensor ||
            c.literal[i].remote_tensor != c.literal[run.first].remote_tensor) {
          return which + ": a moved run repeats descriptors of several tensors";
        }
      }
    }
    if (count != c.descriptors) return which + ": descriptors is not the runs' count";
    if (std::string d = plan_diff(expand(c), y.plan); !d.empty()) return which + " expanded: " + d;
  }
  return "";
}

// Empty when instantiate_moved()'s stages `a` expand (expand(stages, k)) to
// the stages `b`, each moved stage naming an earlier stage that is not
// moved, its runs all moved and each the range of a run of that stage of
// one local and one remote tensor. Adds the moved stages to *moved_stages.
std::string moved_diff(const Result<std::vector<CompactStage>>& a, const Result<std::vector<PlanStage>>& b,
                       uint64_t* moved_stages) {
  if (a.has_value() != b.has_value()) return "the moved stages and the stages differ in success";
  if (!a) return a.error().message() == b.error().message() ? "" : "errors differ";
  if (a->size() != b->size()) return "other number of moved stages";
  for (size_t k = 0; k < a->size(); ++k) {
    const CompactStage& x = (*a)[k];
    const std::string which = "moved stage " + std::to_string(k);
    if (x.first_layer != (*b)[k].first_layer || x.first_token != (*b)[k].first_token) return which + ": other cut";
    if (x.moved_from >= 0) {
      ++*moved_stages;
      if (static_cast<size_t>(x.moved_from) >= k) return which + ": moved from a later stage";
      const CompactPlan& from = (*a)[static_cast<size_t>(x.moved_from)].plan;
      if ((*a)[static_cast<size_t>(x.moved_from)].moved_from >= 0) return which + ": moved from a moved stage";
      if (!x.plan.literal.empty()) return which + ": holds a literal";
      std::set<std::pair<uint64_t, uint64_t>> ranges;
      for (const DescriptorRun& r : from.runs) ranges.insert({r.first, r.count});
      uint64_t count = 0;
      for (const DescriptorRun& r : x.plan.runs) {
        count += r.descriptors();
        if (!r.moved || r.table != nullptr) return which + ": a run that is not moved, or a table run";
        if (!ranges.contains({r.first, r.count})) return which + ": a run that is no run of the stage it moves";
        for (uint64_t i = r.first; i < r.first + r.count; ++i) {
          if (from.literal[i].local_tensor != from.literal[r.first].local_tensor ||
              from.literal[i].remote_tensor != from.literal[r.first].remote_tensor) {
            return which + ": a run over several tensors";
          }
        }
      }
      if (count != x.plan.descriptors) return which + ": descriptors is not the runs' count";
    }
    if (std::string d = plan_diff(expand(*a, k), (*b)[k].plan); !d.empty()) return which + " expanded: " + d;
  }
  return "";
}

TEST(StageTemplatePropertyTest, InstancesAreWhatPlanStagesReturns) {
  const auto start = std::chrono::steady_clock::now();
  uint64_t passed = 0, failures = 0, stages = 0, fallbacks = 0, broken = 0, moved = 0, tables = 0, tables_moved = 0;
  uint64_t moved_stages = 0;
  for (uint64_t i : case_indices(std::max<uint64_t>(num_cases() / 4, 1))) {
    if (failures >= 3) break;
    gen::Rng rng(gen::case_seed(base_seed() ^ 0x57a7e, i));
    const Case c = make_case(base_seed(), i, rng);
    const StageOptions o = random_stage_options(rng, c.local);
    auto failed = [&](const Request& r, const std::string& what) {
      const std::string dir = dump(c, {c.local, c.remotes, r}, what);
      ADD_FAILURE() << c.describe() << " (stage template, layers_per_stage " << o.layers_per_stage << ", chunk_tokens "
                    << o.chunk_tokens << "): " << what << "\n  written to " << dir;
      ++failures;
    };
    Result<StageTemplate> t = StageTemplate::create(c.local, c.remotes, shape_of(c.request), o);
    if (!t) {
      // create() fails where plan_stages() fails for every request of the shape.
      if (plan_stages(c.local, c.remotes, c.request, o).ok())
        failed(c.request, "create() failed: " + t.error().to_string());
      continue;
    }
    if (!t->uniform()) {
      ++fallbacks;
      if (t->fallback_reason().empty()) failed(c.request, "a template that falls back says no reason");
    }
    const Result<std::vector<PlanStage>> own = t->instantiate(c.request);
    if (std::string d = stages_diff(own, plan_stages(c.local, c.remotes, c.request, o)); !d.empty()) {
      failed(c.request, "the case's own ids: " + d);
      continue;
    }
    if (own && t->uniform() && own->size() != t->stages()) failed(c.request, "stages() is not the number of stages");
    if (std::string d = compact_diff(t->instantiate_compact(c.request), own, &moved, &tables, &tables_moved);
        !d.empty()) {
      failed(c.request, "the case's own ids: " + d);
      continue;
    }
    if (std::string d = moved_diff(t->instantiate_moved(c.request), own, &moved_stages); !d.empty()) {
      failed(c.request, "the case's own ids: " + d);
      continue;
    }
    gen::Rng ids_rng(gen::case_seed(base_seed() ^ 0x7e4, i));
    const Request other = gen::with_other_ids(ids_rng, c.request, c.local, c.remotes, random_ids(ids_rng));
    const Result<std::vector<PlanStage>> planned_other = plan_stages(c.local, c.remotes, other, o);
    if (std::string d = stages_diff(t->instantiate(other), planned_other); !d.empty()) {
      failed(other, "other ids of the shape: " + d);
      continue;
    }
    if (std::string d = compact_diff(t->instantiate_compact(other), planned_other, &moved, &tables, &tables_moved);
        !d.empty()) {
      failed(other, "other ids of the shape: " + d);
      continue;
    }
    if (std::string d = moved_diff(t->instantiate_moved(other), planned_other, &moved_stages); !d.empty()) {
      failed(other, "other ids of the shape: " + d);
      continue;
    }
    // One id past its group's blocks: plan_stages()' error, word for word.
    Request bad = other;
    for (auto& [name, blocks] : bad.blocks) {
      for (int64_t& id : blocks.local) {
        if (id >= 0) {
          id = static_cast<int64_t>(c.local.find_group(name)->num_blocks);
          ++broken;
          break;
        }
      }
      break;
    }
    const Result<std::vector<PlanStage>> planned_bad = plan_stages(c.local, c.remotes, bad, o);
    if (std::string d = stages_diff(t->instantiate(bad), planned_bad); !d.empty()) {
      failed(bad, "a broken id: " + d);
      continue;
    }
    if (std::string d = compact_diff(t->instantiate_compact(bad), planned_bad, &moved, &tables, &tables_moved);
        !d.empty()) {
      failed(bad, "a broken id: " + d);
      continue;
    }
    if (std::string d = moved_diff(t->instantiate_moved(bad), planned_bad, &moved_stages); !d.empty()) {
      failed(bad, "a broken id: " + d);
      continue;
    }
    stages += own ? own->size() : 0;
    ++passed;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "[ stage tmpl ] %llu templates: instances, compact and moved instances equal plan_stages() (%llu stages, "
      "%llu of them moved, %llu moved runs, %llu of them in %llu table runs, %llu broken requests, %llu through "
      "plan_stages()) in %.2f s, seed %llu\n",
      (unsigned long long)passed, (unsigned long long)stages, (unsigned long long)moved_stages,
      (unsigned long long)moved, (unsigned long long)tables_moved, (unsigned long long)tables,
      (unsigned long long)broken, (unsigned long long)fallbacks, seconds, (unsigned long long)base_seed());
  if (std::getenv("KVB_PROPERTY_CASE") == nullptr && passed >= 100) {
    EXPECT_GT(stages, passed) << "the generator reaches requests cut in several stages";
    EXPECT_GT(moved, passed / 10) << "the generator reaches plans held with moved runs";
    EXPECT_GT(tables, passed / 50) << "the generator reaches plans held with table runs";
    EXPECT_GT(moved_stages, passed / 10) << "the generator reaches stages that are an earlier stage moved";
  }
}

// A context-parallel decode falls back, saying why, and still plans exactly.
TEST(StageTemplateTest, AContextShardedGroupFallsBackSayingWhy) {
  using testing::preset;
  const std::vector<Layout> remotes = {preset("llama3-8b", 1, 0, 16, Order::kBLHNC, 40)};
  Layout local = preset("llama3-8b", 1, 0, 16, Order::kBLHNC, 40);
  local.groups[0].context = ContextShard{2, 0};
  Request q;
  q.num_tokens = 100;
  for (int64_t i = 0; i < 4; ++i) q.blocks["full"].local.push_back(3 - i);
  for (int64_t i = 0; i < 7; ++i) q.blocks["full"].remote.push_back(i);
  const StageOptions o{4, 0};
  Result<StageTemplate> t = StageTemplate::create(local, remotes, shape_of(q), o);
  ASSERT_TRUE(t.ok()) << t.error().to_string();
  EXPECT_FALSE(t->uniform());
  EXPECT_NE(t->fallback_reason().find("context-sharded"), std::string::npos) << t->fallback_reason();
  EXPECT_EQ(stages_diff(t->instantiate(q), plan_stages(local, remotes, q, o)), "");
}

}  // namespace
}  // namespace kvbridge
