// Building a plan template: see kvbridge/plan.h and plan/template.h.
//
// The template runs the planner's own emission (plan/emit.h) with a sink
// that supplies block id 0 and records, for every piece, the remote entry it
// reads and the block strides of both sides, so each piece's dependence on
// the ids is exactly what plan() would compute for them. Pieces that move
// together (same entries, same strides, contiguous on both sides) are held as
// one, which is what plan()'s Emitter would make of them for any ids.
//
// Entries are grouped into classes by their position range relative to their
// block and their alignment to remote blocks. That the pieces of an entry
// depend on nothing else is a property of emit_block(); rather than rely on
// it, the build records every entry and compares it with its class (the cost
// of one plan), and a template where some entry differs is not uniform and
// falls back to plan().
#include <algorithm>
#include <array>
#include <map>
#include <optional>
#include <string>

#include "common/text.h"
#include "plan/emit.h"
#include "plan/template.h"

namespace kvbridge {
namespace plan_internal {
namespace {

// Appends `p` to `pieces`, as one piece with the last when the two move
// together (same entries and strides on both sides, same source and remote
// tensor) and are contiguous on both sides: for any ids, plan()'s Emitter
// would merge them.
void append(std::vector<TemplatePiece>& pieces, const TemplatePiece& p) {
  if (!pieces.empty()) {
    TemplatePiece& b = pieces.back();
    if (b.source == p.source && b.remote_tensor == p.remote_tensor && b.local_stride == p.local_stride &&
        b.remote_stride == p.remote_stride && b.remote_entry == p.remote_entry &&
        b.local_offset + b.bytes == p.local_offset && b.remote_offset + b.bytes == p.remote_offset) {
      b.bytes += p.bytes;
      return;
    }
  }
  pieces.push_back(p);
}

// The emission sink of a template: block ids are 0, and each piece notes the
// strides and the remote entry (relative to the entry's first) it reads.
class Recorder {
 public:
  uint64_t local_base(const GroupMove&, uint64_t, const Side& L) {
    local_stride_ = L.block_stride;
    return L.offset;
  }
  uint64_t remote_base(const GroupMove&, uint64_t j, const Side& R) {
    remote_entry_ = j;
    remote_stride_ = R.block_stride;
    return R.offset;
  }
  void emit(uint16_t src, uint16_t, uint64_t lo, uint16_t rt, uint64_t ro, uint64_t n) {
    if (remote_entry_ < remote_first_ || remote_entry_ - remote_first_ > UINT32_MAX) {
      out_of_reach_ = true;
      return;
    }
    const auto rel = static_cast<uint32_t>(remote_entry_ - remote_first_);
    append(pieces_, {lo, ro, n, local_stride_, remote_stride_, rel, src, rt});
  }

  // Starts recording an entry whose first remote entry is `remote_first`.
  void start(uint64_t remote_first) {
    pieces_.clear();
    remote_first_ = remote_first;
    out_of_reach_ = false;
  }
  const std::vector<TemplatePiece>& pieces() const { return pieces_; }
  // A piece read a remote entry before the entry's first (never, by
  // emit_block()'s segments): the entry cannot be expressed as a class.
  bool out_of_reach() const { return out_of_reach_; }

