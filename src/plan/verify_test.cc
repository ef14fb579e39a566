// The verifier catches wrong plans: each test breaks a correct plan in one
// way and checks the verifier names the problem.
#include <gtest/gtest.h>

#include "kvbridge/plan.h"
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

}  // namespace
}  // namespace kvbridge
