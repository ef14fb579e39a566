// GrantSet against the places it stands for, listed one by one: random
// spans and repeats in a small address space, every range checked against
// a byte map of the union.
#include "transport/grant_set.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>

namespace kvbridge::transport {
namespace {

TEST(GrantSetTest, RepeatsGrantTheirSpansMovedAndNothingElse) {
  // Two tensors of 8 blocks of 64 bytes; blocks 1, 2 and 5 of the first
  // granted as they are, and again in the second (segment 2, 4096 above).
  GrantPlaces p;
  for (uint64_t b : {1, 2, 5}) p.spans.push_back({1, 1000 + 64 * b, 64});
  p.repeats.push_back({0, 3, 2, 4096});
  const GrantSet set(p);
  EXPECT_TRUE(set.covers(1, 1064, 64));
  EXPECT_TRUE(set.covers(1, 1064, 128)) << "blocks 1 and 2 touch";
  EXPECT_FALSE(set.covers(1, 1064, 129));
  EXPECT_FALSE(set.covers(1, 1000, 64)) << "block 0 is not granted";
  EXPECT_TRUE(set.covers(2, 5096 + 64 * 5, 64));
  EXPECT_TRUE(set.covers(2, 5096 + 64, 128));
  EXPECT_FALSE(set.covers(2, 5096 + 64 * 3, 1));
  EXPECT_FALSE(set.covers(1, 5096 + 64 * 5, 64)) << "a repeat lands in its own segment only";
  EXPECT_EQ(set.reach(2, 5096 + 64 + 10), 5096 + 64 * 3);
  EXPECT_EQ(set.reach(2, 5096), 5096u) << "not covered: the address itself";
}

TEST(GrantSetTest, ARangeMayRunAcrossRepeatsAndGrants) {
  // Layer 0's last block ends where layer 1's first begins: one write may
  // cover both. And two grants that touch cover a range across them.
  GrantPlaces p;
  p.spans = {{1, 0, 64}, {1, 448, 64}};  // blocks 0 and 7 of a 512-byte layer
  p.repeats = {{0, 2, 1, 512}};          // layer 1
  const GrantSet set(p);
  EXPECT_TRUE(set.covers(1, 448, 128)) << "layer 0's block 7 then layer 1's block 0";
  EXPECT_FALSE(set.covers(1, 448, 129));
  GrantPlaces q;
  q.spans = {{1, 576, 64}};
  const GrantSet other(q);
  EXPECT_TRUE(granted({&set, &other}, 1, 448, 192));
  EXPECT_FALSE(granted({&set}, 1, 448, 192));
  EXPECT_FALSE(granted({}, 1, 0, 1));
  EXPECT_TRUE(granted({&set}, 1, 0, 0)) << "nothing to cover";
}

TEST(GrantSetTest, ShiftsBelowWrapAndBadRepeatsGrantNothingExtra) {
  GrantPlaces p;
  p.spans = {{1, 8192, 64}};
  p.repeats = {{0, 1, 1, static_cast<uint64_t>(-4096)},       // 4096 lower
               {0, 2, 1, 64},                                 // past the spans: nothing
               {1, 1, 1, 64},                                 // past the spans: nothing
               {0, 0, 1, 64},                                 // no spans: nothing
               {0, 1, 1, static_cast<uint64_t>(-8192) - 1}};  // would wrap below 0: nothing there
  const GrantSet set(p);
  EXPECT_TRUE(set.covers(1, 4096, 64));
  EXPECT_TRUE(set.covers(1, 8192, 64));
  EXPECT_FALSE(set.covers(1, 8192 + 64, 64));
  EXPECT_FALSE(set.covers(1, 8256, 1));
  EXPECT_FALSE(set.covers(1, UINT64_MAX - 10, 20)) << "a range past 2^64";
}

// Random grants over two segments of 2 KiB: each byte of the union marked
// by listing every place; every range checked.
TEST(GrantSetTest, MatchesThePlacesListedOneByOne) {
  std::mt19937_64 rng(20261207);
  constexpr uint64_t kSpace = 2048;
  for (int round = 0; round < 300; ++round) {
    GrantPlaces p;
    const int spans = 1 + static_cast<int>(rng() % 12);
    for (int i = 0; i < spans; ++i) {
      p.spans.push_back({static_cast<uint32_t>(rng() % 2), rng() % 512, 1 + rng() % 48});
    }
    const int repeats = static_cast<int>(rng() % 6);
    for (int i = 0; i < repeats; ++i) {
      const uint64_t first = rng() % spans, count = 1 + rng() % (spans - first);
      // Shifts up and down (never below address 0: the engine grants only
      // repeats inside a registration), some onto the spans themselves.
      uint64_t lowest = UINT64_MAX;
      for (uint64_t k = first; k < first + count; ++k) lowest = std::min(lowest, p.spans[k].address);
      const uint64_t shift =
          rng() % 3 == 0 ? static_cast<uint64_t>(-static_cast<int64_t>(rng() % (lowest + 1))) : rng() % 1500;
      p.repeats.push_back({first, count, static_cast<uint32_t>(rng() % 2), shift});
    }
    std::vector<std::vector<bool>> mark(2, std::vector<bool>(kSpace + 600, false));
    auto put = [&](uint32_t seg, uint64_t address, uint64_t bytes) {
      for (uint64_t a = address; a < address + bytes; ++a) {
        if (a < mark[seg].size()) mark[seg][a] = true;
      }
    };
    for (const GrantSpan& s : p.spans) put(s.segment, s.address, s.bytes);
    for (const SpanRepeat& r : p.repeats) {
      for (uint64_t k = r.first; k < r.first + r.count; ++k) {
        put(r.segment, p.spans[k].address + r.shift, p.spans[k].bytes);
      }
    }
    const GrantSet set(p);
    for (int c = 0; c < 400; ++c) {
      const uint32_t seg = static_cast<uint32_t>(rng() % 2);
      const uint64_t address = rng() % kSpace, bytes = 1 + rng() % 96;
      bool want = true;
      for (uint64_t a = address; a < address + bytes; ++a) want = want && mark[seg][a];
      ASSERT_EQ(set.covers(seg, address, bytes), want)
          << "round " << round << ": segment " << seg << " [" << address << ", +" << bytes << ")";
    }
  }
}

}  // namespace
}  // namespace kvbridge::transport
