// The memory tier: LRU eviction, pins, the buffer pool.
#include "store/memory_tier.h"

#include <gtest/gtest.h>

namespace kvbridge::store_internal {
namespace {

ObjectKey k(uint64_t i) { return {{i, i * 7}, 0}; }

TEST(MemoryTierTest, EvictsLeastRecentlyUsedFirst) {
  MemoryTier t(300);
  for (uint64_t i = 0; i < 3; ++i) ASSERT_TRUE(t.insert(k(i), t.allocate(100), 100, 0));
  t.unpin(k(0));
  t.pin(k(0));
  t.unpin(k(0));  // 0 is now the most recent
  uint8_t* b = t.allocate(100);
  ASSERT_NE(b, nullptr);
  EXPECT_TRUE(t.contains(k(0)));
  EXPECT_FALSE(t.contains(k(1)));
  EXPECT_EQ(t.evictions(), 1u);
  t.release(b, 100);
  EXPECT_EQ(t.used_bytes(), 300u);
}

TEST(MemoryTierTest, NeverEvictsAPinnedObject) {
  MemoryTier t(200);
  ASSERT_TRUE(t.insert(k(1), t.allocate(100), 100, 1));  // pinned by its reader
  ASSERT_TRUE(t.insert(k(2), t.allocate(100), 100, 0));
  const uint8_t* before = t.pin(k(1));
  t.unpin(k(1));
  uint8_t* b = t.allocate(100);
  ASSERT_NE(b, nullptr);
  EXPECT_TRUE(t.contains(k(1)));
  EXPECT_FALSE(t.contains(k(2)));
  EXPECT_EQ(t.allocate(100), nullptr) << "everything left is pinned or in use";
  EXPECT_EQ(t.pin(k(1)), before);
  t.unpin(k(1));
  t.unpin(k(1));  // the reader is done: evictable now
  t.release(b, 100);
  uint8_t* c = t.allocate(150);
  EXPECT_NE(c, nullptr);
  EXPECT_FALSE(t.contains(k(1)));
  t.release(c, 150);  // handed-out buffers are the caller's to give back
}

TEST(MemoryTierTest, ReusesEvictedBuffersOfTheSameSize) {
  MemoryTier t(200);
  uint8_t* a = t.allocate(100);
  ASSERT_TRUE(t.insert(k(1), a, 100, 0));
  ASSERT_TRUE(t.insert(k(2), t.allocate(100), 100, 0));
  uint8_t* again = t.allocate(100);
  EXPECT_EQ(again, a);  // k(1)'s pages, no new allocation
  EXPECT_EQ(t.used_bytes(), 200u);
  t.release(again, 100);
}

TEST(MemoryTierTest, InsertingAVisibleKeyKeepsTheFirst) {
  MemoryTier t(300);
  uint8_t* a = t.allocate(100);
  ASSERT_TRUE(t.insert(k(1), a, 100, 0));
  EXPECT_FALSE(t.insert(k(1), t.allocate(100), 100, 0));
  EXPECT_EQ(t.pooled_bytes(), 100u);
  EXPECT_EQ(t.pin(k(1)), a);
  t.clear();
  EXPECT_TRUE(t.contains(k(1)));  // pinned: clear() leaves it
  t.unpin(k(1));
  t.clear();
  EXPECT_EQ(t.used_bytes(), 0u);
}

}  // namespace
}  // namespace kvbridge::store_internal
