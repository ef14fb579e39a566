// Checking a request against a template's shape: the one pass of the
// common path (fits()), and the errors of a request that fails it, which
// are plan()'s word for word or name the difference from the shape.
#include <algorithm>
#include <string>

#include "common/text.h"
#include "plan/template.h"

namespace kvbridge::plan_internal {
namespace {

// One list against its shape, in one pass: the length, -1 exactly where
// the shape has -1, every other id a block of the group, and those ids
// distinct (a bitmap over the group's blocks; a sorted copy when the
// blocks far outnumber the ids and the list is not ascending, the usual
// allocator output). A shape that lists every entry (the usual one) skips
// the per-entry look at the shape.
template <bool kAllListed>
bool ids_fit(std::span<const int64_t> ids, const std::vector<bool>& listed, uint64_t num_blocks, bool bitmap,
             std::vector<uint64_t>& seen) {
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t id = ids[i];
    if (!kAllListed && !listed[i]) {
      if (id != -1) return false;
      continue;
    }
    const uint64_t block = static_cast<uint64_t>(id);  // a negative id is past every block
    if (block >= num_blocks) return false;
    if (bitmap) {
      const uint64_t bit = uint64_t{1} << (block % 64);
      uint64_t& word = seen[block / 64];
      if (word & bit) return false;
      word |= bit;
    }
  }
  return true;
}

bool list_fits(std::span<const int64_t> ids, const std::vector<bool>& listed, bool all_listed, uint64_t num_blocks,
               std::vector<uint64_t>& seen) {
  if (ids.size() != listed.size()) return false;
  const bool bitmap = num_blocks / 64 <= 4 * ids.size() + 1024;
  if (bitmap) seen.assign(num_blocks / 64 + 1, 0);
  if (!(all_listed ? ids_fit<true>(ids, listed, num_blocks, bitmap, seen)
                   : ids_fit<false>(ids, listed, num_blocks, bitmap, seen))) {
    return false;
  }
  if (bitmap || listed_ascending(ids)) return true;
  seen.clear();
  for (int64_t id : ids) {
    if (id >= 0) seen.push_back(static_cast<uint64_t>(id));
  }
  std::sort(seen.begin(), seen.end());
  return std::adjacent_find(seen.begin(), seen.end()) == seen.end();
}

}  // namespace

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
    if (!list_fits(blocks.local, shape->second.local, group->local_all_listed, group->local_blocks, scratch) ||
        !list_fits(blocks.remote, shape->second.remote, group->remote_all_listed, group->remote_blocks, scratch)) {
      return false;
    }
    lists.emplace_back(blocks.local);
    lists.emplace_back(blocks.remote);
    ++shape;
    ++group;
  }
  return true;
}

namespace {

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
        if (!listed[i] && ids[i] != -1)
          return Status::invalid_argument(entry + " but the template's shape has -1 there");
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

}  // namespace

// The error of a request that does not pass fits(): plan()'s when plan()
// rejects it (a request off the shape may fail anywhere in planning: a state
// list one longer moves another block, which may alias one of another
// group), else the first difference from the shape.
Status request_error(const PlanTemplate::Impl& t, const Request& r) {
  Result<Plan> planned = plan(t.local(), t.remotes(), r);
  if (!planned.ok()) return planned.error();
  return shape_difference(t.shape, r);
}

}  // namespace kvbridge::plan_internal
