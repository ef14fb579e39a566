// plan(): emission of descriptors by semantic coordinate, with merging.
//
// The work is organised around "units": one component of one layer, or a run
// of components that both sides pack side by side in one cell (K|V, latent|
// rope), which are then moved as one wider cell. For each unit, each run of
// heads served by one remote rank, each block pair and each segment of
// positions that crosses no kernel page on either side, both addresses are
// affine in (position, head, byte). The segment's dimensions are coalesced
// (a dimension whose stride equals the bytes already contiguous on BOTH sides
// joins the run), and what is left is emitted as pieces.
//
// Pieces are merged as they are emitted with the last descriptor of the same
// local tensor. Units and blocks are visited in local address order (block ids
// sorted, block-major rows block-outer), so that merging with the last
// descriptor is complete. When a layout defeats that order (detected: an
// emitted piece starts before the end of its tensor's last descriptor), the
// descriptors are sorted by local address and merged again, which is complete
// for any order because local ranges never overlap. Either way no mergeable
// pair is left: the plan is minimal.
#include <algorithm>
#include <numeric>
#include <string>

#include "plan/internal.h"

namespace kvbridge {
namespace {

using plan_internal::GroupMove;
using plan_internal::HeadRun;

std::string q(std::string_view s) { return "'" + std::string(s) + "'"; }

// One side's geometry of a unit, with position axes coalesced: adjacent axes
// (outer o, inner i) with o.stride == i.size * i.stride become one, and
// size-1 axes are dropped.
struct Side {
  uint16_t tensor = 0;
  uint64_t offset = 0;
  uint64_t block_stride = 0;
  uint64_t head_stride = 0;
  uint64_t pos_sizes[kMaxPositionAxes] = {};
  uint64_t pos_strides[kMaxPositionAxes] = {};
  uint32_t pos_axes = 0;

  uint64_t inner_size() const { return pos_axes ? pos_sizes[pos_axes - 1] : 1; }
  uint64_t inner_stride() const { return pos_axes ? pos_strides[pos_axes - 1] : 0; }
  uint64_t outer_stride() const { return pos_axes ? pos_strides[0] : 0; }
  uint64_t pos_offset(uint64_t p) const {
    if (pos_axes == 1) return p * pos_strides[0];
    uint64_t off = 0;
    for (uint32_t i = pos_axes; i-- > 0;) {
      off += (p % pos_sizes[i]) * pos_strides[i];
      p /= pos_sizes[i];
    }
    return off;
  }
};

Side make_side(const Layout& layout, const Component& c) {
  Side s;
  s.tensor = static_cast<uint16_t>(layout.find_tensor(c.tensor) - layout.tensors.data());
  s.offset = c.offset;
  for (const Axis& a : c.axes) {
    if (a.kind == AxisKind::kBlock) s.block_stride = a.stride;
    if (a.kind == AxisKind::kHead) s.head_stride = a.stride;
    if (a.kind != AxisKind::kPosition || a.size == 1) continue;
    if (s.pos_axes > 0 && s.pos_strides[s.pos_axes - 1] == a.size * a.stride) {
      s.pos_sizes[s.pos_axes - 1] *= a.size;
      s.pos_strides[s.pos_axes - 1] = a.stride;
    } else {
      s.pos_sizes[s.pos_axes] = a.size;
      s.pos_strides[s.pos_axes] = a.stride;
      ++s.pos_axes;
    }
  }
  return s;
}

// Component b continues the cell of the run [first..] ending at `end` in the
// same layer on this side: same tensor, same axes and heads, and starts where
// the run's cell ends.
bool continues(const Component& first, uint64_t end, const Component& b) {
  return !b.empty() && b.tensor == first.tensor && b.axes == first.axes && b.heads == first.heads &&
         b.offset == end;
}

struct Unit {
  size_t layer = 0;
  uint64_t cell_bytes = 0;
  Side local;
  std::vector<Side> remote;  // per remote layout index (only sources are used)
  std::vector<HeadRun> runs;
  uint64_t remote_inner = 1;  // gcd of the sources' inner position axis sizes
  // A whole local block is one segment: one block and one inner run on both
  // sides, of the same size (the common case; emitted without divisions).
  bool block_is_segment = false;
};

class Emitter {
 public:
  Emitter(size_t local_tensors, std::vector<Descriptor>* out, std::vector<SourceTotals>* totals)
      : last_(local_tensors, -1), out_(out), totals_(totals) {}

