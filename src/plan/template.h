// The state of a plan template (kvbridge/plan.h), built by
// template_build.cc and instantiated by template.cc. Not a public header.
//
// Per group move (plan/internal.h) the template holds *loops*, one per unit
// run walked block-outer or one per unit otherwise (plan/emit.h), in
// plan()'s order. A loop visits the moving list entries in ascending local
// block id, as plan() does, and emits for entry e the pieces of e's *class*:
// entries with the same position range relative to their block and the same
// alignment to remote blocks have the same pieces up to their block ids, so
// a class program is recorded once, from a representative entry, with every
// offset at block id 0. For entry e with local id L and remote ids R[.]:
//
//   local offset  = piece.local_offset  + L * piece.local_stride
//   remote offset = piece.remote_offset + R[remote_first[e] + piece.remote_entry] * piece.remote_stride
//
// Thread-safety: immutable after build.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"
#include "kvbridge/plan.h"
#include "plan/internal.h"

namespace kvbridge {
namespace plan_internal {

struct TemplatePiece {
  uint64_t local_offset = 0;   // at local block id 0
  uint64_t remote_offset = 0;  // at remote block id 0
  uint64_t bytes = 0;
  uint64_t local_stride = 0;   // the local offset moves by local id * local_stride
  uint64_t remote_stride = 0;  // the remote offset moves by remote id * remote_stride
  uint32_t remote_entry = 0;   // relative to the entry's first remote entry
  uint16_t source = 0;
  uint16_t remote_tensor = 0;
  bool operator==(const TemplatePiece&) const = default;
};

struct TemplateLoop {
  uint16_t local_tensor = 0;
  std::vector<uint32_t> program;  // class c's pieces are [program[c], program[c + 1])
  std::vector<TemplatePiece> pieces;
  // Every class is one piece (pieces[c]) reading the entry's first remote
  // entry: the common case, instantiated by a loop without an inner loop.
  bool one_piece = false;
  // Every piece reads one source: descriptors are counted once per loop.
  bool one_source = false;
  // In every class, the pieces move together (same strides, same remote
  // entry) and come in local order, none contiguous on both sides with the
  // next: after the first, each piece of an entry is a new descriptor.
  bool rigid = false;
  // A loop that is an earlier loop of its move (`copy_of`) moved by fixed
  // offsets: the same classes, and pieces of the same bytes, strides, remote
  // entries and sources, whose offsets all differ from that loop's by
  // local_shift and remote_shift; every piece of each reads one remote
  // tensor. Starting from the same state (no earlier descriptor of its
  // tensor), it merges exactly as that loop does, so its descriptors are
  // that loop's moved (the layers of a layer-major cache, for instance).
  int64_t copy_of = -1;
  uint64_t local_shift = 0, remote_shift = 0;
  uint16_t remote_tensor = 0;  // of every piece, when copy_of >= 0 (or it is copied)
  // The first of two or more consecutive copies of one loop: one past the
  // last of them, and their tensors and shifts in order (a compact plan's
  // table run, when each of them starts fresh), and whether their local
  // tensors ascend. 0 on every other loop.
  uint32_t copies_end = 0;
  std::shared_ptr<const std::vector<TensorShift>> copies = nullptr;
  bool copies_ascending = false;
};

// One group move with moving positions.
struct TemplateMove {
  size_t group = 0;                    // index into PlanTemplate::Impl::groups
  uint64_t first_entry = 0;            // the move's first moving entry (move entries, see TemplateGroup)
  std::vector<uint32_t> entry_class;   // per moving entry
  std::vector<uint64_t> remote_first;  // per moving entry: its first remote move entry
  uint32_t remote_reads = 0;           // remote entries an entry reads at most, from its first
  std::vector<TemplateLoop> loops;
};

// A group of the shape, in the shape's (name) order. Move entries index the
// lists from `local_entry0`/`remote_entry0`: 0, or for a state group the
// last entry (which holds the state that moves).
struct TemplateGroup {
  std::string name;
  uint64_t local_blocks = 0, remote_blocks = 0;  // num_blocks per side
  uint64_t local_entry0 = 0, remote_entry0 = 0;
  // The shape lists a block at every entry of the list (no -1): fits() then
  // skips the per-entry look at the shape.
  bool local_all_listed = false, remote_all_listed = false;
};

struct TemplateAccess {
  static const PlanTemplate::Impl& impl(const PlanTemplate& t) { return *t.impl_; }
  static PlanTemplate make(std::shared_ptr<const PlanTemplate::Impl> impl) { return PlanTemplate(std::move(impl)); }
  // For tests of the fallback path: a copy of `t` that is not uniform.
  static PlanTemplate not_uniform(const PlanTemplate& t, std::string reason);
};

struct StageCut;  // plan/internal.h

// The request of `shape` whose listed entries name blocks 0, 1, 2, ... in
// list order, as create() plans it. kInvalidArgument when a list lists more
// blocks than its group has.
Result<Request> probe_request(const Layout& local, std::span<const Layout> remotes, const RequestShape& shape);

// Equal tables of copies (TemplateLoop::copies) as one object: the stages
// of a StageTemplate share theirs, so that whoever maps a table run to
// something of its own (the connector: a prepared table of moves) can
// know it again by its address.
class ShiftTables {
 public:
  std::shared_ptr<const std::vector<TensorShift>> intern(std::vector<TensorShift> table);

