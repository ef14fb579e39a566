// transport/grant_set.h: the places one grant gives a peer, in the shape a
// request's blocks have (a tensor's blocks, and the same blocks again in
// the other tensors), and the question a server that serves peers itself
// asks of every range: does it lie inside them?
//
// A grant is `spans` (each granted as it is) and `repeats`: spans
// [first, first + count) again, each moved by `shift` into `segment`. A
// request of 8,192 blocks of an 80-layer model is 8,192 spans and 159
// repeats, where listing its places is 1.3 M spans. GrantSet keeps that
// form: the spans of a repeated range sorted and merged once per range,
// and the repeats sorted by where they land, so a check costs a few
// binary searches, whatever the layers.
//
// Thread-safety: a GrantSet is immutable once made; any thread may read it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace kvbridge::transport {

// A range a grant lets one peer write (or read): [address, address + bytes)
// of local segment `segment`.
struct GrantSpan {
  uint32_t segment = 0;
  uint64_t address = 0;
  uint64_t bytes = 0;
};

// Spans [first, first + count) of a grant again, each at its address plus
// `shift` (modulo 2^64) in segment `segment`.
struct SpanRepeat {
  uint64_t first = 0, count = 0;
  uint32_t segment = 0;
  uint64_t shift = 0;
};

struct GrantPlaces {
  std::vector<GrantSpan> spans;
  std::vector<SpanRepeat> repeats;
};

// A grant of `spans` as they are (no repeats).
std::shared_ptr<const GrantPlaces> grant_of(std::vector<GrantSpan> spans);

class GrantSet {
 public:
  // Empty spans, and repeats past the spans, grant nothing (the engine
  // checks what it is given before it grants).
  explicit GrantSet(const GrantPlaces& places);

  // The end of the granted stretch that starts at or before `address` in
  // `segment` and covers it (spans that touch are one stretch); `address`
  // itself when no place covers it.
  uint64_t reach(uint32_t segment, uint64_t address) const;
  // Every byte of [address, address + bytes) is granted (by this set).
  bool covers(uint32_t segment, uint64_t address, uint64_t bytes) const;

 private:
  struct Interval {
    uint32_t segment;
    uint64_t start, end;
  };
  // A repeated range of spans: their addresses, sorted and merged.
  struct Pattern {
    std::vector<Interval> intervals;  // segment unused
    uint64_t low = 0, high = 0;       // the lowest start, the highest end
  };
  // A repeat, where it lands: [low, high) of `segment`, the pattern moved
  // by `shift`.
  struct Landing {
    uint32_t segment;
    uint64_t low, high, shift;
    uint32_t pattern;
  };
  static uint64_t reach_in(const std::vector<Interval>& sorted, uint32_t segment, uint64_t address);

  std::vector<Interval> as_is_;  // the spans themselves, sorted and merged
  std::vector<Pattern> patterns_;
  std::vector<Landing> landings_;  // sorted by (segment, low)
  uint64_t widest_ = 0;            // the largest high - low of a landing
};

// Whether the union of `sets` covers [address, address + bytes) of
// `segment` (a range may run across places of several grants).
bool granted(const std::vector<const GrantSet*>& sets, uint32_t segment, uint64_t address, uint64_t bytes);

}  // namespace kvbridge::transport