  void emit(uint16_t src, uint16_t lt, uint64_t lo, uint16_t rt, uint64_t ro, uint64_t n) {
    (*totals_)[src].bytes += n;
    int64_t& li = last_[lt];
    if (li >= 0) {
      Descriptor& d = (*out_)[static_cast<size_t>(li)];
      const uint64_t end = d.local_offset + d.bytes;
      if (lo == end && d.source == src && d.remote_tensor == rt && d.remote_offset + d.bytes == ro) {
        d.bytes += n;
        return;
      }
      if (lo < end) unordered_ = true;
    }
    li = static_cast<int64_t>(out_->size());
    out_->push_back({src, lt, rt, 0, lo, ro, n});
    (*totals_)[src].descriptors += 1;
  }

  bool unordered() const { return unordered_; }
  void reserve(uint64_t more) { out_->reserve(out_->size() + more); }

 private:
  std::vector<int64_t> last_;
  std::vector<Descriptor>* out_;
  std::vector<SourceTotals>* totals_;  // per source: bytes, descriptors emitted
  bool unordered_ = false;
};

// Emits the pieces of one segment: positions [0, n) from local/remote start
// offsets, with per-position strides, for heads of one run.
inline void emit_segment(Emitter& e, const Unit& u, const HeadRun& run, uint64_t lo, uint64_t ro, uint64_t n) {
  const Side& L = u.local;
  const Side& R = u.remote[run.source];
  const uint64_t sl = L.inner_stride(), sr = R.inner_stride();
  const uint64_t hl = L.head_stride, hr = R.head_stride;
  const uint64_t nh = run.count;
  uint64_t len = u.cell_bytes;
  bool p_left = n > 1, h_left = nh > 1;
  for (int i = 0; i < 2; ++i) {
    if (p_left && sl == len && sr == len) {
      len *= n;
      p_left = false;
    } else if (h_left && hl == len && hr == len) {
      len *= nh;
      h_left = false;
    }
  }
  const uint16_t src = run.source, lt = L.tensor, rt = R.tensor;
  if (!p_left && !h_left) {
    e.emit(src, lt, lo, rt, ro, len);
  } else if (!h_left) {
    for (uint64_t k = 0; k < n; ++k) e.emit(src, lt, lo + k * sl, rt, ro + k * sr, len);
  } else if (!p_left) {
    for (uint64_t k = 0; k < nh; ++k) e.emit(src, lt, lo + k * hl, rt, ro + k * hr, len);
  } else if (hl > sl) {
    for (uint64_t h = 0; h < nh; ++h)
      for (uint64_t k = 0; k < n; ++k) e.emit(src, lt, lo + h * hl + k * sl, rt, ro + h * hr + k * sr, len);
  } else {
    for (uint64_t k = 0; k < n; ++k)
      for (uint64_t h = 0; h < nh; ++h) e.emit(src, lt, lo + h * hl + k * sl, rt, ro + h * hr + k * sr, len);
  }
}

// Emits every piece of unit `u` for local list entry `i`.
void emit_block(Emitter& e, const GroupMove& m, const Unit& u, uint64_t i) {
  const uint64_t lb = static_cast<uint64_t>(m.local_ids[i]);
  const uint64_t p_begin = std::max(m.begin, i * m.local_ppb);
  const uint64_t p_end = std::min(m.end, (i + 1) * m.local_ppb);
  const Side& L = u.local;
  if (u.block_is_segment && p_end - p_begin == m.local_ppb) {
    // Position i * ppb starts the block on both sides (list entry i).
    const uint64_t rb = static_cast<uint64_t>(m.remote_ids[i]);
    const uint64_t lbase = L.offset + lb * L.block_stride;
    for (const HeadRun& run : u.runs) {
      const Side& R = u.remote[run.source];
      emit_segment(e, u, run, lbase + run.local_head * L.head_stride,
                   R.offset + rb * R.block_stride + run.remote_head * R.head_stride, m.local_ppb);
    }
    return;
  }
  const uint64_t kl = L.inner_size();
  const bool runs_outer = u.runs.size() > 1 && L.head_stride > L.outer_stride();
  auto segment = [&](const HeadRun& run, uint64_t p, uint64_t n) {
    const Side& R = u.remote[run.source];
    const uint64_t j = p / m.remote_ppb;
    const uint64_t rb = static_cast<uint64_t>(m.remote_ids[j]);
    const uint64_t lo = L.offset + lb * L.block_stride + L.pos_offset(p - i * m.local_ppb) + run.local_head * L.head_stride;
    const uint64_t ro = R.offset + rb * R.block_stride + R.pos_offset(p - j * m.remote_ppb) + run.remote_head * R.head_stride;
    emit_segment(e, u, run, lo, ro, n);
  };
  // Segments end at every local and remote kernel-page (inner axis) boundary;
  // block boundaries are among them.
  auto for_segments = [&](auto&& fn) {
    for (uint64_t p = p_begin; p < p_end;) {
      const uint64_t kr = u.remote_inner;
      uint64_t next = std::min({p_end, (p / kl + 1) * kl, (p / kr + 1) * kr});
      fn(p, next - p);
      p = next;
    }
  };
  if (runs_outer) {
    for (const HeadRun& run : u.runs) for_segments([&](uint64_t p, uint64_t n) { segment(run, p, n); });
  } else {
    for_segments([&](uint64_t p, uint64_t n) {
      for (const HeadRun& run : u.runs) segment(run, p, n);
    });
  }
}

// Builds the units of one group move: fused component runs per layer.
Result<std::vector<Unit>> make_units(const Layout& local, std::span<const Layout> remotes,
                                     std::span<const uint16_t> by_rank, const GroupMove& m) {
  const Group& g = local.groups[m.local_group];
  std::vector<Unit> units;
  for (size_t l = 0; l < g.layers.size(); ++l) {
    const std::vector<Component>& comps = g.layers[l].components;
    for (size_t c = 0; c < comps.size();) {
      if (comps[c].empty()) {
        ++c;
        continue;
      }
      // Extend the run while every side packs the next component right after.
      size_t last = c;
      uint64_t cell = comps[c].cell_bytes;
      std::vector<uint64_t> rcell(remotes.size());
      for (size_t r = 0; r < remotes.size(); ++r) {
        rcell[r] = remotes[r].groups[m.remote_group[r]].layers[l].components[c].cell_bytes;
      }
      while (last + 1 < comps.size()) {
        const size_t n = last + 1;
        bool ok = continues(comps[c], comps[c].offset + cell, comps[n]);
        for (size_t r = 0; ok && r < remotes.size(); ++r) {
          const auto& rc = remotes[r].groups[m.remote_group[r]].layers[l].components;
          ok = continues(rc[c], rc[c].offset + rcell[r], rc[n]);
        }
        if (!ok) break;
        cell += comps[n].cell_bytes;
        for (size_t r = 0; r < remotes.size(); ++r) {
          rcell[r] += remotes[r].groups[m.remote_group[r]].layers[l].components[n].cell_bytes;
        }
        last = n;
      }
      Unit u;
      u.layer = l;
      u.cell_bytes = cell;
      u.local = make_side(local, comps[c]);
      for (size_t r = 0; r < remotes.size(); ++r) {
        u.remote.push_back(make_side(remotes[r], remotes[r].groups[m.remote_group[r]].layers[l].components[c]));
      }
      KVB_ASSIGN_OR_RETURN(u.runs, plan_internal::head_runs(local, remotes, by_rank, m, l, c));
      u.remote_inner = 0;
      for (const HeadRun& run : u.runs) u.remote_inner = std::gcd(u.remote_inner, u.remote[run.source].inner_size());
      u.block_is_segment = m.local_ppb == m.remote_ppb && u.local.inner_size() == m.local_ppb &&
                           u.remote_inner == m.remote_ppb;
      units.push_back(std::move(u));
      c = last + 1;
    }
  }
  return units;
}

Status emit_group(Emitter& e, const Layout& local, std::span<const Layout> remotes, std::span<const uint16_t> by_rank,
                  const GroupMove& m) {
  if (m.end <= m.begin) return Status();
  KVB_ASSIGN_OR_RETURN(std::vector<Unit> units, make_units(local, remotes, by_rank, m));
  // Local list entries with moving positions, in ascending local block id, so
  // that a layer-major tensor is visited in address order.
  std::vector<uint64_t> entries;
  for (uint64_t i = m.begin / m.local_ppb; i * m.local_ppb < m.end; ++i) entries.push_back(i);
  std::stable_sort(entries.begin(), entries.end(),
                   [&](uint64_t a, uint64_t b) { return m.local_ids[a] < m.local_ids[b]; });
  // Units of one local tensor in address order; a block-major row (units of
  // one tensor closer together than a block) is walked block-outer.
  std::stable_sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) {
    return a.local.tensor != b.local.tensor ? a.local.tensor < b.local.tensor : a.local.offset < b.local.offset;
  });
  // Reserve for the pieces if nothing merged, so that a plan that cannot
  // merge (shuffled ids) never reallocates; the slack is returned at the end.
  uint64_t pieces = 0;
  for (const Unit& u : units) {
    const uint64_t per_block = u.block_is_segment ? 1 : m.local_ppb / std::min(u.local.inner_size(), u.remote_inner);
    pieces += entries.size() * u.runs.size() * std::max<uint64_t>(per_block, 1);
  }
  e.reserve(std::min<uint64_t>(pieces, uint64_t{1} << 26));
  for (size_t s = 0; s < units.size();) {
    size_t t = s;
    while (t < units.size() && units[t].local.tensor == units[s].local.tensor) ++t;
    const bool block_outer = t - s > 1 && units[t - 1].local.offset - units[s].local.offset < units[s].local.block_stride;
    if (block_outer) {
      for (uint64_t i : entries)
        for (size_t k = s; k < t; ++k) emit_block(e, m, units[k], i);
    } else {
      for (size_t k = s; k < t; ++k)
        for (uint64_t i : entries) emit_block(e, m, units[k], i);
    }
    s = t;
  }
  return Status();
}

