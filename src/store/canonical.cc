// Canonical object layouts and the copies that fill and read objects.
//
// Why layouts: the planner already matches bytes by semantic coordinate across
// any TP size, block size, kernel ratio and axis order, merges what is
// contiguous and is checked by the verifier. Expressing the object as one more
// layout reuses all of that; this file only builds the layouts and executes
// the descriptors with memcpy.
#include "store/canonical.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "kvbridge/store_key.h"

namespace kvbridge::store_internal {
namespace {

std::string q(std::string_view s) { return "'" + std::string(s) + "'"; }

bool token_indexed(GroupKind k) { return k != GroupKind::kState; }

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

}  // namespace

bool is_stored(const Group& g) { return g.prefix_cacheable && g.transfer && g.kind != GroupKind::kScratch; }

Result<Canonical> Canonical::create(const Layout& rank, uint64_t H) {
  Canonical c;
  const std::vector<uint32_t> ids = group_ids(rank);
  c.read_.model = c.write_.model = rank.model;
  c.read_.dtype = c.write_.dtype = rank.dtype;
  c.read_.tp_size = 1;
  c.read_.tp_rank = 0;
  c.write_.tp_size = rank.tp_size;
  c.write_.tp_rank = rank.tp_rank;
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
                                        " is not a multiple of tokens_per_state " +
                                        std::to_string(g.tokens_per_state));
      }
      if (g.kind == GroupKind::kSlidingWindow && g.window_tokens && *g.window_tokens < H) {
        return Status::invalid_argument(where + ": hash_block_tokens " + std::to_string(H) +
                                        " exceeds window_tokens " + std::to_string(*g.window_tokens));
      }
      block_tokens = H;
    }
    Group cg;
    cg.name = g.name;
    cg.kind = g.kind;
    cg.block_tokens = block_tokens;
    cg.tokens_per_state = g.tokens_per_state;
    cg.window_tokens = g.window_tokens;
    cg.prefix_cacheable = g.prefix_cacheable;
    cg.transfer = false;
    cg.num_blocks = 1;
    geo.positions = token_indexed(g.kind) ? block_tokens / g.tokens_per_state : 1;
    Group wg = cg;
    uint64_t off = kHeaderBytes;
    for (size_t li = 0; li < g.layers.size(); ++li) {
      const Layer& layer = g.layers[li];
      Layer rl{layer.name, {}}, wl{layer.name, {}};
      for (const Component& comp : layer.components) {
        const uint64_t total = comp.heads ? comp.heads->total : 1;
        const uint64_t bytes = geo.positions * total * comp.cell_bytes;
        Component rc;
        rc.name = comp.name;
        rc.tensor = "store." + std::to_string(gi);
        rc.offset = off;
        rc.cell_bytes = comp.cell_bytes;
        rc.axes.push_back({AxisKind::kBlock, 1, 0});  // stride patched below
        if (token_indexed(g.kind)) rc.axes.push_back({AxisKind::kPosition, geo.positions, total * comp.cell_bytes});
        Component wc = rc;
        if (comp.heads) {
          rc.heads = HeadMap{comp.heads->total, 0, comp.heads->total};
          rc.axes.push_back({AxisKind::kHead, comp.heads->total, comp.cell_bytes});
          wc.heads = *comp.heads;
          wc.offset += uint64_t{comp.heads->first} * comp.cell_bytes;
          wc.axes.push_back({AxisKind::kHead, comp.heads->count, comp.cell_bytes});
          if (!writes_heads(rank, *comp.heads)) {
            geo.skip.push_back({off, off + bytes});
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
          geo.skip.push_back({off, off + bytes});
        } else {
          geo.part.push_back({off, off + bytes});
        }
        rl.components.push_back(std::move(rc));
        wl.components.push_back(std::move(wc));
        off += bytes;
      }
      cg.layers.push_back(std::move(rl));
      wg.layers.push_back(std::move(wl));
    }
    geo.object_bytes = off;
    // Merge adjacent skip ranges.
    std::vector<std::pair<uint64_t, uint64_t>> merged;
    for (const auto& r : geo.skip) {
      if (r.first == r.second) continue;
      if (!merged.empty() && merged.back().second == r.first) {
        merged.back().second = r.second;
      } else {
        merged.push_back(r);
      }
    }
    geo.skip = std::move(merged);
    merged.clear();
    for (const auto& r : geo.part) {
      if (!merged.empty() && merged.back().second == r.first) {
        merged.back().second = r.second;
      } else {
        merged.push_back(r);
      }
    }
    geo.part = std::move(merged);
    c.read_.tensors.push_back({"store." + std::to_string(gi), geo.object_bytes, "host"});
    c.read_.groups.push_back(std::move(cg));
    c.write_.groups.push_back(std::move(wg));
    c.geometry_.push_back(std::move(geo));
  }
  c.write_.tensors = c.read_.tensors;
  c.hash_block_tokens_ = H;
  c.put_plans_.resize(rank.groups.size());
  c.get_plans_.resize(rank.groups.size());
  for (size_t gi = 0; gi < rank.groups.size(); ++gi) {
    patch(c.read_, gi, 1, c.geometry_[gi].object_bytes);
    patch(c.write_, gi, 1, c.geometry_[gi].object_bytes);
    Layout view = rank;
    for (size_t gj = 0; gj < view.groups.size(); ++gj) view.groups[gj].transfer = gj == gi;
    c.rank_views_.push_back(std::move(view));
  }
  // The canonical layouts are built, not parsed: check them once, so a bug
  // here is an internal error rather than a wrong copy.
  for (const Layout* l : {&c.read_, &c.write_}) {
    Status s = validate(*l);
    if (!s.ok()) return Status::internal("canonical layout: " + s.message());
    s = check_compatible(rank, *l);
    if (!s.ok()) return Status::internal("canonical layout: " + s.message());
  }
  return c;
}

