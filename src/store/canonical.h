// The canonical form of store objects, as layouts the planner understands,
// and the copies between a rank and its objects.
//
// An object is one hash block of one group: a 64-byte header, then for each
// layer and component of the group in layout order a region of
// positions x heads x cell_bytes bytes in (position, global head, cell) order
// (docs/formats/store-object.md). The part of it a rank holds is a Layout:
// one tensor per group holding one object, with the rank's head slice of
// each row (the "slice view"). A put plans from the rank's layout into a
// "write view" (the slice view with the parts another rank writes set
// aside) and runs the descriptors as reads into the object; a get plans the
// same way into the slice view and runs them as writes from the object into
// the rank. Both go through plan templates (plan.h), planned once per group,
// direction and position of the object in a rank block, and the host
// executor (execute.h): the store computes no address itself, and
// heterogeneous TP and block sizes need nothing of their own.
//
// Not a public header. Thread-safety: a Canonical is used by one thread at a
// time (it caches templates and reuses one plan).
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include "kvbridge/execute.h"
#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"
#include "kvbridge/plan.h"
#include "kvbridge/status.h"

namespace kvbridge::store_internal {

inline constexpr uint64_t kHeaderBytes = 64;

// True when a group's blocks go into the store.
bool is_stored(const Group& g);

struct GroupGeometry {
  bool stored = false;
  uint32_t id = 0;            // group id (name order)
  uint64_t positions = 1;     // per object
  uint64_t object_bytes = 0;  // header + payload
  // Object byte ranges [begin, end) this rank writes (its part: the heads it
  // holds and writes, the replicated components it writes), in order and
  // merged. Over all ranks of an instance the parts cover the payload.
  std::vector<std::pair<uint64_t, uint64_t>> part;
};

class Canonical {
 public:
  // Builds the canonical layouts for `rank` (a valid layout) with hash blocks
  // of `hash_block_tokens`. kInvalidArgument naming the group when the hash
  // block does not fit a stored group.
  static Result<Canonical> create(const Layout& rank, uint64_t hash_block_tokens);

  const GroupGeometry& geometry(size_t group) const { return geometry_[group]; }
  size_t num_groups() const { return geometry_.size(); }

  // Copies into `object` (geometry(group).object_bytes) this rank's part of
  // the object of stored `group` that holds tokens [first, end) of rank
  // block `block` (offsets in the block, within one hash block; for a state
  // group, the state in `block`, and first and end are ignored). Returns the
  // bytes copied. Errors: a block id past num_blocks is kOutOfRange naming
  // the group; an internal plan error names the group. With `defer`, the
  // copies are appended to it instead of made (rank memory on a device:
  // the caller moves them through pinned host memory).
  Result<uint64_t> put(size_t group, int64_t block, uint64_t first, uint64_t end, ConstTensorMemory rank,
                       uint8_t* object, std::vector<ByteCopy>* defer = nullptr);
  // Copies from `object` the tokens [first, end) it holds (the state, for a
  // state group) into rank block `block`, with put()'s errors and `defer`.
  Result<uint64_t> get(size_t group, int64_t block, uint64_t first, uint64_t end, const uint8_t* object,
                       TensorMemory rank, std::vector<ByteCopy>* defer = nullptr);

 private:
  struct Copy {
    PlanTemplate plan;
    Request request;  // the template's; its rank block id (remote[0]) is set per copy
  };
  // The cached copy of (group, put, first, end), built on first use.
  Result<Copy*> copy(size_t group, bool put, uint64_t first, uint64_t end);
  // That copy's plan for rank block `block`, in plan_.
  Result<const Plan*> plan_copy(size_t group, bool put, int64_t block, uint64_t first, uint64_t end);

  std::vector<GroupGeometry> geometry_;
  uint64_t hash_block_tokens_ = 0;
  // Per group: the rank's layout, the slice view and the write view with
  // only that group transferable. The write view puts the components another
  // rank writes into a second tensor (store.G.other), so that the
  // descriptors into the object tensor are exactly this rank's part.
  std::vector<Layout> rank_views_, slice_views_, write_views_;
  std::map<std::tuple<size_t, bool, uint64_t, uint64_t>, Copy> copies_;
  Plan plan_;                                     // reused by every copy
  std::vector<std::span<uint8_t>> object_spans_;  // one per view tensor
  std::vector<std::span<const uint8_t>> const_object_spans_;
};

}  // namespace kvbridge::store_internal
