// Submitting a transfer: check every item, resolve it to a transport Copy
// (merging items adjacent on both sides), hold the local regions, split into
// chunks, hand to the transfer table. A prepared list does the checking and
// resolving once; its submits pick items by index.
//
// All checks happen under the registry lock before anything is queued, so a
// batch with one bad item moves nothing, and a region cannot be deregistered
// between its check and its use (it is held in use from here until the
// transfer ends, and by a prepared list until it is released).
#include <algorithm>

#include "common/checked.h"
#include "engine/engine_impl.h"

namespace kvbridge::engine_internal {
namespace {

// Whether `c` continues `last` on both sides (the same peer segment).
bool continues(const transport::Copy& last, const transport::Copy& c) {
  return last.segment == c.segment && last.local + last.bytes == c.local && last.remote + last.bytes == c.remote;
}

// Appends `c`, merged into the last copy when adjacent on both sides: a
// planner's consecutive blocks, or a caller's per-block items, cost the
// transport one operation (one memcpy, iovec, put or get) each run.
void append_copy(std::vector<transport::Copy>& copies, const transport::Copy& c) {
  if (!copies.empty() && continues(copies.back(), c)) {
    copies.back().bytes += c.bytes;
  } else {
    copies.push_back(c);
  }
}

}  // namespace

Status EngineImpl::check_items_locked(const Peer& p, TransferOp op, std::span<const TransferItem> items, size_t index0,
                                      std::vector<transport::Copy>* copies, std::vector<RegionId>* regions, bool merge,
                                      Kinds* kinds, ItemsExtent* extent) const {
  const std::string& peer_name = p.metadata.name;
  // Error messages are built only on error: a context string per item would
  // cost more than the checks for a large batch of small items.
  auto what = [index0](size_t i) { return "item " + std::to_string(index0 + i); };
  const uint8_t needs = op == TransferOp::kRead ? 1 : 2;
  // The items' copies go after what `copies` holds, merged only among
  // themselves: a copy before them is another run's (resolve_runs_locked()
  // repeats a run's copies by their range, which must hold all its bytes).
  // Written in place and cut to size on the way out, error or not.
  const size_t base = copies->size();
  copies->resize(base + items.size());
  transport::Copy* out = copies->data() + base;
  size_t n = 0;  // copies written
  struct Trim {
    std::vector<transport::Copy>* copies;
    size_t base;
    const size_t& n;
    ~Trim() { copies->resize(base + n); }
  };
  const Trim trim{copies, base, n};
  // Items come in runs of one region on each side: the last ones looked
  // up are kept (a local region, once found, passes the same bounds check
  // registry_->resolve() makes), and whether the local one is device memory.
  RegionId last_region = 0;
  const Region* local_region = nullptr;
  bool last_device = false;
  RegionId last_remote = 0;
  const Peer::RemoteRegion* remote_region = nullptr;
  for (size_t i = 0; i < items.size(); ++i) {
    const TransferItem& item = items[i];
    if (item.bytes == 0) return Status::invalid_argument(what(i) + " has 0 bytes");
    // What depends on the regions alone (the peer's access, the pair of
    // memory kinds, the regions held) is checked where they change.
    bool changed = false;
    if (local_region == nullptr || item.local != last_region) {
      local_region = registry_->find(item.local);
      last_region = item.local;
      if (local_region != nullptr) last_device = local_region->memory != "host";
      if (regions->empty() || regions->back() != item.local) regions->push_back(item.local);
      changed = true;
    }
    uint64_t local_end = 0;
    if (local_region == nullptr || !checked_add(item.local_offset, item.bytes, &local_end) ||
        local_end > local_region->bytes) {
      Result<uint8_t*> resolved = registry_->resolve(item.local, item.local_offset, item.bytes, std::string_view());
      return Status(resolved.ok() ? Code::kInternal : resolved.error().code(),
                    what(i) + (resolved.ok() ? ": resolved where the registry did not" : resolved.error().message()));
    }
    if (remote_region == nullptr || item.remote != last_remote) {
      auto found = p.regions.find(item.remote);
      if (found == p.regions.end()) {
        return Status::not_found(what(i) + ": peer '" + peer_name + "' advertises no region " +
                                 std::to_string(item.remote) + " (connect() again with fresh metadata?)");
      }
      remote_region = &found->second;
      last_remote = item.remote;
      if ((remote_region->access & needs) == 0) {
        return Status::permission_denied(what(i) + ": peer '" + peer_name + "' region " + std::to_string(item.remote) +
                                         " does not allow remote " + (op == TransferOp::kRead ? "reads" : "writes"));
      }
      changed = true;
    }
    const Peer::RemoteRegion& r = *remote_region;
    uint64_t end = 0;
    if (!checked_add(item.remote_offset, item.bytes, &end) || end > r.region.bytes) {
      return Status::out_of_range(what(i) + ": remote range [" + std::to_string(item.remote_offset) + ", " +
                                  std::to_string(item.remote_offset) + " + " + std::to_string(item.bytes) +
                                  ") is outside peer '" + peer_name + "' region " + std::to_string(item.remote) +
                                  " of " + std::to_string(r.region.bytes) + " bytes");
    }
    if (changed) kinds->note(last_device, r.device, index0 + i);
    if (extent != nullptr) {
      if (i == 0) {
        extent->local_region = local_region;
        extent->remote_region = remote_region;
      }
      // A region that changes after the first item is another region.
      extent->one_region = extent->one_region && (i == 0 || !changed);
      extent->local_low = std::min(extent->local_low, item.local_offset);
      extent->local_high = std::max(extent->local_high, local_end);
      extent->remote_low = std::min(extent->remote_low, item.remote_offset);
      extent->remote_high = std::max(extent->remote_high, end);
      extent->bytes += item.bytes;
    }
    const transport::Copy c{local_region->base + item.local_offset, r.region.base + item.remote_offset, item.bytes,
                            r.region.segment};
    if (merge && n > 0 && continues(out[n - 1], c)) {
      out[n - 1].bytes += c.bytes;
    } else {
      out[n++] = c;
    }
  }
  return Status();
}

Status EngineImpl::choose_route_locked(const Peer& p, const Kinds& kinds, Route* route) const {
  const std::string& peer_name = p.metadata.name;
  auto kind = [](bool device) { return device ? "device" : "host"; };
  for (const Peer::PeerLink& l : p.links) {
    bool all = true;
    for (int a = 0; a < 2; ++a) {
      for (int b = 0; b < 2; ++b) all = all && (!kinds.pairs[a][b] || l.moves(a, b));
    }
    if (all) {
      route->link = &l;
      route->device = kinds.pairs[0][1] || kinds.pairs[1][0] || kinds.pairs[1][1];
      return Status();
    }
  }
  // Name the first pair no link moves, and what the peer's links are.
  std::string have;
  for (const Peer::PeerLink& l : p.links) have += (have.empty() ? "" : ", ") + l.transport;
  for (int a = 0; a < 2; ++a) {
    for (int b = 0; b < 2; ++b) {
      if (!kinds.pairs[a][b]) continue;
      bool any = false;
      for (const Peer::PeerLink& l : p.links) any = any || l.moves(a, b);
      if (any) continue;
      return Status::unavailable(kinds.what(a, b) + ": no transport to peer '" + peer_name + "' moves " + kind(a) +
                                 " memory here to " + kind(b) + " memory there (its transports: " + have +
                                 "; cuda_ipc needs device memory on the peer's side and the same host; "
                                 "stage device memory through a registered host buffer otherwise)");
    }
  }
  return Status::unavailable("the items of this batch need more than one of the transports to peer '" + peer_name +
                             "' (" + have + "): submit host and device memory in separate batches");
}

Status EngineImpl::resolve_locked(const Peer& p, TransferOp op, std::span<const TransferItem> items,
                                  std::vector<transport::Copy>* copies, std::vector<RegionId>* regions, bool merge,
                                  Route* route) const {
  Kinds kinds;
  KVB_RETURN_IF_ERROR(check_items_locked(p, op, items, 0, copies, regions, merge, &kinds));
  std::sort(regions->begin(), regions->end());
  regions->erase(std::unique(regions->begin(), regions->end()), regions->end());
  return choose_route_locked(p, kinds, route);
}

Result<TransferId> EngineImpl::start_transfer(const Peer& p, const Route& route, TransferOp op,
                                              std::vector<transport::Copy> copies, std::vector<RegionHold> holds,
                                              uint64_t bytes, size_t items, SubmitOptions options,
                                              std::shared_ptr<const CopyProgram> program,
                                              std::vector<std::shared_ptr<const HeldRegions>> held) {
  auto refuse = [&](Status why) {
    for (const RegionHold& hold : holds) Registry::release(hold);
    return why;
  };
  if (options.notification.size() > kMaxControlPayload) {
    return refuse(Status::resource_exhausted("submit: notification is " + std::to_string(options.notification.size()) +
                                             " bytes, more than " + std::to_string(kMaxControlPayload)));
  }
  const bool ready = options.ready_event != 0 || !options.ready_event_handles.empty();
  if (ready && !route.device) {
    return refuse(
        Status::invalid_argument("submit: ready events order copies of device memory, and this transfer "
                                 "moves host memory only"));
  }
  if (options.ready_event_handles.size() > kMaxReadyEvents) {
    return refuse(Status::invalid_argument("submit: " + std::to_string(options.ready_event_handles.size()) +
                                           " ready event handles, more than " + std::to_string(kMaxReadyEvents)));
  }
  if (options.timeout.count() <= 0) options.timeout = options_.default_timeout;
  auto t = std::make_shared<Transfer>();
  t->verify_content = options.verify_content;
  t->device = route.device;
  t->op = op;
  t->notification = std::move(options.notification);
  t->timeout = options.timeout;
  t->on_end = std::move(options.on_end);
  t->bytes_total = bytes;
  t->holds = std::move(holds);
  t->held = std::move(held);
  t->connection = p.connection;
  t->peer_name = p.text;
  t->link = route.link->link;
  t->channel = p.channel;
  // A transfer of device memory is one run: one batched copy on the device
  // (its links cut it into batches themselves), not one per engine thread.
  const size_t threads = route.device ? 1 : options_.threads;
  if (program != nullptr) {
    std::vector<std::vector<CopyRun>> parts = split_runs(*program, threads);
    t->chunks.reset(parts.size());
    for (size_t i = 0; i < parts.size(); ++i) {
      t->chunks[i].program = program;
      t->chunks[i].runs = std::move(parts[i]);
    }
  } else {
    split_copies(std::move(copies), threads, &t->chunks);
  }
  for (Chunk& c : t->chunks) {
    c.control.ready_events = options.ready_event_handles;
    c.control.ready_event = options.ready_event;
  }
  t->start = Clock::now();
  t->deadline = t->start + t->timeout;
  // A transfer of device memory never runs inside submit(): it may wait for
  // the producer's events, and its copy is the device's work anyway.
  const bool here =
      t->notification.empty() && t->bytes_total <= options_.inline_bytes && t->link->runs_inline() && !route.device;
  metrics_.submitted(items);
  Result<TransferId> id = transfers_->start(t, here);
  if (!id.ok()) {
    for (const RegionHold& hold : t->holds) Registry::release(hold);
    metrics_.unsubmitted(items);
  }
  return id;
}

Result<TransferId> EngineImpl::submit(PeerId peer, TransferOp op, std::span<const TransferItem> items,
                                      SubmitOptions options) {
  if (items.empty()) return Status::invalid_argument("submit: the batch is empty");
  std::vector<transport::Copy> copies;
  std::vector<RegionId> regions;  // the local regions the items use, each once
  std::vector<RegionHold> holds;
  std::shared_ptr<Peer> p;
  Route route;
  uint64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    KVB_ASSIGN_OR_RETURN(p, find_peer_locked(peer, "submit"));
    KVB_RETURN_IF_ERROR(resolve_locked(*p, op, items, &copies, &regions, true, &route).with_context("submit"));
    for (RegionId r : regions) holds.push_back(registry_->acquire(r));
  }
  for (const TransferItem& item : items) bytes += item.bytes;
  return start_transfer(*p, route, op, std::move(copies), std::move(holds), bytes, items.size(), std::move(options));
}

