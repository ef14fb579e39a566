// The Redis tier against a real redis-server (started here on loopback with a
// random port, no persistence, and stopped at the end even on failure):
// instances in other processes share objects; a Redis that dies or stalls in
// the middle of a run degrades to misses with counted errors, never a hang.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include <gtest/gtest.h>

#include "kvbridge/store.h"
#include "store/object.h"
#include "store/redis_tier.h"
#include "store/test_support.h"
#include "testing/ports.h"
#include "testing/redis_server.h"
#include "testing/require.h"

namespace kvbridge {
namespace {

using namespace std::chrono_literals;
using testing::make_request;
using testing::preset;
using testing::RankMemory;
using testing::stored_view;
using testing::tokens;

class RedisStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<std::unique_ptr<testing::RedisServer>> s = testing::RedisServer::start();
    if (!s.ok()) KVB_SKIP_UNLESS_REQUIRED("redis", s.error().to_string() + " (scripts/deps.sh installs it)");
    server_ = std::move(*s);
  }
  std::shared_ptr<Store> store(uint64_t H = 16, std::chrono::milliseconds timeout = 2000ms,
                               Assembly assembly = Assembly::kInProcess,
                               std::chrono::milliseconds incomplete_ttl = 60000ms) {
    StoreOptions o;
    o.assembly = assembly;
    o.hash_block_tokens = H;
    o.memory_bytes = uint64_t{512} << 20;
    RedisOptions r;
    r.port = server_->port();
    r.command_timeout = timeout;
    r.connect_timeout = 300ms;
    r.retry_interval = 500ms;
    r.incomplete_ttl = incomplete_ttl;
    o.redis = r;
    return *Store::create(o);
  }
  std::unique_ptr<testing::RedisServer> server_;

 public:
  std::shared_ptr<Store> shared_store(std::chrono::milliseconds ttl) {
    return store(16, 2000ms, Assembly::kShared, ttl);
  }
};

struct Rank {
  RankMemory mem;
  RankStore store;
};

// The ranks of an instance of llama3-8b at TP `tp` (only rank `only` when set).
std::vector<Rank> ranks(const std::shared_ptr<Store>& s, uint32_t tp, uint64_t bt, int only = -1) {
  std::vector<Rank> out;
  for (uint32_t r = 0; r < tp; ++r) {
    if (only >= 0 && r != static_cast<uint32_t>(only)) continue;
    RankMemory m(preset("llama3-8b", tp, r, bt, 8));
    Result<RankStore> rs = RankStore::create(s, m.layout);
    out.push_back({std::move(m), std::move(*rs)});
  }
  return out;
}

void put_all(std::vector<Rank>& rs, const std::vector<uint32_t>& t, uint64_t n, uint64_t seed) {
  for (Rank& r : rs) {
    ASSERT_TRUE(
        fill_request(r.mem.layout, make_request(r.mem.layout, n), RequestSide::kLocal, 0, seed, r.mem.memory()).ok());
    ASSERT_TRUE(r.store.put(t, make_request(r.mem.layout, n), r.mem.memory()).ok());
  }
}

// Gets n tokens on every rank; returns the smallest hit, checking the bytes.
uint64_t get_all(std::vector<Rank>& rs, const std::vector<uint32_t>& t, uint64_t n, uint64_t seed) {
  uint64_t hit = UINT64_MAX;
  for (Rank& r : rs) {
    Result<GetResult> g = r.store.get(t, make_request(r.mem.layout, n, 1), r.mem.memory());
    EXPECT_TRUE(g.ok()) << g.status().to_string();
    if (!g.ok()) return 0;
    hit = std::min(hit, g->hit_tokens);
    if (g->hit_tokens == 0) continue;
    Result<ContentReport> c = check_request(stored_view(r.mem.layout), make_request(r.mem.layout, g->hit_tokens, 1),
                                            RequestSide::kLocal, 0, seed, r.mem.memory());
    EXPECT_EQ(c->bad_cells, 0u) << c->first_error;
  }
  return hit;
}

