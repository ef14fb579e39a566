// The Redis tier against a real redis-server (started here on loopback with a
// random port, no persistence, and stopped at the end even on failure):
// instances in other processes share objects; a Redis that dies or stalls in
// the middle of a run degrades to misses with counted errors, never a hang.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include <gtest/gtest.h>

#include "kvbridge/store.h"
#include "store/redis_tier.h"
#include "store/test_support.h"

namespace kvbridge {
namespace {

using namespace std::chrono_literals;
using testing::make_request;
using testing::preset;
using testing::RankMemory;
using testing::stored_view;
using testing::tokens;

uint16_t free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

bool can_connect(uint16_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  close(fd);
  return ok;
}

// A redis-server child process; killed with the test process too
// (PR_SET_PDEATHSIG), stopped by the destructor.
class RedisServer {
 public:
  bool start() {
    for (int attempt = 0; attempt < 3; ++attempt) {
      port_ = free_port();
      pid_ = fork();
      if (pid_ == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        const int devnull = open("/dev/null", O_WRONLY);
        if (devnull >= 0) {
          dup2(devnull, 1);
          dup2(devnull, 2);
        }
        const std::string p = std::to_string(port_);
        execlp("redis-server", "redis-server", "--port", p.c_str(), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning", static_cast<char*>(nullptr));
        _exit(127);
      }
      const auto deadline = std::chrono::steady_clock::now() + 5s;
      while (std::chrono::steady_clock::now() < deadline) {
        if (can_connect(port_)) return true;
        int status = 0;
        if (waitpid(pid_, &status, WNOHANG) == pid_) break;  // exited: port taken or no binary
        std::this_thread::sleep_for(20ms);
      }
      stop();
    }
    return false;
  }
  void signal(int sig) {
    if (pid_ > 0) ::kill(pid_, sig);
  }
  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGCONT);
    ::kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  ~RedisServer() { stop(); }
  uint16_t port() const { return port_; }

 private:
  pid_t pid_ = -1;
  uint16_t port_ = 0;
};

class RedisStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!server_.start()) GTEST_SKIP() << "redis-server could not be started (scripts/deps.sh installs it)";
  }
  std::shared_ptr<Store> store(uint64_t H = 16, std::chrono::milliseconds timeout = 2000ms) {
    StoreOptions o;
    o.hash_block_tokens = H;
    o.memory_bytes = uint64_t{512} << 20;
    RedisOptions r;
    r.port = server_.port();
    r.command_timeout = timeout;
    r.connect_timeout = 300ms;
    r.retry_interval = 500ms;
    o.redis = r;
    return *Store::create(o);
  }
  RedisServer server_;
};

struct Rank {
  RankMemory mem;
  RankStore store;
};

std::vector<Rank> ranks(const std::shared_ptr<Store>& s, uint32_t tp, uint64_t bt) {
  std::vector<Rank> out;
  for (uint32_t r = 0; r < tp; ++r) {
    RankMemory m(preset("llama3-8b", tp, r, bt, 8));
    Result<RankStore> rs = RankStore::create(s, m.layout);
    out.push_back({std::move(m), std::move(*rs)});
  }
  return out;
}

void put_all(std::vector<Rank>& rs, const std::vector<uint32_t>& t, uint64_t n, uint64_t seed) {
  for (Rank& r : rs) {
    ASSERT_TRUE(fill_request(r.mem.layout, make_request(r.mem.layout, n), RequestSide::kLocal, 0, seed,
                             r.mem.memory()).ok());
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

TEST_F(RedisStoreTest, RedisDownInTheMiddleOfARunDegradesToMisses) {
  auto a = store();
  auto b = store();
  auto wa = ranks(a, 1, 16);
  auto rb = ranks(b, 1, 16);
  const std::vector<uint32_t> p1 = tokens(31, 64), p2 = tokens(32, 64);
  put_all(wa, p1, 64, 1);
  EXPECT_EQ(a->stats().redis_writes, 4u);
  server_.stop();  // SIGKILL: connections reset, port closed
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(get_all(rb, p1, 64, 1), 0u) << "only Redis had it: a miss";
  put_all(wa, p2, 64, 2);                 // the write-through fails: memory only
  EXPECT_EQ(get_all(wa, p1, 64, 1), 64u);  // memory still serves
  EXPECT_EQ(get_all(wa, p2, 64, 2), 64u);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(get_all(rb, p2, 64, 2), 0u);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s) << "failures must not wait";
  const StoreStats sa = a->stats(), sb = b->stats();
  EXPECT_GE(sa.redis_errors, 1u);
  EXPECT_GE(sb.redis_errors, 1u);
  EXPECT_GE(sb.redis_skipped, 1u) << "while down, operations are skipped, not retried";
  EXPECT_FALSE(sb.redis_up);
}

TEST_F(RedisStoreTest, AStalledRedisTimesOutAndComesBack) {
  auto a = store(16, 2000ms);
  auto wa = ranks(a, 1, 16);
  const std::vector<uint32_t> t = tokens(41, 64);
  put_all(wa, t, 64, 3);
  auto b = store(16, 200ms);
  auto rb = ranks(b, 1, 16);
  server_.signal(SIGSTOP);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(get_all(rb, t, 64, 3), 0u);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  EXPECT_GE(b->stats().redis_errors, 1u);
  server_.signal(SIGCONT);
  std::this_thread::sleep_for(600ms);  // past the retry interval
  EXPECT_EQ(get_all(rb, t, 64, 3), 64u);
  EXPECT_TRUE(b->stats().redis_up);
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
}

}  // namespace
}  // namespace kvbridge
