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
// verify() (verify.h) checks 1-3 without trusting the planner. A plan
// template (PlanTemplate, below) plans once for a request shape and yields
// the same plans for each request's block ids without planning again;
// execute.h runs a plan's descriptors as host memory copies.
//
// Which positions move, per group kind: attention, tokens [skip_tokens,
// num_tokens); sliding_window, the same cut to the last window_tokens tokens;
// state, the state of the last listed block on each side, when any token
// moves (a receiver that holds every token, skip_tokens == num_tokens, holds
// the state after them as part of its prefix hit, and its block may be
// shared); scratch, every position of the single listed block, always (a
// per-request ring is never prefix-cached, so the receiver never holds it).
// With tokens_per_state > 1 a position moves when it holds any token of the
// range. docs/formats/request.md says why.
//
// Pure: no I/O, no threads, no globals. Thread-safety: reentrant.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
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
  uint32_t tp_rank = 0;  // the remote rank's tp_rank
  uint32_t pp_rank = 0;  // and its pipeline stage
  uint64_t descriptors = 0;
  uint64_t bytes = 0;
};

struct Plan {
  std::vector<Descriptor> descriptors;  // in local (tensor, offset) order
  std::vector<SourceTotals> sources;    // one per remote layout, in input order
  uint64_t bytes = 0;                   // sum of descriptor bytes
};

// Plans `request` into `local` from the ranks in `remotes` (any order; all of
// one instance: same tp_size and pp_size, distinct ranks; a subset is allowed
// when it holds every layer and head the local rank needs). The local rank
// and the remote ranks may be pipeline stages (of any sizes): each layer the
// local rank holds is read from the remote ranks that hold it. It reads from
// source_ranks() only.
//
// Errors, each naming the field; never a partial plan:
//  - kIncompatible: an identity mismatch (check_compatible's message), remote
//    ranks of different tp_size or pp_size, or no given remote rank holds a
//    needed layer (naming it and the stages given) or head;
//  - kInvalidArgument: duplicate remote ranks, a request naming an unknown or
//    non-transfer group or missing a transfer group, a block list too short
//    for its tokens, a -1 where a block moves, a scratch list not of length 1,
//    scratch blocks of different sizes, the same local bytes written twice
//    (one block id given to two aliasing groups);
//  - kOutOfRange: a block id at or beyond num_blocks;
//  - kResourceExhausted: more than 65,535 tensors or remote ranks.
// Requires valid layouts (parse_layout() or validate()).
Result<Plan> plan(const Layout& local, std::span<const Layout> remotes, const Request& request);

// The remote ranks a plan into `local` reads from (docs/planner.md,
// "Sources"): the fewest of `remotes` that together hold everything `local`
// moves (each local head of each component of every transfer group), as
// ranks of their instance (Layout::rank(): the tp_rank when there is one
// pipeline stage) in ascending order. A plan's descriptors come from these ranks
// only, and a request that moves every transfer group reads from each of
// them. Deterministic, from the layouts alone. Errors: plan()'s for the
// layouts (an identity mismatch, a needed head no given rank holds, ...).
Result<std::vector<uint32_t>> source_ranks(const Layout& local, std::span<const Layout> remotes);

// Who reads whom, for a pair of instances: for each remote rank (in the
// order given), the ranks (Layout::rank()) of the `locals` (the ranks of the
// reading instance) whose source_ranks() include it, ascending. What a prefill rank
// counts before it frees a request's blocks: every reader said done. A
// remote rank nobody reads has an empty list. Errors: source_ranks()'s,
// naming the local rank.
struct SourceReaders {
  uint32_t rank = 0;              // the remote rank (Layout::rank())
  std::vector<uint32_t> readers;  // local ranks reading it
};
Result<std::vector<SourceReaders>> readers_per_source(std::span<const Layout> locals, std::span<const Layout> remotes);

// The count of descriptors the usual engine scheme would post for the same
// request: one per (layer, component, block pair with moving positions, and
// remote rank holding the local heads). For comparisons in benchmarks.
uint64_t naive_descriptor_count(const Layout& local, std::span<const Layout> remotes, const Request& request);

