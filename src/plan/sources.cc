// Which remote ranks a local rank reads from (the fewest that hold all it
// needs), and which of them serves which local heads.
#include <algorithm>
#include <set>
#include <string>

#include "common/text.h"
#include "plan/internal.h"

namespace kvbridge::plan_internal {
namespace {

// Combinations tried by the exact search before it falls back to greedy.
constexpr uint64_t kMaxCombinations = 200000;

// "3", or "3 (pp 1, tp 1)" for a rank of a pipeline stage.
std::string rank_name(const Layout& l) {
  if (l.pp_size == 1) return std::to_string(l.tp_rank);
  return std::to_string(l.rank()) + " (pp " + std::to_string(l.pp_rank) + ", tp " + std::to_string(l.tp_rank) + ")";
}

// True when remote component `rc` holds global head `global` (any head of
// a replicated local component: `sharded` false).
bool holds_head(const Component& rc, bool sharded, uint32_t global) {
  if (rc.empty()) return false;
  return !sharded || (rc.heads && global >= rc.heads->first && global < rc.heads->first + rc.heads->count);
}

bool has(std::span<const uint64_t> set, size_t r) { return (set[r / 64] >> (r % 64) & 1) != 0; }
void add(std::span<uint64_t> set, size_t r) { set[r / 64] |= uint64_t{1} << (r % 64); }
bool meets(std::span<const uint64_t> a, std::span<const uint64_t> b) {
  for (size_t w = 0; w < a.size(); ++w) {
    if ((a[w] & b[w]) != 0) return true;
  }
  return false;
}

}  // namespace

Result<SourceNeeds> source_needs(const Layout& local, std::span<const Layout> remotes,
                                 std::span<const uint16_t> by_rank) {
  SourceNeeds out;
  out.words = (remotes.size() + 63) / 64;
  std::vector<uint64_t> holders(out.words);
  std::vector<const Group*> rg(remotes.size());
  for (const Group& g : local.groups) {
    if (!g.transfer) continue;
    for (size_t r = 0; r < remotes.size(); ++r) rg[r] = remotes[r].find_group(g.name);
    // The remote context shards the local rank's positions meet (one, any
    // rank's, when the remote group is not sharded).
    const ContextShard& rcs = rg[by_rank[0]]->context;
    const std::vector<bool> shards = shards_needed(g.context, rcs);
    for (size_t l = 0; l < g.layers.size(); ++l) {
      if (g.layers[l].held &&
          std::none_of(by_rank.begin(), by_rank.end(), [&](uint16_t r) { return rg[r]->layers[l].held; })) {
        std::set<uint32_t> stages;
        for (uint16_t r : by_rank) stages.insert(remotes[r].pp_rank);
        std::string given;
        for (uint32_t st : stages) given += (given.empty() ? "" : ", ") + std::to_string(st);
        return Status::incompatible("group " + q(g.name) + " layer " + q(g.layers[l].name) +
                                    ": no given remote rank holds the layer (the remote ranks given are of pipeline "
                                    "stage" +
                                    (stages.size() > 1 ? "s " : " ") + given + " of " +
                                    std::to_string(remotes[by_rank[0]].pp_size) + ")");
      }
      for (size_t c = 0; c < g.layers[l].components.size(); ++c) {
        const Component& comp = g.layers[l].components[c];
        if (comp.empty()) continue;
        const uint32_t count = comp.heads ? comp.heads->count : 1;
        for (uint32_t h = 0; h < count; ++h) {
          for (uint32_t shard = 0; shard < shards.size(); ++shard) {
            if (!shards[shard]) continue;
            std::fill(holders.begin(), holders.end(), 0);
            bool any = false;
            for (uint16_t r : by_rank) {
              const uint32_t global = comp.heads ? comp.heads->first + h : 0;
              if ((!rcs.sharded() || rg[r]->context.rank == shard) &&
                  holds_head(rg[r]->layers[l].components[c], comp.heads.has_value(), global)) {
                add(holders, r), any = true;
              }
            }
            if (!any) {
              const std::string of_shard = rcs.sharded() ? " of context shard " + std::to_string(shard) : "";
              return Status::incompatible(
                  "group " + q(g.name) + " layer " + q(g.layers[l].name) + " component " + q(comp.name) + ": " +
                  (comp.heads
                       ? "no given remote rank holds global head " + std::to_string(comp.heads->first + h) + of_shard
                       : "no given remote rank" + of_shard + " holds it"));
            }
            // Distinct sets only; there are few, so a linear search is cheapest.
            bool known = false;
            for (size_t n = 0; n < out.sets.size() && !known; n += out.words) {
              known = std::equal(holders.begin(), holders.end(), out.sets.begin() + static_cast<std::ptrdiff_t>(n));
            }
            if (!known) out.sets.insert(out.sets.end(), holders.begin(), holders.end());
          }
        }
      }
    }
  }
  return out;
}

Result<std::vector<uint16_t>> choose_sources(const Layout& local, std::span<const Layout> remotes,
                                             std::span<const uint16_t> by_rank) {
  KVB_ASSIGN_OR_RETURN(SourceNeeds needs, source_needs(local, remotes, by_rank));
  const size_t words = needs.words;
  auto need = [&](size_t i) { return std::span<const uint64_t>(needs.sets).subspan(i * words, words); };
  const size_t count = needs.sets.size() / std::max<size_t>(words, 1);
  std::vector<uint64_t> in(words, 0);
  // A rank that alone holds something is in every covering set.
  for (size_t i = 0; i < count; ++i) {
    size_t bits = 0, last = 0;
    for (size_t w = 0; w < words; ++w) {
      if (need(i)[w] == 0) continue;
      bits += static_cast<size_t>(__builtin_popcountll(need(i)[w]));
      last = w * 64 + 63 - static_cast<size_t>(__builtin_clzll(need(i)[w]));
    }
    if (bits == 1) add(in, last);
  }
  std::vector<size_t> left;  // needs the forced ranks do not meet
  for (size_t i = 0; i < count; ++i) {
    if (!meets(need(i), in)) left.push_back(i);
  }
  if (!left.empty()) {
    // Candidates in tp_rank order, rotated by the local rank, so that local
    // ranks with the same needs spread over the remote ranks.
    std::vector<uint16_t> cand;
    for (uint16_t r : by_rank) {
      if (std::any_of(left.begin(), left.end(), [&](size_t i) { return has(need(i), r); })) cand.push_back(r);
    }
    std::rotate(cand.begin(), cand.begin() + static_cast<std::ptrdiff_t>(local.rank() % cand.size()), cand.end());
    auto covers = [&](std::span<const uint64_t> set) {
      return std::all_of(left.begin(), left.end(), [&](size_t i) { return meets(need(i), set); });
    };
    // Exact: the first combination (in candidate order) of the smallest size.
    uint64_t tried = 0;
    bool found = false;
    std::vector<uint64_t> trial(words);
    for (size_t k = 1; k <= cand.size() && !found && tried < kMaxCombinations; ++k) {
      std::vector<size_t> idx(k);
      for (size_t i = 0; i < k; ++i) idx[i] = i;
      while (tried < kMaxCombinations) {
        ++tried;
        trial = in;
        for (size_t i : idx) add(trial, cand[i]);
        if (covers(trial)) {
          in = trial;
          found = true;
          break;
        }
        // The next combination, in lexicographic order of positions.
        size_t i = k;
        while (i > 0 && idx[i - 1] == cand.size() - k + i - 1) --i;
        if (i == 0) break;
        ++idx[i - 1];
        for (size_t j = i; j < k; ++j) idx[j] = idx[j - 1] + 1;
      }
    }
    // Too many to try: greedy, the candidate meeting most needs left first.
    while (!found && !left.empty()) {
      size_t best = 0, best_hits = 0;
      for (size_t c = 0; c < cand.size(); ++c) {
        const size_t hits = static_cast<size_t>(
            std::count_if(left.begin(), left.end(), [&](size_t i) { return has(need(i), cand[c]); }));
        if (hits > best_hits) best = c, best_hits = hits;
      }
      add(in, cand[best]);
      std::erase_if(left, [&](size_t i) { return has(need(i), cand[best]); });
    }
  }
  std::vector<uint16_t> out;
  for (uint16_t r : by_rank) {
    if (has(in, r)) out.push_back(r);
  }
  return out;
}

Result<std::vector<uint16_t>> check_remotes(const Layout& local, std::span<const Layout> remotes) {
  if (remotes.empty()) return Status::invalid_argument("no remote layouts given");
  if (remotes.size() > 0xffff) return Status::resource_exhausted("more than 65,535 remote layouts");
  if (local.tensors.size() > 0xffff) return Status::resource_exhausted("local layout has more than 65,535 tensors");
  std::vector<uint16_t> by_rank(remotes.size());
  for (size_t i = 0; i < remotes.size(); ++i) by_rank[i] = static_cast<uint16_t>(i);
  std::sort(by_rank.begin(), by_rank.end(),
            [&](uint16_t a, uint16_t b) { return remotes[a].rank() < remotes[b].rank(); });
  const Layout& first = remotes[by_rank[0]];
  for (size_t k = 0; k < by_rank.size(); ++k) {
    const Layout& r = remotes[by_rank[k]];
    std::string who = "remote rank " + rank_name(r);
    if (r.tensors.size() > 0xffff) return Status::resource_exhausted(who + " has more than 65,535 tensors");
    if (r.tp_size != first.tp_size || r.pp_size != first.pp_size) {
      return Status::incompatible(who + " has tp_size " + std::to_string(r.tp_size) + " and pp_size " +
                                  std::to_string(r.pp_size) + " but remote rank " + rank_name(first) + " has " +
                                  std::to_string(first.tp_size) + " and " + std::to_string(first.pp_size) +
                                  "; remote layouts must come from one instance");
    }
    if (k > 0 && r.rank() == remotes[by_rank[k - 1]].rank()) {
      return Status::invalid_argument(who + " is given twice");
    }
    KVB_RETURN_IF_ERROR(check_compatible(local, r).with_context(who));
    for (const Group& g : r.groups) {
      const Group* f = first.find_group(g.name);
      if (g.block_tokens != f->block_tokens || g.num_blocks != f->num_blocks) {
        return Status::incompatible(who + " group " + q(g.name) + " has block_tokens " +
                                    std::to_string(g.block_tokens) + " and num_blocks " + std::to_string(g.num_blocks) +
                                    " but remote rank " + rank_name(first) + " has " + std::to_string(f->block_tokens) +
                                    " and " + std::to_string(f->num_blocks) + "; one instance shares block geometry");
      }
      if (g.context.size != f->context.size || g.context.interleave != f->context.interleave) {
        return Status::incompatible(who + " group " + q(g.name) + " has " + std::to_string(g.context.size) +
                                    " context shards of interleave " + std::to_string(g.context.interleave) +
                                    " but remote rank " + rank_name(first) + " has " + std::to_string(f->context.size) +
                                    " of interleave " + std::to_string(f->context.interleave) +
                                    "; one instance shards its context one way");
      }
    }
  }
  return choose_sources(local, remotes, by_rank);
}

Result<std::vector<HeadRun>> head_runs(const Layout& local, std::span<const Layout> remotes,
                                       std::span<const uint16_t> by_rank, const GroupMove& move, size_t layer,
                                       size_t component) {
  const Group& g = local.groups[move.local_group];
  const Component& c = g.layers[layer].components[component];
  auto remote_component = [&](uint16_t r) -> const Component& {
    return remotes[r].groups[move.remote_group[r]].layers[layer].components[component];
  };
  // Of n holders, the one serving this layer: the group's layers that the
  // local rank holds cut into n contiguous ranges, one per holder, rotated
  // by the local rank.
  size_t held = 0, before = 0;
  for (size_t l = 0; l < g.layers.size(); ++l) {
    held += g.layers[l].held;
    before += g.layers[l].held && l < layer;
  }
  auto spread = [&](size_t n) { return (local.rank() + before * n / held) % n; };
  // A rank of another context shard than the one read holds other positions.
  auto of_shard = [&](uint16_t r) { return !move.remote_cp.sharded() || move.remote_shard[r] == move.shard; };
  auto shard_text = [&] {  // for errors only: not built on the planning path
    return move.remote_cp.sharded() ? " of context shard " + std::to_string(move.shard) : std::string();
  };
  std::vector<HeadRun> runs;
  std::vector<uint16_t> holders;
  if (!c.heads) {
    // Replicated: every rank holds it; spread local ranks over remote ranks.
    for (uint16_t r : by_rank) {
      if (of_shard(r) && holds_head(remote_component(r), false, 0)) holders.push_back(r);
    }
    if (holders.empty()) {
      return Status::incompatible("group " + q(g.name) + " layer " + q(g.layers[layer].name) + " component " +
                                  q(c.name) + ": no given remote rank" + shard_text() + " holds it");
    }
    runs.push_back({0, 1, holders[spread(holders.size())], 0});
    return runs;
  }
  for (uint32_t h = 0; h < c.heads->count; ++h) {
    const uint32_t global = c.heads->first + h;
    holders.clear();
    for (uint16_t r : by_rank) {
      if (of_shard(r) && holds_head(remote_component(r), true, global)) holders.push_back(r);
    }
    if (holders.empty()) {
      return Status::incompatible("group " + q(g.name) + " layer " + q(g.layers[layer].name) + " component " +
                                  q(c.name) + ": no given remote rank holds global head " + std::to_string(global) +
                                  shard_text());
    }
    const uint16_t src = holders[spread(holders.size())];
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

namespace kvbridge {

Result<std::vector<uint32_t>> source_ranks(const Layout& local, std::span<const Layout> remotes) {
  KVB_ASSIGN_OR_RETURN(std::vector<uint16_t> chosen, plan_internal::check_remotes(local, remotes));
  std::vector<uint32_t> out;
  for (uint16_t r : chosen) out.push_back(remotes[r].rank());
  return out;
}

Result<std::vector<SourceReaders>> readers_per_source(std::span<const Layout> locals, std::span<const Layout> remotes) {
  std::vector<SourceReaders> out(remotes.size());
  for (size_t r = 0; r < remotes.size(); ++r) out[r].rank = remotes[r].rank();
  for (const Layout& local : locals) {
    Result<std::vector<uint16_t>> chosen = plan_internal::check_remotes(local, remotes);
    if (!chosen) return chosen.error().with_context("local rank " + std::to_string(local.rank()));
    for (uint16_t r : *chosen) out[r].readers.push_back(local.rank());
  }
  for (SourceReaders& s : out) std::sort(s.readers.begin(), s.readers.end());
  return out;
}

}  // namespace kvbridge
