// The shared tier on a real Redis Cluster (3 masters, 3 replicas, started
// here on loopback ports and stopped at the end): slots routed by hash tag,
// objects written at TP 8 read byte-exact at TP 2 (whole objects, and parts
// assembled on the cluster's nodes by rank stores of their own), a slot
// migrated while it is read (ASK, then MOVED), a master killed mid-run
// (misses while it fails over, never wrong bytes, then hits again from the
// promoted replica), and a cluster that cannot be reached (misses, at once).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <thread>

#include <gtest/gtest.h>

#include "kvbridge/store.h"
#include "store/cluster_tier.h"
#include "store/test_support.h"
#include "testing/ports.h"
#include "testing/redis_cluster.h"
#include "testing/require.h"

namespace kvbridge {
namespace {

using namespace std::chrono_literals;
using testing::Instance;
using testing::tokens;

// The shared suite's cluster tolerates a node that is busy for longer than
// the failover test's: the part that completes an object checksums it inside
// Redis (store-object.md), 0.8-0.9 s for qwen3-next's 77 MB state object on
// two cores, and a node that misses the cluster bus's pings for the node
// timeout is marked failed (every node then answers CLUSTERDOWN until it is
// back).
constexpr int kSuiteNodeTimeoutMs = 5000;
constexpr int kFailoverNodeTimeoutMs = 1000;

Result<std::unique_ptr<testing::RedisCluster>> start_cluster(int node_timeout_ms) {
  return testing::RedisCluster::start(3, 1, node_timeout_ms);
}

// The timeouts are roomier than the library's defaults: these tests run
// beside others under the sanitizers on two cores, where six Redis servers
// and the test share the CPU and a part's write has failed with the
// defaults. The tests that bound an operation's time (failover, an
// unreachable cluster) pass the defaults.
struct Timeouts {
  std::chrono::milliseconds connect = 2000ms;
  std::chrono::milliseconds command = 10000ms;
};
constexpr Timeouts kDefaultTimeouts{300ms, 2000ms};

std::shared_ptr<Store> cluster_store(uint16_t seed_port, Assembly assembly = Assembly::kInProcess,
                                     Timeouts timeouts = {}) {
  StoreOptions o;
  o.hash_block_tokens = 16;
  o.memory_bytes = uint64_t{256} << 20;
  o.assembly = assembly;
  RedisOptions r;
  r.port = seed_port;
  r.cluster = true;
  r.connect_timeout = timeouts.connect;
  r.command_timeout = timeouts.command;
  r.retry_interval = 400ms;
  o.redis = r;
  Result<std::shared_ptr<Store>> s = Store::create(o);
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  return s.ok() ? *s : nullptr;
}

// Gets n tokens into every rank of `reader` (memory emptied first, so every
// object comes from the cluster); returns the smallest hit and checks every
// byte of it.
uint64_t get_checked(Instance& reader, const std::shared_ptr<Store>& store, const std::vector<uint32_t>& t, uint64_t n,
                     uint64_t seed) {
  store->clear_memory(true);
  uint64_t hit = n;
  for (size_t r = 0; r < reader.ranks.size(); ++r) {
    auto& m = reader.ranks[r];
    const Request q = testing::make_request(m.layout, n, 2, reader.stride);
    Result<GetResult> g = reader.stores[r].get(t, q, m.memory());
    EXPECT_TRUE(g.ok()) << g.status().to_string();
    if (!g.ok()) return 0;
    hit = std::min(hit, g->hit_tokens);
    if (g->hit_tokens == 0) continue;
    Result<ContentReport> c =
        check_request(testing::stored_view(m.layout), testing::make_request(m.layout, g->hit_tokens, 2, reader.stride),
                      RequestSide::kLocal, 0, seed, m.memory());
    EXPECT_TRUE(c.ok());
    EXPECT_EQ(c->bad_cells, 0u) << "rank " << r << ": " << c->first_error;
  }
  return hit;
}

class ClusterStoreTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    Result<std::unique_ptr<testing::RedisCluster>> c = start_cluster(kSuiteNodeTimeoutMs);
    if (c.ok()) {
      cluster_ = c->release();
    } else {
      why_ = new std::string(c.status().to_string());
    }
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
    delete why_;
    why_ = nullptr;
  }
  void SetUp() override {
    if (cluster_ == nullptr)
      KVB_SKIP_UNLESS_REQUIRED("redis", *why_ + " (scripts/deps.sh installs redis-server and redis-tools)");
  }
  static testing::RedisCluster* cluster_;
  static std::string* why_;
};
testing::RedisCluster* ClusterStoreTest::cluster_ = nullptr;
std::string* ClusterStoreTest::why_ = nullptr;

