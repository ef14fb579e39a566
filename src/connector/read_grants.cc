// A pull-mode prefill rank's read grants (read_grants.h).
#include "connector/read_grants.h"

namespace kvbridge::connector {

ReadGrants::~ReadGrants() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [request, h] : held_) revoke_locked(h);
}

Result<ReadGrants::Places> ReadGrants::places_of(const Blocks& blocks) const {
  Places out;
  for (const auto& [name, ids] : blocks) {
    KVB_ASSIGN_OR_RETURN(BlockPlaces p, block_places(layout_, *layout_.find_group(name), ids));
    const uint64_t at = out.ranges.size();
    out.ranges.reserve(at + p.spans.size());
    for (const TensorSpan& s : p.spans) out.ranges.push_back({regions_[s.tensor], s.offset, s.bytes});
    for (const BlockPlaces::Repeat& r : p.repeats) {
      out.repeats.push_back({at + r.first, r.count, regions_[r.tensor], r.shift});
    }
  }
  return out;
}

Result<bool> ReadGrants::hand_off(const std::string& request, Blocks blocks) {
  // Checked here, cheaply; the spans are made by the first grant.
  for (const auto& [name, ids] : blocks) {
    const Group* g = layout_.find_group(name);
    if (g == nullptr) {
      return Status::invalid_argument("hand_off of request '" + request + "': the layout has no group '" + name + "'");
    }
    for (int64_t b : ids) {
      if (b >= 0 && static_cast<uint64_t>(b) >= g->num_blocks) {
        return Status::out_of_range("hand_off of request '" + request + "': group '" + name + "': block " +
                                    std::to_string(b) + " is not below " + std::to_string(g->num_blocks) + " blocks");
      }
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (held_.count(request) != 0) {
    return Status::already_exists("hand_off: request '" + request + "' is handed off already (not released)");
  }
  if (!enabled_) return false;
  while (held_.size() >= kMaxHeld) {
    auto first = held_.find(held_order_.begin()->second);
    if (first->second.granting) break;  // the pump finishes it; the bound is passed by one meanwhile
    held_order_.erase(held_order_.begin());
    revoke_locked(first->second);
    pending_.erase(first->first);
    held_.erase(first);
  }
  HandOff h;
  h.seq = next_seq_++;
  h.blocks = std::make_shared<const Blocks>(std::move(blocks));
  if (auto e = early_.find(request); e != early_.end()) {
    h.waiting = std::move(e->second.readers);
    early_order_.erase(e->second.seq);
    early_.erase(e);
  }
  held_order_.emplace(h.seq, request);
  const bool waiting = !h.waiting.empty();
  if (waiting) pending_.insert(request);
  held_.emplace(request, std::move(h));
  return waiting;
}

void ReadGrants::heard(const std::string& request, const Reader& reader) {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = held_.find(request); it != held_.end()) {
    HandOff& h = it->second;
    if (h.grants.count(reader) == 0 && h.grants.size() + h.waiting.size() < kMaxReaders &&
        h.waiting.insert(reader).second) {
      pending_.insert(request);
    }
    return;
  }
  auto e = early_.find(request);
  if (e == early_.end()) {
    while (early_.size() >= kMaxEarly) {
      early_.erase(early_order_.begin()->second);
      early_order_.erase(early_order_.begin());
    }
    e = early_.emplace(request, Early{next_seq_++, {}}).first;
    early_order_.emplace(e->second.seq, request);
  }
  if (e->second.readers.size() < kMaxReaders) e->second.readers.insert(reader);
}

void ReadGrants::grant_waiting() {
  while (true) {
    std::unique_lock<std::mutex> lock(mu_);
    if (pending_.empty()) return;
    const std::string request = *pending_.begin();
    pending_.erase(pending_.begin());
    auto it = held_.find(request);
    if (it == held_.end() || it->second.waiting.empty()) continue;
    HandOff& h = it->second;
    h.granting = true;
    const uint64_t seq = h.seq;
    std::shared_ptr<const Blocks> blocks = h.blocks;
    std::shared_ptr<const Places> places = h.places;
    const std::set<Reader> readers = std::exchange(h.waiting, {});
    const GrantId h_like = h.grants.empty() ? 0 : h.grants.begin()->second;
    lock.unlock();
    // Outside the lock: the places (once per hand-off) and the engine's grants.
    if (!places) {
      Result<Places> made = places_of(*blocks);
      places = std::make_shared<const Places>(made.ok() ? std::move(*made) : Places{});
    }
    // The first reader's grant holds the places; the others share them.
    std::vector<std::pair<Reader, GrantId>> made;
    GrantId like = h_like;
    for (const Reader& r : readers) {
      if (places->ranges.empty()) break;  // nothing to read
      Result<GrantId> g = like != 0 ? engine_.share_reads(like, r.first, r.second)
                                    : engine_.grant_reads(r.first, r.second, places->ranges, places->repeats);
      if (!g.ok()) continue;  // a region is gone: the worker is closing
      made.emplace_back(r, *g);
      if (like == 0) like = *g;
    }
    lock.lock();
    it = held_.find(request);
    if (it == held_.end() || it->second.seq != seq) {
      for (const auto& [r, g] : made) engine_.revoke_reads(g);  // not reached: released() waits for us
    } else {
      it->second.places = std::move(places);
      for (const auto& [r, g] : made) it->second.grants.emplace(r, g);
      it->second.granting = false;
    }
    granted_.notify_all();
  }
}

void ReadGrants::revoke_locked(HandOff& h) {
  for (auto& [reader, g] : h.grants) engine_.revoke_reads(g);
  h.grants.clear();
}

void ReadGrants::released(const std::string& request) {
  std::unique_lock<std::mutex> lock(mu_);
  if (auto e = early_.find(request); e != early_.end()) {
    early_order_.erase(e->second.seq);
    early_.erase(e);
  }
  granted_.wait(lock, [&] {
    auto it = held_.find(request);
    return it == held_.end() || !it->second.granting;
  });
  auto it = held_.find(request);
  if (it == held_.end()) return;
  revoke_locked(it->second);
  pending_.erase(request);
  held_order_.erase(it->second.seq);
  held_.erase(it);
}

size_t ReadGrants::held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_.size();
}

}  // namespace kvbridge::connector