// Sorts by local address and merges every contiguous pair; fails when two
// descriptors write the same local byte.
Status sort_and_merge(const Layout& local, std::vector<Descriptor>& ds) {
  std::sort(ds.begin(), ds.end(), [](const Descriptor& a, const Descriptor& b) {
    return a.local_tensor != b.local_tensor ? a.local_tensor < b.local_tensor : a.local_offset < b.local_offset;
  });
  size_t w = 0;
  for (size_t r = 0; r < ds.size(); ++r) {
    if (w > 0) {
      Descriptor& d = ds[w - 1];
      const Descriptor& n = ds[r];
      if (d.local_tensor == n.local_tensor) {
        const uint64_t end = d.local_offset + d.bytes;
        if (n.local_offset < end) {
          return Status::invalid_argument(
              "local tensor " + q(local.tensors[n.local_tensor].name) + " bytes [" + std::to_string(n.local_offset) +
              ", " + std::to_string(std::min(end, n.local_offset + n.bytes)) +
              ") would be written twice; is one block id given to two groups that alias the same bytes?");
        }
        if (n.local_offset == end && n.source == d.source && n.remote_tensor == d.remote_tensor &&
            n.remote_offset == d.remote_offset + d.bytes) {
          d.bytes += n.bytes;
          continue;
        }
      }
    }
    ds[w++] = ds[r];
  }
  ds.resize(w);
  return Status();
}