Result<PreparedId> EngineImpl::prepare(PeerId peer, TransferOp op, std::span<const TransferItem> items) {
  if (items.empty()) return Status::invalid_argument("prepare: the list is empty");
  if (items.size() > UINT32_MAX) return Status::resource_exhausted("prepare: more than 2^32 - 1 items");
  auto list = std::make_shared<PreparedList>();
  list->op = op;
  std::lock_guard<std::mutex> lock(mu_);
  KVB_ASSIGN_OR_RETURN(list->peer, find_peer_locked(peer, "prepare"));
  std::vector<RegionId> regions;
  auto literal = std::make_shared<CopyList>();
  KVB_RETURN_IF_ERROR(check_items_locked(*list->peer, op, items, 0, &literal->copies, &regions, false, &list->kinds)
                          .with_context("prepare"));
  KVB_RETURN_IF_ERROR(choose_route_locked(*list->peer, list->kinds, &list->route).with_context("prepare"));
  std::sort(regions.begin(), regions.end());
  regions.erase(std::unique(regions.begin(), regions.end()), regions.end());
  literal->count_ends();
  list->literal = std::move(literal);
  list->items.assign(items.begin(), items.end());
  list->generation = list->peer->generation;
  // The peer regions named, each once (items come in runs of one region).
  for (size_t i = 0; i < items.size(); ++i) {
    const RegionId r = items[i].remote;
    if (i > 0 && r == items[i - 1].remote) continue;
    list->remote.try_emplace(r, list->peer->regions.at(r).region);
  }
  for (RegionId r : regions) list->holds.push_back(registry_->acquire(r));
  const PreparedId id = next_prepared_++;
  prepared_.emplace(id, std::move(list));
  return id;
}