void Canonical::patch(Layout& layout, size_t gi, uint64_t objects, uint64_t object_bytes) {
  layout.tensors[gi].bytes = objects * object_bytes;
  Group& g = layout.groups[gi];
  g.num_blocks = objects;
  for (size_t gj = 0; gj < layout.groups.size(); ++gj) layout.groups[gj].transfer = gj == gi;
  for (Layer& l : g.layers) {
    for (Component& c : l.components) {
      for (Axis& a : c.axes) {
        if (a.kind == AxisKind::kBlock) {
          a.size = objects;
          a.stride = object_bytes;
        }
      }
    }
  }
}

const Layout& Canonical::read_view(size_t group, uint64_t objects) {
  patch(read_, group, objects, geometry_[group].object_bytes);
  return read_;
}

const Layout& Canonical::write_view(size_t group, uint64_t objects) {
  patch(write_, group, objects, geometry_[group].object_bytes);
  return write_;
}

const ObjectPlan* Canonical::object_plan(size_t gi, bool put, uint64_t phase) {
  const Group& g = rank_views_[gi].groups[gi];
  const bool state = g.kind == GroupKind::kState;
  auto& cache = put ? put_plans_[gi] : get_plans_[gi];
  const uint64_t phases = state ? 1 : g.block_tokens / hash_block_tokens_;
  if (cache.size() < phases) cache.resize(phases);
  if (phase >= phases) return nullptr;
  CachedPlan& c = cache[phase];
  if (c.built) return c.affine ? &c.plan : nullptr;
  c.built = true;
  if (g.num_blocks < 2) return nullptr;
  // Plan the object for rank blocks 0 and 1; the plan is affine when every
  // piece moves by one shift per rank tensor.
  std::vector<ObjectPlan::Piece> at[2];
  for (int b = 0; b < 2; ++b) {
    Request r;
    GroupBlocks& gb = r.blocks[g.name];
    std::vector<int64_t> canon = {0};
    if (state) {
      r.num_tokens = hash_block_tokens_;
    } else {
      r.num_tokens = (phase + 1) * hash_block_tokens_;
      r.skip_tokens = phase * hash_block_tokens_;
      canon.assign(phase + 1, -1);
      canon.back() = 0;
    }
    const std::vector<int64_t> ranks = {b};
    gb.local = put ? canon : ranks;
    gb.remote = put ? ranks : canon;
    Result<Plan> p = put ? plan(write_view(gi, 1), std::span<const Layout>(&rank_views_[gi], 1), r)
                         : plan(rank_views_[gi], std::span<const Layout>(&read_view(gi, 1), 1), r);
    if (!p.ok()) return nullptr;
    for (const Descriptor& d : p->descriptors) {
      ObjectPlan::Piece piece;
      piece.bytes = d.bytes;
      if (put) {
        piece.rank_tensor = d.remote_tensor;
        piece.rank_offset = d.remote_offset;
        piece.object_offset = d.local_offset;
      } else {
        piece.rank_tensor = d.local_tensor;
        piece.rank_offset = d.local_offset;
        piece.object_offset = d.remote_offset;
      }
      at[b].push_back(piece);
    }
  }
  if (at[0].size() != at[1].size()) return nullptr;
  std::vector<uint64_t> delta(rank_views_[gi].tensors.size(), 0);
  std::vector<uint8_t> seen(delta.size(), 0);
  for (size_t i = 0; i < at[0].size(); ++i) {
    const auto& a = at[0][i];
    const auto& b = at[1][i];
    if (a.rank_tensor != b.rank_tensor || a.object_offset != b.object_offset || a.bytes != b.bytes ||
        b.rank_offset < a.rank_offset) {
      return nullptr;
    }
    const uint64_t d = b.rank_offset - a.rank_offset;
    if (seen[a.rank_tensor] && delta[a.rank_tensor] != d) return nullptr;
    seen[a.rank_tensor] = 1;
    delta[a.rank_tensor] = d;
  }
  // Copy in object order: the object is read or written front to back.
  std::sort(at[0].begin(), at[0].end(),
            [](const ObjectPlan::Piece& x, const ObjectPlan::Piece& y) { return x.object_offset < y.object_offset; });
  c.plan.pieces = std::move(at[0]);
  c.plan.delta = std::move(delta);
  c.affine = true;
  return &c.plan;
}