// Stable counting sort by local tensor (each tensor's run is already in
// address order).
void order_by_tensor(size_t tensors, std::vector<Descriptor>& ds) {
  bool sorted = true;
  for (size_t i = 1; i < ds.size() && sorted; ++i) sorted = ds[i - 1].local_tensor <= ds[i].local_tensor;
  if (sorted) return;
  std::vector<size_t> start(tensors + 1, 0);
  for (const Descriptor& d : ds) ++start[d.local_tensor + 1];
  std::partial_sum(start.begin(), start.end(), start.begin());
  std::vector<Descriptor> out(ds.size());
  for (const Descriptor& d : ds) out[start[d.local_tensor]++] = d;
  ds.swap(out);
}

}  // namespace

Result<Plan> plan(const Layout& local, std::span<const Layout> remotes, const Request& request) {
  KVB_ASSIGN_OR_RETURN(std::vector<uint16_t> by_rank, plan_internal::check_remotes(local, remotes));
  KVB_ASSIGN_OR_RETURN(std::vector<GroupMove> moves, plan_internal::group_moves(local, remotes, request));
  Plan p;
  p.sources.resize(remotes.size());
  for (size_t r = 0; r < remotes.size(); ++r) p.sources[r].tp_rank = remotes[r].tp_rank;
  Emitter e(local.tensors.size(), &p.descriptors, &p.sources);
  for (const GroupMove& m : moves) {
    KVB_RETURN_IF_ERROR(emit_group(e, local, remotes, by_rank, m));
  }
  if (e.unordered()) {
    KVB_RETURN_IF_ERROR(sort_and_merge(local, p.descriptors));
    for (SourceTotals& t : p.sources) t.descriptors = 0;
    for (const Descriptor& d : p.descriptors) p.sources[d.source].descriptors += 1;
  } else {
    order_by_tensor(local.tensors.size(), p.descriptors);
  }
  if (p.descriptors.capacity() > p.descriptors.size() + p.descriptors.size() / 8) p.descriptors.shrink_to_fit();
  for (const SourceTotals& t : p.sources) p.bytes += t.bytes;
  return p;
}