TEST_F(ClusterStoreTest, KeysGoToTheirSlotsMastersAndTp8ObjectsReadByteExactAtTp2) {
  const std::vector<uint32_t> t = tokens(21, 512);
  auto w = cluster_store(cluster_->ports()[0]);
  Instance writer(w, "llama3-8b", {8, 32}, 512);
  writer.fill(512, 3);
  writer.put(t, 512);
  const StoreStats ws = w->stats();
  EXPECT_EQ(ws.redis_writes, 32u);
  EXPECT_EQ(ws.redis_nodes, 3u);
  EXPECT_EQ(ws.redis_errors, 0u) << ws.redis_last_error;
  // Every master holds some of the 32 objects, each in the slot Redis
  // computes for its key.
  for (uint16_t m : cluster_->master_ports()) EXPECT_NE(cluster_->cli(m, "dbsize"), "0") << "master " << m;
  const std::string key = ObjectKey{writer.stores[0].hashes(t)[5], 0}.cluster_text("kvb1:");
  EXPECT_EQ(cluster_->cli(cluster_->ports()[0], "cluster keyslot '" + key + "'"), std::to_string(redis_key_slot(key)));
  EXPECT_EQ(cluster_->cli(cluster_->master_of(redis_key_slot(key)), "exists '" + key + "'"), "1");
  // A reader at TP 2 with 16-token blocks, its memory empty: all from the
  // cluster, byte-exact.
  auto r = cluster_store(cluster_->ports()[4]);  // seeded by a replica: the map still names masters
  Instance reader(r, "llama3-8b", {2, 16}, 512);
  EXPECT_EQ(get_checked(reader, r, t, 512, 3), 512u);
  EXPECT_EQ(r->stats().redis_hits, 32u) << "rank 0 promotes every object";
  EXPECT_EQ(r->stats().memory_hits, 32u) << "rank 1 reads them from memory";
  Result<Store::RedisInfo> info = r->redis_info();
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_GE(info->keys, 32u) << "summed over the masters";
}

TEST_F(ClusterStoreTest, DeviceMemoryGoesThroughTheClusterByteExact) {
  auto writer = cluster_store(cluster_->ports()[0]);
  auto reader = cluster_store(cluster_->ports()[1]);
  EXPECT_EQ(testing::device_round_trip(writer, reader, "llama3-8b", {4, 32}, {2, 16}, 128, 12), 128u);
  EXPECT_GT(reader->stats().redis_hits, 0u);
  EXPECT_EQ(reader->stats().redis_errors, 0u) << reader->stats().redis_last_error;
}

