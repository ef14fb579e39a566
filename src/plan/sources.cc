// Which remote rank serves which local heads.
#include <algorithm>
#include <string>

#include "common/text.h"
#include "plan/internal.h"

namespace kvbridge::plan_internal {
namespace {}  // namespace

Result<std::vector<uint16_t>> check_remotes(const Layout& local, std::span<const Layout> remotes) {
  if (remotes.empty()) return Status::invalid_argument("no remote layouts given");
  if (remotes.size() > 0xffff) return Status::resource_exhausted("more than 65,535 remote layouts");
  if (local.tensors.size() > 0xffff) return Status::resource_exhausted("local layout has more than 65,535 tensors");
  std::vector<uint16_t> by_rank(remotes.size());
  for (size_t i = 0; i < remotes.size(); ++i) by_rank[i] = static_cast<uint16_t>(i);
  std::sort(by_rank.begin(), by_rank.end(),
            [&](uint16_t a, uint16_t b) { return remotes[a].tp_rank < remotes[b].tp_rank; });
  const Layout& first = remotes[by_rank[0]];
  for (size_t k = 0; k < by_rank.size(); ++k) {
    const Layout& r = remotes[by_rank[k]];
    std::string who = "remote rank " + std::to_string(r.tp_rank);
    if (r.tensors.size() > 0xffff) return Status::resource_exhausted(who + " has more than 65,535 tensors");
    if (r.tp_size != first.tp_size) {
      return Status::incompatible(who + " has tp_size " + std::to_string(r.tp_size) + " but remote rank " +
                                  std::to_string(first.tp_rank) + " has " + std::to_string(first.tp_size) +
                                  "; remote layouts must come from one instance");
    }
    if (k > 0 && r.tp_rank == remotes[by_rank[k - 1]].tp_rank) {
      return Status::invalid_argument(who + " is given twice");
    }
    KVB_RETURN_IF_ERROR(check_compatible(local, r).with_context(who));
    for (const Group& g : r.groups) {
      const Group* f = first.find_group(g.name);
      if (g.block_tokens != f->block_tokens || g.num_blocks != f->num_blocks) {
        return Status::incompatible(who + " group " + q(g.name) + " has block_tokens " +
                                    std::to_string(g.block_tokens) + " and num_blocks " + std::to_string(g.num_blocks) +
                                    " but remote rank " + std::to_string(first.tp_rank) + " has " +
                                    std::to_string(f->block_tokens) + " and " + std::to_string(f->num_blocks) +
                                    "; one instance shares block geometry");
      }
    }
  }
  return by_rank;
}

Result<std::vector<HeadRun>> head_runs(const Layout& local, std::span<const Layout> remotes,
                                       std::span<const uint16_t> by_rank, const GroupMove& move, size_t layer,
                                       size_t component) {
  const Group& g = local.groups[move.local_group];
  const Component& c = g.layers[layer].components[component];
  auto remote_component = [&](uint16_t r) -> const Component& {
    return remotes[r].groups[move.remote_group[r]].layers[layer].components[component];
  };
  std::vector<HeadRun> runs;
  std::vector<uint16_t> holders;
  if (!c.heads) {
    // Replicated: every rank holds it; spread local ranks over remote ranks.
    for (uint16_t r : by_rank) {
      if (!remote_component(r).empty()) holders.push_back(r);
    }
    if (holders.empty()) {
      return Status::incompatible("group " + q(g.name) + " layer " + q(g.layers[layer].name) + " component " +
                                  q(c.name) + ": no remote rank holds it");
    }
    runs.push_back({0, 1, holders[local.tp_rank % holders.size()], 0});
    return runs;
  }
  for (uint32_t h = 0; h < c.heads->count; ++h) {
    const uint32_t global = c.heads->first + h;
    holders.clear();
    for (uint16_t r : by_rank) {
      const Component& rc = remote_component(r);
      if (rc.heads && global >= rc.heads->first && global < rc.heads->first + rc.heads->count) holders.push_back(r);
    }
    if (holders.empty()) {
      return Status::incompatible("group " + q(g.name) + " layer " + q(g.layers[layer].name) + " component " +
                                  q(c.name) + ": no given remote rank holds global head " + std::to_string(global));
    }
    const uint16_t src = holders[local.tp_rank % holders.size()];
    const uint32_t rh = global - remote_component(src).heads->first;
    if (!runs.empty() && runs.back().source == src && runs.back().remote_head + runs.back().count == rh) {
      ++runs.back().count;
    } else {
      runs.push_back({h, 1, src, rh});
    }
  }
  return runs;
}

}  // namespace kvbridge::plan_internal
