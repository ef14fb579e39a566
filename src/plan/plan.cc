// plan(): units, the order of emission, and merging (the pieces themselves
// are emitted by plan/emit.h, shared with plan templates).
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

#include "common/text.h"
#include "plan/emit.h"

namespace kvbridge {
namespace plan_internal {
namespace {

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
  return !b.empty() && b.tensor == first.tensor && b.axes == first.axes && b.heads == first.heads && b.offset == end;
}

}  // namespace

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
      u.block_is_segment =
          m.local_ppb == m.remote_ppb && u.local.inner_size() == m.local_ppb && u.remote_inner == m.remote_ppb;
      units.push_back(std::move(u));
      c = last + 1;
    }
  }
  // Units of one local tensor in address order.
  std::stable_sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) {
    return a.local.tensor != b.local.tensor ? a.local.tensor < b.local.tensor : a.local.offset < b.local.offset;
  });
  return units;
}

std::vector<UnitRun> unit_runs(std::span<const Unit> units) {
  std::vector<UnitRun> runs;
  for (size_t s = 0; s < units.size();) {
    size_t t = s;
    while (t < units.size() && units[t].local.tensor == units[s].local.tensor) ++t;
    const bool block_outer =
        t - s > 1 && units[t - 1].local.offset - units[s].local.offset < units[s].local.block_stride;
    runs.push_back({s, t, block_outer});
    s = t;
  }
  return runs;
}

namespace {

Status emit_group(Emitter& e, const Layout& local, std::span<const Layout> remotes, std::span<const uint16_t> by_rank,
                  const GroupMove& m) {
  if (m.end <= m.begin) return Status();
  KVB_ASSIGN_OR_RETURN(std::vector<Unit> units, make_units(local, remotes, by_rank, m));
  // Local list entries with moving positions, in ascending local block id, so
  // that a layer-major tensor is visited in address order.
  std::vector<uint64_t> entries;
  for (uint64_t i = first_entry(m); i < end_entry(m); ++i) entries.push_back(i);
  std::stable_sort(entries.begin(), entries.end(),
                   [&](uint64_t a, uint64_t b) { return m.local_ids[a] < m.local_ids[b]; });
  // Reserve for the pieces if nothing merged, so that a plan that cannot
  // merge (shuffled ids) never reallocates; the slack is returned at the end.
  uint64_t pieces = 0;
  for (const Unit& u : units) {
    const uint64_t per_block = u.block_is_segment ? 1 : m.local_ppb / std::min(u.local.inner_size(), u.remote_inner);
    pieces += entries.size() * u.runs.size() * std::max<uint64_t>(per_block, 1);
  }
  e.reserve(std::min<uint64_t>(pieces, uint64_t{1} << 26));
  for (const UnitRun& run : unit_runs(units)) {
    if (run.block_outer) {
      for (uint64_t i : entries)
        for (size_t k = run.begin; k < run.end; ++k) emit_block(e, m, units[k], i);
    } else {
      for (size_t k = run.begin; k < run.end; ++k)
        for (uint64_t i : entries) emit_block(e, m, units[k], i);
    }
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
  std::vector<size_t> start(tensors + 1, 0);
  for (const Descriptor& d : ds) ++start[d.local_tensor + 1];
  std::partial_sum(start.begin(), start.end(), start.begin());
  std::vector<Descriptor> out(ds.size());
  for (const Descriptor& d : ds) out[start[d.local_tensor]++] = d;
  ds.swap(out);
}

}  // namespace

Status finish_plan(const Layout& local, const EmitOrder& order, Plan& p) {
  if (order.unordered) {
    KVB_RETURN_IF_ERROR(sort_and_merge(local, p.descriptors));
    for (SourceTotals& t : p.sources) t.descriptors = 0;
    for (const Descriptor& d : p.descriptors) p.sources[d.source].descriptors += 1;
  } else if (!order.by_tensor) {
    order_by_tensor(local.tensors.size(), p.descriptors);
  }
  p.bytes = 0;
  for (const SourceTotals& t : p.sources) p.bytes += t.bytes;
  return Status();
}

}  // namespace plan_internal

