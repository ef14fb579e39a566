// Canonical object layouts and the copies that fill and read objects.
//
// Why layouts: the planner already matches bytes by semantic coordinate across
// any TP size, block size, kernel ratio and axis order, merges what is
// contiguous and is checked by the verifier. Expressing the object as one more
// layout reuses all of that; this file only builds the layouts, asks plan
// templates for the descriptors of one object and runs them with the
// executor.
#include "store/canonical.h"

#include <algorithm>
#include <string>

#include "common/text.h"
#include "kvbridge/execute.h"
#include "kvbridge/store_key.h"

namespace kvbridge::store_internal {
namespace {

// Whether this rank writes the heads it holds of a sharded component. Heads
// held by several ranks (TP above the head count) are written by the first of
// them only, under the even-split convention of docs/presets.md; any other
// sharding writes them from every holder (the bytes are equal, so the only
// cost is the copy).
bool writes_heads(const Layout& l, const HeadMap& h) {
  const uint64_t held = uint64_t{h.count} * l.tp_size;
  if (held <= h.total) return true;
  if (h.count == 1 && l.tp_size % h.total == 0) return l.tp_rank % (l.tp_size / h.total) == 0;
  return true;
}

std::string object_tensor(size_t group) { return "store." + std::to_string(group); }
std::string other_tensor(size_t group) { return "store." + std::to_string(group) + ".other"; }

// One object per group: the block axis of every component strides over
// objects of the group's size.
void set_block_axes(Group& g, uint64_t object_bytes) {
  for (Layer& l : g.layers) {
    for (Component& c : l.components) {
      for (Axis& a : c.axes) {
        if (a.kind == AxisKind::kBlock) a.stride = object_bytes;
      }
    }
  }
}

// `layout` with only group `group` transferable.
Layout only(const Layout& layout, size_t group) {
  Layout view = layout;
  for (size_t gj = 0; gj < view.groups.size(); ++gj) view.groups[gj].transfer = gj == group;
  return view;
}

}  // namespace

bool is_stored(const Group& g) { return g.prefix_cacheable && g.transfer && g.kind != GroupKind::kScratch; }

Result<Canonical> Canonical::create(const Layout& rank, uint64_t H) {
  Canonical c;
  const std::vector<uint32_t> ids = group_ids(rank);
  // The slice view (every component of the rank's heads, in the object) and
  // the write view (the same with the parts another rank writes moved to
  // store.G.other).
  Layout slice, write;
  slice.model = write.model = rank.model;
  slice.dtype = write.dtype = rank.dtype;
  slice.tp_size = write.tp_size = rank.tp_size;
  slice.tp_rank = write.tp_rank = rank.tp_rank;
  for (size_t gi = 0; gi < rank.groups.size(); ++gi) {
    const Group& g = rank.groups[gi];
    GroupGeometry geo;
    geo.stored = is_stored(g);
    geo.id = ids[gi];
    const std::string where = "group " + q(g.name);
    uint64_t block_tokens = g.block_tokens;
    if (geo.stored) {
      if (g.block_tokens % H != 0) {
        return Status::invalid_argument(where + ": hash_block_tokens " + std::to_string(H) +
                                        " does not divide block_tokens " + std::to_string(g.block_tokens));
      }
      if (token_indexed(g.kind) && H % g.tokens_per_state != 0) {
        return Status::invalid_argument(where + ": hash_block_tokens " + std::to_string(H) +
                                        " is not a multiple of tokens_per_state " + std::to_string(g.tokens_per_state));
      }
      if (g.kind == GroupKind::kSlidingWindow && g.window_tokens && *g.window_tokens < H) {
        return Status::invalid_argument(where + ": hash_block_tokens " + std::to_string(H) + " exceeds window_tokens " +
                                        std::to_string(*g.window_tokens));
      }
      block_tokens = H;
    }
    Group sg;
    sg.name = g.name;
    sg.kind = g.kind;
    sg.block_tokens = block_tokens;
    sg.tokens_per_state = g.tokens_per_state;
    sg.window_tokens = g.window_tokens;
    sg.prefix_cacheable = g.prefix_cacheable;
    sg.transfer = false;
    sg.num_blocks = 1;
    geo.positions = token_indexed(g.kind) ? block_tokens / g.tokens_per_state : 1;
    Group wg = sg;
    uint64_t off = kHeaderBytes;
    for (size_t li = 0; li < g.layers.size(); ++li) {
      const Layer& layer = g.layers[li];
      Layer sl{layer.name, {}}, wl{layer.name, {}};
      for (const Component& comp : layer.components) {
        // The object's region of the component: positions x every head x
        // cell, of which the rank's heads are a slice of each row.
        const uint64_t total = comp.heads ? comp.heads->total : 1;
        const uint64_t bytes = geo.positions * total * comp.cell_bytes;
        Component sc;
        sc.name = comp.name;
        sc.tensor = object_tensor(gi);
        sc.offset = off;
        sc.cell_bytes = comp.cell_bytes;
        sc.axes.push_back({AxisKind::kBlock, 1, 0});  // stride set below
        if (token_indexed(g.kind)) sc.axes.push_back({AxisKind::kPosition, geo.positions, total * comp.cell_bytes});
        if (comp.heads) {
          sc.heads = *comp.heads;
          sc.offset += uint64_t{comp.heads->first} * comp.cell_bytes;
          sc.axes.push_back({AxisKind::kHead, comp.heads->count, comp.cell_bytes});
        }
        Component wc = sc;
        if (comp.heads) {
          if (!writes_heads(rank, *comp.heads)) {
            wc.tensor = other_tensor(gi);
          } else {
            const uint64_t row = total * comp.cell_bytes;
            const uint64_t first = uint64_t{comp.heads->first} * comp.cell_bytes;
            const uint64_t run = uint64_t{comp.heads->count} * comp.cell_bytes;
            for (uint64_t p = 0; p < geo.positions; ++p) {
              geo.part.push_back({off + p * row + first, off + p * row + first + run});
            }
          }
        } else if (li % rank.tp_size != rank.tp_rank) {
          // A replicated component is written once: by rank (layer index mod
          // TP), which spreads the writes over the ranks.
          wc.tensor = other_tensor(gi);
        } else {
          geo.part.push_back({off, off + bytes});
        }
        sl.components.push_back(std::move(sc));
        wl.components.push_back(std::move(wc));
        off += bytes;
      }
      sg.layers.push_back(std::move(sl));
      wg.layers.push_back(std::move(wl));
    }
    geo.object_bytes = off;
    set_block_axes(sg, off);
    set_block_axes(wg, off);
    std::vector<std::pair<uint64_t, uint64_t>> merged;
    for (const auto& r : geo.part) {
      if (!merged.empty() && merged.back().second == r.first) {
        merged.back().second = r.second;
      } else {
        merged.push_back(r);
      }
    }
    geo.part = std::move(merged);
    slice.tensors.push_back({object_tensor(gi), geo.object_bytes, "host"});
    slice.groups.push_back(std::move(sg));
    write.groups.push_back(std::move(wg));
    c.geometry_.push_back(std::move(geo));
  }
  write.tensors = slice.tensors;
  for (size_t gi = 0; gi < rank.groups.size(); ++gi) {
    write.tensors.push_back({other_tensor(gi), c.geometry_[gi].object_bytes, "host"});
  }
  // The canonical layouts are built, not parsed: check them once, so a bug
  // here is an internal error rather than a wrong copy.
  for (const Layout* l : {&slice, &write}) {
    Status s = validate(*l);
    if (!s.ok()) return Status::internal("canonical layout: " + s.message());
    s = check_compatible(rank, *l);
    if (!s.ok()) return Status::internal("canonical layout: " + s.message());
  }
  c.hash_block_tokens_ = H;
  for (size_t gi = 0; gi < rank.groups.size(); ++gi) {
    c.rank_views_.push_back(only(rank, gi));
    c.slice_views_.push_back(only(slice, gi));
    c.write_views_.push_back(only(write, gi));
  }
  c.object_spans_.resize(write.tensors.size());
  c.const_object_spans_.resize(slice.tensors.size());
  return c;
}

Result<Canonical::Copy*> Canonical::copy(size_t gi, bool put, uint64_t first, uint64_t end) {
  const Group& g = rank_views_[gi].groups[gi];
  const bool state = g.kind == GroupKind::kState;
  if (state) first = end = 0;
  auto it = copies_.find({gi, put, first, end});
  if (it != copies_.end()) return &it->second;
  // The request that moves tokens [first, end) of rank entry 0 (or its
  // state) into object 0, listed in the canonical entry that holds token
  // `first`. Both directions plan into the object, so that descriptors come
  // in object order (the object is read or written front to back; the rank
  // side is scattered either way): a put runs them as reads into the write
  // view, a get as writes from the slice view back into the rank.
  Request r;
  std::vector<int64_t> objects = {0};
  if (state) {
    r.num_tokens = 1;
  } else {
    r.num_tokens = end;
    r.skip_tokens = first;
    objects.assign(slice_views_[gi].groups[gi].slot_of_token(first).entry + 1, -1);
    objects.back() = 0;
  }
  r.blocks[g.name] = GroupBlocks{objects, {0}};
  const Layout& object = put ? write_views_[gi] : slice_views_[gi];
  Result<PlanTemplate> t = PlanTemplate::create(object, std::span(&rank_views_[gi], 1), shape_of(r));
  if (!t.ok()) {
    return Status::internal("store: group " + q(g.name) +
                            ": the copy of an object cannot be planned: " + t.error().message());
  }
  return &copies_.emplace(std::tuple{gi, put, first, end}, Copy{std::move(*t), std::move(r)}).first->second;
}

Result<const Plan*> Canonical::plan_copy(size_t gi, bool put, int64_t block, uint64_t first, uint64_t end) {
  const Group& g = rank_views_[gi].groups[gi];
  const std::string what = std::string("store: ") + (put ? "put" : "get") + " group " + q(g.name);
  if (block < 0 || static_cast<uint64_t>(block) >= g.num_blocks) {
    return Status::out_of_range(what + ": block id " + std::to_string(block) + " is not below num_blocks " +
                                std::to_string(g.num_blocks));
  }
  KVB_ASSIGN_OR_RETURN(Copy * c, copy(gi, put, first, end));
  c->request.blocks.begin()->second.remote[0] = block;
  KVB_RETURN_IF_ERROR(c->plan.instantiate(c->request, &plan_).with_context(what));
  return &plan_;
}

Result<uint64_t> Canonical::put(size_t gi, int64_t block, uint64_t first, uint64_t end, ConstTensorMemory rank,
                                uint8_t* object, std::vector<ByteCopy>* defer) {
  KVB_ASSIGN_OR_RETURN(const Plan* p, plan_copy(gi, true, block, first, end));
  // Descriptors come in local tensor order: those into the object (tensor
  // gi) before those into store.gi.other, the part another rank writes.
  const auto part_end = std::partition_point(p->descriptors.begin(), p->descriptors.end(),
                                             [gi](const Descriptor& d) { return d.local_tensor == gi; });
  object_spans_[gi] = {object, geometry_[gi].object_bytes};
  const ConstTensorMemory sources[] = {rank};
  const std::span<const Descriptor> mine(p->descriptors.begin(), part_end);
  Result<uint64_t> n =
      defer != nullptr ? resolve_read(mine, object_spans_, sources, defer) : execute_read(mine, object_spans_, sources);
  object_spans_[gi] = {};
  return n;
}

Result<uint64_t> Canonical::get(size_t gi, int64_t block, uint64_t first, uint64_t end, const uint8_t* object,
                                TensorMemory rank, std::vector<ByteCopy>* defer) {
  KVB_ASSIGN_OR_RETURN(const Plan* p, plan_copy(gi, false, block, first, end));
  const_object_spans_[gi] = {object, geometry_[gi].object_bytes};
  const TensorMemory destinations[] = {rank};
  Result<uint64_t> n = defer != nullptr ? resolve_write(p->descriptors, const_object_spans_, destinations, defer)
                                        : execute_write(p->descriptors, const_object_spans_, destinations);
  const_object_spans_[gi] = {};
  return n;
}

}  // namespace kvbridge::store_internal