uint64_t naive_descriptor_count(const Layout& local, std::span<const Layout> remotes, const Request& request) {
  auto by_rank = plan_internal::check_remotes(local, remotes);
  if (!by_rank) return 0;
  auto moves = plan_internal::group_moves(local, remotes, request);
  if (!moves) return 0;
  uint64_t total = 0;
  for (const GroupMove& m : *moves) {
    if (m.end <= m.begin) continue;
    // Block pairs with moving positions.
    uint64_t pairs = 0;
    for (uint64_t i = m.begin / m.local_ppb; i * m.local_ppb < m.end; ++i) {
      const uint64_t a = std::max(m.begin, i * m.local_ppb), b = std::min(m.end, (i + 1) * m.local_ppb);
      pairs += (b - 1) / m.remote_ppb - a / m.remote_ppb + 1;
    }
    const Group& g = local.groups[m.local_group];
    for (size_t l = 0; l < g.layers.size(); ++l) {
      for (size_t c = 0; c < g.layers[l].components.size(); ++c) {
        if (g.layers[l].components[c].empty()) continue;
        auto runs = plan_internal::head_runs(local, remotes, *by_rank, m, l, c);
        if (!runs) return 0;
        std::vector<uint16_t> sources;
        for (const HeadRun& r : *runs) sources.push_back(r.source);
        std::sort(sources.begin(), sources.end());
        total += pairs * static_cast<uint64_t>(std::unique(sources.begin(), sources.end()) - sources.begin());
      }
    }
  }
  return total;
}

}  // namespace kvbridge