TEST_F(ClusterStoreTest, PartsFromRankStoresOfTheirOwnAssembleOnTheSlotsNode) {
  const std::vector<uint32_t> t = tokens(22, 128);
  // Each rank with a Store of its own, as in separate processes: parts meet
  // in the cluster, staging and object keys on one node (hash tags).
  for (uint32_t rank = 0; rank < 4; ++rank) {
    auto s = cluster_store(cluster_->ports()[rank % 3], Assembly::kShared);
    testing::RankMemory m(testing::preset("qwen3-next", 4, rank, 64, 4));
    Result<RankStore> rs = RankStore::create(s, m.layout);
    ASSERT_TRUE(rs.ok());
    for (uint64_t b = 64; b < 128; b += 64) {  // the states an align-mode engine keeps
      ASSERT_TRUE(
          fill_request(m.layout, testing::make_request(m.layout, b), RequestSide::kLocal, 0, 8, m.memory()).ok());
    }
    ASSERT_TRUE(
        fill_request(m.layout, testing::make_request(m.layout, 128), RequestSide::kLocal, 0, 8, m.memory()).ok());
    Result<PutResult> p = rs->put(t, testing::make_request(m.layout, 128), m.memory());
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    EXPECT_GT(p->parts_written, 0u);
    EXPECT_EQ(s->stats().redis_errors, 0u) << "rank " << rank << ": " << s->stats().redis_last_error;
    if (rank < 3) {
      EXPECT_EQ(p->objects_published, 0u) << "rank " << rank << ": not whole yet";
    } else {
      EXPECT_GT(p->objects_published, 0u) << "the last part completes each object";
    }
  }
  auto r = cluster_store(cluster_->ports()[1]);
  Instance reader(r, "qwen3-next", {1, 128}, 128);
  EXPECT_EQ(get_checked(reader, r, t, 128, 8), 128u);
}

TEST_F(ClusterStoreTest, ASlotMigratedWhileItIsReadIsFollowed) {
  const std::vector<uint32_t> t = tokens(23, 1024);
  auto w = cluster_store(cluster_->ports()[0]);
  Instance writer(w, "llama3-8b", {1, 16}, 1024);
  writer.fill(1024, 4);
  writer.put(t, 1024);
  auto r = cluster_store(cluster_->ports()[1]);
  Instance reader(r, "llama3-8b", {1, 16}, 1024);
  ASSERT_EQ(get_checked(reader, r, t, 1024, 4), 1024u);  // the reader's map is read
  // Move the slot of block 7's object to another master, reading the whole
  // prefix after every batch of keys: part of the slot is on each side.
  const uint16_t slot = redis_key_slot(ObjectKey{writer.stores[0].hashes(t)[7], 0}.cluster_text("kvb1:"));
  const uint16_t from = cluster_->master_of(slot);
  uint16_t to = 0;
  for (uint16_t m : cluster_->master_ports()) {
    if (m != from) to = m;
  }
  int reads = 0;
  const Status moved = cluster_->migrate_slot(slot, to, [&](int) {
    EXPECT_EQ(get_checked(reader, r, t, 1024, 4), 1024u) << "during the migration";
    ++reads;
  });
  ASSERT_TRUE(moved.ok()) << moved.to_string();
  EXPECT_GE(reads, 1);
  EXPECT_EQ(get_checked(reader, r, t, 1024, 4), 1024u) << "after it: MOVED";
  const StoreStats s = r->stats();
  EXPECT_GT(s.redis_redirects, 0u);
  EXPECT_GE(s.redis_slot_map_updates, 2u);
  EXPECT_EQ(cluster_->master_of(slot), to);
}