TEST_F(RedisStoreTest, AnInstanceInAnotherProcessReadsWhatOneWrote) {
  const std::vector<uint32_t> t = tokens(21, 100);
  // The writer: TP 8, 32-token blocks, in a child process with its own store.
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto s = store();
    auto w = ranks(s, 8, 32);
    put_all(w, t, 100, 5);
    const StoreStats st = s->stats();
    _exit(st.redis_writes == 6 && st.redis_errors == 0 && !::testing::Test::HasFailure() ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  // The reader: TP 2, 16-token blocks, a fresh store in this process.
  auto s = store();
  auto r = ranks(s, 2, 16);
  EXPECT_EQ(r[0].store.lookup(t)->redis_objects, 6u);
  EXPECT_EQ(get_all(r, t, 100, 5), 96u);
  const StoreStats st = s->stats();
  EXPECT_EQ(st.redis_hits, 6u) << "the first rank fetches and promotes";
  EXPECT_EQ(st.memory_hits, 6u) << "the second rank reads the promoted objects";
  EXPECT_EQ(st.redis_errors, 0u);
}

// Runs `body` in a child process; returns a pid to pass to wait_ok().
template <typename F>
pid_t spawn(F body) {
  const pid_t pid = fork();
  if (pid == 0) _exit(body() && !::testing::Test::HasFailure() ? 0 : 1);
  return pid;
}

// Waits for a child (with a deadline: a hung child fails the test, killed).
bool wait_ok(pid_t pid) {
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      ADD_FAILURE() << "child " << pid << " did not finish in 20 s";
      return false;
    }
    std::this_thread::sleep_for(5ms);
  }
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// Puts the part of rank `rank` of a TP `tp` instance from a store of its own
// (one process per rank): true when the put wrote a part of every object.
bool put_rank(RedisStoreTest* t, uint32_t tp, uint32_t rank, const std::vector<uint32_t>& toks, uint64_t n,
              uint64_t objects, std::chrono::milliseconds ttl = 60000ms);

bool put_rank(RedisStoreTest* t, uint32_t tp, uint32_t rank, const std::vector<uint32_t>& toks, uint64_t n,
              uint64_t objects, std::chrono::milliseconds ttl) {
  auto s = t->shared_store(ttl);
  auto r = ranks(s, tp, 16, static_cast<int>(rank));
  Rank& me = r[0];
  EXPECT_TRUE(
      fill_request(me.mem.layout, make_request(me.mem.layout, n), RequestSide::kLocal, 0, 5, me.mem.memory()).ok());
  Result<PutResult> p = me.store.put(toks, make_request(me.mem.layout, n), me.mem.memory());
  EXPECT_TRUE(p.ok()) << p.status().to_string();
  if (!p.ok()) return false;
  EXPECT_EQ(p->parts_written, objects);
  EXPECT_EQ(s->stats().redis_errors, 0u);
  EXPECT_EQ(s->stats().memory_objects, 0u) << "a part is not an object";
  return p->parts_written == objects;
}

// Device memory through Redis: a writer's Store writes through, a reader's
// Store (its memory empty) reads every object from Redis into device memory;
// with assembly in Redis too (each rank's part written from its device).
TEST_F(RedisStoreTest, DeviceMemoryGoesThroughRedisByteExact) {
  auto writer = store();
  auto reader = store();
  EXPECT_EQ(testing::device_round_trip(writer, reader, "llama3-8b", {4, 32}, {2, 16}, 128, 9), 128u);
  EXPECT_GT(reader->stats().redis_hits, 0u);
  EXPECT_EQ(reader->stats().redis_errors, 0u) << reader->stats().redis_last_error;
  auto parts = shared_store(60000ms);
  auto parts_reader = store();
  EXPECT_EQ(testing::device_round_trip(parts, parts_reader, "llama3-8b", {4, 32}, {1, 16}, 64, 10), 64u);
  EXPECT_GT(parts_reader->stats().redis_hits, 0u);
}

