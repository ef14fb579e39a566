// What the store keeps of a request, and the lookup rule. Pure functions of
// a group, a block list and token counts, over hash-block indices j (block j
// covers tokens [j*H, (j+1)*H)); see docs/store.md.
//
// Not a public header. Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"
#include "kvbridge/status.h"

namespace kvbridge::store_internal {

// One object a put writes: hash block j, and for a state group the rank block
// id that holds the state at the end of block j.
struct Selected {
  uint64_t block = 0;
  int64_t state_block_id = -1;
};

// The hash blocks of group `g` that a put of [0, num_tokens) stores, in
// increasing order, given the rank's block list `ids`:
//  - attention: full hash blocks at or after skip_tokens whose rank block is
//    listed (not -1);
//  - sliding_window: full hash blocks that meet the window ending at the last
//    full hash block, whose rank block is listed;
//  - state: for each listed entry i, the state it holds, at token (i+1) *
//    block_tokens, or num_tokens for the last entry, when that token is a
//    positive multiple of H after skip_tokens;
//  - scratch, or not prefix-cacheable: none.
// kInvalidArgument naming the group when the list is too short.
Result<std::vector<Selected>> select_blocks(const Group& g, std::span<const int64_t> ids, uint64_t num_tokens,
                                            uint64_t skip_tokens, uint64_t H);

// Presence of one stored group's objects, by hash block index.
struct GroupPresence {
  const Group* group = nullptr;
  std::vector<uint8_t> present;  // 1 when object j is in some tier
};

// The lookup rule: the largest T <= limit_tokens, a multiple of align_tokens
// (itself a multiple of H), such that every attention group has blocks [0,
// T/H), every sliding-window group the blocks meeting [T - window, T), and
// every state group the state at T (block T/H - 1). 0 when none.
uint64_t hit_tokens(std::span<const GroupPresence> groups, uint64_t H, uint64_t align_tokens, uint64_t limit_tokens);

// The hash blocks of group `g` a reader needs to resume at `hit` when it
// already holds tokens [0, skip_tokens): attention [skip/H, hit/H); the window
// blocks before hit that end after skip; the state block hit/H - 1 when hit >
// skip.
std::vector<uint64_t> needed_blocks(const Group& g, uint64_t hit, uint64_t skip_tokens, uint64_t H);

}  // namespace kvbridge::store_internal
