// StageTemplate (kvbridge/plan.h): one PlanTemplate per stage of a shape,
// each built by template_build.cc for its stage's cut; a stage whose
// template is an earlier stage's with its tensors moved (a later layer of a
// layer-major cache) is noted as that stage moved (moved_of()).
#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kvbridge/plan.h"
#include "plan/internal.h"
#include "plan/template.h"

namespace kvbridge {
// Named (not anonymous): Impl holds a StageMap, and the library is built
// as unity files.
namespace plan_internal::moved_stages {

// Where a stage's tensor goes in a stage moved from it: tensor `to` (-1:
// not named), at its offsets plus `shift` (modulo 2^64).
struct TensorMove {
  int32_t to = -1;
  uint64_t shift = 0;
};
struct StageMap {
  std::vector<TensorMove> local, remote;  // by the earlier stage's tensor
};

// Binds tensor `from` to `to` at `shift`; false when it is bound otherwise.
bool bind(std::vector<TensorMove>& map, uint16_t from, uint16_t to, uint64_t shift) {
  if (from >= map.size()) map.resize(from + 1u);
  TensorMove& m = map[from];
  if (m.to < 0) {
    m = {to, shift};
    return true;
  }
  return m.to == to && m.shift == shift;
}

// The tensors bound map to tensors in the same order (so to distinct ones).
bool ascending(const std::vector<TensorMove>& map) {
  int32_t last = -1;
  for (const TensorMove& m : map) {
    if (m.to < 0) continue;
    if (m.to <= last) return false;
    last = m.to;
  }
  return true;
}

// True when template `b` is template `a` with its tensors moved, filling
// *map: the same groups, moves, loops, classes and pieces, but for each
// piece's tensors and offsets, which differ by one shift per tensor (local,
// and remote, the same for every source), the tensors mapped in ascending
// order. Then for every request of the shape `b` plans `a`'s descriptors
// with each tensor moved so: its pieces are `a`'s moved, in the same order;
// two descriptors merge only inside one tensor (and source) when adjacent on
// both sides, which a shift of each tensor keeps; a copied loop starts
// fresh exactly when `a`'s does (its tensor's earlier descriptors are
// `a`'s, moved), and plans sort by (tensor, offset), which an ascending
// map and a shift per tensor keep. Loops with tables of copies are not
// compared (false).
bool moved_of(const PlanTemplate::Impl& a, const PlanTemplate::Impl& b, StageMap* map) {
  if (!a.uniform || !b.uniform || a.pieces != b.pieces || a.max_pieces != b.max_pieces ||
      a.moves.size() != b.moves.size() || a.groups.size() != b.groups.size() || a.totals.size() != b.totals.size()) {
    return false;
  }
  for (size_t g = 0; g < a.groups.size(); ++g) {
    const plan_internal::TemplateGroup &x = a.groups[g], &y = b.groups[g];
    if (x.name != y.name || x.local_blocks != y.local_blocks || x.remote_blocks != y.remote_blocks ||
        x.local_entry0 != y.local_entry0 || x.remote_entry0 != y.remote_entry0) {
      return false;
    }
  }
  for (size_t r = 0; r < a.totals.size(); ++r) {
    const SourceTotals &x = a.totals[r], &y = b.totals[r];
    if (x.tp_rank != y.tp_rank || x.pp_rank != y.pp_rank || x.descriptors != y.descriptors || x.bytes != y.bytes) {
      return false;
    }
  }
  map->local.assign(a.local().tensors.size(), {});
  map->remote.clear();
  for (size_t m = 0; m < a.moves.size(); ++m) {
    const TemplateMove &x = a.moves[m], &y = b.moves[m];
    if (x.group != y.group || x.first_entry != y.first_entry || x.entry_class != y.entry_class ||
        x.remote_first != y.remote_first || x.remote_reads != y.remote_reads || x.loops.size() != y.loops.size()) {
      return false;
    }
    for (size_t i = 0; i < x.loops.size(); ++i) {
      const TemplateLoop &p = x.loops[i], &q = y.loops[i];
      if (p.copies_end != 0 || q.copies_end != 0 || p.copies != nullptr || q.copies != nullptr ||
          p.copy_of != q.copy_of || p.program != q.program || p.one_piece != q.one_piece ||
          p.one_source != q.one_source || p.rigid != q.rigid || p.pieces.size() != q.pieces.size()) {
        return false;
      }
      for (size_t k = 0; k < p.pieces.size(); ++k) {
        const plan_internal::TemplatePiece &u = p.pieces[k], &v = q.pieces[k];
        if (u.bytes != v.bytes || u.local_stride != v.local_stride || u.remote_stride != v.remote_stride ||
            u.remote_entry != v.remote_entry || u.source != v.source ||
            !bind(map->local, p.local_tensor, q.local_tensor, v.local_offset - u.local_offset) ||
            !bind(map->remote, u.remote_tensor, v.remote_tensor, v.remote_offset - u.remote_offset)) {
          return false;
        }
      }
      if (p.copy_of < 0) continue;
      // A copied loop emits its original's descriptors at its own shifts:
      // those must be its original's moved.
      const TemplateLoop &o = x.loops[static_cast<size_t>(p.copy_of)], &o2 = y.loops[static_cast<size_t>(q.copy_of)];
      if (o.local_tensor >= map->local.size() || map->local[o.local_tensor].to < 0 ||
          o.remote_tensor >= map->remote.size() || map->remote[o.remote_tensor].to < 0) {
        return false;
      }
      const uint64_t local = q.local_shift + map->local[o.local_tensor].shift - p.local_shift;
      const uint64_t remote = q.remote_shift + map->remote[o.remote_tensor].shift - p.remote_shift;
      if (o2.local_tensor != map->local[o.local_tensor].to || o2.remote_tensor != map->remote[o.remote_tensor].to ||
          !bind(map->local, p.local_tensor, q.local_tensor, local) ||
          !bind(map->remote, p.remote_tensor, q.remote_tensor, remote)) {
        return false;
      }
    }
  }
  return ascending(map->local) && ascending(map->remote);
}

// Runs of `plan` (a stage's compact plan) whose descriptors all name one
// local and one remote tensor: a literal run that names several is cut
// where they change (its expansion stays the same).
void cut_by_tensor(CompactPlan& plan) {
  std::vector<DescriptorRun> runs;
  runs.reserve(plan.runs.size());
  for (const DescriptorRun& r : plan.runs) {
    if (r.moved) {
      runs.push_back(r);
      continue;
    }
    uint64_t begin = r.first;
    for (uint64_t i = r.first + 1; i <= r.first + r.count; ++i) {
      const Descriptor& d = plan.literal[begin];
      if (i < r.first + r.count && plan.literal[i].local_tensor == d.local_tensor &&
          plan.literal[i].remote_tensor == d.remote_tensor) {
        continue;
      }
      runs.push_back({begin, i - begin});
      begin = i;
    }
  }
  plan.runs = std::move(runs);
}

// The runs of a stage moved from `from` (cut_by_tensor()) by `map`: each
// of `from`'s runs, moved; false when one names a tensor the map does not.
bool moved_runs(const CompactPlan& from, const StageMap& map, std::vector<DescriptorRun>* out) {
  out->clear();
  out->reserve(from.runs.size());
  for (const DescriptorRun& r : from.runs) {
    if (r.table != nullptr) return false;
    const Descriptor& d = from.literal[r.first];
    const uint16_t lt = r.moved ? r.local_tensor : d.local_tensor, rt = r.moved ? r.remote_tensor : d.remote_tensor;
    if (lt >= map.local.size() || rt >= map.remote.size() || map.local[lt].to < 0 || map.remote[rt].to < 0) {
      return false;
    }
    const TensorMove &l = map.local[lt], &m = map.remote[rt];
    out->push_back({r.first, r.count, true, static_cast<uint16_t>(l.to), static_cast<uint16_t>(m.to),
                    (r.moved ? r.local_shift : 0) + l.shift, (r.moved ? r.remote_shift : 0) + m.shift});
  }
  return true;
}

}  // namespace plan_internal::moved_stages

using plan_internal::moved_stages::StageMap;

struct StageTemplate::Impl {
  std::shared_ptr<const plan_internal::TemplateLayouts> layouts;  // shared with each stage's template
  RequestShape shape;
  StageOptions options;
  bool uniform = true;
  std::string fallback_reason;
  // The stages that move something, in plan_stages()' order: each one's
  // fields but its plan (those of the probe request), and its template.
  std::vector<PlanStage> headers;
  std::vector<PlanTemplate> templates;
  std::optional<PlanTemplate> whole;  // checks a request when no stage moves anything
  // Per stage: the earlier stage whose template it is, moved (moved_of()),
  // or -1, and the map; the templates of the stages that are not moved.
  std::vector<int64_t> moved_from;
  std::vector<StageMap> maps;
  std::vector<PlanTemplate> own;
  std::vector<size_t> own_index;  // per stage not moved: its index in `own`
  bool any_moved = false;
};

Result<StageTemplate> StageTemplate::create(const Layout& local, std::span<const Layout> remotes,
                                            const RequestShape& shape, const StageOptions& options) {
  using namespace plan_internal;
  auto t = std::make_shared<Impl>();
  // The cuts are the shape's: the probe (blocks 0, 1, 2, ... where the shape
  // lists blocks) cuts as every request of the shape does. Its errors are
  // plan()'s for the shape, as PlanTemplate::create()'s.
  KVB_ASSIGN_OR_RETURN(StagePrep prep, prepare_stages(local, remotes, shape));
  t->layouts = prep.layouts;
  t->shape = shape;
  t->options = options;
  const Request& probe = prep.probe;
  const std::vector<std::string> order = layer_order(local);
  // The cuts are made once, before any stage narrows prep's moves.
  for (const StageCut& cut : stage_cuts(local, remotes, prep.moves, probe, options, order)) {
    KVB_ASSIGN_OR_RETURN(PlanTemplate stage, build_template(local, remotes, shape, &cut, &prep));
    if (!stage.uniform()) {
      t->uniform = false;
      t->fallback_reason = stage.fallback_reason();
      t->headers.clear();
      t->templates.clear();
      return StageTemplate(std::move(t));
    }
    // A stage that holds no piece moves nothing for any request of the
    // shape: plan_stages() leaves it out. (The probe itself may not be a
    // valid request: overlaid groups given the same ids.)
    if (stage.pieces() == 0) continue;
    t->headers.push_back(stage_header(remotes, probe, cut, order));
    t->templates.push_back(std::move(stage));
  }
  // A shape that moves nothing: the whole shape's template checks a
  // request's ids before plan_stages()' one empty stage is returned.
  if (t->templates.empty()) {
    KVB_ASSIGN_OR_RETURN(PlanTemplate whole, PlanTemplate::create(local, remotes, shape));
    t->whole = std::move(whole);
  }
  // The stages that are an earlier one moved: compared with the earlier
  // stages of their chunk and layer count that are not moved themselves.
  const size_t n = t->templates.size();
  t->moved_from.assign(n, -1);
  t->maps.resize(n);
  t->own_index.assign(n, SIZE_MAX);
  std::map<std::tuple<uint64_t, uint64_t, uint32_t>, std::vector<size_t>> bases;
  for (size_t j = 0; j < n; ++j) {
    const PlanStage& h = t->headers[j];
    std::vector<size_t>& same = bases[{h.first_token, h.end_token, h.end_layer - h.first_layer}];
    const PlanTemplate::Impl& b = plan_internal::TemplateAccess::impl(t->templates[j]);
    for (size_t i : same) {
      if (plan_internal::moved_stages::moved_of(plan_internal::TemplateAccess::impl(t->templates[i]), b, &t->maps[j])) {
        t->moved_from[j] = static_cast<int64_t>(i);
        t->any_moved = true;
        break;
      }
    }
    if (t->moved_from[j] >= 0) continue;
    t->maps[j] = {};
    same.push_back(j);
    t->own_index[j] = t->own.size();
    t->own.push_back(t->templates[j]);
  }
  return StageTemplate(std::move(t));
}

const RequestShape& StageTemplate::shape() const { return impl_->shape; }
const StageOptions& StageTemplate::options() const { return impl_->options; }
bool StageTemplate::uniform() const { return impl_->uniform; }
const std::string& StageTemplate::fallback_reason() const { return impl_->fallback_reason; }
size_t StageTemplate::moved_stages() const {
  return static_cast<size_t>(
      std::count_if(impl_->moved_from.begin(), impl_->moved_from.end(), [](int64_t i) { return i >= 0; }));
}
size_t StageTemplate::stages() const { return impl_->uniform ? std::max<size_t>(impl_->headers.size(), 1) : 0; }

Result<std::vector<PlanStage>> StageTemplate::instantiate(const Request& request) const {
  const Impl& t = *impl_;
  auto planned = [&] { return plan_stages(t.layouts->local, t.layouts->remotes, request, t.options); };
  if (!t.uniform) return planned();
  if (t.templates.empty()) {
    // Moving nothing: plan_stages()' one empty stage, after the checks a
    // request of the shape must pass.
    if (!t.whole->instantiate(request).ok()) return planned();
    return std::vector<PlanStage>{plan_internal::empty_stage(t.layouts->local, t.layouts->remotes, request)};
  }
  // The request checked once for every stage; one that does not fit, or
  // that plan_stages() refuses, gets plan_stages()' answer, word for word.
  std::vector<Plan> plans(t.templates.size());
  if (!plan_internal::instantiate_all(t.templates, request, plans)) return planned();
  std::vector<PlanStage> out(t.headers);
  for (size_t i = 0; i < out.size(); ++i) out[i].plan = std::move(plans[i]);
  return out;
}

Result<std::vector<CompactStage>> StageTemplate::instantiate_compact(const Request& request) const {
  const Impl& t = *impl_;
  // Where the template falls back, moves nothing or cannot hold a stage
  // compact: instantiate()'s stages, each one literal run.
  auto whole = [&]() -> Result<std::vector<CompactStage>> {
    KVB_ASSIGN_OR_RETURN(std::vector<PlanStage> stages, instantiate(request));
    std::vector<CompactStage> out;
    out.reserve(stages.size());
    for (PlanStage& s : stages) out.push_back(compact(std::move(s)));
    return out;
  };
  if (!t.uniform || t.templates.empty()) return whole();
  std::vector<CompactPlan> plans(t.templates.size());
  if (!plan_internal::instantiate_all_compact(t.templates, request, plans)) return whole();
  std::vector<CompactStage> out(t.headers.size());
  for (size_t i = 0; i < out.size(); ++i) {
    const PlanStage& h = t.headers[i];
    out[i] = {h.first_layer, h.end_layer, h.first_token, h.end_token, h.resume_token, std::move(plans[i])};
  }
  return out;
}

Result<std::vector<CompactStage>> StageTemplate::instantiate_moved(const Request& request) const {
  const Impl& t = *impl_;
  if (!t.uniform || t.templates.empty() || !t.any_moved) return instantiate_compact(request);
  std::vector<CompactPlan> plans(t.own.size());
  if (!plan_internal::instantiate_all_compact(t.own, request, plans)) return instantiate_compact(request);
  std::vector<CompactStage> out(t.headers.size());
  std::vector<uint8_t> cut(t.headers.size(), 0);
  for (size_t j = 0; j < out.size(); ++j) {
    const PlanStage& h = t.headers[j];
    out[j] = {h.first_layer, h.end_layer, h.first_token, h.end_token, h.resume_token, {}};
    if (t.moved_from[j] < 0) {
      out[j].plan = std::move(plans[t.own_index[j]]);
      continue;
    }
    const size_t i = static_cast<size_t>(t.moved_from[j]);
    if (!cut[i]) {
      plan_internal::moved_stages::cut_by_tensor(out[i].plan);
      cut[i] = 1;
    }
    const CompactPlan& from = out[i].plan;
    CompactPlan& c = out[j].plan;
    if (!plan_internal::moved_stages::moved_runs(from, t.maps[j], &c.runs)) return instantiate_compact(request);
    c.sources = from.sources;
    c.bytes = from.bytes;
    c.descriptors = from.descriptors;
    out[j].moved_from = static_cast<int64_t>(i);
  }
  return out;
}

Plan expand(std::span<const CompactStage> stages, size_t k) {
  const CompactStage& s = stages[k];
  if (s.moved_from < 0) return expand(s.plan);
  CompactPlan c = s.plan;
  c.literal = stages[static_cast<size_t>(s.moved_from)].plan.literal;
  return expand(c);
}

}  // namespace kvbridge