TEST_F(RedisStoreTest, RanksInSeparateProcessesAssembleObjectsInRedis) {
  const std::vector<uint32_t> t = tokens(61, 100);
  // A TP 2 instance, one process per rank, both putting at once.
  const pid_t a = spawn([&] { return put_rank(this, 2, 0, t, 100, 6); });
  const pid_t b = spawn([&] { return put_rank(this, 2, 1, t, 100, 6); });
  ASSERT_TRUE(wait_ok(a));
  ASSERT_TRUE(wait_ok(b));
  // Only whole objects are left: the staging keys became the object keys.
  auto s = store();
  EXPECT_EQ(s->redis_info()->keys, 6u);
  // A TP 4 instance with 32-token blocks reads it byte for byte.
  auto r = ranks(s, 4, 32);
  EXPECT_EQ(r[0].store.lookup(t)->redis_objects, 6u);
  EXPECT_EQ(get_all(r, t, 100, 5), 96u);
  EXPECT_EQ(s->stats().redis_bad_objects, 0u);
  // Putting again finds the objects and writes nothing.
  EXPECT_TRUE(wait_ok(spawn([&] {
    auto w = store(16, 2000ms, Assembly::kShared);
    auto rk = ranks(w, 2, 16, 1);
    EXPECT_TRUE(fill_request(rk[0].mem.layout, make_request(rk[0].mem.layout, 100), RequestSide::kLocal, 0, 5,
                             rk[0].mem.memory())
                    .ok());
    Result<PutResult> p = rk[0].store.put(t, make_request(rk[0].mem.layout, 100), rk[0].mem.memory());
    return p.ok() && p->objects_present == 6 && p->parts_written == 0 && p->bytes_copied == 0;
  })));
}

TEST_F(RedisStoreTest, AnObjectMissingAPartIsAMissAndItsPartExpires) {
  const std::vector<uint32_t> t = tokens(71, 64);
  // Only rank 0 of a TP 2 instance writes (rank 1 died): nothing is visible.
  // The TTL leaves room for the checks below under a sanitizer on a busy
  // machine (300 ms did not, under TSan with another test running).
  ASSERT_TRUE(wait_ok(spawn([&] { return put_rank(this, 2, 0, t, 64, 4, 1500ms); })));
  auto s = store();
  auto r = ranks(s, 1, 16);
  EXPECT_EQ(r[0].store.lookup(t)->hit_tokens, 0u);
  EXPECT_EQ(get_all(r, t, 64, 5), 0u);
  store_internal::RedisTier tier(*s->options().redis);
  const std::string object = ObjectKey{r[0].store.hashes(t)[0], 0}.text(s->options().redis->key_prefix);
  std::vector<std::string> pttl = {"PTTL", object + ".tp2"};
  Result<std::string> left = tier.command(pttl);
  ASSERT_TRUE(left.ok());
  EXPECT_GT(std::stoll(*left), 0) << "the incomplete object has a TTL";
  EXPECT_LE(std::stoll(*left), 1500);
  // Past the TTL the half is gone: rank 1's part alone does not make an
  // object of it. (Redis drops expired keys in a cycle ten times a second,
  // and the parts' TTLs started a little apart: wait for it, bounded.)
  const auto gone_by = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::stoll(*left)) + 3s;
  while (s->redis_info()->keys != 0 && std::chrono::steady_clock::now() < gone_by) {
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_EQ(s->redis_info()->keys, 0u);
  ASSERT_TRUE(wait_ok(spawn([&] { return put_rank(this, 2, 1, t, 64, 4); })));
  EXPECT_EQ(r[0].store.lookup(t)->hit_tokens, 0u);
  // Rank 0 again: now complete.
  ASSERT_TRUE(wait_ok(spawn([&] { return put_rank(this, 2, 0, t, 64, 4); })));
  EXPECT_EQ(get_all(r, t, 64, 5), 64u);
  EXPECT_EQ(s->redis_info()->keys, 4u);
}