 private:
  std::vector<TemplatePiece> pieces_;
  uint64_t remote_first_ = 0, remote_entry_ = 0;
  uint64_t local_stride_ = 0, remote_stride_ = 0;
  bool out_of_reach_ = false;
};

// The shape of a loop up to where it is: its classes and, per piece, what
// does not move when the loop is moved by fixed offsets (TemplateLoop::
// copy_of). Empty when its pieces read more than one remote tensor.
std::vector<uint64_t> loop_shape(const TemplateLoop& loop) {
  std::vector<uint64_t> shape(loop.program.begin(), loop.program.end());
  if (loop.pieces.empty()) return {};
  const TemplatePiece& p0 = loop.pieces.front();
  for (const TemplatePiece& p : loop.pieces) {
    if (p.remote_tensor != p0.remote_tensor) return {};
    shape.insert(shape.end(), {p.bytes, p.local_stride, p.remote_stride, p.remote_entry, p.source,
                               p.local_offset - p0.local_offset, p.remote_offset - p0.remote_offset});
  }
  return shape;
}

// Marks each loop that is an earlier loop moved by fixed offsets.
void find_copies(std::vector<TemplateLoop>& loops, ShiftTables* tables) {
  std::map<std::vector<uint64_t>, size_t> first_of_shape;
  for (size_t i = 0; i < loops.size(); ++i) {
    std::vector<uint64_t> shape = loop_shape(loops[i]);
    if (shape.empty()) continue;
    TemplateLoop& loop = loops[i];
    loop.remote_tensor = loop.pieces.front().remote_tensor;
    const auto [it, fresh] = first_of_shape.emplace(std::move(shape), i);
    if (fresh) continue;
    const TemplateLoop& original = loops[it->second];
    loop.copy_of = static_cast<int64_t>(it->second);
    loop.local_shift = loop.pieces.front().local_offset - original.pieces.front().local_offset;
    loop.remote_shift = loop.pieces.front().remote_offset - original.pieces.front().remote_offset;
  }
  // Runs of consecutive copies of one loop: a compact plan's table runs.
  for (size_t i = 0; i < loops.size();) {
    size_t j = i + 1;
    while (loops[i].copy_of >= 0 && j < loops.size() && loops[j].copy_of == loops[i].copy_of) ++j;
    if (j - i >= 2) {
      auto table = std::make_shared<std::vector<TensorShift>>();
      bool ascending = true;
      for (size_t k = i; k < j; ++k) {
        table->push_back({loops[k].local_tensor, loops[k].remote_tensor, loops[k].local_shift, loops[k].remote_shift});
        ascending = ascending && (k == i || loops[k].local_tensor >= loops[k - 1].local_tensor);
      }
      loops[i].copies_end = static_cast<uint32_t>(j);
      loops[i].copies = tables != nullptr ? tables->intern(std::move(*table)) : std::move(table);
      loops[i].copies_ascending = ascending;
    }
    i = j;
  }
}

// Loops of one local tensor can emit pieces out of local address order (a
// block-major row of K then V, each of every head): plan() then sorts and
// merges its descriptors again, and so would every instance. When all the
// pieces of the tensor move with one block stride S and, with several
// entries moving, all of an entry's pieces lie within S bytes, the address
// order of the pieces does not depend on the ids: entries in id order, each
// entry's pieces by offset. The loops then become one, holding each class's
// pieces in that order: its instances come out in address order, and merge
// to what plan() returns after its sort.
void order_by_address(std::vector<TemplateLoop>& loops, uint64_t entries) {
  std::vector<TemplateLoop> out;
  for (size_t i = 0; i < loops.size();) {
    size_t j = i + 1;
    while (j < loops.size() && loops[j].local_tensor == loops[i].local_tensor) ++j;
    const uint64_t stride = loops[i].pieces.empty() ? 0 : loops[i].pieces.front().local_stride;
    uint64_t lowest = UINT64_MAX, highest = 0;
    bool one_stride = true;
    for (size_t k = i; k < j; ++k) {
      for (const TemplatePiece& p : loops[k].pieces) {
        one_stride = one_stride && p.local_stride == stride;
        lowest = std::min(lowest, p.local_offset);
        highest = std::max(highest, p.local_offset + p.bytes);
      }
    }
    if (!one_stride || (entries > 1 && highest - lowest > stride)) {
      for (size_t k = i; k < j; ++k) out.push_back(std::move(loops[k]));
      i = j;
      continue;
    }
    TemplateLoop merged;
    merged.local_tensor = loops[i].local_tensor;
    std::vector<TemplatePiece> program;
    for (size_t c = 0; c + 1 < loops[i].program.size(); ++c) {
      program.clear();
      for (size_t k = i; k < j; ++k) {
        program.insert(program.end(), loops[k].pieces.begin() + loops[k].program[c],
                       loops[k].pieces.begin() + loops[k].program[c + 1]);
      }
      std::stable_sort(program.begin(), program.end(),
                       [](const TemplatePiece& a, const TemplatePiece& b) { return a.local_offset < b.local_offset; });
      merged.program.push_back(static_cast<uint32_t>(merged.pieces.size()));
      const size_t first = merged.pieces.size();
      for (const TemplatePiece& p : program) {
        // Only within the class's own pieces.
        if (merged.pieces.size() == first) {
          merged.pieces.push_back(p);
        } else {
          append(merged.pieces, p);
        }
      }
    }
    merged.program.push_back(static_cast<uint32_t>(merged.pieces.size()));
    out.push_back(std::move(merged));
    i = j;
  }
  loops = std::move(out);
}

// Builds the template of one group move. Returns false (and a reason) when
// some entry's pieces are not its class's.
bool build_move(const GroupMove& m, std::span<const Unit> units, const std::string& group, PlanTemplate::Impl& t,
                TemplateMove& tm, ShiftTables* tables) {
  const uint64_t e0 = first_entry(m), e1 = end_entry(m);
  tm.first_entry = e0;
  // Classes: the position range of an entry relative to its block, and where
  // it starts relative to a remote block.
  std::map<std::array<uint64_t, 3>, uint32_t> classes;
  std::vector<uint64_t> representative, members;
  for (uint64_t e = e0; e < e1; ++e) {
    const uint64_t pb = std::max(m.begin, e * m.local_ppb), pe = std::min(m.end, (e + 1) * m.local_ppb);
    const auto [it, fresh] = classes.emplace(std::array<uint64_t, 3>{pb - e * m.local_ppb, pe - pb, pb % m.remote_ppb},
                                             static_cast<uint32_t>(representative.size()));
    if (fresh) {
      representative.push_back(e);
      members.push_back(0);
    }
    ++members[it->second];
    tm.entry_class.push_back(it->second);
    tm.remote_first.push_back(pb / m.remote_ppb);
  }
  Recorder rec;
  auto record = [&](size_t k0, size_t k1, uint64_t e) {
    rec.start(tm.remote_first[e - e0]);
    for (size_t k = k0; k < k1; ++k) emit_block(rec, m, units[k], e);
    return !rec.out_of_reach();
  };
  auto fail = [&](uint64_t e, uint64_t rep) {
    t.uniform = false;
    t.fallback_reason = "group " + q(group) + " list entry " + std::to_string(e) +
                        ": its pieces are not those of entry " + std::to_string(rep) + " moved by its block ids";
    return false;
  };
  auto add_loop = [&](size_t k0, size_t k1) {
    TemplateLoop loop;
    loop.local_tensor = units[k0].local.tensor;
    for (uint64_t rep : representative) {
      if (!record(k0, k1, rep)) return fail(rep, rep);
      loop.program.push_back(static_cast<uint32_t>(loop.pieces.size()));
      loop.pieces.insert(loop.pieces.end(), rec.pieces().begin(), rec.pieces().end());
    }
    loop.program.push_back(static_cast<uint32_t>(loop.pieces.size()));
    // Every entry must be its class's program moved by its ids.
    for (uint64_t e = e0; e < e1; ++e) {
      const uint32_t c = tm.entry_class[e - e0];
      if (representative[c] == e) continue;
      const auto first = loop.pieces.begin() + loop.program[c], last = loop.pieces.begin() + loop.program[c + 1];
      if (!record(k0, k1, e) || !std::equal(first, last, rec.pieces().begin(), rec.pieces().end())) {
        return fail(e, representative[c]);
      }
    }
    tm.loops.push_back(std::move(loop));
    return true;
  };
  for (const UnitRun& run : unit_runs(units)) {
    if (run.block_outer) {
      if (!add_loop(run.begin, run.end)) return false;
    } else {
      for (size_t k = run.begin; k < run.end; ++k) {
        if (!add_loop(k, k + 1)) return false;
      }
    }
  }
  order_by_address(tm.loops, e1 - e0);
  find_copies(tm.loops, tables);
  for (TemplateLoop& loop : tm.loops) {
    for (size_t c = 0; c + 1 < loop.program.size(); ++c) {
      t.max_pieces += members[c] * (loop.program[c + 1] - loop.program[c]);
      for (uint32_t x = loop.program[c]; x < loop.program[c + 1]; ++x) {
        t.totals[loop.pieces[x].source].bytes += members[c] * loop.pieces[x].bytes;
      }
    }
    for (const TemplatePiece& p : loop.pieces) tm.remote_reads = std::max(tm.remote_reads, p.remote_entry + 1);
    loop.one_source = std::all_of(loop.pieces.begin(), loop.pieces.end(),
                                  [&](const TemplatePiece& p) { return p.source == loop.pieces.front().source; });
    loop.rigid = true;
    for (size_t c = 0; c + 1 < loop.program.size() && loop.rigid; ++c) {
      for (uint32_t x = loop.program[c] + 1; x < loop.program[c + 1] && loop.rigid; ++x) {
        const TemplatePiece& a = loop.pieces[x - 1];
        const TemplatePiece& b = loop.pieces[x];
        loop.rigid = a.local_stride == b.local_stride && a.remote_stride == b.remote_stride &&
                     a.remote_entry == b.remote_entry && a.local_offset + a.bytes <= b.local_offset &&
                     !(a.local_offset + a.bytes == b.local_offset && a.remote_offset + a.bytes == b.remote_offset &&
                       a.source == b.source && a.remote_tensor == b.remote_tensor);
      }
    }
    loop.one_piece =
        loop.pieces.size() + 1 == loop.program.size() &&
        std::all_of(loop.pieces.begin(), loop.pieces.end(), [](const TemplatePiece& p) { return p.remote_entry == 0; });
    t.pieces += loop.pieces.size();
  }
  return true;
}

}  // namespace

Result<Request> probe_request(const Layout& local, std::span<const Layout> remotes, const RequestShape& shape) {
  Request r;
  r.num_tokens = shape.num_tokens;
  r.skip_tokens = shape.skip_tokens;
  for (const auto& [name, gs] : shape.groups) {
    GroupBlocks& b = r.blocks[name];
    const Group* lg = local.find_group(name);
    const Group* rg = remotes.empty() ? nullptr : remotes.front().find_group(name);
    for (int side = 0; side < 2; ++side) {
      const std::vector<bool>& listed = side == 0 ? gs.local : gs.remote;
      const Group* g = side == 0 ? lg : rg;
      std::vector<int64_t>& ids = side == 0 ? b.local : b.remote;
      int64_t next = 0;
      for (bool l : listed) ids.push_back(l ? next++ : -1);
      if (g != nullptr && static_cast<uint64_t>(next) > g->num_blocks) {
        return Status::invalid_argument("group " + q(name) + " " + (side == 0 ? "local" : "remote") +
                                        " block list of the shape lists " + std::to_string(next) +
                                        " blocks but the group has num_blocks " + std::to_string(g->num_blocks) +
                                        "; no request of this shape is valid");
      }
    }
  }
  return r;
}

std::shared_ptr<const std::vector<TensorShift>> ShiftTables::intern(std::vector<TensorShift> table) {
  std::vector<uint64_t> key;
  key.reserve(3 * table.size());
  for (const TensorShift& m : table) {
    key.insert(key.end(), {uint64_t{m.local_tensor} << 16 | m.remote_tensor, m.local_shift, m.remote_shift});
  }
  auto [it, fresh] = tables_.try_emplace(std::move(key));
  if (fresh) it->second = std::make_shared<const std::vector<TensorShift>>(std::move(table));
  return it->second;
}

Result<StagePrep> prepare_stages(const Layout& local, std::span<const Layout> remotes, const RequestShape& shape) {
  StagePrep p;
  KVB_ASSIGN_OR_RETURN(p.probe, probe_request(local, remotes, shape));
  KVB_ASSIGN_OR_RETURN(p.by_rank, check_remotes(local, remotes));
  KVB_ASSIGN_OR_RETURN(p.moves, group_moves(local, remotes, p.probe));
  p.layouts = std::make_shared<const TemplateLayouts>(
      TemplateLayouts{local, std::vector<Layout>(remotes.begin(), remotes.end())});
  return p;
}

Result<PlanTemplate> build_template(const Layout& local, std::span<const Layout> remotes, const RequestShape& shape,
                                    const StageCut* cut, StagePrep* prep) {
  std::optional<StagePrep> own;
  if (prep == nullptr) {
    KVB_ASSIGN_OR_RETURN(StagePrep made, prepare_stages(local, remotes, shape));
    own = std::move(made);
  }
  StagePrep& p = prep != nullptr ? *prep : *own;
  ShiftTables* tables = prep != nullptr ? &prep->tables : nullptr;
  const Request& probe = p.probe;
  const std::vector<uint16_t>& by_rank = p.by_rank;
  std::vector<GroupMove>& moves = p.moves;
  auto t = std::make_shared<PlanTemplate::Impl>();
  t->layouts = p.layouts;
  t->shape = shape;
  t->totals.resize(remotes.size());
  for (size_t r = 0; r < remotes.size(); ++r)
    t->totals[r].tp_rank = remotes[r].tp_rank, t->totals[r].pp_rank = remotes[r].pp_rank;
  // group_moves() accepted the probe, so the shape's groups are exactly the
  // transfer groups, each present on every remote rank.
  for (const auto& group : t->shape.groups) {
    TemplateGroup g;
    g.name = group.first;
    g.local_blocks = local.find_group(g.name)->num_blocks;
    g.remote_blocks = remotes.front().find_group(g.name)->num_blocks;
    auto all = [](const std::vector<bool>& listed) {
      return std::find(listed.begin(), listed.end(), false) == listed.end();
    };
    g.local_all_listed = all(group.second.local);
    g.remote_all_listed = all(group.second.remote);
    t->groups.push_back(g);
  }
  for (size_t k = 0; k < moves.size(); ++k) {
    GroupMove& m = moves[k];
    // The cut narrows the shared move for this stage only.
    struct Restore {
      GroupMove& m;
      const uint64_t begin, end, delta;
      const uint32_t shard;
      ~Restore() { m.begin = begin, m.end = end, m.delta = delta, m.shard = shard; }
    } restore{m, m.begin, m.end, m.delta, m.shard};
    const Group& g = local.groups[m.local_group];
    const size_t gi = static_cast<size_t>(std::distance(t->shape.groups.begin(), t->shape.groups.find(g.name)));
    if (g.kind == GroupKind::kState && m.end > m.begin) {
      // The state that moves is in each list's last entry (positions.cc).
      const GroupShape& gs = t->shape.groups.at(g.name);
      t->groups[gi].local_entry0 = gs.local.size() - 1;
      t->groups[gi].remote_entry0 = gs.remote.size() - 1;
    }
    if (cut != nullptr) narrow_to_cut(local, probe, *cut, m);
    if (m.end <= m.begin) continue;
    if (m.context_sharded()) {
      // An entry's pieces depend on which shard holds each of its positions,
      // not on the entry's position in its block alone.
      t->uniform = false;
      t->fallback_reason = "group " + q(g.name) + " is context-sharded: its entries' pieces differ by shard";
      t->moves.clear();
      t->pieces = t->max_pieces = 0;
      break;
    }
    if (end_entry(m) - first_entry(m) > UINT32_MAX) {
      return Status::resource_exhausted("group " + q(g.name) + ": more than 2^32 list entries move");
    }
    const bool masked = cut != nullptr && !cut->masks.empty();
    KVB_ASSIGN_OR_RETURN(std::vector<Unit> units,
                         make_units(local, remotes, by_rank, m,
                                    masked ? std::span<const uint8_t>(cut->masks[k]) : std::span<const uint8_t>()));
    if (masked && units.empty()) continue;  // none of the stage's layers is this group's
    TemplateMove tm;
    tm.group = gi;
    if (!build_move(m, units, g.name, *t, tm, tables)) {
      t->moves.clear();
      t->pieces = t->max_pieces = 0;
      break;
    }
    t->moves.push_back(std::move(tm));
  }
  return TemplateAccess::make(std::move(t));
}

}  // namespace plan_internal
}  // namespace kvbridge
