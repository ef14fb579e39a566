// Keys: stable across processes and independent of TP and block size.
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>

#include "kvbridge/store_key.h"
#include "store/test_support.h"

namespace kvbridge {
namespace {

using testing::preset;
using testing::tokens;

std::string chain_text(const Layout& l, uint64_t H, std::vector<std::string> extra, uint64_t n) {
  const std::vector<uint32_t> t = tokens(7, n);
  std::string s;
  for (const BlockHash& h : chain_hashes(chain_seed(l, H, extra), H, t)) s += h.hex() + "\n";
  return s;
}

TEST(StoreKeyTest, HashesMatchAGoldenValue) {
  // A change here breaks every store shared with an older build: bump the
  // format ("kvbridge.store/1") instead.
  const Layout l = preset("llama3-8b", 1, 0, 16, 4);
  const std::vector<uint32_t> t = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  const auto h = chain_hashes(chain_seed(l, 16, {}), 16, t);
  ASSERT_EQ(h.size(), 1u);
  EXPECT_EQ(h[0].hex(), "30e7459dd72761e8c1420b004847fa9f");
}

TEST(StoreKeyTest, TwoProcessesComputeTheSameHashes) {
  const Layout l = preset("qwen3-next", 2, 1, 64, 2);
  const std::string here = chain_text(l, 16, {"adapter-a"}, 4096);
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // The child builds its own layout and hashes from scratch.
    close(fds[0]);
    const std::string s = chain_text(preset("qwen3-next", 2, 1, 64, 2), 16, {"adapter-a"}, 4096);
    size_t off = 0;
    while (off < s.size()) {
      const ssize_t n = write(fds[1], s.data() + off, s.size() - off);
      if (n <= 0) _exit(1);
      off += static_cast<size_t>(n);
    }
    _exit(0);
  }
  close(fds[1]);
  std::string there;
  char buf[4096];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof(buf))) > 0) there.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(here, there);
  EXPECT_EQ(std::count(here.begin(), here.end(), '\n'), 256);
}

TEST(StoreKeyTest, TpSizeAndBlockSizeDoNotChangeKeys) {
  const std::string a = chain_text(preset("llama3-8b", 1, 0, 16, 4), 16, {}, 256);
  EXPECT_EQ(a, chain_text(preset("llama3-8b", 8, 3, 32, 4), 16, {}, 256));
  EXPECT_EQ(a, chain_text(preset("llama3-8b", 2, 0, 64, 4, Order::kBLHNC), 16, {}, 256));
}

TEST(StoreKeyTest, ModelHashBlockAndExtraKeysChangeKeys) {
  const Layout l = preset("llama3-8b", 1, 0, 16, 4);
  const std::string a = chain_text(l, 16, {}, 256);
  EXPECT_NE(a, chain_text(preset("llama3-70b", 1, 0, 16, 4), 16, {}, 256));
  EXPECT_NE(a, chain_text(l, 16, {"salt"}, 256));
  EXPECT_NE(chain_text(l, 16, {"ab", "c"}, 256), chain_text(l, 16, {"a", "bc"}, 256));
  EXPECT_NE(chain_text(l, 8, {}, 256).substr(0, 33), chain_text(l, 16, {}, 256).substr(0, 33));
}

TEST(StoreKeyTest, ChainingMakesAKeyDependOnTheWholePrefix) {
  const Layout l = preset("llama3-8b", 1, 0, 16, 4);
  std::vector<uint32_t> t = tokens(1, 64);
  const auto a = chain_hashes(chain_seed(l, 16, {}), 16, t);
  t[3] ^= 1;
  const auto b = chain_hashes(chain_seed(l, 16, {}), 16, t);
  for (size_t j = 0; j < a.size(); ++j) EXPECT_NE(a[j], b[j]) << j;
  EXPECT_EQ(chain_hashes(chain_seed(l, 16, {}), 16, std::span<const uint32_t>(t).first(47)).size(), 2u);
}

TEST(StoreKeyTest, GroupIdsFollowNameOrderAndSkipNothing) {
  const Layout l = preset("qwen3-next", 1, 0, 64, 2);  // full, linear, ring
  const std::vector<uint32_t> ids = group_ids(l);
  for (size_t i = 0; i < l.groups.size(); ++i) {
    size_t below = 0;
    for (const Group& g : l.groups) below += g.name < l.groups[i].name;
    EXPECT_EQ(ids[i], below) << l.groups[i].name;
  }
}

}  // namespace
}  // namespace kvbridge

namespace kvbridge {
namespace {

TEST(StoreKeyTest, ClusterSlotsMatchRedis) {
  // Values from the Redis Cluster specification and CLUSTER KEYSLOT.
  EXPECT_EQ(redis_key_slot("123456789"), 0x31C3 & 16383);
  EXPECT_EQ(redis_key_slot("foo"), 12182);
  EXPECT_EQ(redis_key_slot("bar"), 5061);
  EXPECT_EQ(redis_key_slot("hello"), 866);
  EXPECT_EQ(redis_key_slot("{user1000}.following"), redis_key_slot("user1000"));
  EXPECT_EQ(redis_key_slot("foo{}{bar}"), redis_key_slot("foo{}{bar}"));
  EXPECT_NE(redis_key_slot("foo{}{bar}"), redis_key_slot("bar")) << "an empty tag hashes the whole key";
  EXPECT_EQ(redis_key_slot("foo{{bar}}zap"), redis_key_slot("{bar"));
  EXPECT_EQ(redis_key_slot("foo{bar}{zap}"), redis_key_slot("bar"));
  const ObjectKey k{BlockHash{0x1234, 0xabcd}, 3};
  EXPECT_EQ(k.cluster_text("kvb1:"), "kvb1:{000000000000abcd0000000000001234.3}");
  EXPECT_EQ(redis_key_slot(k.cluster_text("kvb1:") + ":staging:tp8"), redis_key_slot(k.cluster_text("kvb1:")));
}

}  // namespace
}  // namespace kvbridge
