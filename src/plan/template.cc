// Instantiating plan templates: see kvbridge/plan.h and plan/template.h.
//
// The common path checks the request in one pass without building strings
// (fits()), then replays the loops with the request's ids. Only a request
// that fails the check pays for plan() itself, which is what makes its
// errors plan()'s, word for word.
#include <algorithm>
#include <string>

#include "plan/emit.h"
#include "plan/template.h"

namespace kvbridge {
namespace plan_internal {
namespace {

std::string q(std::string_view s) { return "'" + std::string(s) + "'"; }

// True when the listed ids are distinct. Ascending lists (the usual
// allocator output) take one pass; others a bitmap over the group's blocks,
// or a sorted copy when the blocks far outnumber the ids.
bool distinct(std::span<const int64_t> ids, uint64_t num_blocks, std::vector<uint64_t>& scratch) {
  int64_t prev = -1;
  bool ascending = true;
  for (int64_t id : ids) {
    if (id < 0) continue;
    if (id <= prev) {
      ascending = false;
      break;
    }
    prev = id;
  }
  if (ascending) return true;
  if (num_blocks / 64 <= 4 * ids.size() + 1024) {
    scratch.assign(num_blocks / 64 + 1, 0);
    for (int64_t id : ids) {
      if (id < 0) continue;
      const uint64_t bit = uint64_t{1} << (id % 64);
      uint64_t& word = scratch[static_cast<uint64_t>(id) / 64];
      if (word & bit) return false;
      word |= bit;
    }
    return true;
  }
  scratch.clear();
  for (int64_t id : ids) {
    if (id >= 0) scratch.push_back(static_cast<uint64_t>(id));
  }
  std::sort(scratch.begin(), scratch.end());
  return std::adjacent_find(scratch.begin(), scratch.end()) == scratch.end();
}

// One list against its shape: the length, -1 exactly where the shape has
// -1, every other id a block of the group.
bool list_fits(std::span<const int64_t> ids, const std::vector<bool>& listed, uint64_t num_blocks) {
  if (ids.size() != listed.size()) return false;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (listed[i] ? ids[i] < 0 || static_cast<uint64_t>(ids[i]) >= num_blocks : ids[i] != -1) return false;
  }
  return true;
}

// True when `r` fits the shape and its ids are in range and distinct per
// list. Then plan() accepts it: everything else plan() checks depends on the
// shape only, and create() planned the shape. Fills `lists` with each
// group's local and remote list, in shape order.
bool fits(const PlanTemplate::Impl& t, const Request& r, std::vector<std::span<const int64_t>>& lists,
          std::vector<uint64_t>& scratch) {
  if (r.num_tokens != t.shape.num_tokens || r.skip_tokens != t.shape.skip_tokens) return false;
  if (r.blocks.size() != t.shape.groups.size()) return false;
  lists.clear();
  auto shape = t.shape.groups.begin();
  auto group = t.groups.begin();
  for (const auto& [name, blocks] : r.blocks) {
    if (name != shape->first) return false;
    if (!list_fits(blocks.local, shape->second.local, group->local_blocks) ||
        !list_fits(blocks.remote, shape->second.remote, group->remote_blocks) ||
        !distinct(blocks.local, group->local_blocks, scratch) ||
        !distinct(blocks.remote, group->remote_blocks, scratch)) {
      return false;
    }
    lists.emplace_back(blocks.local);
    lists.emplace_back(blocks.remote);
    ++shape;
    ++group;
  }
  return true;
}

// The first difference between `r` and the shape.
Status shape_difference(const RequestShape& shape, const Request& r) {
  auto differs = [](std::string_view what, uint64_t got, uint64_t want) {
    return Status::invalid_argument(std::string(what) + " " + std::to_string(got) + " differs from the template's " +
                                    std::to_string(want));
  };
  if (r.num_tokens != shape.num_tokens) return differs("num_tokens", r.num_tokens, shape.num_tokens);
  if (r.skip_tokens != shape.skip_tokens) return differs("skip_tokens", r.skip_tokens, shape.skip_tokens);
  for (const auto& [name, gs] : shape.groups) {
    auto it = r.blocks.find(name);
    if (it == r.blocks.end()) {
      return Status::invalid_argument("request has no block lists for group " + q(name) +
                                      ", which the template's shape has");
    }
    for (int side = 0; side < 2; ++side) {
      const std::string which = side == 0 ? "local" : "remote";
      const std::vector<int64_t>& ids = side == 0 ? it->second.local : it->second.remote;
      const std::vector<bool>& listed = side == 0 ? gs.local : gs.remote;
      const std::string where = "group " + q(name) + " " + which;
      if (ids.size() != listed.size()) {
        return Status::invalid_argument(where + " block list has " + std::to_string(ids.size()) +
                                        " entries, the template's shape " + std::to_string(listed.size()));
      }
      for (size_t i = 0; i < ids.size(); ++i) {
        const std::string entry = where + "[" + std::to_string(i) + "] is " + std::to_string(ids[i]);
        if (listed[i] && ids[i] == -1) {
          return Status::invalid_argument(entry + " but the template's shape lists a block there");
        }
        if (!listed[i] && ids[i] != -1) return Status::invalid_argument(entry + " but the template's shape has -1 there");
      }
    }
  }
  for (const auto& [name, blocks] : r.blocks) {
    if (!shape.groups.contains(name)) {
      return Status::invalid_argument("request names group " + q(name) + ", which the template's shape lacks");
    }
  }
  return Status::internal("the request fits the template's shape but failed its check");
}

// The error of a request that does not pass fits(): plan()'s when plan()
// rejects it (a request off the shape may fail anywhere in planning: a state
// list one longer moves another block, which may alias one of another
// group), else the first difference from the shape.
Status request_error(const PlanTemplate::Impl& t, const Request& r) {
  Result<Plan> planned = plan(t.local, t.remotes, r);
  if (!planned.ok()) return planned.error();
  return shape_difference(t.shape, r);
}

// Emits the loops of one move with the request's ids, merging as plan()'s
// Emitter does (bytes per source are the template's; descriptors are
// counted here).
void emit_move(const TemplateMove& tm, std::span<const int64_t> local_ids, std::span<const int64_t> remote_ids,
               std::vector<uint64_t>& order, std::vector<int64_t>& last, Plan& out, bool& unordered) {
  const std::span<const int64_t> lids = local_ids.subspan(tm.first_entry, tm.entry_class.size());
  // Entries in ascending local block id (ids of moving entries are distinct).
  order.resize(lids.size());
  bool ascending = true;
  for (size_t k = 0; k < lids.size(); ++k) {
    order[k] = k;
    ascending = ascending && (k == 0 || lids[k] > lids[k - 1]);
  }
  if (!ascending) {
    for (size_t k = 0; k < lids.size(); ++k) order[k] = static_cast<uint64_t>(lids[k]) << 32 | k;
    std::sort(order.begin(), order.end());
    for (uint64_t& k : order) k &= UINT32_MAX;
  }
  std::vector<Descriptor>& ds = out.descriptors;
  for (const TemplateLoop& loop : tm.loops) {
    int64_t& li = last[loop.local_tensor];
    const TemplatePiece* pieces = loop.pieces.data();
    const uint32_t* program = loop.program.data();
    for (const uint64_t k : order) {
      const uint64_t lb = static_cast<uint64_t>(lids[k]);
      const int64_t* rb = remote_ids.data() + tm.remote_first[k];
      const uint32_t c = tm.entry_class[k];
      for (uint32_t x = program[c]; x < program[c + 1]; ++x) {
        const TemplatePiece& p = pieces[x];
        const uint64_t lo = p.local_offset + lb * p.local_stride;
        const uint64_t ro = p.remote_offset + static_cast<uint64_t>(rb[p.remote_entry]) * p.remote_stride;
        if (li >= 0) {
          Descriptor& d = ds[static_cast<size_t>(li)];
          const uint64_t end = d.local_offset + d.bytes;
          if (lo == end && d.source == p.source && d.remote_tensor == p.remote_tensor &&
              d.remote_offset + d.bytes == ro) {
            d.bytes += p.bytes;
            continue;
          }
          unordered = unordered || lo < end;
        }
        li = static_cast<int64_t>(ds.size());
        ds.push_back({p.source, loop.local_tensor, p.remote_tensor, 0, lo, ro, p.bytes});
        ++out.sources[p.source].descriptors;
      }
    }
  }
}

Status instantiate(const PlanTemplate::Impl& t, const Request& r, Plan& out) {
  std::vector<std::span<const int64_t>> lists;
  std::vector<uint64_t> scratch;
  if (!fits(t, r, lists, scratch)) return request_error(t, r);
  if (!t.uniform) {
    KVB_ASSIGN_OR_RETURN(out, plan(t.local, t.remotes, r));
    return Status();
  }
  out.descriptors.clear();
  out.descriptors.reserve(t.max_pieces);
  out.sources = t.totals;
  std::vector<int64_t> last(t.local.tensors.size(), -1);
  bool unordered = false;
  for (const TemplateMove& tm : t.moves) {
    const TemplateGroup& g = t.groups[tm.group];
    emit_move(tm, lists[2 * tm.group].subspan(g.local_entry0), lists[2 * tm.group + 1].subspan(g.remote_entry0),
              scratch, last, out, unordered);
  }
  return finish_plan(t.local, unordered, out);
}

}  // namespace

PlanTemplate TemplateAccess::not_uniform(const PlanTemplate& t, std::string reason) {
  auto copy = std::make_shared<PlanTemplate::Impl>(*t.impl_);
  copy->uniform = false;
  copy->fallback_reason = std::move(reason);
  copy->moves.clear();
  return PlanTemplate(std::move(copy));
}

}  // namespace plan_internal

