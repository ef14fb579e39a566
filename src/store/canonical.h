// The canonical form of store objects, as layouts the planner understands.
//
// An object is one hash block of one group: a 64-byte header, then for each
// layer and component of the group in layout order a region of
// positions x heads x cell_bytes bytes in (position, global head, cell) order
// (docs/formats/store-object.md). That is a Layout: one tensor per group
// holding K objects back to back (the block axis strides over objects), TP 1,
// every head. A rank's put plans from its layout into a "write view" of the
// canonical layout that holds only its head slice; a get plans from the
// canonical "read view" (every head) into the rank's layout. Heterogeneous TP
// and block sizes then need nothing of their own.
//
// Not a public header. Thread-safety: a Canonical is used by one thread at a
// time (its layouts are patched in place for each call's object count).
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "kvbridge/content.h"
#include "kvbridge/layout.h"
#include "kvbridge/plan.h"
#include "kvbridge/status.h"

namespace kvbridge::store_internal {

inline constexpr uint64_t kHeaderBytes = 64;

// True when a group's blocks go into the store.
bool is_stored(const Group& g);

struct GroupGeometry {
  bool stored = false;
  uint32_t id = 0;              // group id (name order)
  uint64_t positions = 1;       // per object
  uint64_t object_bytes = 0;    // header + payload
  // Object byte ranges [begin, end) this rank must not write: replicated
  // components another rank writes, heads another rank holds too.
  std::vector<std::pair<uint64_t, uint64_t>> skip;
  // Object byte ranges [begin, end) this rank writes (its part: the heads it
  // holds and writes, the replicated components it writes), in order and
  // merged. Over all ranks of an instance the parts cover the payload.
  std::vector<std::pair<uint64_t, uint64_t>> part;
};

// The copies that move one object to or from rank block 0, and how they
// move with the block id: for rank block b a piece's rank offset is
// rank_offset + b * delta[rank_tensor]. Planned once per (group, direction,
// position of the hash block in the rank block), so puts and gets of any
// length plan nothing.
struct ObjectPlan {
  struct Piece {
    uint16_t rank_tensor = 0;
    uint64_t rank_offset = 0;
    uint64_t object_offset = 0;
    uint64_t bytes = 0;
  };
  std::vector<Piece> pieces;
  std::vector<uint64_t> delta;  // per rank tensor
};

class Canonical {
 public:
  // Builds the canonical layouts for `rank` (a valid layout) with hash blocks
  // of `hash_block_tokens`. kInvalidArgument naming the group when the hash
  // block does not fit a stored group.
  static Result<Canonical> create(const Layout& rank, uint64_t hash_block_tokens);

  const GroupGeometry& geometry(size_t group) const { return geometry_[group]; }
  size_t num_groups() const { return geometry_.size(); }

  // The canonical layout with every head and `objects` objects of `group`,
  // only that group transferable. Valid until the next call.
  const Layout& read_view(size_t group, uint64_t objects);
  // The same holding only this rank's head slice.
  const Layout& write_view(size_t group, uint64_t objects);
  // The rank's layout with only `group` transferable.
  const Layout& rank_view(size_t group) const { return rank_views_[group]; }

  // The per-object plan of hash block `phase` (its index inside the rank
  // block) of `group`, for a put (rank to object) or a get, or nullptr when
  // the rank layout's addresses are not one shift per tensor in the block id
  // (then callers plan the whole request). Cached.
  const ObjectPlan* object_plan(size_t group, bool put, uint64_t phase);

 private:
  static void patch(Layout& layout, size_t group, uint64_t objects, uint64_t object_bytes);
  std::vector<GroupGeometry> geometry_;
  struct CachedPlan {
    bool built = false;
    bool affine = false;
    ObjectPlan plan;
  };
  std::vector<std::vector<CachedPlan>> put_plans_, get_plans_;  // [group][phase]
  uint64_t hash_block_tokens_ = 0;
  std::vector<Layout> rank_views_;
  Layout read_;
  Layout write_;
};

// Runs a put plan (local: a write view, remote: the rank view): copies rank
// memory into object k = local_offset / object_bytes of `objects`, leaving out
// `skip` ranges. Returns the bytes copied.
uint64_t copy_into_objects(const Plan& plan, TensorMemory rank, std::span<uint8_t* const> objects,
                           uint64_t object_bytes, std::span<const std::pair<uint64_t, uint64_t>> skip);

// Runs a get plan (local: the rank view, remote: a read view): copies from the
// objects into rank memory. Returns the bytes copied.
uint64_t copy_from_objects(const Plan& plan, TensorMemory rank, std::span<const uint8_t* const> objects,
                           uint64_t object_bytes);

// Copies with an ObjectPlan: rank block `block` to or from `object`.
// Returns the bytes copied. Requires block < the group's num_blocks.
uint64_t put_object(const ObjectPlan& p, TensorMemory rank, uint64_t block, uint8_t* object,
                    std::span<const std::pair<uint64_t, uint64_t>> skip);
uint64_t get_object(const ObjectPlan& p, TensorMemory rank, uint64_t block, const uint8_t* object);

}  // namespace kvbridge::store_internal
