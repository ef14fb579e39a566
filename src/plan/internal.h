// Internal pieces of the planner, split by concern: which positions move
// (positions.cc), which remote rank serves which heads (sources.cc), and the
// emission and merging of descriptors (plan.cc). Not a public header.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"
#include "kvbridge/plan.h"

namespace kvbridge::plan_internal {

// What one group moves. Token-indexed groups move request positions
// [begin, end); position p lives in list entry p / positions_per_block on
// each side. A state group is normalised to one position in one "block" per
// side: the last listed block. Scratch moves all positions of its one block.
struct GroupMove {
  size_t local_group = 0;                  // index into local.groups
  std::vector<size_t> remote_group;        // per remote layout, index into its groups
  uint64_t begin = 0, end = 0;             // request positions
  uint64_t local_ppb = 1, remote_ppb = 1;  // positions per block on each side
  std::vector<int64_t> local_ids, remote_ids;
};

// Validates the request against the layouts and returns the moves of every
// transfer group, in local group order. Errors name the group and the field.
Result<std::vector<GroupMove>> group_moves(const Layout& local, std::span<const Layout> remotes,
                                           const Request& request);

// True when the ids of `ids` that are not -1 are strictly ascending (the
// usual allocator output): then they are distinct.
bool listed_ascending(std::span<const int64_t> ids);

// A run of local heads served by one remote rank: local heads
// [local_head, local_head + count) are that rank's heads [remote_head, ...).
// A replicated component has one run of count 1.
struct HeadRun {
  uint32_t local_head = 0;
  uint32_t count = 0;
  uint16_t source = 0;  // index into remotes
  uint32_t remote_head = 0;
};

// Checks that the remote layouts form one instance compatible with `local`
// (same tp_size, distinct ranks, equal identity, equal block geometry per
// group). Returns the remote indices sorted by tp_rank.
Result<std::vector<uint16_t>> check_remotes(const Layout& local, std::span<const Layout> remotes);

// Chooses, for each local head of component (group g, layer l, component c),
// the remote rank that serves it: among the ranks holding that global head
// (in tp_rank order), the one at local.tp_rank modulo their count, so local
// ranks spread over remote ranks. Returns kIncompatible naming the component
// and the global head when no given rank holds it.
Result<std::vector<HeadRun>> head_runs(const Layout& local, std::span<const Layout> remotes,
                                       std::span<const uint16_t> by_rank, const GroupMove& move, size_t layer,
                                       size_t component);

}  // namespace kvbridge::plan_internal
