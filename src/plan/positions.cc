// Which positions of each group a request moves, and the request checks that
// go with it. DESIGN.md, "What a request transfers".
#include <algorithm>
#include <numeric>
#include <string>

#include "common/text.h"
#include "plan/internal.h"

namespace kvbridge::plan_internal {
namespace {

uint64_t ceil_div(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }

// Every id must be -1 or a block of the group; the entries that move must not
// be -1. `need` is the number of entries the moving positions use, from
// `first_used`; the list must have at least `length` (>= need) entries.
Status check_ids(const std::string& where, std::string_view side, const std::vector<int64_t>& ids, uint64_t num_blocks,
                 uint64_t first_used, uint64_t need, uint64_t length = 0) {
  length = std::max(length, need);
  if (ids.size() < length) {
    return Status::invalid_argument(where + " " + std::string(side) + " block list has " + std::to_string(ids.size()) +
                                    " entries but the request's positions need " + std::to_string(length));
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < -1) {
      return Status::invalid_argument(where + " " + std::string(side) + "[" + std::to_string(i) + "] is " +
                                      std::to_string(ids[i]) + "; block ids are >= 0, or -1 for no block");
    }
    if (ids[i] >= 0 && static_cast<uint64_t>(ids[i]) >= num_blocks) {
      return Status::out_of_range(where + " " + std::string(side) + "[" + std::to_string(i) + "] = " +
                                  std::to_string(ids[i]) + " is beyond num_blocks " + std::to_string(num_blocks));
    }
    if (i >= first_used && i < need && ids[i] < 0) {
      return Status::invalid_argument(where + " " + std::string(side) + "[" + std::to_string(i) +
                                      "] is -1 but that block's positions move");
    }
  }
  return Status();
}

// No block id may appear twice in one list: two positions of a request never
// share a block. Ascending lists (the usual allocator output) are checked in
// one pass; others sort a copy.
Status check_distinct(const std::string& where, std::string_view side, const std::vector<int64_t>& ids) {
  if (listed_ascending(ids)) return Status();
  std::vector<int64_t> sorted;
  sorted.reserve(ids.size());
  for (int64_t id : ids) {
    if (id >= 0) sorted.push_back(id);
  }
  std::sort(sorted.begin(), sorted.end());
  auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup == sorted.end()) return Status();
  std::vector<size_t> at;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] == *dup) at.push_back(i);
  }
  return Status::invalid_argument(where + " " + std::string(side) + " block " + std::to_string(*dup) +
                                  " is listed twice (entries " + std::to_string(at[0]) + " and " +
                                  std::to_string(at[1]) + ")");
}

}  // namespace

std::vector<ContextPiece> context_pieces(const GroupMove& m) {
  std::vector<ContextPiece> out;
  if (m.end <= m.begin) return out;
  if (!m.context_sharded()) return {{m.begin, m.end, 0, 0}};
  const ContextShard& L = m.local_cp;
  const ContextShard& R = m.remote_cp;
  for (uint64_t p = m.begin; p < m.end;) {
    if (!L.holds(p)) {
      // The start of the local shard's next chunk.
      const uint64_t chunk = p / L.interleave;
      const uint64_t ahead = (L.rank + L.size - chunk % L.size) % L.size;
      p = (chunk + ahead) * L.interleave;
      continue;
    }
    const uint64_t next =
        std::min({m.end, (p / L.interleave + 1) * L.interleave, (p / R.interleave + 1) * R.interleave});
    const uint64_t lq = L.local_of(p), rq = R.local_of(p), n = next - p;
    const uint32_t shard = R.shard_of(p);
    if (!out.empty() && out.back().end == lq && out.back().shard == shard && out.back().delta == rq - lq) {
      out.back().end += n;
    } else {
      out.push_back({lq, lq + n, rq - lq, shard});
    }
    p = next;
  }
  return out;
}

