// Batches given as runs (Engine::submit with ItemRun): literal runs are
// checked and resolved as submit() checks items; a moved run is checked as
// a whole, by its literal run's extent against the regions it names or,
// naming a prepared table of moves (Engine::prepare_moves), against the
// room every move of the table leaves, found once. The transfer holds a
// CopyProgram that its engine threads expand as they copy (transfers.h).
#include <algorithm>

#include "common/checked.h"
#include "engine/engine_impl.h"
#include "engine/metadata.h"

namespace kvbridge::engine_internal {

namespace {

using Wide = __int128;

// The literal offsets [min, max] a move by `shift` (modulo 2^64, read as a
// signed difference) keeps inside a region of `bytes`.
void narrow(uint64_t shift, uint64_t bytes, Wide* min, Wide* max) {
  const Wide d = static_cast<int64_t>(shift);
  *min = std::max(*min, -d);
  *max = std::min(*max, static_cast<Wide>(bytes) - d);
}

uint64_t clamp(Wide v) { return v < 0 ? 0 : v > static_cast<Wide>(UINT64_MAX) ? UINT64_MAX : static_cast<uint64_t>(v); }

}  // namespace

Status EngineImpl::check_moves_locked(const Peer& p, PreparedMoves& m, TransferOp op, PreparedId id) const {
  // Named only on error: this runs for each table of each submit.
  auto table = [id] { return "prepared table of moves " + std::to_string(id); };
  if (m.op != op) {
    return Status::invalid_argument(table() + " was prepared for " + (m.op == TransferOp::kRead ? "reads" : "writes"));
  }
  if (m.peer.get() != &p) {
    return Status::unavailable(table() + " was prepared for another peer or an earlier connection to " + *p.text +
                               ": prepare again");
  }
  if (p.generation != m.generation) {
    // The peer's registrations changed: every region the table names must
    // be where it was.
    for (const auto& [region, was] : m.remote) {
      auto r = p.regions.find(region);
      if (r == p.regions.end() || !(r->second.region == was)) {
        return Status::unavailable(table() + ": peer region " + std::to_string(region) +
                                   " moved or is gone: prepare again");
      }
    }
    m.generation = p.generation;
  }
  return Status();
}

Result<PreparedId> EngineImpl::prepare_moves(PeerId peer, TransferOp op, std::span<const RunMove> moves) {
  if (moves.empty()) return Status::invalid_argument("prepare_moves: no moves");
  auto m = std::make_shared<PreparedMoves>();
  m->op = op;
  std::lock_guard<std::mutex> lock(mu_);
  KVB_ASSIGN_OR_RETURN(m->peer, find_peer_locked(peer, "prepare_moves"));
  const Peer& p = *m->peer;
  const uint8_t needs = op == TransferOp::kRead ? 1 : 2;
  Wide local_min = 0, local_max = static_cast<Wide>(UINT64_MAX), remote_min = 0, remote_max = local_max;
  std::vector<RegionId> regions;
  for (size_t k = 0; k < moves.size(); ++k) {
    const RunMove& mv = moves[k];
    const std::string what = "prepare_moves: move " + std::to_string(k);
    const Region* r = registry_->find(mv.local);
    if (r == nullptr)
      return Status::not_found(what + ": local region " + std::to_string(mv.local) + " is not registered");
    auto f = p.regions.find(mv.remote);
    if (f == p.regions.end()) {
      return Status::not_found(what + ": peer '" + p.metadata.name + "' advertises no region " +
                               std::to_string(mv.remote) + " (connect() again with fresh metadata?)");
    }
    if ((f->second.access & needs) == 0) {
      return Status::permission_denied(what + ": peer '" + p.metadata.name + "' region " + std::to_string(mv.remote) +
                                       " does not allow remote " + (op == TransferOp::kRead ? "reads" : "writes"));
    }
    narrow(mv.local_shift, r->bytes, &local_min, &local_max);
    narrow(mv.remote_shift, f->second.region.bytes, &remote_min, &remote_max);
    m->moves.push_back({reinterpret_cast<uintptr_t>(r->base) + mv.local_shift, f->second.region.base + mv.remote_shift,
                        f->second.region.segment});
    m->kinds.note(r->memory != "host", f->second.device, k, true);
    m->remote[mv.remote] = f->second.region;
    regions.push_back(mv.local);
  }
  m->local_min = clamp(local_min);
  m->local_max = clamp(local_max);
  m->remote_min = clamp(remote_min);
  m->remote_max = clamp(remote_max);
  std::sort(regions.begin(), regions.end());
  regions.erase(std::unique(regions.begin(), regions.end()), regions.end());
  auto held = std::make_shared<HeldRegions>();
  for (RegionId r : regions) held->holds.push_back(registry_->acquire(r));
  m->held = std::move(held);
  m->generation = p.generation;
  const PreparedId id = next_prepared_++;
  moves_.emplace(id, std::move(m));
  return id;
}

Status EngineImpl::add_moved_run_locked(const Peer& p, TransferOp op, const ItemRun& run, size_t k, const RunLiteral& l,
                                        CopyProgram* program, std::vector<RegionId>* regions, Kinds* kinds,
                                        uint64_t* bytes, uint64_t* count,
                                        std::vector<std::shared_ptr<PreparedMoves>>* tables) const {
  auto what = [k] { return "run " + std::to_string(k); };
  const uint64_t end = run.first + run.count;
  // The deltas that move the literal run's copies to local address
  // `local_at` and peer address `remote_at` (a region's base plus a shift,
  // modulo 2^64) in peer segment `segment`.
  auto move_of = [&l](uintptr_t local_at, uint64_t remote_at, uint32_t segment) {
    return CopyMove{local_at - reinterpret_cast<uintptr_t>(l.local_region->base),
                    remote_at - l.remote_region->region.base, segment};
  };
  if (!l.one_region) {
    return Status::invalid_argument(what() + " moves items [" + std::to_string(run.first) + ", " + std::to_string(end) +
                                    "), which name more than one local or peer region");
  }
  if (run.moves != 0) {
    // One moved run per move of a prepared table: one check of the
    // literal extent against the room every move leaves.
    auto t = moves_.find(run.moves);
    if (t == moves_.end()) {
      return Status::not_found(what() + ": prepared table of moves " + std::to_string(run.moves) + " is unknown");
    }
    PreparedMoves& m = *t->second;
    KVB_RETURN_IF_ERROR(check_moves_locked(p, m, op, run.moves).with_context(what()));
    if (hooks_.refuse_table && hooks_.refuse_table()) {
      return Status::unavailable(what() + ": prepared table of moves " + std::to_string(run.moves) +
                                 ": its peer regions moved (testing fault refuse-tables): prepare again");
    }
    if (l.local_low < m.local_min || l.local_high > m.local_max || l.remote_low < m.remote_min ||
        l.remote_high > m.remote_max) {
      return Status::out_of_range(what() + ": items [" + std::to_string(run.first) + ", " + std::to_string(end) +
                                  ") span local [" + std::to_string(l.local_low) + ", " + std::to_string(l.local_high) +
                                  ") and peer [" + std::to_string(l.remote_low) + ", " + std::to_string(l.remote_high) +
                                  "), outside what every move of " + "prepared table " + std::to_string(run.moves) +
                                  " keeps in its regions (local [" + std::to_string(m.local_min) + ", " +
                                  std::to_string(m.local_max) + "], peer [" + std::to_string(m.remote_min) + ", " +
                                  std::to_string(m.remote_max) + "])");
    }
    for (int a = 0; a < 2; ++a) {
      for (int b = 0; b < 2; ++b) {
        if (m.kinds.pairs[a][b]) kinds->note(a, b, k, true);
      }
    }
    // One table run: its moves' deltas from the literal run's regions,
    // computed once per pair of regions and shared, read only, by every
    // transfer that uses them.
    const uintptr_t local_base = reinterpret_cast<uintptr_t>(l.local_region->base);
    const uint64_t remote_base = l.remote_region->region.base;
    if (m.deltas == nullptr || m.deltas_local_base != local_base || m.deltas_remote_base != remote_base) {
      auto deltas = std::make_shared<std::vector<CopyMove>>();
      deltas->reserve(m.moves.size());
      for (const PreparedMoves::Move& mv : m.moves) deltas->push_back(move_of(mv.local_at, mv.remote_at, mv.segment));
      m.deltas = std::move(deltas);
      m.deltas_local_base = local_base;
      m.deltas_remote_base = remote_base;
    }
    CopyRun c;
    c.first = l.copy_first;
    c.count = l.copy_count;
    c.moves = m.deltas->data();
    c.move_count = m.deltas->size();
    program->runs.push_back(c);
    program->tables.push_back(m.deltas);
    *bytes += l.bytes * m.moves.size();
    *count += run.count * m.moves.size();
    tables->push_back(t->second);
    return Status();
  }
  // The local side: the literal run's extent, moved, inside `run.local`.
  // Shifts are added modulo 2^64 (a later layer may lie lower); the
  // moved extent must then lie inside the region without wrapping.
  const uint64_t low = l.local_low + run.local_shift, extent = l.local_high - l.local_low;
  const Region* local_region = registry_->find(run.local);
  uint64_t local_end = 0;
  if (local_region == nullptr || !checked_add(low, extent, &local_end) || local_end > local_region->bytes) {
    Result<uint8_t*> to = registry_->resolve(run.local, low, extent, std::string_view());
    return Status(to.ok() ? Code::kInternal : to.error().code(),
                  what() + (to.ok() ? ": resolved where the registry did not" : to.error().message()));
  }
  // The peer's side: its region, access and extent.
  const std::string& peer_name = p.metadata.name;
  auto found = p.regions.find(run.remote);
  if (found == p.regions.end()) {
    return Status::not_found(what() + ": peer '" + peer_name + "' advertises no region " + std::to_string(run.remote) +
                             " (connect() again with fresh metadata?)");
  }
  const Peer::RemoteRegion& r = found->second;
  if ((r.access & (op == TransferOp::kRead ? 1 : 2)) == 0) {
    return Status::permission_denied(what() + ": peer '" + peer_name + "' region " + std::to_string(run.remote) +
                                     " does not allow remote " + (op == TransferOp::kRead ? "reads" : "writes"));
  }
  const uint64_t remote_low = l.remote_low + run.remote_shift;
  uint64_t remote_end = 0;
  if (!checked_add(remote_low, l.remote_high - l.remote_low, &remote_end) || remote_end > r.region.bytes) {
    return Status::out_of_range(what() + ": remote range [" + std::to_string(l.remote_low) + " + " +
                                std::to_string(run.remote_shift) + ", " + std::to_string(l.remote_high) + " + " +
                                std::to_string(run.remote_shift) + ") is outside peer '" + peer_name + "' region " +
                                std::to_string(run.remote) + " of " + std::to_string(r.region.bytes) + " bytes");
  }
  kinds->note(local_region->memory != "host", r.device, k, true);
  const CopyMove m = move_of(reinterpret_cast<uintptr_t>(local_region->base) + run.local_shift,
                             r.region.base + run.remote_shift, r.region.segment);
  program->runs.push_back({l.copy_first, l.copy_count, true, m.local_delta, m.remote_delta, m.segment});
  regions->push_back(run.local);
  *bytes += l.bytes;
  *count += run.count;
  return Status();
}

Status EngineImpl::resolve_runs_locked(const Peer& p, TransferOp op, std::span<const TransferItem> items,
                                       std::span<const ItemRun> runs, CopyProgram* program,
                                       std::vector<RegionId>* regions, Route* route, uint64_t* bytes, uint64_t* count,
                                       std::vector<std::shared_ptr<PreparedMoves>>* tables) const {
  // What a moved run needs of the literal run it repeats: its copies, and
  // the regions and extents of its items.
  std::vector<RunLiteral> literal;
  auto list = std::make_shared<CopyList>();
  Kinds kinds;
  program->runs.reserve(runs.size());
  for (size_t k = 0; k < runs.size(); ++k) {
    const ItemRun& run = runs[k];
    uint64_t end = 0;
    if (run.count == 0 || !checked_add(run.first, run.count, &end) || end > items.size()) {
      return Status::invalid_argument("run " + std::to_string(k) + " names items [" + std::to_string(run.first) + ", " +
                                      std::to_string(run.first) + " + " + std::to_string(run.count) + ") of " +
                                      std::to_string(items.size()));
    }
    if (!run.moved) {
      RunLiteral l;
      l.first = run.first;
      l.count = run.count;
      l.copy_first = list->copies.size();
      KVB_RETURN_IF_ERROR(check_items_locked(p, op, items.subspan(run.first, run.count), run.first, &list->copies,
                                             regions, true, &kinds, &l));
      l.copy_count = list->copies.size() - l.copy_first;
      program->runs.push_back({l.copy_first, l.copy_count});
      *bytes += l.bytes;
      *count += run.count;
      literal.push_back(l);
      continue;
    }
    // Usually the latest literal run.
    auto from = std::find_if(literal.rbegin(), literal.rend(),
                             [&](const RunLiteral& l) { return l.first == run.first && l.count == run.count; });
    if (from == literal.rend()) {
      return Status::invalid_argument("run " + std::to_string(k) + " moves items [" + std::to_string(run.first) + ", " +
                                      std::to_string(end) + "), which no earlier literal run holds");
    }
    KVB_RETURN_IF_ERROR(add_moved_run_locked(p, op, run, k, *from, program, regions, &kinds, bytes, count, tables));
  }
  std::sort(regions->begin(), regions->end());
  regions->erase(std::unique(regions->begin(), regions->end()), regions->end());
  list->count_ends();
  program->literal = std::move(list);
  return choose_route_locked(p, kinds, route);
}

Result<TransferId> EngineImpl::submit(PeerId peer, TransferOp op, std::span<const TransferItem> items,
                                      std::span<const ItemRun> runs, SubmitOptions options) {
  if (runs.empty()) return Status::invalid_argument("submit: the batch has no runs");
  auto program = std::make_shared<CopyProgram>();
  std::vector<RegionId> regions;
  std::vector<RegionHold> holds;
  std::shared_ptr<Peer> p;
  Route route;
  uint64_t bytes = 0, count = 0;
  std::vector<std::shared_ptr<PreparedMoves>> tables;
  std::vector<std::shared_ptr<const HeldRegions>> held;
  {
    std::lock_guard<std::mutex> lock(mu_);
    KVB_ASSIGN_OR_RETURN(p, find_peer_locked(peer, "submit"));
    KVB_RETURN_IF_ERROR(
        resolve_runs_locked(*p, op, items, runs, program.get(), &regions, &route, &bytes, &count, &tables)
            .with_context("submit"));
    for (RegionId r : regions) holds.push_back(registry_->acquire(r));
    // The transfer holds its tables' regions too (it may outlive a table):
    // one reference to each table's holds.
    for (const std::shared_ptr<PreparedMoves>& t : tables) held.push_back(t->held);
  }
  return start_transfer(*p, route, op, {}, std::move(holds), bytes, count, std::move(options), std::move(program),
                        std::move(held));
}

Result<TransferId> EngineImpl::submit_runs(PreparedId id, std::span<const ItemRun> runs, SubmitOptions options) {
  if (runs.empty()) return Status::invalid_argument("submit: the batch has no runs");
  auto program = std::make_shared<CopyProgram>();
  std::vector<RegionId> regions;
  std::vector<RegionHold> holds;
  std::shared_ptr<PreparedList> list;
  Route route;
  uint64_t bytes = 0, count = 0;
  std::vector<std::shared_ptr<PreparedMoves>> tables;
  std::vector<std::shared_ptr<const HeldRegions>> held;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Result<std::shared_ptr<PreparedList>> live = live_list_locked(id);
    if (!live.ok()) return live.error().with_context("submit");
    list = std::move(*live);
    const Peer& p = *list->peer;
    program->literal = list->literal;
    program->runs.reserve(runs.size());
    const std::vector<uint64_t>& ends = list->literal->ends;
    const uint64_t n = list->items.size();
    Kinds kinds = list->kinds;
    for (size_t k = 0; k < runs.size(); ++k) {
      const ItemRun& run = runs[k];
      uint64_t end = 0;
      if (run.count == 0 || !checked_add(run.first, run.count, &end) || end > n) {
        return Status::invalid_argument("submit: run " + std::to_string(k) + " names items [" +
                                        std::to_string(run.first) + ", " + std::to_string(run.first) + " + " +
                                        std::to_string(run.count) + ") of the " + std::to_string(n) +
                                        " of prepared list " + std::to_string(id));
      }
      if (!run.moved) {
        program->runs.push_back({run.first, run.count});
        bytes += ends[end] - ends[run.first];
        count += run.count;
        continue;
      }
      // The range's extent, found once and kept with the list (a bounded
      // number of ranges: a caller's runs are the same few every time).
      auto e = list->extents.find({run.first, run.count});
      if (e == list->extents.end()) {
        if (list->extents.size() >= 4096) list->extents.clear();
        PreparedList::Extent x;
        for (uint64_t i = run.first; i < end; ++i) {
          const TransferItem& it = list->items[i];
          if (i == run.first) x.local = it.local, x.remote = it.remote;
          x.one_region = x.one_region && it.local == x.local && it.remote == x.remote;
          x.local_low = std::min(x.local_low, it.local_offset);
          x.local_high = std::max(x.local_high, it.local_offset + it.bytes);
          x.remote_low = std::min(x.remote_low, it.remote_offset);
          x.remote_high = std::max(x.remote_high, it.remote_offset + it.bytes);
          x.bytes += it.bytes;
        }
        e = list->extents.emplace(std::make_pair(run.first, run.count), x).first;
      }
      const PreparedList::Extent& x = e->second;
      RunLiteral l;
      l.one_region = x.one_region;
      l.local_region = registry_->find(x.local);  // held by the list
      auto remote = p.regions.find(x.remote);     // where it was (live_list_locked())
      if (l.local_region == nullptr || remote == p.regions.end()) {
        return Status::internal("submit: prepared list " + std::to_string(id) + " names a region that is gone");
      }
      l.remote_region = &remote->second;
      l.local_low = x.local_low;
      l.local_high = x.local_high;
      l.remote_low = x.remote_low;
      l.remote_high = x.remote_high;
      l.bytes = x.bytes;
      l.first = l.copy_first = run.first;
      l.count = l.copy_count = run.count;
      KVB_RETURN_IF_ERROR(
          add_moved_run_locked(p, list->op, run, k, l, program.get(), &regions, &kinds, &bytes, &count, &tables)
              .with_context("submit: prepared list " + std::to_string(id)));
    }
    KVB_RETURN_IF_ERROR(choose_route_locked(p, kinds, &route).with_context("submit"));
    std::sort(regions.begin(), regions.end());
    regions.erase(std::unique(regions.begin(), regions.end()), regions.end());
    for (RegionId r : regions) holds.push_back(registry_->acquire(r));
    // The transfer holds the list's and its tables' regions too: it may
    // outlive them.
    for (const RegionHold& hold : list->holds) {
      hold->fetch_add(1, std::memory_order_acq_rel);
      holds.push_back(hold);
    }
    for (const std::shared_ptr<PreparedMoves>& t : tables) held.push_back(t->held);
  }
  return start_transfer(*list->peer, route, list->op, {}, std::move(holds), bytes, count, std::move(options),
                        std::move(program), std::move(held));
}

}  // namespace kvbridge::engine_internal
