// Test-only: every rank of a preset's instance, whole-request block lists
// for it, and a check that every rank's plan verifies. Shared by the
// pipeline and context-parallel tests and the preset matrix.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kvbridge/plan.h"
#include "kvbridge/presets.h"
#include "kvbridge/verify.h"

namespace kvbridge::testing {

// One rank of a preset; a failure to make it fails the test.
inline Layout preset(const std::string& name, uint32_t tp, uint32_t rank, uint64_t block, Order order,
                     uint64_t blocks = 16) {
  Result<Layout> l = make_preset(PresetOptions{
      .name = name, .tp_size = tp, .tp_rank = rank, .block_tokens = block, .order = order, .num_blocks = blocks});
  EXPECT_TRUE(l.ok()) << l.error().to_string();
  return l ? *l : Layout{};
}

// Every rank of the instance of `base` (its preset, block, order, blocks
// and context options) at TP `tp` in `pp` stages, stage-major; or the
// first error.
inline Result<std::vector<Layout>> preset_instance(PresetOptions base, uint32_t tp, uint32_t pp = 1) {
  std::vector<Layout> out;
  for (uint32_t s = 0; s < pp; ++s) {
    for (uint32_t r = 0; r < tp; ++r) {
      base.tp_size = tp, base.tp_rank = r, base.pp_size = pp, base.pp_rank = s;
      Result<Layout> l = make_preset(base);
      if (!l) return l.error();
      out.push_back(std::move(*l));
    }
  }
  return out;
}

// Tokens 0..num_tokens-1 of every group, each side's block ids counting up
// across the groups (so overlaid groups never share one), the prefill side
// from 7.
inline Request whole_request(const Layout& decode, const Layout& prefill, uint64_t num_tokens) {
  Request q;
  q.num_tokens = num_tokens;
  int64_t local = 0, remote = 7;
  for (const Group& g : decode.groups) {
    if (!g.transfer) continue;
    const Group* p = prefill.find_group(g.name);
    GroupBlocks b;
    const uint64_t dn = g.kind == GroupKind::kScratch ? 1 : g.entries_for_tokens(num_tokens);
    const uint64_t pn = p->kind == GroupKind::kScratch ? 1 : p->entries_for_tokens(num_tokens);
    for (uint64_t i = 0; i < dn; ++i) b.local.push_back(local++);
    for (uint64_t i = 0; i < pn; ++i) b.remote.push_back(remote++);
    q.blocks[g.name] = b;
  }
  return q;
}

// Every decode rank's plan of a whole request verifies, minimal, and moves
// something.
inline void expect_every_rank_verifies(const std::vector<Layout>& decode, const std::vector<Layout>& prefill,
                                       uint64_t num_tokens, const std::string& what) {
  for (const Layout& d : decode) {
    const Request q = whole_request(d, prefill[0], num_tokens);
    Result<Plan> p = plan(d, prefill, q);
    ASSERT_TRUE(p.ok()) << what << " decode rank " << d.rank() << ": " << p.error().to_string();
    Result<VerifyReport> v = verify(*p, d, prefill, q, /*check_minimal=*/true);
    ASSERT_TRUE(v.ok()) << what << " decode rank " << d.rank() << ": " << v.error().to_string();
    EXPECT_GT(p->bytes, 0u) << what;
  }
}

}  // namespace kvbridge::testing
