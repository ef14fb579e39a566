// The pure parts of `kvbridge sim`: how slots split over masters, where
// store keys land, and the etcd registration model.

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kvbridge/store_key.h"
#include "sim.h"
#include "sim_slot.h"

namespace kvbridge::cli {
namespace {

TEST(KeySlotTest, SlotsSplitAsRedisCliCreateSplitsThem) {
  // redis-cli --cluster create with 3 masters: 0-5460, 5461-10922, 10923-16383.
  EXPECT_EQ(slot_master(0, 3), 0u);
  EXPECT_EQ(slot_master(5460, 3), 0u);
  EXPECT_EQ(slot_master(5461, 3), 1u);
  EXPECT_EQ(slot_master(10922, 3), 1u);
  EXPECT_EQ(slot_master(10923, 3), 2u);
  EXPECT_EQ(slot_master(16383, 3), 2u);
  EXPECT_EQ(slot_master(16383, 1), 0u);
  // Every master owns a share within one slot of 16384 / n.
  for (uint32_t n : {1u, 3u, 6u, 7u, 12u, 100u}) {
    std::vector<uint32_t> owned(n, 0);
    for (uint32_t s = 0; s < kClusterSlots; ++s) ++owned[slot_master(static_cast<uint16_t>(s), n)];
    for (uint32_t i = 0; i < n; ++i) {
      EXPECT_NEAR(owned[i], double(kClusterSlots) / n, 1.0) << n << " masters, master " << i;
    }
  }
}

TEST(KeySlotTest, StoreKeysSpreadOverMasters) {
  // Keys shaped as a cluster tier's ("kvb1:{<32 hex>.<group>}": the tag is
  // what hashes) fill every master of 12 within 10% of the mean.
  std::vector<uint32_t> count(12, 0);
  const int keys = 24000;
  for (int i = 0; i < keys; ++i) {
    char hex[33];
    std::snprintf(hex, sizeof hex, "%016llx%016llx", static_cast<unsigned long long>(i * 0x9e3779b97f4a7c15ULL),
                  static_cast<unsigned long long>(i));
    const std::string key = std::string("kvb1:{") + hex + ".0}";
    EXPECT_EQ(redis_key_slot(key), redis_key_slot(std::string(hex) + ".0"));
    ++count[slot_master(redis_key_slot(key), 12)];
  }
  for (uint32_t c : count) EXPECT_NEAR(c, keys / 12.0, keys / 12.0 * 0.1);
}

TEST(EtcdModelTest, KeepAlivesGrowWithInstancesAndEventsWithWatchersToo) {
  const EtcdRates a = etcd_rates(100, 50, 10, 1);
  EXPECT_DOUBLE_EQ(a.keepalives, 30.0);  // 100 leases, one keep-alive every 10/3 s
  // 100 joins an hour: a grant and a put each, and 100 revokes.
  EXPECT_DOUBLE_EQ(a.writes, 300.0 / 3600);
  // A put and a delete per churn, each to 50 watchers.
  EXPECT_DOUBLE_EQ(a.events, 2 * 100.0 / 3600 * 50);
  const EtcdRates b = etcd_rates(200, 100, 10, 1);
  EXPECT_DOUBLE_EQ(b.keepalives, 2 * a.keepalives);
  EXPECT_DOUBLE_EQ(b.events, 4 * a.events);  // quadratic in the fleet
  EXPECT_DOUBLE_EQ(etcd_rates(100, 50, 10, 0).events, 0.0);
}

TEST(SimOptionsTest, ErrorsNameTheOption) {
  SimOptions o;
  o.ranks = {16, 0};
  Status s = check_sim_options(o);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("--ranks"), std::string::npos) << s.message();
  o = SimOptions{};
  o.reuse = 1.5;
  EXPECT_NE(check_sim_options(o).message().find("--reuse"), std::string::npos);
  o = SimOptions{};
  o.store_nodes = {3, 0};
  EXPECT_NE(check_sim_options(o).message().find("--store-nodes"), std::string::npos);
  o = SimOptions{};
  o.prefill_instances = 2;
  EXPECT_NE(check_sim_options(o).message().find("--decode-instances"), std::string::npos);
  EXPECT_TRUE(check_sim_options(SimOptions{}).ok());
}

}  // namespace
}  // namespace kvbridge::cli