 private:
  std::map<std::vector<uint64_t>, std::shared_ptr<const std::vector<TensorShift>>> tables_;
};

// The layouts a template was made for, copied once.
struct TemplateLayouts {
  Layout local;
  std::vector<Layout> remotes;
};

// What the stages of one shape share, made once (StageTemplate::create()):
// the probe request, the remote ranks' order, its group moves (each stage
// narrows them to its cut and restores them), the tables of copies, and one
// copy of the layouts.
struct StagePrep {
  Request probe;
  std::vector<uint16_t> by_rank;
  std::vector<GroupMove> moves;
  ShiftTables tables;
  std::shared_ptr<const TemplateLayouts> layouts;
};
Result<StagePrep> prepare_stages(const Layout& local, std::span<const Layout> remotes, const RequestShape& shape);

// PlanTemplate::create(); with `cut` and `prep` (of the same layouts and
// shape), the template of that stage of the shape (StageTemplate): its
// moves narrowed to the cut's tokens and layers, its tables of copies and
// its layouts `prep`'s.
Result<PlanTemplate> build_template(const Layout& local, std::span<const Layout> remotes, const RequestShape& shape,
                                    const StageCut* cut = nullptr, StagePrep* prep = nullptr);

// True when `r` fits the shape of `t` and its ids are in range and distinct
// per list: then plan() accepts it (everything else plan() checks depends
// on the shape only, and create() planned the shape). Fills `lists` with
// each group's local and remote list, in shape order; `scratch` is a
// buffer (template_fits.cc).
bool fits(const PlanTemplate::Impl& t, const Request& r, std::vector<std::span<const int64_t>>& lists,
          std::vector<uint64_t>& scratch);
// The error of a request that does not pass fits(): plan()'s when plan()
// rejects it, else the first difference from the shape.
Status request_error(const PlanTemplate::Impl& t, const Request& r);

// Instantiates `templates` (the stages of one shape: StageTemplate) for
// `request` into out[i] (out.size() >= templates.size()), checking the
// request against the shape once and reusing one set of buffers. False when
// the request does not fit the shape, a template is not uniform, or bytes
// would be written twice: the caller asks plan_stages() for the answer.
bool instantiate_all(std::span<const PlanTemplate> templates, const Request& request, std::span<Plan> out);
// The same as compact plans (kvbridge/plan.h): a template's plan is held
// with moved runs where it can be, and as one literal run where not.
bool instantiate_all_compact(std::span<const PlanTemplate> templates, const Request& request,
                             std::span<CompactPlan> out);

}  // namespace plan_internal

struct PlanTemplate::Impl {
  // Copies of create()'s layouts (for plan()'s error messages, and the
  // fallback), one set for every stage of a StageTemplate.
  std::shared_ptr<const plan_internal::TemplateLayouts> layouts;
  const Layout& local() const { return layouts->local; }
  const std::vector<Layout>& remotes() const { return layouts->remotes; }
  RequestShape shape;
  bool uniform = true;
  std::string fallback_reason;
  std::vector<plan_internal::TemplateGroup> groups;
  std::vector<plan_internal::TemplateMove> moves;  // in plan()'s (local group) order
  std::vector<SourceTotals> totals;                // per source: tp_rank and bytes (fixed by the shape)
  uint64_t max_pieces = 0;                         // pieces emitted when nothing merges
  uint64_t pieces = 0;                             // pieces held
};

}  // namespace kvbridge
