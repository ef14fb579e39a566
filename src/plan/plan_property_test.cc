// Property tests of plan() over thousands of random layouts (random_layout.h):
// every plan verifies (exact, in bounds, minimal), is deterministic and moves
// the bytes an independent count says it should. Invalid inputs are in
// plan_property_errors_test.cc; the case generator, the checks and the
// shrinking of failures are in property_support.h (which also lists the
// KVB_PROPERTY_* environment variables).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>

#include "plan/property_support.h"

namespace kvbridge {
namespace {

using namespace ::kvbridge::property;
// ---------------------------------------------------------------------------

TEST(PlanPropertyTest, RandomLayoutsOfEveryShapeValidate) {
  // make_rank_layout() aborts on an invalid layout; this also checks that the
  // generator reaches its shapes.
  uint64_t overlays = 0, one_tensor = 0, kernel = 0, inner = 0, junk = 0, split = 0, empty = 0, cases = 0;
  for (uint64_t i : case_indices(std::min<uint64_t>(num_cases(), 500))) {
    gen::Rng rng(gen::case_seed(base_seed() ^ 0x5eed, i));
    gen::ModelRecipe recipe = gen::random_recipe(rng);
    for (uint32_t tp : gen::valid_tp_sizes(recipe)) {
      gen::InstanceShape s = gen::random_instance(rng, recipe, tp, 100);
      for (const Layout& l : gen::make_instance(recipe, s)) ASSERT_TRUE(validate(l).ok());
      overlays += !s.overlays.empty();
      for (const gen::FamilyShape& f : s.families) {
        one_tensor += f.one_tensor;
        split += f.components.size() < recipe.groups[f.group].components.size();
        junk += f.junk_unit_strides;
      }
      for (const gen::GroupShape& g : s.groups) {
        kernel += g.kernel_ratio > 1;
        inner += g.inner_split > 1;
      }
      ++cases;
    }
    for (const gen::GroupRecipe& g : recipe.groups) {
      for (const gen::ComponentRecipe& c : g.components) empty += c.cell_bytes == 0;
    }
  }
  std::printf(
      "[ generator ] %llu instances: %llu with overlays, %llu one-tensor families, %llu split families, "
      "%llu with junk unit strides, %llu kernel-paged groups, %llu with three position axes, "
      "%llu empty components\n",
      (unsigned long long)cases, (unsigned long long)overlays, (unsigned long long)one_tensor,
      (unsigned long long)split, (unsigned long long)junk, (unsigned long long)kernel, (unsigned long long)inner,
      (unsigned long long)empty);
  if (std::getenv("KVB_PROPERTY_CASE") == nullptr && cases >= 100) {
    EXPECT_GT(overlays, 0u);
    EXPECT_GT(one_tensor, 0u);
    EXPECT_GT(kernel, 0u);
    EXPECT_GT(inner, 0u);
    EXPECT_GT(junk, 0u);
    EXPECT_GT(split, 0u);
    EXPECT_GT(empty, 0u);
  }
}

TEST(PlanPropertyTest, EveryPlanVerifiesIsDeterministicAndMovesTheRequestedBytes) {
  const auto start = std::chrono::steady_clock::now();
  uint64_t passed = 0, failures = 0, descriptors = 0, bytes = 0, remote_stages = 0, local_stages = 0;
  for (uint64_t i : case_indices(num_cases())) {
    gen::Rng rng(gen::case_seed(base_seed(), i));
    const Case c = make_case(base_seed(), i, rng);
    remote_stages += c.remotes[0].pp_size > 1;
    local_stages += c.local.pp_size > 1;
    const Outcome o = check(c.local, c.remotes, c.request);
    if (!o.failure.empty()) {
      report(c, o);
      if (++failures >= 3) break;  // the first few, shrunk, say enough
      continue;
    }
    ++passed;
    descriptors += o.descriptors;
    bytes += o.bytes;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "[ property  ] %llu plans verified (%llu descriptors, %llu bytes; %llu from pipeline stages, %llu into one) in "
      "%.2f s, seed %llu\n",
      (unsigned long long)passed, (unsigned long long)descriptors, (unsigned long long)bytes,
      (unsigned long long)remote_stages, (unsigned long long)local_stages, seconds, (unsigned long long)base_seed());
  EXPECT_GT(remote_stages, 0u);
  EXPECT_GT(local_stages, 0u);
}

}  // namespace
}  // namespace kvbridge
