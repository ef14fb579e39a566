// The places of a grant, kept in their repeated form (grant_set.h).
#include "transport/grant_set.h"

#include <algorithm>
#include <map>
#include <tuple>
#include <utility>

namespace kvbridge::transport {

namespace {

// Sorts by (segment, start) and merges what overlaps or touches.
template <typename Interval>
void sort_and_merge(std::vector<Interval>& v) {
  auto before = [](const Interval& x, const Interval& y) {
    return std::tie(x.segment, x.start) < std::tie(y.segment, y.start);
  };
  if (!std::is_sorted(v.begin(), v.end(), before)) std::sort(v.begin(), v.end(), before);
  size_t n = 0;
  for (const Interval& i : v) {
    if (n > 0 && v[n - 1].segment == i.segment && i.start <= v[n - 1].end) {
      v[n - 1].end = std::max(v[n - 1].end, i.end);
    } else {
      v[n++] = i;
    }
  }
  v.resize(n);
}

}  // namespace

std::shared_ptr<const GrantPlaces> grant_of(std::vector<GrantSpan> spans) {
  auto p = std::make_shared<GrantPlaces>();
  p->spans = std::move(spans);
  return p;
}

GrantSet::GrantSet(const GrantPlaces& places) {
  const std::vector<GrantSpan>& spans = places.spans;
  as_is_.reserve(spans.size());
  for (const GrantSpan& s : spans) {
    if (s.bytes > 0 && s.address + s.bytes > s.address) as_is_.push_back({s.segment, s.address, s.address + s.bytes});
  }
  sort_and_merge(as_is_);
  // One pattern per repeated range, however many repeats name it (a
  // tensor's blocks, repeated in every other tensor).
  std::map<std::pair<uint64_t, uint64_t>, uint32_t> pattern_of;
  for (const SpanRepeat& r : places.repeats) {
    if (r.count == 0 || r.first >= spans.size() || r.count > spans.size() - r.first) continue;
    auto [it, made] = pattern_of.emplace(std::make_pair(r.first, r.count), static_cast<uint32_t>(patterns_.size()));
    if (made) {
      Pattern p;
      p.intervals.reserve(r.count);
      for (uint64_t k = r.first; k < r.first + r.count; ++k) {
        const GrantSpan& s = spans[k];
        if (s.bytes > 0 && s.address + s.bytes > s.address) p.intervals.push_back({0, s.address, s.address + s.bytes});
      }
      sort_and_merge(p.intervals);
      if (!p.intervals.empty()) {
        p.low = p.intervals.front().start;
        for (const Interval& i : p.intervals) p.high = std::max(p.high, i.end);
      }
      patterns_.push_back(std::move(p));
    }
    const Pattern& p = patterns_[it->second];
    if (p.intervals.empty()) continue;
    const uint64_t low = p.low + r.shift, high = p.high + r.shift;
    if (high <= low) continue;  // wraps past 2^64: no memory is there
    landings_.push_back({r.segment, low, high, r.shift, it->second});
    widest_ = std::max(widest_, high - low);
  }
  std::sort(landings_.begin(), landings_.end(),
            [](const Landing& x, const Landing& y) { return std::tie(x.segment, x.low) < std::tie(y.segment, y.low); });
}

uint64_t GrantSet::reach_in(const std::vector<Interval>& sorted, uint32_t segment, uint64_t address) {
  auto it = std::upper_bound(sorted.begin(), sorted.end(), std::make_pair(segment, address),
                             [](const std::pair<uint32_t, uint64_t>& key, const Interval& i) {
                               return key < std::make_pair(i.segment, i.start);
                             });
  if (it == sorted.begin()) return address;
  --it;
  if (it->segment != segment || address >= it->end) return address;
  return it->end;
}

uint64_t GrantSet::reach(uint32_t segment, uint64_t address) const {
  uint64_t best = reach_in(as_is_, segment, address);
  // The landings that may cover `address`: low <= address, and low above
  // address - widest_ (a landing is at most widest_ long).
  auto it = std::upper_bound(landings_.begin(), landings_.end(), std::make_pair(segment, address),
                             [](const std::pair<uint32_t, uint64_t>& key, const Landing& l) {
                               return key < std::make_pair(l.segment, l.low);
                             });
  while (it != landings_.begin()) {
    --it;
    if (it->segment != segment || address - it->low >= widest_) break;
    if (address >= it->high) continue;
    const uint64_t local = address - it->shift;
    const uint64_t end = reach_in(patterns_[it->pattern].intervals, 0, local);
    if (end != local) best = std::max(best, end + it->shift);
  }
  return best;
}

bool GrantSet::covers(uint32_t segment, uint64_t address, uint64_t bytes) const {
  return granted({this}, segment, address, bytes);
}

bool granted(const std::vector<const GrantSet*>& sets, uint32_t segment, uint64_t address, uint64_t bytes) {
  uint64_t end = 0;
  if (__builtin_add_overflow(address, bytes, &end)) return false;
  uint64_t at = address;
  while (at < end) {
    uint64_t next = at;
    for (const GrantSet* s : sets) next = std::max(next, s->reach(segment, at));
    if (next == at) return false;
    at = next;
  }
  return true;
}

}  // namespace kvbridge::transport
