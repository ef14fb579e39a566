// Property tests of plan templates (plan.h) against plan() over thousands of
// random layouts (random_layout.h): a template of each case's request shape,
// instantiated with the case's ids and with other ids of the same shape,
// returns exactly plan()'s plan, and the instance verifies; a request broken
// in one way gets plan()'s error word for word, or, when plan() would accept
// it, an error saying how it differs from the shape. Cases, seeds and the
// KVB_PROPERTY_* variables come from property_support.h.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <string>

#include "plan/property_support.h"
#include "plan/template.h"

namespace kvbridge {
namespace {

using namespace ::kvbridge::property;

// Empty when the template's result is plan()'s: equal plans, or errors of the
// same code and message.
std::string outcome_diff(const Result<Plan>& instance, const Result<Plan>& planned) {
  if (instance.has_value() != planned.has_value()) {
    return std::string("the template ") + (instance ? "returned a plan" : "failed: " + instance.error().to_string()) +
           ", plan() " + (planned ? "returned a plan" : "failed: " + planned.error().to_string());
  }
  if (!instance) {
    const Status& a = instance.error();
    const Status& b = planned.error();
    return a.code() == b.code() && a.message() == b.message()
               ? ""
               : "errors differ: template " + instance.error().to_string() + ", plan() " + planned.error().to_string();
  }
  return plan_diff(*instance, *planned);
}

void fail(const Case& c, const Inputs& in, const std::string& what, uint64_t& failures) {
  const std::string dir = dump(c, in, what);
  ADD_FAILURE() << c.describe() << " (template): " << what << "\n  written to " << dir;
  ++failures;
}

TEST(PlanTemplatePropertyTest, InstancesAreWhatPlanReturnsForTheSameRequestAndVerify) {
  const auto start = std::chrono::steady_clock::now();
  uint64_t passed = 0, failures = 0, not_uniform = 0, pieces = 0, descriptors = 0, loops = 0, copies = 0,
           sharded_fallbacks = 0;
  for (uint64_t i : case_indices(num_cases())) {
    if (failures >= 3) break;
    gen::Rng rng(gen::case_seed(base_seed(), i));
    const Case c = make_case(base_seed(), i, rng);
    gen::Rng ids_rng(gen::case_seed(base_seed() ^ 0x7e3, i));
    Result<PlanTemplate> t = PlanTemplate::create(c.local, c.remotes, shape_of(c.request));
    if (!t) {
      fail(c, {c.local, c.remotes, c.request}, "create() failed: " + t.error().to_string(), failures);
      continue;
    }
    // Context-sharded groups fall back to plan() (their entries differ by
    // shard); every other generated layout is uniform.
    const bool sharded = std::any_of(c.local.groups.begin(), c.local.groups.end(), [&](const Group& g) {
      const Group* rg = c.remotes.front().find_group(g.name);
      return g.transfer && (g.context.sharded() || rg->context.sharded());
    });
    not_uniform += !t->uniform() && !sharded;
    sharded_fallbacks += sharded && !t->uniform();
    pieces += t->pieces();
    for (const plan_internal::TemplateMove& m : plan_internal::TemplateAccess::impl(*t).moves) {
      for (const plan_internal::TemplateLoop& l : m.loops) {
        ++loops;
        copies += l.copy_of >= 0;
      }
    }
    const Result<Plan> instance = t->instantiate(c.request);
    if (std::string d = outcome_diff(instance, plan(c.local, c.remotes, c.request)); !d.empty()) {
      fail(c, {c.local, c.remotes, c.request}, "the case's own ids: " + d, failures);
      continue;
    }
    // Other ids of the same shape, instantiated into the first instance's
    // Plan (reusing its memory).
    const Request other = gen::with_other_ids(ids_rng, c.request, c.local, c.remotes, random_ids(ids_rng));
    Plan reused = instance ? *instance : Plan{};
    Status s = t->instantiate(other, &reused);
    const Result<Plan> planned = plan(c.local, c.remotes, other);
    const Result<Plan> again = s.ok() ? Result<Plan>(std::move(reused)) : Result<Plan>(s);
    if (std::string d = outcome_diff(again, planned); !d.empty()) {
      fail(c, {c.local, c.remotes, other}, "other ids of the shape: " + d, failures);
      continue;
    }
    if (again) {
      Result<VerifyReport> v = verify(*again, c.local, c.remotes, other, /*check_minimal=*/true);
      if (!v) {
        fail(c, {c.local, c.remotes, other}, "the instance fails verification: " + v.error().to_string(), failures);
        continue;
      }
      descriptors += again->descriptors.size();
    }
    ++passed;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "[ template  ] %llu templates: instances equal plan() and verify (%llu pieces held, %llu loops of "
      "which %llu copies, %llu descriptors, %llu not uniform, %llu context-sharded through plan()) in %.2f s, seed "
      "%llu\n",
      (unsigned long long)passed, (unsigned long long)pieces, (unsigned long long)loops, (unsigned long long)copies,
      (unsigned long long)descriptors, (unsigned long long)not_uniform, (unsigned long long)sharded_fallbacks, seconds,
      (unsigned long long)base_seed());
  EXPECT_EQ(not_uniform, 0u) << "every generated layout is uniform";
  if (std::getenv("KVB_PROPERTY_CASE") == nullptr && passed >= 100) {
    EXPECT_GT(copies, 0u) << "the generator reaches loops that are copies of others";
  }
}

// One way to break a request: what it does, in a few words.
std::string break_request(gen::Rng& rng, const Case& c, Request& r) {
  std::vector<std::string> names;
  for (const auto& [name, blocks] : r.blocks) names.push_back(name);
  const std::string name = gen::pick(rng, names);
  const bool on_local = gen::chance(rng, 50);
  std::vector<int64_t>& ids = on_local ? r.blocks[name].local : r.blocks[name].remote;
  const uint64_t num_blocks = (on_local ? c.local : c.remotes.front()).find_group(name)->num_blocks;
  std::vector<size_t> listed, unlisted;
  for (size_t k = 0; k < ids.size(); ++k) (ids[k] >= 0 ? listed : unlisted).push_back(k);
  switch (gen::draw(rng, 0, 10)) {
    case 0:
      if (listed.empty()) return "";
      ids[gen::pick(rng, listed)] = static_cast<int64_t>(num_blocks + gen::draw(rng, 0, 3));
      return "id past num_blocks";
    case 1:
      if (ids.empty()) return "";
      ids.back() = -1;
      return "-1 in the last entry";
    case 2:
      if (listed.empty()) return "";
      ids[gen::pick(rng, listed)] = -1;
      return "-1 in a listed entry";
    case 3:
      if (listed.size() < 2) return "";
      ids[listed[0]] = ids[listed[1]];
      return "an id listed twice";
    case 4:
      if (unlisted.empty()) return "";
      ids[gen::pick(rng, unlisted)] = static_cast<int64_t>(gen::draw(rng, 0, num_blocks - 1));
      return "an id where the shape has -1";
    case 5:
      ids.push_back(gen::chance(rng, 50) ? -1 : static_cast<int64_t>(gen::draw(rng, 0, num_blocks - 1)));
      return "a list one longer";
    case 6:
      if (ids.empty()) return "";
      ids.pop_back();
      return "a list one shorter";
    case 7:
      if (gen::chance(rng, 50)) {
        r.num_tokens += 1;
        return "num_tokens + 1";
      }
      if (r.skip_tokens == 0) return "";
      r.skip_tokens -= 1;
      return "skip_tokens - 1";
    case 8: {
      const std::vector<size_t> cls = gen::overlay_classes(c.local);
      for (size_t a = 0; a < cls.size(); ++a) {
        for (size_t b = a + 1; b < cls.size(); ++b) {
          const Group& ga = c.local.groups[a];
          const Group& gb = c.local.groups[b];
          if (cls[a] != cls[b] || !ga.transfer || !gb.transfer) continue;
          r.blocks[gb.name].local.back() = r.blocks[ga.name].local.back();
          return "overlaid groups given one id";
        }
      }
      return "";
    }
    case 9:
      if (gen::chance(rng, 50)) {
        r.blocks["no-such-group"] = GroupBlocks{{0}, {0}};
        return "an unknown group";
      }
      r.blocks.erase(name);
      return "a missing group";
    default:
      if (ids.empty()) return "";
      ids[gen::draw(rng, 0, ids.size() - 1)] = -2;
      return "an id below -1";
  }
}

TEST(PlanTemplatePropertyTest, BrokenRequestsGetPlansErrorOrSayHowTheyDifferFromTheShape) {
  uint64_t checked = 0, failures = 0;
  std::map<std::string, uint64_t> counts;
  for (uint64_t i : case_indices(std::max<uint64_t>(num_cases() / 2, 1))) {
    if (failures >= 5) break;
    gen::Rng rng(gen::case_seed(base_seed() ^ 0xb7e, i));
    const Case c = make_case(base_seed(), i, rng);
    Result<PlanTemplate> t = PlanTemplate::create(c.local, c.remotes, shape_of(c.request));
    if (!t) continue;  // the test above reports it
    Request r = c.request;
    const std::string what = break_request(rng, c, r);
    if (what.empty()) continue;
    ++checked;
    const Result<Plan> planned = plan(c.local, c.remotes, r);
    const Result<Plan> instance = t->instantiate(r);
    std::string failure;
    if (shape_of(r) == t->shape() || !planned) {
      failure = outcome_diff(instance, planned);
      ++counts[what + (planned ? " (fits, plans)" : " (plan() fails)")];
    } else {
      ++counts[what + " (shape error)"];
      if (instance) {
        failure = "instantiate() returned a plan for a request that does not fit its shape";
      } else if (instance.error().code() != Code::kInvalidArgument || instance.error().message().empty()) {
        failure = "instantiate() returned " + instance.error().to_string() + " for a request off its shape";
      }
    }
    if (!failure.empty()) fail(c, {c.local, c.remotes, r}, what + ": " + failure, failures);
  }
  std::printf("[ template  ] %llu broken requests checked:", (unsigned long long)checked);
  for (const auto& [kind, n] : counts) std::printf(" %s: %llu;", kind.c_str(), (unsigned long long)n);
  std::printf("\n");
}

}  // namespace
}  // namespace kvbridge