TEST(ClusterFailoverTest, AMasterKilledMidRunFailsOverToItsReplicaWithoutWrongBytes) {
  Result<std::unique_ptr<testing::RedisCluster>> started = start_cluster(kFailoverNodeTimeoutMs);
  if (!started.ok()) KVB_SKIP_UNLESS_REQUIRED("redis", started.status().to_string());
  std::unique_ptr<testing::RedisCluster> cluster = std::move(*started);
  const std::vector<uint32_t> t = tokens(24, 512);
  auto w = cluster_store(cluster->ports()[0], Assembly::kInProcess, kDefaultTimeouts);
  Instance writer(w, "llama3-8b", {1, 16}, 512);
  writer.fill(512, 6);
  writer.put(t, 512);
  // The objects are on the replicas before the master dies.
  ASSERT_TRUE(cluster->wait_replicated(10000)) << "the replicas did not catch up";
  auto r = cluster_store(cluster->ports()[1], Assembly::kInProcess, kDefaultTimeouts);
  Instance reader(r, "llama3-8b", {1, 16}, 512);
  ASSERT_EQ(get_checked(reader, r, t, 512, 6), 512u);
  // Kill the master of block 0's object: until its replica takes over, the
  // prefix cannot be resumed past block 0 (the cluster answers CLUSTERDOWN
  // or the dead node refuses).
  const uint16_t slot = redis_key_slot(ObjectKey{writer.stores[0].hashes(t)[0], 0}.cluster_text("kvb1:"));
  const uint16_t dead = cluster->master_of(slot);
  ASSERT_NE(dead, cluster->ports()[1]) << "the reader's seed survives";
  std::string before;
  for (uint16_t p : cluster->ports()) before += std::to_string(p) + ":" + cluster->cli(p, "dbsize") + " ";
  cluster->kill(dead);
  const auto t0 = std::chrono::steady_clock::now();
  int misses = 0, hits = 0;
  uint64_t last_hit = 0;
  while (std::chrono::steady_clock::now() - t0 < 20s) {
    const auto op = std::chrono::steady_clock::now();
    const uint64_t hit = get_checked(reader, r, t, 512, 6);  // never a wrong byte
    last_hit = hit;
    EXPECT_LT(std::chrono::steady_clock::now() - op, 5s) << "a get never hangs";
    if (hit == 512) {
      if (++hits == 3) break;
    } else {
      ++misses;
      std::this_thread::sleep_for(100ms);
    }
  }
  const StoreStats s = r->stats();
  EXPECT_EQ(hits, 3) << "the replica took over and serves every object: slot " << slot << " was on " << dead
                     << ", now on " << cluster->master_of(slot) << "; " << misses << " misses; map read "
                     << s.redis_slot_map_updates << " times, " << s.redis_errors << " errors, " << s.redis_skipped
                     << " skipped, " << s.redis_redirects << " redirects; the new master holds "
                     << cluster->cli(cluster->master_of(slot), "dbsize") << " keys, block 0's: "
                     << cluster->cli(
                            cluster->master_of(slot),
                            "exists '" + ObjectKey{writer.stores[0].hashes(t)[0], 0}.cluster_text("kvb1:") + "'")
                     << ", last hit " << last_hit << "; before: " << before << "; after: " << [&] {
                          std::string a;
                          for (uint16_t p : cluster->ports()) {
                            if (p != dead) a += std::to_string(p) + ":" + cluster->cli(p, "dbsize") + " ";
                          }
                          return a + cluster->cli(cluster->ports()[1], "cluster nodes");
                        }();
  EXPECT_GT(misses, 0) << "the failover window was seen";
  EXPECT_NE(cluster->master_of(slot), dead);
  EXPECT_GT(s.misses, 0u);
  EXPECT_GE(s.redis_slot_map_updates, 2u);
  EXPECT_EQ(s.redis_bad_objects, 0u);
}

TEST(ClusterRedirectTest, RepliesThatSendAKeyElsewhereAreParsedAndOthersAreNot) {
  store_internal::Redirect r;
  ASSERT_TRUE(store_internal::parse_redirect("MOVED 3999 127.0.0.1:6381", &r));
  EXPECT_EQ(r.kind, store_internal::Redirect::kMoved);
  EXPECT_EQ(r.slot, 3999);
  EXPECT_EQ(r.host, "127.0.0.1");
  EXPECT_EQ(r.port, 6381);
  ASSERT_TRUE(store_internal::parse_redirect("ASK 16383 ::1:7000", &r));
  EXPECT_EQ(r.kind, store_internal::Redirect::kAsk);
  EXPECT_EQ(r.host, "::1");
  EXPECT_EQ(r.port, 7000);
  EXPECT_TRUE(store_internal::parse_redirect("CLUSTERDOWN The cluster is down", &r));
  EXPECT_EQ(r.kind, store_internal::Redirect::kRetry);
  EXPECT_EQ(r.reply, "CLUSTERDOWN The cluster is down");
  EXPECT_TRUE(store_internal::parse_redirect("TRYAGAIN Multiple keys request during rehashing of slot", &r));
  for (const char* bad : {"MOVED 16384 127.0.0.1:1", "MOVED 1 127.0.0.1:0", "MOVED 1 127.0.0.1:65536", "MOVED x h:1",
                          "MOVED 1 :1", "MOVED 1", "ERR unknown command", "ASK", "OOM command not allowed"}) {
    EXPECT_FALSE(store_internal::parse_redirect(bad, &r)) << bad;
  }
}