TEST_F(RedisStoreTest, RedisDownInTheMiddleOfARunDegradesToMisses) {
  auto a = store();
  auto b = store();
  auto wa = ranks(a, 1, 16);
  auto rb = ranks(b, 1, 16);
  const std::vector<uint32_t> p1 = tokens(31, 64), p2 = tokens(32, 64);
  put_all(wa, p1, 64, 1);
  EXPECT_EQ(a->stats().redis_writes, 4u);
  server_->stop();  // SIGKILL: connections reset, port closed
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(get_all(rb, p1, 64, 1), 0u) << "only Redis had it: a miss";
  put_all(wa, p2, 64, 2);                  // the write-through fails: memory only
  EXPECT_EQ(get_all(wa, p1, 64, 1), 64u);  // memory still serves
  EXPECT_EQ(get_all(wa, p2, 64, 2), 64u);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(get_all(rb, p2, 64, 2), 0u);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s) << "failures must not wait";
  const StoreStats sa = a->stats(), sb = b->stats();
  EXPECT_GE(sa.redis_errors, 1u);
  EXPECT_GE(sb.redis_errors, 1u);
  EXPECT_GE(sb.redis_skipped, 1u) << "while down, operations are skipped, not retried";
  EXPECT_FALSE(sb.redis_up);
  // The latest failure is named: the node, the operation, the cause (the
  // store's connection, made when it was created, was reset; or a new one
  // was refused).
  const std::string node = ":" + std::to_string(server_->port()) + ": ";
  EXPECT_TRUE(sb.redis_last_error.find(node + "connect: Connection refused") != std::string::npos ||
              sb.redis_last_error.find(": the server closed the connection") != std::string::npos)
      << sb.redis_last_error;
  EXPECT_NE(sb.redis_last_error.find(node), std::string::npos) << sb.redis_last_error;
  EXPECT_FALSE(sa.redis_last_error.empty());
}

TEST_F(RedisStoreTest, AStalledRedisTimesOutAndComesBack) {
  auto a = store(16, 2000ms);
  auto wa = ranks(a, 1, 16);
  const std::vector<uint32_t> t = tokens(41, 64);
  put_all(wa, t, 64, 3);
  auto b = store(16, 200ms);
  auto rb = ranks(b, 1, 16);
  server_->signal(SIGSTOP);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(get_all(rb, t, 64, 3), 0u);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  EXPECT_GE(b->stats().redis_errors, 1u);
  EXPECT_NE(b->stats().redis_last_error.find(": no progress within the command timeout of 200 ms"), std::string::npos)
      << "last error: " << b->stats().redis_last_error;
  server_->signal(SIGCONT);
  std::this_thread::sleep_for(600ms);  // past the retry interval
  EXPECT_EQ(get_all(rb, t, 64, 3), 64u);
  EXPECT_TRUE(b->stats().redis_up);
}

// The tier's own GET reader and SET writer (they bypass hiredis) across value
// sizes around its buffer and direct-receive thresholds, with absent keys in
// between and a window smaller than the batch.
TEST_F(RedisStoreTest, TheTierMovesValuesOfEverySizeByteExact) {
  RedisOptions o = *store()->options().redis;
  o.pipeline_depth = 3;
  store_internal::RedisTier tier(o);
  const std::vector<uint64_t> sizes = {0, 1, 1024, (64 << 10) - 1, 64 << 10, (64 << 10) + 1, (256 << 10) + 7, 3 << 20};
  std::vector<std::string> keys;
  std::vector<std::vector<uint8_t>> values;
  std::vector<std::span<const uint8_t>> spans;
  for (size_t i = 0; i < sizes.size(); ++i) {
    keys.push_back("t:" + std::to_string(i));
    values.emplace_back(sizes[i]);
    for (uint64_t b = 0; b < sizes[i]; ++b) values.back()[b] = static_cast<uint8_t>(b * 31 + i);
    spans.emplace_back(values.back());
  }
  ASSERT_EQ(tier.put(keys, spans), keys.size());
  // Read them back interleaved with absent keys, twice over one connection.
  std::vector<std::string> ask;
  for (const std::string& k : keys) {
    ask.push_back(k);
    ask.push_back(k + ":absent");
  }
  struct Sink : store_internal::GetSink {
    std::vector<std::vector<uint8_t>> got;
    std::vector<uint64_t> arrived;
    std::vector<int> finished;
    explicit Sink(size_t n) : got(n), arrived(n, 0), finished(n, 0) {}
    uint8_t* buffer(size_t i, uint64_t bytes) override {
      got[i].assign(bytes + 1, 0xee);  // one guard byte
      return got[i].data();
    }
    void received(size_t i, uint64_t offset, uint64_t n) override {
      EXPECT_EQ(offset, arrived[i]);
      arrived[i] += n;
    }
    void done(size_t i) override { ++finished[i]; }
  };
  for (int round = 0; round < 2; ++round) {
    Sink sink(ask.size());
    ASSERT_TRUE(tier.get(ask, sink));
    for (size_t i = 0; i < keys.size(); ++i) {
      EXPECT_EQ(sink.finished[2 * i], 1) << "size " << sizes[i];
      EXPECT_EQ(sink.finished[2 * i + 1], 0);
      EXPECT_EQ(sink.arrived[2 * i], sizes[i]);
      ASSERT_EQ(sink.got[2 * i].size(), sizes[i] + 1);
      EXPECT_TRUE(std::equal(values[i].begin(), values[i].end(), sink.got[2 * i].begin())) << "size " << sizes[i];
      EXPECT_EQ(sink.got[2 * i][sizes[i]], 0xee) << "wrote past the value";
    }
  }
  // hiredis and the tier's own I/O stay in step on one connection.
  std::vector<std::string> dbsize = {"DBSIZE"};
  EXPECT_EQ(*tier.command(dbsize), std::to_string(keys.size()));
  EXPECT_EQ(tier.counters().errors, 0u);
}

