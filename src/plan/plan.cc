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
#include <map>
#include <numeric>
#include <optional>
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
                                     std::span<const uint16_t> by_rank, const GroupMove& m,
                                     std::span<const uint8_t> layers) {
  const Group& g = local.groups[m.local_group];
  std::vector<Unit> units;
  for (size_t l = 0; l < g.layers.size(); ++l) {
    if (!layers.empty() && layers[l] == 0) continue;
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
          // A rank that holds none of the run (another pipeline stage's
          // layer) never serves it, so its geometry does not matter.
          const auto& rc = remotes[r].groups[m.remote_group[r]].layers[l].components;
          ok = rc[c].empty() || continues(rc[c], rc[c].offset + rcell[r], rc[n]);
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

// Local list entries of m's [begin, end), in ascending local block id, so
// that a layer-major tensor is visited in address order.
std::vector<uint64_t> sorted_entries(const GroupMove& m) {
  std::vector<uint64_t> entries;
  for (uint64_t i = first_entry(m); i < end_entry(m); ++i) entries.push_back(i);
  std::stable_sort(entries.begin(), entries.end(),
                   [&](uint64_t a, uint64_t b) { return m.local_ids[a] < m.local_ids[b]; });
  return entries;
}

// Emits a context-sharded group move (m's positions are global): piece by
// piece (context_pieces()), each from the units of its remote shard. Units
// of every shard have the same local geometry and order (make_units()
// depends on the shard only for the head runs), so unit k of one shard is
// unit k of another.
Status emit_sharded(Emitter& e, const Layout& local, std::span<const Layout> remotes, std::span<const uint16_t> by_rank,
                    GroupMove& m, std::span<const uint8_t> layers) {
  const std::vector<ContextPiece> pieces = context_pieces(m);
  if (pieces.empty()) return Status();
  std::vector<std::vector<Unit>> units(m.remote_cp.size);
  for (const ContextPiece& piece : pieces) {
    if (!units[piece.shard].empty()) continue;
    m.shard = piece.shard;
    KVB_ASSIGN_OR_RETURN(units[piece.shard], make_units(local, remotes, by_rank, m, layers));
    if (units[piece.shard].empty()) return Status();
  }
  const std::vector<Unit>& shape = units[pieces.front().shard];
  // Each piece's entries, sorted once (every unit visits them).
  std::vector<std::vector<uint64_t>> entries;
  for (const ContextPiece& piece : pieces) {
    m.begin = piece.begin, m.end = piece.end;
    entries.push_back(sorted_entries(m));
  }
  auto each_piece = [&](auto&& fn) {
    for (size_t k = 0; k < pieces.size(); ++k) {
      const ContextPiece& piece = pieces[k];
      m.begin = piece.begin, m.end = piece.end, m.delta = piece.delta, m.shard = piece.shard;
      for (uint64_t i : entries[k]) fn(units[piece.shard], i);
    }
  };
  for (const UnitRun& run : unit_runs(shape)) {
    if (run.block_outer) {
      each_piece([&](const std::vector<Unit>& us, uint64_t i) {
        for (size_t k = run.begin; k < run.end; ++k) emit_block(e, m, us[k], i);
      });
    } else {
      for (size_t k = run.begin; k < run.end; ++k) {
        each_piece([&](const std::vector<Unit>& us, uint64_t i) { emit_block(e, m, us[k], i); });
      }
    }
  }
  return Status();
}

// Emits one group move; with `layers` (one flag per layer of the local
// group), only the layers flagged. m's range and piece fields are restored
// on return.
Status emit_group(Emitter& e, const Layout& local, std::span<const Layout> remotes, std::span<const uint16_t> by_rank,
                  GroupMove& m, std::span<const uint8_t> layers = {}) {
  if (m.end <= m.begin) return Status();
  if (m.context_sharded()) {
    const uint64_t begin = m.begin, end = m.end;
    const Status s = emit_sharded(e, local, remotes, by_rank, m, layers);
    m.begin = begin, m.end = end, m.delta = 0, m.shard = 0;
    return s;
  }
  KVB_ASSIGN_OR_RETURN(std::vector<Unit> units, make_units(local, remotes, by_rank, m, layers));
  if (units.empty()) return Status();
  const std::vector<uint64_t> entries = sorted_entries(m);
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
  for (size_t r = 0; r < remotes.size(); ++r)
    p.sources[r].tp_rank = remotes[r].tp_rank, p.sources[r].pp_rank = remotes[r].pp_rank;
  Emitter e(local.tensors.size(), &p.descriptors, &p.sources);
  for (GroupMove& m : moves) {
    KVB_RETURN_IF_ERROR(emit_group(e, local, remotes, by_rank, m));
  }
  KVB_RETURN_IF_ERROR(finish_plan(local, e.order(), p));
  if (p.descriptors.capacity() > p.descriptors.size() + p.descriptors.size() / 8) p.descriptors.shrink_to_fit();
  return p;
}

namespace {

// The token ranges plan_chunks() cuts a request into (plan.h): `whole` when
// it is not resumable (one range, every position of every group).
struct Cuts {
  bool whole = true;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
};

Cuts cut_tokens(const Layout& local, std::span<const Layout> remotes, std::span<const plan_internal::GroupMove> moves,
                const Request& request, uint64_t chunk_tokens) {
  const uint64_t skip = request.skip_tokens, n = request.num_tokens;
  // Resumable from a chunk's first token only when every moving group keeps
  // the KV of every token (attention), or moved its window from skip.
  bool resumable = chunk_tokens > 0 && skip < n;
  uint64_t align = 1;
  for (const plan_internal::GroupMove& m : moves) {
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
  Cuts cuts;
  if (!resumable) {
    cuts.ranges.emplace_back(skip, n);
    return cuts;
  }
  cuts.whole = false;
  const uint64_t step = (chunk_tokens + align - 1) / align * align;
  for (uint64_t first = skip; first < n;) {
    const uint64_t end = std::min(n, (first / step + 1) * step);
    cuts.ranges.emplace_back(first, end);
    first = end;
  }
  return cuts;
}

// The plan of `cut`: the positions of its tokens (every position when
// whole), of the layers its masks flag (no masks: every layer).
Result<Plan> plan_part(const Layout& local, std::span<const Layout> remotes, std::span<const uint16_t> by_rank,
                       std::span<plan_internal::GroupMove> moves, const Request& request,
                       const plan_internal::StageCut& cut) {
  using namespace plan_internal;
  Plan p;
  p.sources.resize(remotes.size());
  for (size_t r = 0; r < remotes.size(); ++r)
    p.sources[r].tp_rank = remotes[r].tp_rank, p.sources[r].pp_rank = remotes[r].pp_rank;
  Emitter e(local.tensors.size(), &p.descriptors, &p.sources);
  for (size_t k = 0; k < moves.size(); ++k) {
    GroupMove& m = moves[k];
    const uint64_t begin = m.begin, stop = m.end;
    narrow_to_cut(local, request, cut, m);
    const Status s =
        emit_group(e, local, remotes, by_rank, m, cut.masks.empty() ? std::span<const uint8_t>() : cut.masks[k]);
    m.begin = begin;
    m.end = stop;
    KVB_RETURN_IF_ERROR(s);
  }
  KVB_RETURN_IF_ERROR(finish_plan(local, e.order(), p));
  return p;
}

}  // namespace

Result<std::vector<PlanChunk>> plan_chunks(const Layout& local, std::span<const Layout> remotes, const Request& request,
                                           uint64_t chunk_tokens) {
  using namespace plan_internal;
  KVB_ASSIGN_OR_RETURN(std::vector<uint16_t> by_rank, check_remotes(local, remotes));
  KVB_ASSIGN_OR_RETURN(std::vector<GroupMove> moves, group_moves(local, remotes, request));
  const Cuts cuts = cut_tokens(local, remotes, moves, request, chunk_tokens);
  std::vector<PlanChunk> out;
  for (const auto& [first, end] : cuts.ranges) {
    const StageCut cut{first, end, cuts.whole, 0, 0, {}};
    KVB_ASSIGN_OR_RETURN(Plan p, plan_part(local, remotes, by_rank, moves, request, cut));
    if (!p.descriptors.empty() || out.empty()) {
      out.push_back(PlanChunk{first, end, cuts.whole ? request.skip_tokens : first, std::move(p)});
    } else {
      out.back().end_token = end;
    }
  }
  return out;
}

namespace plan_internal {

std::vector<StageCut> stage_cuts(const Layout& local, std::span<const Layout> remotes, std::span<const GroupMove> moves,
                                 const Request& request, const StageOptions& options,
                                 const std::vector<std::string>& order) {
  const size_t layers = std::max<size_t>(order.size(), 1);
  const size_t per = options.layers_per_stage == 0 ? layers : options.layers_per_stage;
  std::map<std::string_view, size_t> ordinal;
  for (size_t i = 0; i < order.size(); ++i) ordinal.emplace(order[i], i);
  const Cuts cuts = cut_tokens(local, remotes, moves, request, options.chunk_tokens);
  std::vector<StageCut> out;
  for (const auto& [first, end] : cuts.ranges) {
    for (size_t begin_layer = 0; begin_layer < layers; begin_layer += per) {
      StageCut c{first, end, cuts.whole, begin_layer, std::min(order.size(), begin_layer + per), {}};
      c.masks.resize(moves.size());
      for (size_t k = 0; k < moves.size(); ++k) {
        const Group& g = local.groups[moves[k].local_group];
        c.masks[k].assign(g.layers.size(), 0);
        for (size_t l = 0; l < g.layers.size(); ++l) {
          const size_t o = ordinal.at(g.layers[l].name);
          c.masks[k][l] = o >= c.begin_layer && o < c.end_layer;
        }
      }
      out.push_back(std::move(c));
    }
  }
  return out;
}

void narrow_to_cut(const Layout& local, const Request& request, const StageCut& cut, GroupMove& m) {
  const Group& g = local.groups[m.local_group];
  if (cut.whole || !token_indexed(g.kind)) return;
  const uint64_t tps = g.tokens_per_state;
  if (cut.first > request.skip_tokens) m.begin = std::max(m.begin, cut.first / tps + (cut.first % tps != 0));
  if (cut.end < request.num_tokens) m.end = std::min(m.end, cut.end / tps + (cut.end % tps != 0));
}

PlanStage stage_header(std::span<const Layout> remotes, const Request& request, const StageCut& cut,
                       const std::vector<std::string>& order) {
  PlanStage s;
  s.first_layer = static_cast<uint32_t>(cut.begin_layer);
  s.end_layer = static_cast<uint32_t>(cut.end_layer);
  s.layers.assign(order.begin() + static_cast<std::ptrdiff_t>(cut.begin_layer),
                  order.begin() + static_cast<std::ptrdiff_t>(cut.end_layer));
  s.first_token = cut.first;
  s.end_token = cut.end;
  s.resume_token = cut.whole ? request.skip_tokens : cut.first;
  s.plan.sources.resize(remotes.size());
  for (size_t r = 0; r < remotes.size(); ++r)
    s.plan.sources[r].tp_rank = remotes[r].tp_rank, s.plan.sources[r].pp_rank = remotes[r].pp_rank;
  return s;
}

PlanStage empty_stage(const Layout& local, std::span<const Layout> remotes, const Request& request) {
  PlanStage s;
  s.layers = layer_order(local);
  s.end_layer = static_cast<uint32_t>(s.layers.size());
  s.first_token = s.resume_token = request.skip_tokens;
  s.end_token = std::max(request.skip_tokens, request.num_tokens);
  s.plan.sources.resize(remotes.size());
  for (size_t r = 0; r < remotes.size(); ++r)
    s.plan.sources[r].tp_rank = remotes[r].tp_rank, s.plan.sources[r].pp_rank = remotes[r].pp_rank;
  return s;
}

}  // namespace plan_internal

Result<std::vector<PlanStage>> plan_stages(const Layout& local, std::span<const Layout> remotes, const Request& request,
                                           const StageOptions& options) {
  using namespace plan_internal;
  KVB_ASSIGN_OR_RETURN(std::vector<uint16_t> by_rank, check_remotes(local, remotes));
  KVB_ASSIGN_OR_RETURN(std::vector<GroupMove> moves, group_moves(local, remotes, request));
  std::vector<PlanStage> out;
  const std::vector<std::string> order = layer_order(local);
  for (const StageCut& cut : stage_cuts(local, remotes, moves, request, options, order)) {
    KVB_ASSIGN_OR_RETURN(Plan p, plan_part(local, remotes, by_rank, moves, request, cut));
    if (p.descriptors.empty()) continue;
    PlanStage s = stage_header(remotes, request, cut, order);
    s.plan = std::move(p);
    out.push_back(std::move(s));
  }
  if (out.empty()) out.push_back(empty_stage(local, remotes, request));
  return out;
}

uint64_t naive_descriptor_count(const Layout& local, std::span<const Layout> remotes, const Request& request) {
  using plan_internal::HeadRun;
  auto by_rank = plan_internal::check_remotes(local, remotes);
  if (!by_rank) return 0;
  auto moves = plan_internal::group_moves(local, remotes, request);
  if (!moves) return 0;
  uint64_t total = 0;
  for (plan_internal::GroupMove& m : *moves) {
    for (const plan_internal::ContextPiece& piece : plan_internal::context_pieces(m)) {
      // Block pairs with moving positions.
      uint64_t pairs = 0;
      for (uint64_t i = piece.begin / m.local_ppb; i * m.local_ppb < piece.end; ++i) {
        const uint64_t a = std::max(piece.begin, i * m.local_ppb), b = std::min(piece.end, (i + 1) * m.local_ppb);
        pairs += (b - 1 + piece.delta) / m.remote_ppb - (a + piece.delta) / m.remote_ppb + 1;
      }
      m.shard = piece.shard;
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
  }
  return total;
}

}  // namespace kvbridge