Result<std::shared_ptr<EngineImpl::PreparedList>> EngineImpl::live_list_locked(PreparedId id) const {
  auto it = prepared_.find(id);
  if (it == prepared_.end()) return Status::not_found("prepared list " + std::to_string(id) + " is unknown");
  const std::shared_ptr<PreparedList>& list = it->second;
  const Peer& p = *list->peer;
  auto now = peers_.find(p.id);
  if (now == peers_.end() || now->second != list->peer || !p.channel->health().ok()) {
    return Status::unavailable("prepared list " + std::to_string(id) + ": its peer " + *p.text +
                               " is gone or was connected again: prepare again");
  }
  if (p.generation != list->generation) {
    // The peer's registrations changed: every region the list names must
    // be where it was.
    for (const auto& [region, was] : list->remote) {
      auto r = p.regions.find(region);
      if (r == p.regions.end() || !(r->second.region == was)) {
        return Status::unavailable("prepared list " + std::to_string(id) + ": peer region " + std::to_string(region) +
                                   " moved or is gone: prepare again");
      }
    }
    list->generation = p.generation;
  }
  return list;
}

Result<TransferId> EngineImpl::submit(PreparedId id, std::span<const uint32_t> selection, SubmitOptions options) {
  if (selection.empty()) return Status::invalid_argument("submit: the selection is empty");
  std::shared_ptr<PreparedList> list;
  std::vector<RegionHold> holds;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Result<std::shared_ptr<PreparedList>> live = live_list_locked(id);
    if (!live.ok()) return live.error().with_context("submit");
    list = std::move(*live);
    // The transfer holds the list's regions too: it may outlive the list.
    for (const RegionHold& hold : list->holds) {
      hold->fetch_add(1, std::memory_order_acq_rel);
      holds.push_back(hold);
    }
  }
  std::vector<transport::Copy> copies;
  copies.reserve(selection.size());
  uint64_t bytes = 0;
  const std::vector<transport::Copy>& all = list->literal->copies;
  const size_t n = all.size();
  for (size_t k = 0; k < selection.size(); ++k) {
    const uint32_t i = selection[k];
    if (i >= n) {
      for (const RegionHold& hold : holds) Registry::release(hold);
      return Status::out_of_range("submit: selection " + std::to_string(k) + " is index " + std::to_string(i) +
                                  ", past the " + std::to_string(n) + " items of prepared list " + std::to_string(id));
    }
    const transport::Copy& c = all[i];
    append_copy(copies, c);
    bytes += c.bytes;
  }
  return start_transfer(*list->peer, list->route, list->op, std::move(copies), std::move(holds), bytes,
                        selection.size(), std::move(options));
}

Status EngineImpl::release_prepared(PreparedId id) {
  std::shared_ptr<PreparedList> list;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = prepared_.find(id);
    if (it == prepared_.end()) {
      auto m = moves_.find(id);
      if (m == moves_.end()) {
        return Status::not_found("release_prepared: list " + std::to_string(id) + " is unknown");
      }
      moves_.erase(m);  // its regions are released with the last transfer using it
      return Status();
    }
    list = std::move(it->second);
    prepared_.erase(it);
  }
  for (const RegionHold& hold : list->holds) Registry::release(hold);
  return Status();
}

}  // namespace kvbridge::engine_internal