Result<Plan> plan(const Layout& local, std::span<const Layout> remotes, const Request& request) {
  using namespace plan_internal;
  KVB_ASSIGN_OR_RETURN(std::vector<uint16_t> by_rank, check_remotes(local, remotes));
  KVB_ASSIGN_OR_RETURN(std::vector<GroupMove> moves, group_moves(local, remotes, request));
  Plan p;
  p.sources.resize(remotes.size());
  for (size_t r = 0; r < remotes.size(); ++r) p.sources[r].tp_rank = remotes[r].tp_rank;
  Emitter e(local.tensors.size(), &p.descriptors, &p.sources);
  for (const GroupMove& m : moves) {
    KVB_RETURN_IF_ERROR(emit_group(e, local, remotes, by_rank, m));
  }
  KVB_RETURN_IF_ERROR(finish_plan(local, e.order(), p));
  if (p.descriptors.capacity() > p.descriptors.size() + p.descriptors.size() / 8) p.descriptors.shrink_to_fit();
  return p;
}

Result<std::vector<PlanChunk>> plan_chunks(const Layout& local, std::span<const Layout> remotes, const Request& request,
                                           uint64_t chunk_tokens) {
  using namespace plan_internal;
  KVB_ASSIGN_OR_RETURN(std::vector<uint16_t> by_rank, check_remotes(local, remotes));
  KVB_ASSIGN_OR_RETURN(std::vector<GroupMove> moves, group_moves(local, remotes, request));
  const uint64_t skip = request.skip_tokens, n = request.num_tokens;
  // Resumable from a chunk's first token only when every moving group keeps
  // the KV of every token (attention), or moved its window from skip.
  bool resumable = chunk_tokens > 0 && skip < n;
  uint64_t align = 1;
  for (const GroupMove& m : moves) {
    const Group& g = local.groups[m.local_group];
    if (m.end <= m.begin) continue;
    if (g.kind == GroupKind::kState || g.kind == GroupKind::kScratch ||
        (g.kind == GroupKind::kSlidingWindow && n > skip + *g.window_tokens)) {
      resumable = false;
      break;
    }
    for (uint64_t bt : {g.block_tokens, remotes[0].groups[m.remote_group[0]].block_tokens}) {
      const uint64_t l = std::lcm(align, bt);
      if (l <= (uint64_t{1} << 24)) align = l;
    }
  }
  auto chunk = [&](uint64_t first, uint64_t end, bool whole) -> Result<PlanChunk> {
    PlanChunk c;
    c.first_token = first;
    c.end_token = end;
    c.resume_token = whole ? skip : first;
    c.plan.sources.resize(remotes.size());
    for (size_t r = 0; r < remotes.size(); ++r) c.plan.sources[r].tp_rank = remotes[r].tp_rank;
    Emitter e(local.tensors.size(), &c.plan.descriptors, &c.plan.sources);
    for (GroupMove& m : moves) {
      const Group& g = local.groups[m.local_group];
      const uint64_t begin = m.begin, stop = m.end;
      if (!whole && token_indexed(g.kind)) {
        const uint64_t tps = g.tokens_per_state;
        if (first > skip) m.begin = std::max(m.begin, first / tps + (first % tps != 0));
        if (end < n) m.end = std::min(m.end, end / tps + (end % tps != 0));
      }
      const Status s = emit_group(e, local, remotes, by_rank, m);
      m.begin = begin;
      m.end = stop;
      KVB_RETURN_IF_ERROR(s);
    }
    KVB_RETURN_IF_ERROR(finish_plan(local, e.order(), c.plan));
    return c;
  };
  std::vector<PlanChunk> out;
  if (!resumable) {
    KVB_ASSIGN_OR_RETURN(PlanChunk c, chunk(skip, n, true));
    out.push_back(std::move(c));
    return out;
  }
  const uint64_t step = (chunk_tokens + align - 1) / align * align;
  for (uint64_t first = skip; first < n;) {
    const uint64_t end = std::min(n, (first / step + 1) * step);
    KVB_ASSIGN_OR_RETURN(PlanChunk c, chunk(first, end, false));
    if (!c.plan.descriptors.empty() || out.empty())
      out.push_back(std::move(c));
    else
      out.back().end_token = end;
    first = end;
  }
  return out;
}

uint64_t naive_descriptor_count(const Layout& local, std::span<const Layout> remotes, const Request& request) {
  using plan_internal::GroupMove;
  using plan_internal::HeadRun;
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