uint64_t put_object(const ObjectPlan& p, TensorMemory rank, uint64_t block, uint8_t* object,
                    std::span<const std::pair<uint64_t, uint64_t>> skip) {
  uint64_t copied = 0;
  for (const ObjectPlan::Piece& x : p.pieces) {
    const uint8_t* src = rank[x.rank_tensor].data() + x.rank_offset + block * p.delta[x.rank_tensor];
    if (skip.empty()) {
      std::memcpy(object + x.object_offset, src, x.bytes);
      copied += x.bytes;
      continue;
    }
    const uint64_t stop = x.object_offset + x.bytes;
    uint64_t cur = x.object_offset;
    for (const auto& [s0, s1] : skip) {
      if (s1 <= cur) continue;
      if (s0 >= stop) break;
      if (s0 > cur) {
        std::memcpy(object + cur, src + (cur - x.object_offset), s0 - cur);
        copied += s0 - cur;
      }
      cur = std::max(cur, s1);
      if (cur >= stop) break;
    }
    if (cur < stop) {
      std::memcpy(object + cur, src + (cur - x.object_offset), stop - cur);
      copied += stop - cur;
    }
  }
  return copied;
}

uint64_t get_object(const ObjectPlan& p, TensorMemory rank, uint64_t block, const uint8_t* object) {
  uint64_t copied = 0;
  for (const ObjectPlan::Piece& x : p.pieces) {
    std::memcpy(rank[x.rank_tensor].data() + x.rank_offset + block * p.delta[x.rank_tensor],
                object + x.object_offset, x.bytes);
    copied += x.bytes;
  }
  return copied;
}

uint64_t copy_into_objects(const Plan& plan, TensorMemory rank, std::span<uint8_t* const> objects,
                           uint64_t object_bytes, std::span<const std::pair<uint64_t, uint64_t>> skip) {
  uint64_t copied = 0;
  for (const Descriptor& d : plan.descriptors) {
    uint64_t lo = d.local_offset, ro = d.remote_offset, n = d.bytes;
    const uint8_t* src = rank[d.remote_tensor].data();
    while (n > 0) {
      const uint64_t k = lo / object_bytes;
      const uint64_t in = lo % object_bytes;
      const uint64_t piece = std::min(n, object_bytes - in);
      // Copy the parts of [in, in + piece) outside the skipped ranges.
      const uint64_t stop = in + piece;
      uint64_t cur = in;
      for (const auto& [s0, s1] : skip) {
        if (s1 <= cur) continue;
        if (s0 >= stop) break;
        if (s0 > cur) {
          std::memcpy(objects[k] + cur, src + ro + (cur - in), s0 - cur);
          copied += s0 - cur;
        }
        cur = std::max(cur, s1);
        if (cur >= stop) break;
      }
      if (cur < stop) {
        std::memcpy(objects[k] + cur, src + ro + (cur - in), stop - cur);
        copied += stop - cur;
      }
      lo += piece;
      ro += piece;
      n -= piece;
    }
  }
  return copied;
}

uint64_t copy_from_objects(const Plan& plan, TensorMemory rank, std::span<const uint8_t* const> objects,
                           uint64_t object_bytes) {
  uint64_t copied = 0;
  for (const Descriptor& d : plan.descriptors) {
    uint64_t lo = d.local_offset, ro = d.remote_offset, n = d.bytes;
    uint8_t* dst = rank[d.local_tensor].data();
    while (n > 0) {
      const uint64_t k = ro / object_bytes;
      const uint64_t in = ro % object_bytes;
      const uint64_t piece = std::min(n, object_bytes - in);
      std::memcpy(dst + lo, objects[k] + in, piece);
      copied += piece;
      lo += piece;
      ro += piece;
      n -= piece;
    }
  }
  return copied;
}

}  // namespace kvbridge::store_internal
