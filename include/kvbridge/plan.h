// kvbridge/plan.h: the planner: layout x layouts x request -> descriptors.
//
// plan() returns the descriptors that move exactly one request's KV from the
// ranks of a remote instance into one local rank. Matching is by semantic
// coordinate (group, layer, component, position in the request, global head,
// byte in cell), never by block index, so heterogeneous TP, different block
// sizes and kernel ratios, and different axis orders need no special cases.
// The guarantees (DESIGN.md, "The plan and its guarantees"):
//  1. Exact: every byte the request moves into the local rank receives the
//     byte with the same semantic coordinate from a remote rank that holds it;
//     no other local byte is written (and none twice).
//  2. In bounds: every descriptor lies inside one tensor on each side.
//  3. Minimal: no two descriptors are contiguous on both sides with the same
//     tensors and source rank (such pairs are always merged).
//  4. Deterministic: same inputs, same plan, on any machine.
// verify() (verify.h) checks 1-3 without trusting the planner.
//
// Which positions move, per group kind: attention, tokens [skip_tokens,
// num_tokens); sliding_window, the same cut to the last window_tokens tokens;
// state, the state of the last listed block on each side; scratch, every
// position of the single listed block. With tokens_per_state > 1 a position
// moves when it holds any token of the range.
//
// Pure: no I/O, no threads, no globals. Thread-safety: reentrant.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"
#include "kvbridge/status.h"

namespace kvbridge {

// One copy. Tensors are indices into the tensors of the local layout and of
// the source rank's layout; `source` is an index into the remote layouts as
// passed to plan() (its tp_rank is remotes[source].tp_rank). 32 bytes.
struct Descriptor {
  uint16_t source = 0;
  uint16_t local_tensor = 0;
  uint16_t remote_tensor = 0;
  uint16_t reserved = 0;
  uint64_t local_offset = 0;
  uint64_t remote_offset = 0;
  uint64_t bytes = 0;
  bool operator==(const Descriptor&) const = default;
};
static_assert(sizeof(Descriptor) == 32);

struct SourceTotals {
  uint32_t tp_rank = 0;     // the remote rank's tp_rank
  uint64_t descriptors = 0;
  uint64_t bytes = 0;
};

struct Plan {
  std::vector<Descriptor> descriptors;  // in local (tensor, offset) order
  std::vector<SourceTotals> sources;    // one per remote layout, in input order
  uint64_t bytes = 0;                   // sum of descriptor bytes
};

// Plans `request` into `local` from the ranks in `remotes` (any order; all of
// one instance: same tp_size, distinct tp_ranks; a subset is allowed when it
// holds every head the local rank needs).
//
// Errors, each naming the field; never a partial plan:
//  - kIncompatible: an identity mismatch (check_compatible's message), remote
//    ranks of different tp_size, or no given remote rank holds a needed head;
//  - kInvalidArgument: duplicate remote ranks, a request naming an unknown or
//    non-transfer group or missing a transfer group, a block list too short
//    for its tokens, a -1 where a block moves, a scratch list not of length 1,
//    scratch blocks of different sizes, the same local bytes written twice
//    (one block id given to two aliasing groups);
//  - kOutOfRange: a block id at or beyond num_blocks;
//  - kResourceExhausted: more than 65,535 tensors or remote ranks.
// Requires valid layouts (parse_layout() or validate()).
Result<Plan> plan(const Layout& local, std::span<const Layout> remotes, const Request& request);

// The count of descriptors the usual engine scheme would post for the same
// request: one per (layer, component, block pair with moving positions, and
// remote rank holding the local heads). For comparisons in benchmarks.
uint64_t naive_descriptor_count(const Layout& local, std::span<const Layout> remotes, const Request& request);

// Writes a plan as `kvbridge.plan/1` JSON (docs/formats/plan.md). With
// `items`, includes the descriptor list as [tp_rank, local_tensor,
// local_offset, remote_tensor, remote_offset, bytes] with tensor names.
// `verified` is written when set (-1: not checked, 0: failed, 1: passed).
std::string plan_to_json(const Plan& plan, const Layout& local, std::span<const Layout> remotes, bool items,
                         int verified = -1, int indent = 2);

}  // namespace kvbridge
