// A pull-mode prefill rank's read grants (read_grants.h).
#include "connector/read_grants.h"

namespace kvbridge::connector {

ReadGrants::~ReadGrants() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [request, h] : held_) revoke_locked(h);
}

Status ReadGrants::hand_off(const std::string& request, const std::map<std::string, std::vector<int64_t>>& blocks) {
  HandOff h;
  for (const auto& [name, ids] : blocks) {
    const Group* g = layout_.find_group(name);
    if (g == nullptr) {
      return Status::invalid_argument("hand_off of request '" + request + "': the layout has no group '" + name + "'");
    }
    Result<std::vector<TensorSpan>> spans = block_spans(layout_, *g, ids);
    if (!spans.ok()) return spans.error().with_context("hand_off of request '" + request + "'");
    for (const TensorSpan& s : *spans) h.ranges.push_back({regions_[s.tensor], s.offset, s.bytes});
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (held_.count(request) != 0) {
    return Status::already_exists("hand_off: request '" + request + "' is handed off already (not released)");
  }
  if (!enabled_) return Status();
  while (held_.size() >= kMaxHeld) {
    auto first = held_.find(held_order_.begin()->second);
    held_order_.erase(held_order_.begin());
    revoke_locked(first->second);
    held_.erase(first);
  }
  h.seq = next_seq_++;
  held_order_.emplace(h.seq, request);
  HandOff& kept = held_.emplace(request, std::move(h)).first->second;
  if (auto e = early_.find(request); e != early_.end()) {
    for (const Reader& r : e->second.readers) grant_locked(kept, r);
    early_order_.erase(e->second.seq);
    early_.erase(e);
  }
  return Status();
}

void ReadGrants::heard(const std::string& request, const Reader& reader) {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (auto h = held_.find(request); h != held_.end()) return grant_locked(h->second, reader);
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

void ReadGrants::grant_locked(HandOff& h, const Reader& reader) {
  if (h.ranges.empty() || h.grants.count(reader) != 0 || h.grants.size() >= kMaxReaders) return;
  Result<GrantId> g = engine_.grant_reads(reader.first, reader.second, h.ranges);
  if (g.ok()) h.grants.emplace(reader, *g);  // else a region is gone: the worker is closing
}

void ReadGrants::revoke_locked(HandOff& h) {
  for (auto& [reader, g] : h.grants) engine_.revoke_reads(g);
  h.grants.clear();
}

void ReadGrants::released(const std::string& request) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto e = early_.find(request); e != early_.end()) {
    early_order_.erase(e->second.seq);
    early_.erase(e);
  }
  auto it = held_.find(request);
  if (it == held_.end()) return;
  revoke_locked(it->second);
  held_order_.erase(it->second.seq);
  held_.erase(it);
}

size_t ReadGrants::held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_.size();
}

}  // namespace kvbridge::connector