RequestShape shape_of(const Request& request) {
  RequestShape s;
  s.num_tokens = request.num_tokens;
  s.skip_tokens = request.skip_tokens;
  for (const auto& [name, blocks] : request.blocks) {
    GroupShape& g = s.groups[name];
    for (int64_t id : blocks.local) g.local.push_back(id != -1);
    for (int64_t id : blocks.remote) g.remote.push_back(id != -1);
  }
  return s;
}

Result<PlanTemplate> PlanTemplate::create(const Layout& local, std::span<const Layout> remotes,
                                          const RequestShape& shape) {
  return plan_internal::build_template(local, remotes, shape);
}

const RequestShape& PlanTemplate::shape() const { return impl_->shape; }
bool PlanTemplate::uniform() const { return impl_->uniform; }
const std::string& PlanTemplate::fallback_reason() const { return impl_->fallback_reason; }
uint64_t PlanTemplate::pieces() const { return impl_->pieces; }

Result<Plan> PlanTemplate::instantiate(const Request& request) const {
  Plan p;
  KVB_RETURN_IF_ERROR(plan_internal::instantiate(*impl_, request, p));
  if (p.descriptors.capacity() > p.descriptors.size() + p.descriptors.size() / 8) p.descriptors.shrink_to_fit();
  return p;
}

Status PlanTemplate::instantiate(const Request& request, Plan* out) const {
  return plan_internal::instantiate(*impl_, request, *out);
}

}  // namespace kvbridge