// ---------------------------------------------------------------------------
// Token-ordered chunks: one request's plan cut at token boundaries, so that a
// load that fails part way knows which tokens arrived whole and the engine
// recomputes only from there.
//
// plan_chunks() cuts the positions of the token-indexed groups (attention,
// sliding window) at multiples of `chunk_tokens`, rounded up to a multiple
// of every moving group's block tokens on both sides (so that chunks end on
// block boundaries), in token order. A position belongs to the chunk that
// holds its first token; the first chunk starts at the request's
// skip_tokens, the last ends at num_tokens. State and scratch groups move
// in the last chunk. Invariant (tested over generated layouts and the preset
// matrix): the chunks' descriptors together write exactly the bytes plan()
// writes (each chunk's plan is minimal; a run crossing a chunk boundary is
// cut there), so verify() passes their concatenation with check_minimal off.
//
// `resume_token`: when the chunks before one arrived whole and it did not,
// the engine can recompute from there. That is the chunk's first token when
// the KV of the tokens before it is all a recompute needs: every moving
// group is attention, or a sliding window moved from skip_tokens. Otherwise
// (a state or scratch group holds only the request's final state; a window
// moved only its last window_tokens) nothing short of the whole request is
// resumable, and plan_chunks() returns one chunk resuming at skip_tokens.
// `chunk_tokens` 0 gives one chunk. Errors: plan()'s.
struct PlanChunk {
  uint64_t first_token = 0;   // first token of the chunk's positions (skip_tokens for the first)
  uint64_t end_token = 0;     // one past the last (num_tokens for the last)
  uint64_t resume_token = 0;  // where a recompute starts when this is the first chunk not whole
  Plan plan;
};
Result<std::vector<PlanChunk>> plan_chunks(const Layout& local, std::span<const Layout> remotes, const Request& request,
                                           uint64_t chunk_tokens);

// ---------------------------------------------------------------------------
// Stages: one request's plan cut by layer (and by token chunk), so that a
// stage can move as soon as the prefill has computed its layers, while it
// computes the next (layer-wise streaming: docs/connector.md).
//
// layer_order() (layout.h) is the model's layer order.
//
// plan_stages() cuts the request's token-indexed positions into chunks as
// plan_chunks() does (`chunk_tokens`, same rounding, same resume rule), and
// each chunk into stages of `layers_per_stage` consecutive layers of
// layer_order(), in the order a chunked prefill computes them: chunk by
// chunk, and layer by layer inside a chunk. A (group, layer) unit belongs to
// the stage of its layer; so a state or scratch layer moves in its layer's
// stage of the last chunk (it is final only then: such a request is one
// chunk anyway). Stages that move nothing are left out (a request moving
// nothing gets one empty stage). Invariant (tested over generated layouts
// and the preset matrix): each stage is minimal on its own, the stages are
// disjoint, and together they write exactly the bytes plan() writes, so
// verify() passes their concatenation with check_minimal off. Errors:
// plan()'s.

struct StageOptions {
  uint32_t layers_per_stage = 1;  // 0: every layer in one stage
  uint64_t chunk_tokens = 0;      // as plan_chunks(); 0: one chunk
};

struct PlanStage {
  uint32_t first_layer = 0, end_layer = 0;  // its layers: [first_layer, end_layer) of layer_order()
  std::vector<std::string> layers;          // their names
  uint64_t first_token = 0, end_token = 0;  // its chunk's tokens (PlanChunk's)
  uint64_t resume_token = 0;                // where a recompute starts when this stage is the first not whole
  Plan plan;
};
Result<std::vector<PlanStage>> plan_stages(const Layout& local, std::span<const Layout> remotes, const Request& request,
                                           const StageOptions& options);

// ---------------------------------------------------------------------------
// Plan templates: planned once, instantiated for each request's block ids.
//
// What plan() computes from the layouts and the token counts (which
// positions move, which rank serves which head, units, segments, how pieces
// coalesce) does not depend on the block ids. A template keeps it: every
// piece of the plan records the list entry it depends on on each side and
// moves with that entry's block id (offset = base + id * the component's
// block stride). instantiate() computes the offsets from a request's ids,
// visits entries in plan()'s order and merges pieces adjacent on both sides
// (same tensors, same source) exactly as plan() does.
//
// Invariant (tested over generated layouts and the preset matrix): for a
// request that fits the template's shape, instantiate() returns what plan()
// returns for the same layouts and request: the same descriptors in the same
// order, the same per-source totals and bytes, or the same error.

// The shape of one group's block lists: one flag per list entry, in list
// order, true where the entry names a block and false where it is -1.
struct GroupShape {
  std::vector<bool> local;
  std::vector<bool> remote;
  bool operator==(const GroupShape&) const = default;
};

// What a template is planned for. A request fits a shape when it has the
// shape's num_tokens and skip_tokens, names exactly the shape's groups, and
// each of its block lists has the shape's length and is -1 exactly at the
// entries the shape marks false (the ids of the other entries are free).
struct RequestShape {
  uint64_t num_tokens = 0;
  uint64_t skip_tokens = 0;
  std::map<std::string, GroupShape> groups;  // by group name
  bool operator==(const RequestShape&) const = default;
};

