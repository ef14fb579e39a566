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
//
// A context-sharded group (on either side) numbers positions per shard
// (ContextShard): global positions [begin, end) are cut into pieces
// (context_pieces()), and emission visits one piece at a time with begin,
// end, delta and shard set to the piece's.
struct GroupMove {
  size_t local_group = 0;                  // index into local.groups
  std::vector<size_t> remote_group;        // per remote layout, index into its groups
  uint64_t begin = 0, end = 0;             // request positions
  uint64_t local_ppb = 1, remote_ppb = 1;  // positions per block on each side
  std::vector<int64_t> local_ids, remote_ids;
  // The local group's context shard, and the remote instance's (its rank
  // unused: remote_shard holds each remote layout's).
  ContextShard local_cp, remote_cp;
  std::vector<uint32_t> remote_shard;  // per remote layout
  // While one piece is emitted: the remote position of local position p is
  // p + delta (mod 2^64), on remote shard `shard`.
  uint64_t delta = 0;
  uint32_t shard = 0;

  bool context_sharded() const { return local_cp.sharded() || remote_cp.sharded(); }
};

// A run of positions that are consecutive on both sides: local positions
// [begin, end) (numbered on the local shard) are remote positions
// [begin + delta, end + delta) of remote shard `shard`.
struct ContextPiece {
  uint64_t begin = 0, end = 0;
  uint64_t delta = 0;  // mod 2^64
  uint32_t shard = 0;
};

// The pieces of global positions [m.begin, m.end) that the local shard
// holds, in ascending local position, adjacent pieces merged when both sides
// continue. One piece {begin, end, 0, 0} when neither side is sharded.
std::vector<ContextPiece> context_pieces(const GroupMove& m);

// For each remote shard (of remote.size), whether the positions of local
// shard `local` meet it: a property of the two shardings, not of a request.
std::vector<bool> shards_needed(const ContextShard& local, const ContextShard& remote);

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
// group). Returns the indices of the sources chosen by choose_sources(),
// sorted by tp_rank.
Result<std::vector<uint16_t>> check_remotes(const Layout& local, std::span<const Layout> remotes);

// What the local rank needs: the distinct sets of remote ranks that hold one
// thing it moves (a local head of a component of a transfer group, by its
// global head, or a replicated component, where it is not empty), each a
// bit set over the indices into remotes of `words` 64-bit words, stored one
// after the other in `sets`.
struct SourceNeeds {
  size_t words = 0;
  std::vector<uint64_t> sets;
};
// kIncompatible naming the component (and global head) when no rank of
// by_rank holds it.
Result<SourceNeeds> source_needs(const Layout& local, std::span<const Layout> remotes,
                                 std::span<const uint16_t> by_rank);

// The fewest remote ranks that hold everything the local rank needs
// (docs/planner.md, "Sources"), in tp_rank order: every rank that alone
// holds something, then the first smallest set covering the rest, trying
// candidates in tp_rank order rotated by local.tp_rank (greedy past
// kMaxCombinations tries). Deterministic; depends on the layouts only.
Result<std::vector<uint16_t>> choose_sources(const Layout& local, std::span<const Layout> remotes,
                                             std::span<const uint16_t> by_rank);

// Chooses, for each local head of component (group g, layer l, component c),
// the remote rank of `by_rank` (the chosen sources) that serves it: among
// those holding that global head (in rank order; of remote context shard
// move.shard when the remote group is sharded), with n of them, the
// group's layers that the local rank holds are cut into n contiguous ranges,
// and layer l is served by holder (local.rank() + range) mod n, so local
// ranks spread over remote ranks and one rank's bytes spread over its
// sources. Returns kIncompatible
// naming the component and the global head when no given rank holds it.
// One stage of plan_stages() (plan.h): the tokens of its chunk (every
// position when `whole`) and its layers of layer_order(), flagged per move
// and local group layer.
struct StageCut {
  uint64_t first = 0, end = 0;
  bool whole = true;
  size_t begin_layer = 0, end_layer = 0;
  std::vector<std::vector<uint8_t>> masks;  // per move (group_moves() order), per layer of its local group
};
// The stages plan_stages() cuts `request` into, empty ones included, in
// its order; `order` is layer_order(local), which the caller computes once
// for the cuts and their headers.
std::vector<StageCut> stage_cuts(const Layout& local, std::span<const Layout> remotes, std::span<const GroupMove> moves,
                                 const Request& request, const StageOptions& options,
                                 const std::vector<std::string>& order);
// Narrows `m` to the positions of tokens [cut.first, cut.end), as a stage
// of a chunk does (nothing when `cut.whole` or the group is not token
// indexed).
void narrow_to_cut(const Layout& local, const Request& request, const StageCut& cut, GroupMove& m);
// A stage of `cut` with every field but its plan set, as plan_stages() sets
// it; `sources` holds one empty entry per remote layout. `order` is
// layer_order(local).
PlanStage stage_header(std::span<const Layout> remotes, const Request& request, const StageCut& cut,
                       const std::vector<std::string>& order);
// plan_stages()'s one empty stage of a request that moves nothing.
PlanStage empty_stage(const Layout& local, std::span<const Layout> remotes, const Request& request);

Result<std::vector<HeadRun>> head_runs(const Layout& local, std::span<const Layout> remotes,
                                       std::span<const uint16_t> by_rank, const GroupMove& move, size_t layer,
                                       size_t component);

}  // namespace kvbridge::plan_internal