std::vector<bool> shards_needed(const ContextShard& local, const ContextShard& remote) {
  std::vector<bool> need(remote.size, false);
  // The pattern repeats every lcm of the two cycles; past a bound (hostile
  // sizes), every shard counts as needed, which is never wrong for a plan.
  const uint64_t lc = local.interleave * local.size, rc = remote.interleave * remote.size;
  const uint64_t period = std::lcm(lc, rc);
  if (period / local.interleave > (uint64_t{1} << 20)) {
    need.assign(remote.size, true);
    return need;
  }
  size_t found = 0;
  for (uint64_t chunk = local.rank; chunk * local.interleave < period && found < remote.size; chunk += local.size) {
    const uint64_t a = chunk * local.interleave, b = a + local.interleave;
    for (uint64_t rc0 = a / remote.interleave; rc0 * remote.interleave < b && found < remote.size; ++rc0) {
      const size_t s = rc0 % remote.size;
      if (!need[s]) need[s] = true, ++found;
    }
  }
  return need;
}

bool listed_ascending(std::span<const int64_t> ids) {
  int64_t prev = -1;
  for (int64_t id : ids) {
    if (id < 0) continue;
    if (id <= prev) return false;
    prev = id;
  }
  return true;
}

Result<std::vector<GroupMove>> group_moves(const Layout& local, std::span<const Layout> remotes,
                                           const Request& request) {
  for (const auto& [name, blocks] : request.blocks) {
    const Group* g = local.find_group(name);
    if (g == nullptr) return Status::invalid_argument("request names group " + q(name) + ", which the layout lacks");
    if (!g->transfer) {
      return Status::invalid_argument("request names group " + q(name) + ", whose transfer is false");
    }
  }
  if (request.skip_tokens > request.num_tokens) {
    return Status::invalid_argument("skip_tokens " + std::to_string(request.skip_tokens) + " exceeds num_tokens " +
                                    std::to_string(request.num_tokens));
  }
  std::vector<GroupMove> moves;
  for (size_t gi = 0; gi < local.groups.size(); ++gi) {
    const Group& g = local.groups[gi];
    if (!g.transfer) continue;
    std::string where = "group " + q(g.name);
    auto it = request.blocks.find(g.name);
    if (it == request.blocks.end()) {
      return Status::invalid_argument("request has no block lists for " + where + " (its transfer is true)");
    }
    GroupMove m;
    m.local_group = gi;
    const Group* rg0 = nullptr;
    for (const Layout& r : remotes) {
      const Group* rg = r.find_group(g.name);
      if (rg == nullptr) return Status::incompatible(where + " is missing on remote rank " + std::to_string(r.rank()));
      m.remote_group.push_back(static_cast<size_t>(rg - r.groups.data()));
      rg0 = rg;
    }
    if (rg0 == nullptr) return Status::invalid_argument("no remote layouts given");
    const std::vector<int64_t>& lids = it->second.local;
    const std::vector<int64_t>& rids = it->second.remote;
    KVB_RETURN_IF_ERROR(check_distinct(where, "local", lids));
    KVB_RETURN_IF_ERROR(check_distinct(where, "remote", rids));
    m.local_ppb = g.positions_per_block();
    m.remote_ppb = rg0->positions_per_block();
    m.local_cp = g.context;
    m.remote_cp = rg0->context;
    for (size_t r = 0; r < remotes.size(); ++r) {
      m.remote_shard.push_back(remotes[r].groups[m.remote_group[r]].context.rank);
    }
    const uint64_t tps = g.tokens_per_state;
    uint64_t first_token = request.skip_tokens;
    switch (g.kind) {
      case GroupKind::kSlidingWindow:
        if (request.num_tokens > *g.window_tokens) {
          first_token = std::max(first_token, request.num_tokens - *g.window_tokens);
        }
        [[fallthrough]];
      case GroupKind::kAttention: {
        m.begin = first_token / tps;
        m.end = first_token >= request.num_tokens ? m.begin : ceil_div(request.num_tokens, tps);
        if (m.end == m.begin) m.begin = m.end = 0;
        // The entries the moving positions use on each side, by position
        // on the shards (the positions themselves when nothing is sharded).
        uint64_t lfirst = m.begin, llast = m.end, rfirst = m.begin, rlast = m.end;
        if (m.context_sharded()) {
          lfirst = rfirst = UINT64_MAX;
          llast = rlast = 0;
          for (const ContextPiece& piece : context_pieces(m)) {
            lfirst = std::min(lfirst, piece.begin), llast = std::max(llast, piece.end);
            rfirst = std::min(rfirst, piece.begin + piece.delta), rlast = std::max(rlast, piece.end + piece.delta);
          }
          if (llast == 0) lfirst = rfirst = 0;
        }
        const uint64_t lneed = llast == 0 ? 0 : ceil_div(llast, m.local_ppb);
        const uint64_t rneed = rlast == 0 ? 0 : ceil_div(rlast, m.remote_ppb);
        // Each side's list covers the request's tokens on that side, whatever
        // the local rank reads of it (a sharded side's ranks share one list,
        // as long as shard 0 needs).
        const uint64_t llen = m.end > 0 ? g.entries_for_tokens(request.num_tokens) : 0;
        const uint64_t rlen = m.end > 0 ? rg0->entries_for_tokens(request.num_tokens) : 0;
        KVB_RETURN_IF_ERROR(check_ids(where, "local", lids, g.num_blocks, lfirst / m.local_ppb, lneed, llen));
        KVB_RETURN_IF_ERROR(check_ids(where, "remote", rids, rg0->num_blocks, rfirst / m.remote_ppb, rneed, rlen));
        m.local_ids = lids;
        m.remote_ids = rids;
        break;
      }
      case GroupKind::kState: {
        // The request's final state: the last listed block on each side. The
        // lists may differ in length. Nothing moves when the receiver already
        // has every token.
        KVB_RETURN_IF_ERROR(check_ids(where, "local", lids, g.num_blocks, 0, 0));
        KVB_RETURN_IF_ERROR(check_ids(where, "remote", rids, rg0->num_blocks, 0, 0));
        if (request.skip_tokens >= request.num_tokens) break;
        if (lids.empty() || rids.empty()) {
          return Status::invalid_argument(where + " is a state group: its " + (lids.empty() ? "local" : "remote") +
                                          " block list must name the block holding the final state");
        }
        if (lids.back() < 0 || rids.back() < 0) {
          return Status::invalid_argument(where + " is a state group: the last " +
                                          (lids.back() < 0 ? "local" : "remote") +
                                          " block holds the final state and cannot be -1");
        }
        m.local_ppb = m.remote_ppb = 1;
        m.begin = 0;
        m.end = 1;
        m.local_ids = {lids.back()};
        m.remote_ids = {rids.back()};
        break;
      }
      case GroupKind::kScratch: {
        if (lids.size() != 1 || rids.size() != 1) {
          return Status::invalid_argument(where + " is a scratch group: it needs exactly one block per side, got " +
                                          std::to_string(lids.size()) + " local and " + std::to_string(rids.size()) +
                                          " remote");
        }
        if (m.local_ppb != m.remote_ppb) {
          return Status::incompatible(where + " is a scratch group whose blocks hold " + std::to_string(m.local_ppb) +
                                      " positions locally and " + std::to_string(m.remote_ppb) + " remotely");
        }
        KVB_RETURN_IF_ERROR(check_ids(where, "local", lids, g.num_blocks, 0, 1));
        KVB_RETURN_IF_ERROR(check_ids(where, "remote", rids, rg0->num_blocks, 0, 1));
        m.begin = 0;
        m.end = m.local_ppb;
        m.local_ids = lids;
        m.remote_ids = rids;
        break;
      }
    }
    moves.push_back(std::move(m));
  }
  return moves;
}

}  // namespace kvbridge::plan_internal
