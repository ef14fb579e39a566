// The verifier catches wrong plans: each test breaks a correct plan in one
// way and checks the verifier names the problem.
#include <gtest/gtest.h>

#include "kvbridge/plan.h"
#include "kvbridge/presets.h"
#include "kvbridge/verify.h"
#include "layout/test_layouts.h"

namespace kvbridge {
namespace {

struct Fixture {
  std::vector<Layout> remotes;
  Layout local;
  Request request;
  Plan plan;
};

// TP 2 -> TP 1 on small_gqa: 24 descriptors would be 2 layers x 4 heads x 3
// blocks; with 2 heads per remote rank, 2 heads x 4 pos x 32 B = 256 B runs.
Fixture make() {
  Fixture f;
  for (uint32_t r = 0; r < 2; ++r) {
    Layout l = testing::small_gqa(2, 4, 2, 2 * r);
    l.tp_size = 2;
    l.tp_rank = r;
    f.remotes.push_back(l);
  }
  f.local = testing::small_gqa();
  f.request.num_tokens = 12;
  f.request.blocks["full"] = {{0, 1, 2}, {4, 5, 6}};
  Result<Plan> p = plan(f.local, f.remotes, f.request);
  EXPECT_TRUE(p.has_value());
  f.plan = *p;
  return f;
}

void expect_caught(const Fixture& f, const std::string& fragment, bool minimal = true) {
  Result<VerifyReport> v = verify(f.plan, f.local, f.remotes, f.request, minimal);
  ASSERT_FALSE(v.has_value()) << "the verifier accepted a broken plan";
  EXPECT_EQ(v.error().code(), Code::kInternal);
  EXPECT_NE(v.error().message().find(fragment), std::string::npos) << v.error().message();
}

TEST(VerifierTest, AcceptsTheCorrectPlan) {
  Fixture f = make();
  Result<VerifyReport> v = verify(f.plan, f.local, f.remotes, f.request);
  ASSERT_TRUE(v.has_value()) << v.error().to_string();
  EXPECT_EQ(v->bytes_checked, 2u * 12 * 4 * 32);
  EXPECT_EQ(v->bytes_written, v->bytes_checked);
  EXPECT_EQ(v->cells_checked, 2u * 12 * 4 * 2);
}

TEST(VerifierTest, CatchesAWrongRemoteOffsetAndNamesTheCoordinate) {
  Fixture f = make();
  f.plan.descriptors[3].remote_offset += 16;
  expect_caught(f, "component");
  expect_caught(f, "holds 0x");
}

TEST(VerifierTest, CatchesAReadFromTheWrongRank) {
  Fixture f = make();
  f.plan.descriptors[0].source ^= 1;
  expect_caught(f, "head");
}

TEST(VerifierTest, CatchesAMissingDescriptor) {
  Fixture f = make();
  f.plan.descriptors.pop_back();
  expect_caught(f, "layers.1");
}

TEST(VerifierTest, CatchesAWriteOutsideTheRequest) {
  Fixture f = make();
  Descriptor extra = f.plan.descriptors[0];
  extra.local_offset = 7 * 512;  // block 7 is not in the request
  extra.bytes = 32;
  f.plan.descriptors.push_back(extra);
  expect_caught(f, "written by the plan");
}

TEST(VerifierTest, CatchesOutOfBoundsOnEitherSide) {
  Fixture f = make();
  f.plan.descriptors[0].local_offset = 8 * 512 - 16;
  expect_caught(f, "outside tensor 'kv.0'");
  f = make();
  f.plan.descriptors[0].remote_offset = 1u << 30;
  expect_caught(f, "outside remote rank");
}

TEST(VerifierTest, CatchesADoubleWrite) {
  Fixture f = make();
  f.plan.descriptors.push_back(f.plan.descriptors[0]);
  expect_caught(f, "written twice");
}

TEST(VerifierTest, CatchesAMergeablePairOnlyWhenAskedForMinimality) {
  Fixture f = make();
  Descriptor d = f.plan.descriptors[0];
  ASSERT_GT(d.bytes, 32u);
  f.plan.descriptors[0].bytes = 32;
  d.local_offset += 32;
  d.remote_offset += 32;
  d.bytes -= 32;
  f.plan.descriptors.insert(f.plan.descriptors.begin() + 1, d);
  expect_caught(f, "not minimal");
  EXPECT_TRUE(verify(f.plan, f.local, f.remotes, f.request, /*check_minimal=*/false).has_value());
}

TEST(VerifierTest, CatchesAZeroLengthDescriptor) {
  Fixture f = make();
  f.plan.descriptors.push_back({0, 0, 0, 0, 0, 0, 0});
  expect_caught(f, "zero length");
}

// A receiver that holds every token (skip_tokens == num_tokens: a full
// prefix hit) holds the state after them too, so a state group moves
// nothing; a scratch group (a per-request ring, never prefix-cached) moves
// its one block whatever skip_tokens says. The verifier checks that rule
// from its own code (moving.h): a plan that writes the state at a full hit
// writes a byte the request does not move, and one that leaves the ring out
// misses bytes it does.
TEST(VerifierTest, AFullPrefixHitMovesTheScratchRingButNotTheState) {
  PresetOptions o;
  o.name = "qwen3-next";
  o.num_blocks = 8;
  Result<Layout> local = make_preset(o);
  ASSERT_TRUE(local.ok()) << local.error().to_string();
  const std::vector<Layout> remotes = {*local};
  bool has_state = false, has_scratch = false;
  Request full, partial;
  for (const Group& g : local->groups) {
    if (!g.transfer) continue;
    has_state = has_state || g.kind == GroupKind::kState;
    has_scratch = has_scratch || g.kind == GroupKind::kScratch;
    if (g.kind == GroupKind::kState || g.kind == GroupKind::kScratch) {
      full.blocks[g.name] = {{1}, {2}};
    } else {
      full.blocks[g.name] = {{1, 3}, {2, 4}};
    }
  }
  ASSERT_TRUE(has_state && has_scratch);
  const uint64_t tokens = local->groups.front().block_tokens + 1;
  full.num_tokens = tokens;
  full.skip_tokens = tokens;
  partial = full;
  partial.skip_tokens = tokens - 1;
  Result<Plan> at_full = plan(*local, remotes, full);
  Result<Plan> at_partial = plan(*local, remotes, partial);
  ASSERT_TRUE(at_full.ok() && at_partial.ok());
  ASSERT_TRUE(verify(*at_full, *local, remotes, full).ok());
  ASSERT_TRUE(verify(*at_partial, *local, remotes, partial).ok());
  auto group_of = [&](const Descriptor& d) {
    const std::string& tensor = local->tensors[d.local_tensor].name;
    for (const Group& g : local->groups) {
      for (const Layer& l : g.layers) {
        for (const Component& c : l.components) {
          if (c.tensor == tensor) return g.kind;
        }
      }
    }
    return GroupKind::kAttention;
  };
  size_t state_full = 0, scratch_full = 0;
  for (const Descriptor& d : at_full->descriptors) {
    state_full += group_of(d) == GroupKind::kState;
    scratch_full += group_of(d) == GroupKind::kScratch;
  }
  EXPECT_EQ(state_full, 0u);
  EXPECT_GT(scratch_full, 0u);
  // The state's descriptors of the partial hit, added to the full hit's
  // plan, write bytes the full hit does not move: refused.
  Plan wrong = *at_full;
  size_t state_partial = 0;
  for (const Descriptor& d : at_partial->descriptors) {
    if (group_of(d) != GroupKind::kState) continue;
    wrong.descriptors.push_back(d);
    ++state_partial;
  }
  ASSERT_GT(state_partial, 0u);
  Result<VerifyReport> v = verify(wrong, *local, remotes, full, /*check_minimal=*/false);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.error().code(), Code::kInternal);
  // And a plan without the ring misses it.
  Plan no_ring;
  for (const Descriptor& d : at_full->descriptors) {
    if (group_of(d) != GroupKind::kScratch) no_ring.descriptors.push_back(d);
  }
  EXPECT_FALSE(verify(no_ring, *local, remotes, full, /*check_minimal=*/false).ok());
}

}  // namespace
}  // namespace kvbridge