// The shape `request` fits (an id below -1 counts as a block).
RequestShape shape_of(const Request& request);

namespace plan_internal {
struct TemplateAccess;
}

// Thread-safety: immutable after create(); instantiate() may run on several
// threads at once. Copies share the planned state and are cheap.
// Ownership: the template keeps copies of what it needs from create()'s
// arguments; they may be destroyed after create() returns.
class PlanTemplate {
 public:
  // Plans `shape` into `local` from `remotes` (as for plan()). Errors:
  // plan()'s, for these layouts and a request of the shape whose listed
  // entries name blocks 0, 1, 2, ... in list order (an unknown group, a list
  // too short for its tokens, a -1 where a block moves, an identity
  // mismatch, ...); kInvalidArgument when a list lists more blocks than its
  // group has (num_blocks), since no request of the shape could be valid.
  static Result<PlanTemplate> create(const Layout& local, std::span<const Layout> remotes, const RequestShape& shape);

  const RequestShape& shape() const;

  // True when instantiate() computes plans from the template's pieces. A
  // template is uniform when the pieces of every list entry are those of a
  // representative entry with the same positions, moved by the entry's own
  // block ids; create() checks this for every entry. Every layout the tests
  // generate, and every preset, is uniform (the layout model's addresses are
  // affine in the block id). When false, instantiate() checks the request's
  // fit and then calls plan(): the same result at plan()'s cost.
  bool uniform() const;
  // Why the template is not uniform (names the group and the entry); empty
  // when it is.
  const std::string& fallback_reason() const;
  // The pieces the template holds (pieces that move together are held as
  // one), a measure of its size.
  uint64_t pieces() const;

  // The plan of `request`: exactly plan(local, remotes, request) for the
  // arguments of create(). Errors: when plan() would fail for the request,
  // its error (same code and message: an id at or beyond num_blocks is
  // kOutOfRange, a -1 where a block moves kInvalidArgument, ...); otherwise,
  // when the request does not fit the shape, kInvalidArgument naming the
  // first difference, e.g. "group 'full' local block list has 7 entries,
  // the template's shape 8" or "group 'full' remote[3] is 12 but the
  // template's shape has -1 there".
  Result<Plan> instantiate(const Request& request) const;
  // The same into `out`, reusing the memory of its descriptors (a plan that
  // is instantiated again and again into one Plan is not reallocated). On
  // error the contents of `out` are unspecified.
  Status instantiate(const Request& request, Plan* out) const;

  // The planned state (src/plan/template.h); opaque outside the planner.
  struct Impl;

