// Submitting a transfer: check every item, resolve it to a transport Copy
// (merging items adjacent on both sides), hold the local regions, split into
// chunks, hand to the transfer table.
//
// All checks happen under the registry lock before anything is queued, so a
// batch with one bad item moves nothing, and a region cannot be deregistered
// between its check and its use (it is held in use from here until the
// transfer ends).
#include <algorithm>

#include "common/checked.h"
#include "engine/engine_impl.h"

namespace kvbridge::engine_internal {

Result<TransferId> EngineImpl::submit(PeerId peer, TransferOp op, std::span<const TransferItem> items,
                                      std::string notification, std::chrono::milliseconds timeout) {
  if (items.empty()) return Status::invalid_argument("submit: the batch is empty");
  if (notification.size() > kMaxControlPayload) {
    return Status::resource_exhausted("submit: notification is " + std::to_string(notification.size()) +
                                      " bytes, more than " + std::to_string(kMaxControlPayload));
  }
  if (timeout.count() <= 0) timeout = options_.default_timeout;
  auto t = std::make_shared<Transfer>();
  t->op = op;
  t->notification = std::move(notification);
  t->timeout = timeout;
  std::vector<transport::Copy> copies;
  copies.reserve(items.size());
  std::vector<RegionId> regions;  // the local regions the items use, each once
  {
    std::lock_guard<std::mutex> lock(mu_);
    KVB_ASSIGN_OR_RETURN(std::shared_ptr<Peer> found, find_peer_locked(peer, "submit"));
    const Peer& p = *found;
    const std::string& peer_name = p.metadata.name;
    // Error messages are built only on error: a context string per item would
    // cost more than the checks for a large batch of small items.
    auto what = [](size_t i) { return "submit: item " + std::to_string(i); };
    const uint8_t needs = op == TransferOp::kRead ? 1 : 2;
    for (size_t i = 0; i < items.size(); ++i) {
      const TransferItem& item = items[i];
      if (item.bytes == 0) return Status::invalid_argument(what(i) + " has 0 bytes");
      Result<uint8_t*> resolved = registry_->resolve(item.local, item.local_offset, item.bytes, std::string_view());
      if (!resolved.ok()) return Status(resolved.error().code(), what(i) + resolved.error().message());
      uint8_t* local = *resolved;
      auto found = p.regions.find(item.remote);
      if (found == p.regions.end()) {
        return Status::not_found(what(i) + ": peer '" + peer_name + "' advertises no region " +
                                 std::to_string(item.remote) + " (connect() again with fresh metadata?)");
      }
      const auto& r = *found;
      if ((r.second.access & needs) == 0) {
        return Status::permission_denied(what(i) + ": peer '" + peer_name + "' region " +
                                         std::to_string(item.remote) + " does not allow remote " +
                                         (op == TransferOp::kRead ? "reads" : "writes"));
      }
      uint64_t end = 0;
      if (!checked_add(item.remote_offset, item.bytes, &end) || end > r.second.region.bytes) {
        return Status::out_of_range(what(i) + ": remote range [" + std::to_string(item.remote_offset) + ", " +
                                    std::to_string(item.remote_offset) + " + " + std::to_string(item.bytes) +
                                    ") is outside peer '" + peer_name + "' region " + std::to_string(item.remote) +
                                    " of " + std::to_string(r.second.region.bytes) + " bytes");
      }
      const uint64_t remote = r.second.region.base + item.remote_offset;
      // Items adjacent on both sides become one copy: a planner's
      // consecutive blocks, or a caller's per-block items, cost the
      // transport one operation (one memcpy, iovec, put or get) each run.
      transport::Copy* last = copies.empty() ? nullptr : &copies.back();
      if (last != nullptr && last->segment == r.second.region.segment && last->local + last->bytes == local &&
          last->remote + last->bytes == remote) {
        last->bytes += item.bytes;
      } else {
        copies.push_back(transport::Copy{local, remote, item.bytes, r.second.region.segment});
      }
      t->bytes_total += item.bytes;
      if (regions.empty() || regions.back() != item.local) regions.push_back(item.local);
    }
    std::sort(regions.begin(), regions.end());
    regions.erase(std::unique(regions.begin(), regions.end()), regions.end());
    for (RegionId r : regions) t->holds.push_back(registry_->acquire(r));
    t->connection = p.connection;
    t->peer_name = peer_text(p.metadata);
    t->link = p.link;
    t->channel = p.channel;
  }
  std::vector<std::vector<transport::Copy>> parts = split_copies(std::move(copies), options_.threads);
  t->chunks.reset(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) t->chunks[i].copies = std::move(parts[i]);
  t->start = Clock::now();
  t->deadline = t->start + timeout;
  const bool here = t->notification.empty() && t->bytes_total <= options_.inline_bytes && t->link->runs_inline();
  metrics_.submitted(items.size());
  Result<TransferId> id = transfers_->start(t, here);
  if (!id.ok()) {
    for (const RegionHold& hold : t->holds) Registry::release(hold);
    metrics_.unsubmitted(items.size());
    return id;
  }
  return id;
}

}  // namespace kvbridge::engine_internal