TEST(ClusterRefusalTest, KeysStillRefusedAfterTheRetriesAreErrorsThatSayWhy) {
  // One master serving every slot, then none: each key is answered
  // CLUSTERDOWN, retried, and given up on; the stats name the refusal.
  Result<std::unique_ptr<testing::RedisCluster>> started = testing::RedisCluster::start(1, 0);
  if (!started.ok()) KVB_SKIP_UNLESS_REQUIRED("redis", started.status().to_string());
  std::unique_ptr<testing::RedisCluster> cluster = std::move(*started);
  auto s = cluster_store(cluster->ports()[0], Assembly::kInProcess, kDefaultTimeouts);
  Instance inst(s, "llama3-8b", {1, 16}, 64);
  const std::vector<uint32_t> a = tokens(26, 64), b = tokens(27, 64);
  inst.fill(64, 1);
  inst.put(a, 64);  // the slot map is read
  EXPECT_EQ(s->stats().redis_writes, 4u);
  EXPECT_EQ(s->stats().redis_errors, 0u) << s->stats().redis_last_error;
  ASSERT_EQ(cluster->cli(cluster->ports()[0], "cluster delslotsrange 0 16383"), "OK");
  inst.put(b, 64);  // into memory; the cluster refuses every key
  const StoreStats st = s->stats();
  EXPECT_EQ(st.redis_writes, 4u);
  // One per object not written, and one more if the map was read again
  // meanwhile (it is 2 s old on a slow machine) and found no slot served.
  EXPECT_GE(st.redis_errors, 4u);
  EXPECT_LE(st.redis_errors, 5u);
  EXPECT_NE(st.redis_last_error.find("4 of 4 keys unanswered after 4 rounds; last reply: CLUSTERDOWN"),
            std::string::npos)
      << st.redis_last_error;
}

// A cluster node that lies: CLUSTER SLOTS answers `slots` (RESP), PING
// answers PONG, and every keyed command MOVED to 127.0.0.1:`moved_to`.
class LyingNode {
 public:
  LyingNode(std::function<std::string(uint16_t self)> slots, uint16_t moved_to)
      : slots_(std::move(slots)), moved_to_(moved_to), thread_([this] { serve(); }) {}
  ~LyingNode() {
    stop_.store(true);
    thread_.join();
  }
  uint16_t port() const { return at_.port(); }

