// Which positions of a group a request holds, and the mixing function of the
// byte patterns, shared by the verifier (verify.cc) and the deterministic
// content (content.cc). Written from DESIGN.md independently of the
// planner's own rules (positions.cc), so that the verifier and the demos
// check the planner rather than repeat it. Not a public header.
//
// Thread-safety: pure functions.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"

namespace kvbridge::plan_internal {

// The semantic position of a state group's final state (the one position a
// state group moves), in the patterns and the verifier's messages.
inline constexpr uint64_t kFinalState = ~uint64_t{0};

// splitmix64's finaliser: the patterns' mixing function.
inline uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Positions [first, last) of group `g` that `request` holds from token
// `first_token` on: attention and sliding_window the positions holding any
// token of [first_token, num_tokens) (a window group cut to its last
// window_tokens); a state group its final state (first 0, last 1) when any
// token is held; a scratch group every position of its one block.
struct Moving {
  uint64_t first = 0, last = 0;
};

inline Moving moving_positions(const Group& g, const Request& request, uint64_t first_token) {
  Moving m;
  const uint64_t tps = g.tokens_per_state;
  if (g.kind == GroupKind::kAttention || g.kind == GroupKind::kSlidingWindow) {
    uint64_t t0 = first_token;
    if (g.kind == GroupKind::kSlidingWindow && request.num_tokens > *g.window_tokens) {
      t0 = std::max(t0, request.num_tokens - *g.window_tokens);
    }
    if (t0 < request.num_tokens) {
      m.first = t0 / tps;
      m.last = (request.num_tokens + tps - 1) / tps;
    }
  } else if (g.kind == GroupKind::kState) {
    m.last = first_token < request.num_tokens ? 1 : 0;
  } else {
    m.last = g.positions_per_block();
  }
  return m;
}

}  // namespace kvbridge::plan_internal