 private:
  friend struct plan_internal::TemplateAccess;
  explicit PlanTemplate(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

// ---------------------------------------------------------------------------
// Compact plans: a plan held as runs of descriptors, where a run may be an
// earlier run moved to other tensors by fixed offsets. In a layer-major
// cache every layer's descriptors are the first layer's moved, so a compact
// plan grows with the blocks a request moves, not with layers x blocks, and
// so does the work of everything that passes it on (the connector, the
// engine's checks); the engine's threads expand it as they copy.
//
// Invariant (tested over generated layouts and the preset matrix): expand()
// of a stage template's compact stages is what plan_stages() returns, stage
// by stage, descriptor by descriptor.

// Where a moved run puts its descriptors: these tensors, at their offsets
// plus the shifts (modulo 2^64).
struct TensorShift {
  uint16_t local_tensor = 0, remote_tensor = 0;
  uint64_t local_shift = 0, remote_shift = 0;
  bool operator==(const TensorShift&) const = default;
};

struct DescriptorRun {
  uint64_t first = 0, count = 0;  // descriptors [first, first + count) of CompactPlan::literal
  // False: those descriptors as they are. True: moved, each naming
  // local_tensor and remote_tensor (its source unchanged) at its offsets
  // plus the shifts. A moved run's range is exactly an earlier literal
  // run's, all of whose descriptors name one local and one remote tensor.
  bool moved = false;
  uint16_t local_tensor = 0, remote_tensor = 0;
  uint64_t local_shift = 0, remote_shift = 0;
  // A table run (moved, with a table): the run moved by each shift of the
  // table in turn, as that many moved runs one after another would be (the
  // later layers of a layer-major cache: one run for all of them, and a
  // table shared by every instance of the template). The fields above are
  // then its first shift's.
  std::shared_ptr<const std::vector<TensorShift>> table = nullptr;
  // The descriptors it stands for.
  uint64_t descriptors() const { return table != nullptr ? count * table->size() : count; }
  bool operator==(const DescriptorRun& o) const {
    return first == o.first && count == o.count && moved == o.moved && local_tensor == o.local_tensor &&
           remote_tensor == o.remote_tensor && local_shift == o.local_shift && remote_shift == o.remote_shift &&
           (table == o.table || (table != nullptr && o.table != nullptr && *table == *o.table));
  }
};

struct CompactPlan {
  std::vector<Descriptor> literal;
  std::vector<DescriptorRun> runs;    // the plan's descriptors: every run's, in order
  std::vector<SourceTotals> sources;  // as Plan::sources, of the whole plan
  uint64_t bytes = 0;                 // as Plan::bytes
  uint64_t descriptors = 0;           // the plan's (runs expanded)
};

// The plan a compact plan holds.
Plan expand(const CompactPlan& compact);
// A plan as a compact plan of one literal run (none when it is empty).
CompactPlan compact(Plan plan);

// A stage (PlanStage) with a compact plan.
struct CompactStage {
  uint32_t first_layer = 0, end_layer = 0;
  uint64_t first_token = 0, end_token = 0;
  uint64_t resume_token = 0;
  CompactPlan plan;
  // StageTemplate::instantiate_moved() only: an earlier stage (its index)
  // whose descriptors this stage's are, moved to other tensors (a later
  // layer's stage of a layer-major cache: the first layer's, at the later
  // layer's tensors). Then `plan` holds no literal: each of its runs is
  // moved and names a run of that stage's literal, a literal run there of
  // one local and one remote tensor, or a moved run's range there. -1: a
  // stage with a literal of its own.
  int64_t moved_from = -1;
};
CompactStage compact(PlanStage stage);
// The plan of stages[k], taking its literal from the stage it is moved
// from where it is (CompactStage::moved_from).
Plan expand(std::span<const CompactStage> stages, size_t k);

// Stage templates: plan_stages() planned once for a request shape, as a
// PlanTemplate plans plan() once. Each stage of the shape is a template of
// its own (the stage's tokens and layers), instantiated from a request's
// block ids; the stages, their tokens and layers are the shape's.
//
// Invariant (tested over generated layouts and the preset matrix): for a
// request of the shape, instantiate() returns what plan_stages() returns
// for the same layouts, request and options: the same stages with the same
// descriptors in the same order, or the same error. Where the stages'
// templates are not uniform (a context-sharded group), instantiate() calls
// plan_stages(): fallback_reason() says why, once, for the template.
//
// Thread-safety and ownership: as PlanTemplate's.
class StageTemplate {
 public:
  // Errors: PlanTemplate::create()'s.
  static Result<StageTemplate> create(const Layout& local, std::span<const Layout> remotes, const RequestShape& shape,
                                      const StageOptions& options);

  const RequestShape& shape() const;
  const StageOptions& options() const;
  bool uniform() const;
  const std::string& fallback_reason() const;
  size_t stages() const;  // of a request of the shape; 0 when it falls back

  // The stages of `request`: exactly plan_stages(local, remotes, request,
  // options) for the arguments of create(), errors included.
  Result<std::vector<PlanStage>> instantiate(const Request& request) const;
  // The same stages as compact plans (expand() gives instantiate()'s):
  // the layers that repeat a stage's first layer are moved runs. A stage
  // whose descriptors cannot be held so (plan_stages() would reorder them,
  // or a later piece merges into a moved run) is one literal run, as is
  // every stage where the template falls back.
  Result<std::vector<CompactStage>> instantiate_compact(const Request& request) const;
  // The same, except that a stage whose template is an earlier stage's
  // with its tensors moved (equal but for each tensor and a shift of its
  // offsets: the later layers of a layer-major cache, streamed a layer per
  // stage) is that stage moved (CompactStage::moved_from), planned in the
  // time of its runs instead of its descriptors; expand(stages, k) gives
  // instantiate()'s stage k. A caller that does not follow moved_from
  // takes instantiate_compact().
  Result<std::vector<CompactStage>> instantiate_moved(const Request& request) const;
  // Stages of a request of the shape that instantiate_moved() gives as an
  // earlier stage moved.
  size_t moved_stages() const;

  struct Impl;

 private:
  explicit StageTemplate(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

// Writes a plan as `kvbridge.plan/1` JSON (docs/formats/plan.md). With
// `items`, includes the descriptor list as [tp_rank, local_tensor,
// local_offset, remote_tensor, remote_offset, bytes] with tensor names.
// `verified` is written when set (-1: not checked, 0: failed, 1: passed).
std::string plan_to_json(const Plan& plan, const Layout& local, std::span<const Layout> remotes, bool items,
                         int verified = -1, int indent = 2);

}  // namespace kvbridge