 private:
  void serve() {
    while (!stop_.load()) {
      pollfd p{at_.fd(), POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      const int c = ::accept(at_.fd(), nullptr, nullptr);
      if (c < 0) continue;
      std::string in;
      char buf[65536];
      while (!stop_.load()) {
        pollfd q{c, POLLIN, 0};
        if (::poll(&q, 1, 20) < 0) break;
        if (q.revents == 0) continue;
        const ssize_t n = ::recv(c, buf, sizeof buf, 0);
        if (n <= 0) break;
        in.append(buf, static_cast<size_t>(n));
        std::vector<std::string> args;
        while (take_command(in, &args)) {
          std::string reply = "+OK\r\n";
          if (!args.empty() && (args[0] == "PING" || args[0] == "ping")) {
            reply = "+PONG\r\n";
          } else if (args.size() >= 2 && (args[0] == "CLUSTER" || args[0] == "cluster")) {
            reply = slots_(at_.port());
          } else if (args.size() >= 2) {
            reply = "-MOVED " + std::to_string(redis_key_slot(args[1])) + " 127.0.0.1:" + std::to_string(moved_to_) +
                    "\r\n";
          }
          (void)!::send(c, reply.data(), reply.size(), MSG_NOSIGNAL);
        }
      }
      ::close(c);
    }
  }
  // One whole RESP command (*<argc>, then $<len> and the bytes each) off the
  // front of `in`; false when it has not all arrived.
  static bool take_command(std::string& in, std::vector<std::string>* args) {
    args->clear();
    size_t eol = in.find("\r\n");
    if (in.empty() || in[0] != '*' || eol == std::string::npos) return false;
    const long argc = std::strtol(in.c_str() + 1, nullptr, 10);
    size_t at = eol + 2;
    for (long k = 0; k < argc; ++k) {
      const size_t e = in.find("\r\n", at);
      if (e == std::string::npos) return false;
      const size_t len = std::strtoul(in.c_str() + at + 1, nullptr, 10);
      if (in.size() < e + 2 + len + 2) return false;
      args->push_back(in.substr(e + 2, len));
      at = e + 2 + len + 2;
    }
    in.erase(0, at);
    return true;
  }
  testing::SilentListener at_;
  std::function<std::string(uint16_t)> slots_;
  uint16_t moved_to_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

std::string one_range(uint32_t first, uint32_t last, uint16_t port) {
  return "*3\r\n:" + std::to_string(first) + "\r\n:" + std::to_string(last) +
         "\r\n*2\r\n$9\r\n127.0.0.1\r\n:" + std::to_string(port) + "\r\n";
}

std::vector<std::string> cluster_keys(int n) {
  std::vector<std::string> keys;
  for (int k = 0; k < n; ++k) keys.push_back("kvb1:{" + std::to_string(k) + "}");
  return keys;
}

// A node that lies: it serves every slot by its own map, and answers every
// key with MOVED to some other host:port. The tier does not follow a
// redirect to a node the map does not name: nothing connects to the trap,
// and the keys are misses whose error says why.
TEST(ClusterRedirectTest, ARedirectToANodeTheMapDoesNotNameIsNotFollowed) {
  testing::SilentListener trap;
  LyingNode liar([](uint16_t self) { return "*1\r\n" + one_range(0, 16383, self); }, trap.port());
  RedisOptions o;
  o.port = liar.port();
  o.cluster = true;
  o.retry_interval = 400ms;
  store_internal::ClusterTier tier(o);
  for (uint8_t g : tier.exists(cluster_keys(8))) EXPECT_EQ(g, 0);
  EXPECT_FALSE(trap.accepted_any()) << "the tier connected to the host:port a node redirected it to";
  const store_internal::RedisCounters c = tier.counters();
  EXPECT_EQ(c.redirects, 0u);
  EXPECT_NE(c.last_error.find("a redirect to 127.0.0.1:" + std::to_string(trap.port()) +
                              ", which the cluster's slot map does not name"),
            std::string::npos)
      << c.last_error;
}

// A slot map over many silent nodes: one operation over keys of all of them
// ends within its deadline (twice a node's connect and command timeouts),
// not after a timeout per node; the keys not tried are misses that say so.
TEST(ClusterRedirectTest, AnOperationOverManySilentNodesEndsWithinItsDeadline) {
  std::vector<std::unique_ptr<testing::SilentListener>> silent(16);
  for (auto& l : silent) l = std::make_unique<testing::SilentListener>();
  LyingNode seed(
      [&](uint16_t) {
        std::string r = "*" + std::to_string(silent.size()) + "\r\n";
        for (size_t i = 0; i < silent.size(); ++i) {
          r += one_range(static_cast<uint32_t>(i * 1024), static_cast<uint32_t>(i * 1024 + 1023), silent[i]->port());
        }
        return r;
      },
      0);
  RedisOptions o;
  o.port = seed.port();
  o.cluster = true;
  o.connect_timeout = 100ms;
  o.command_timeout = 400ms;  // a deadline of 1 s for the operation; 16 nodes x 0.4 s without it
  o.retry_interval = 10s;
  store_internal::ClusterTier tier(o);
  const auto t0 = std::chrono::steady_clock::now();
  for (uint8_t g : tier.exists(cluster_keys(256))) EXPECT_EQ(g, 0);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[ measured ] exists over 16 silent nodes: %.2f s\n", s);
  EXPECT_LT(s, 3.0);
  // The stats name why: a silent master (which explains more), or the deadline.
  const std::string why = tier.counters().last_error;
  EXPECT_TRUE(why.find("no progress within the command timeout") != std::string::npos ||
              why.find("ms deadline passed") != std::string::npos)
      << why;
  EXPECT_GT(tier.counters().errors, 0u);
}

// A slot map of 25 MB (every slot its own range, each with 63 replicas):
// read as it streams in and refused past 8 MiB, so no reply tree of it is
// ever built; the keys are misses and the stats say the map was not read.
TEST(ClusterRedirectTest, ASlotMapPastItsBoundIsRefusedWhileItIsRead) {
  std::string big;
  LyingNode liar(
      [&](uint16_t self) {
        if (big.empty()) {
          std::string replica = "*2\r\n$9\r\n127.0.0.1\r\n:1\r\n";
          std::string replicas;
          for (int r = 0; r < 63; ++r) replicas += replica;
          big = "*16384\r\n";
          for (int slot = 0; slot < 16384; ++slot) {
            big += "*66\r\n:" + std::to_string(slot) + "\r\n:" + std::to_string(slot) +
                   "\r\n*2\r\n$9\r\n127.0.0.1\r\n:" + std::to_string(self) + "\r\n" + replicas;
          }
        }
        return big;
      },
      0);
  RedisOptions o;
  o.port = liar.port();
  o.cluster = true;
  o.retry_interval = 10s;
  store_internal::ClusterTier tier(o);
  for (uint8_t g : tier.exists(cluster_keys(4))) EXPECT_EQ(g, 0);
  ASSERT_GT(big.size(), size_t{20} << 20);
  const store_internal::RedisCounters c = tier.counters();
  EXPECT_FALSE(c.up);
  EXPECT_EQ(c.slot_map_updates, 0u);
  EXPECT_GT(c.errors, 0u);
}

// Integers past int64 in a slot map (a slot, a port, an array's length):
// refused as a bad map, never computed with (UBSan stops the test on a
// signed overflow).
TEST(ClusterRedirectTest, ASlotMapWithIntegersPastInt64IsRefused) {
  for (const std::string& map :
       {std::string("*1\r\n*3\r\n:9999999999999999999\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:1\r\n"),
        std::string("*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:-9999999999999999999\r\n"),
        std::string("*9999999999999999999\r\n")}) {
    LyingNode liar([&](uint16_t) { return map; }, 0);
    RedisOptions o;
    o.port = liar.port();
    o.cluster = true;
    o.retry_interval = 10s;
    store_internal::ClusterTier tier(o);
    for (uint8_t g : tier.exists(cluster_keys(4))) EXPECT_EQ(g, 0);
    const store_internal::RedisCounters c = tier.counters();
    EXPECT_EQ(c.slot_map_updates, 0u) << map;
    EXPECT_GT(c.errors, 0u) << map;
  }
}

TEST(ClusterUnreachableTest, AClusterThatCannotBeReachedIsMissesAtOnce) {
  auto s = cluster_store(testing::free_loopback_port(), Assembly::kInProcess, kDefaultTimeouts);
  Instance inst(s, "llama3-8b", {1, 16}, 64);
  const std::vector<uint32_t> t = tokens(25, 64);
  inst.fill(64, 1);
  const auto t0 = std::chrono::steady_clock::now();
  inst.put(t, 64);  // into memory; the cluster write fails
  s->clear_memory();
  for (int i = 0; i < 5; ++i) EXPECT_EQ(inst.stores[0].lookup(t)->hit_tokens, 0u);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  const StoreStats st = s->stats();
  EXPECT_FALSE(st.redis_up);
  EXPECT_GT(st.redis_errors + st.redis_skipped, 0u);
  Result<Store::RedisInfo> info = s->redis_info();
  EXPECT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), Code::kUnavailable) << info.status().to_string();
}

}  // namespace
}  // namespace kvbridge