TEST_F(RedisStoreTest, ACorruptObjectIsAMiss) {
  auto a = store();
  auto wa = ranks(a, 1, 16);
  const std::vector<uint32_t> t = tokens(51, 64);
  put_all(wa, t, 64, 4);
  // Flip one payload byte of the third block's object in Redis.
  const BlockHash h = wa[0].store.hashes(t)[2];
  store_internal::RedisTier tier(*a->options().redis);
  const std::string key = ObjectKey{h, 0}.text(a->options().redis->key_prefix);
  std::vector<std::string> get = {"GET", key};
  Result<std::string> v = tier.command(get);
  ASSERT_TRUE(v.ok());
  std::string bad = *v;
  bad[1000] ^= 0x5a;
  std::vector<std::string> set = {"SET", key, bad};
  ASSERT_TRUE(tier.command(set).ok());
  auto b = store();
  auto rb = ranks(b, 1, 16);
  EXPECT_EQ(get_all(rb, t, 64, 4), 32u);
  EXPECT_EQ(b->stats().redis_bad_objects, 1u);
  // A value of the wrong size (the second block's, cut short) is dropped
  // unread, and the connection stays usable.
  const std::string key1 = ObjectKey{wa[0].store.hashes(t)[1], 0}.text(a->options().redis->key_prefix);
  std::vector<std::string> cut = {"SET", key1, v->substr(0, 5000)};
  ASSERT_TRUE(tier.command(cut).ok());
  auto c = store();
  auto rc = ranks(c, 1, 16);
  EXPECT_EQ(get_all(rc, t, 64, 4), 16u);
  EXPECT_EQ(c->stats().redis_bad_objects, 2u) << "the cut one and the corrupt one";
  EXPECT_EQ(c->stats().redis_errors, 0u);
}

TEST_F(RedisStoreTest, AnAssembledObjectCarriesTheChecksumRedisWroteAndACorruptOneIsAMiss) {
  const std::vector<uint32_t> t = tokens(81, 64);
  const pid_t a = spawn([&] { return put_rank(this, 2, 0, t, 64, 4); });
  const pid_t b = spawn([&] { return put_rank(this, 2, 1, t, 64, 4); });
  ASSERT_TRUE(wait_ok(a));
  ASSERT_TRUE(wait_ok(b));
  auto s = store();
  auto r = ranks(s, 1, 16);
  store_internal::RedisTier tier(*s->options().redis);
  const std::string key = ObjectKey{r[0].store.hashes(t)[1], 0}.text(s->options().redis->key_prefix);
  std::vector<std::string> get = {"GET", key};
  Result<std::string> v = tier.command(get);
  ASSERT_TRUE(v.ok());
  // The header of the assembled object has its checksum flag and the first
  // 8 bytes of SHA-1 of its payload, as the completing script wrote them.
  const auto* o = reinterpret_cast<const uint8_t*>(v->data());
  EXPECT_EQ(o[48] & (store_internal::kFlagAssembled | store_internal::kFlagAssembledChecksum),
            store_internal::kFlagAssembled | store_internal::kFlagAssembledChecksum);
  uint8_t sum[8];
  store_internal::assembled_checksum(o + store_internal::kHeaderBytes, v->size() - store_internal::kHeaderBytes, sum);
  EXPECT_EQ(std::memcmp(sum, o + 40, 8), 0);
  EXPECT_EQ(get_all(r, t, 64, 5), 64u);
  EXPECT_EQ(s->stats().redis_bad_objects, 0u);
  // Four bytes of the payload changed in Redis: the second block is a miss
  // (a hit stops at the first block), counted, not wrong bytes.
  std::vector<std::string> poke = {"SETRANGE", key, std::to_string(v->size() - 100), "XXXX"};
  ASSERT_TRUE(tier.command(poke).ok());
  auto c = store();
  auto rc = ranks(c, 1, 16);
  EXPECT_EQ(get_all(rc, t, 64, 5), 16u);
  EXPECT_EQ(c->stats().redis_bad_objects, 1u);
  // An assembled object whose checksum flag was cleared is not trusted either.
  const std::string key0 = ObjectKey{r[0].store.hashes(t)[0], 0}.text(s->options().redis->key_prefix);
  std::vector<std::string> get0 = {"GET", key0};
  Result<std::string> v0 = tier.command(get0);
  ASSERT_TRUE(v0.ok());
  std::string cleared(1, static_cast<char>((*v0)[48] & ~store_internal::kFlagAssembledChecksum));
  std::vector<std::string> clear = {"SETRANGE", key0, "48", cleared};
  ASSERT_TRUE(tier.command(clear).ok());
  auto d = store();
  auto rd = ranks(d, 1, 16);
  EXPECT_EQ(get_all(rd, t, 64, 5), 0u);
  EXPECT_EQ(d->stats().redis_bad_objects, 2u) << "the uncheckable first block's and the corrupt second's";
}

// A server that answers a GET with a large value one byte at a time, each
// byte within the command timeout: the get fails once the reply is older
// than the command timeout and slower than the least rate, not after hours.
TEST(RedisTrickleTest, AReplyTrickledByteByByteFailsSoonAfterTheCommandTimeout) {
  testing::SilentListener ls;
  ASSERT_TRUE(ls.ok());
  std::atomic<bool> stop{false};
  std::thread server([&] {
    pollfd p{ls.fd(), POLLIN, 0};
    if (::poll(&p, 1, 5000) != 1) return;
    const int c = ::accept(ls.fd(), nullptr, nullptr);
    if (c < 0) return;
    char buf[4096];
    (void)!::recv(c, buf, sizeof buf, 0);  // the GET
    const std::string head = "$1000000\r\n";
    (void)!::send(c, head.data(), head.size(), MSG_NOSIGNAL);
    while (!stop.load() && ::send(c, "x", 1, MSG_NOSIGNAL) == 1)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ::close(c);
  });
  RedisOptions o;
  o.port = ls.port();
  o.command_timeout = std::chrono::milliseconds(500);
  store_internal::RedisTier tier(o);
  struct Sink : store_internal::GetSink {
    std::vector<uint8_t> got;
    int finished = 0;
    uint8_t* buffer(size_t, uint64_t bytes) override {
      got.resize(bytes);
      return got.data();
    }
    void received(size_t, uint64_t, uint64_t) override {}
    void done(size_t) override { ++finished; }
  } sink;
  const std::vector<std::string> keys = {"k"};
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(tier.get(keys, sink));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  stop.store(true);
  server.join();
  EXPECT_EQ(sink.finished, 0);
  EXPECT_LT(s, 2.0) << "a trickled reply held the get";
  EXPECT_NE(tier.counters().last_error.find("slower than 1024 KiB/s"), std::string::npos) << tier.counters().last_error;
}

}  // namespace
}  // namespace kvbridge
