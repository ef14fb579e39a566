// Registration and Watcher against a real etcd (a child process): latency
// to visible, a killed registrant, an etcd restart, a lost lease, an
// unreachable or stopped etcd.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <mutex>
#include <thread>
#include <vector>

#include "discovery/etcd_client.h"
#include "kvbridge/discovery.h"
#include "testing/etcd_server.h"
#include "testing/require.h"

namespace kvbridge {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

InstanceRecord record(std::string id, std::string role = "prefill") {
  InstanceRecord r;
  r.id = std::move(id);
  r.role = std::move(role);
  r.ranks = {"127.0.0.1:7000", "127.0.0.1:7001"};
  r.identity = "0123456789abcdef";
  r.protocol = 2;
  return r;
}

double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

// The watcher's callbacks, with when each arrived.
struct Events {
  struct Event {
    InstanceEvent event;
    InstanceRecord record;
    Clock::time_point at;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Event> seen;

  InstanceCallback callback() {
    return [this](InstanceEvent e, const InstanceRecord& r) {
      std::lock_guard<std::mutex> l(mu);
      seen.push_back({e, r, Clock::now()});
      cv.notify_all();
    };
  }
  // The first `event` for `id`, waiting up to `timeout`.
  std::optional<Event> wait(InstanceEvent event, const std::string& id, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> l(mu);
    std::optional<Event> found;
    cv.wait_for(l, timeout, [&] {
      for (const Event& e : seen) {
        if (e.event == event && e.record.id == id) {
          found = e;
          return true;
        }
      }
      return false;
    });
    return found;
  }
  size_t count() {
    std::lock_guard<std::mutex> l(mu);
    return seen.size();
  }
};

class DiscoveryTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    Result<std::unique_ptr<testing::EtcdServer>> s = testing::EtcdServer::start();
    if (s.ok()) {
      server_ = std::move(*s).release();
    } else {
      start_error_ = s.error().to_string();
    }
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    if (!server_) KVB_SKIP_UNLESS_REQUIRED("etcd", start_error_ + " (scripts/deps.sh installs it)");
    options_.endpoint = server_->endpoint();
    // One prefix per test: the tests share one etcd.
    options_.prefix = std::string("/kvb-test/") + ::testing::UnitTest::GetInstance()->current_test_info()->name();
  }

  static testing::EtcdServer* server_;
  static std::string start_error_;
  EtcdOptions options_;
};
testing::EtcdServer* DiscoveryTest::server_ = nullptr;
std::string DiscoveryTest::start_error_;

TEST_F(DiscoveryTest, ARegistrationIsVisibleToAWatcherWithinOneSecondAndGoneAtOnceWhenDestroyed) {
  Events events;
  Result<std::unique_ptr<Watcher>> w = Watcher::create(options_, events.callback());
  ASSERT_TRUE(w.ok()) << w.error().to_string();
  EXPECT_TRUE((*w)->instances().empty());

  const Clock::time_point start = Clock::now();
  Result<std::unique_ptr<Registration>> r = Registration::create(options_, record("p0"), 5s);
  ASSERT_TRUE(r.ok()) << r.error().to_string();
  std::optional<Events::Event> added = events.wait(InstanceEvent::kAdded, "p0", 5s);
  ASSERT_TRUE(added) << "no 'added' within 5 s";
  const double visible_ms = std::chrono::duration<double, std::milli>(added->at - start).count();
  std::printf("[ measured ] registration to visible in the watcher: %.1f ms\n", visible_ms);
  EXPECT_LT(visible_ms, 1000.0);
  EXPECT_EQ(added->record, record("p0"));
  EXPECT_EQ((*w)->instances().at("p0"), record("p0"));
  EXPECT_TRUE((*r)->health().ok());
  EXPECT_EQ((*r)->key(), options_.prefix + "/instances/p0");

  // A second watcher starting now finds it by listing.
  Result<std::unique_ptr<Watcher>> late = Watcher::create(options_);
  ASSERT_TRUE(late.ok()) << late.error().to_string();
  EXPECT_TRUE((*late)->wait_for("p0", 1s).ok());

  // Destroying revokes the lease: the key goes at once, not after the TTL.
  const Clock::time_point revoke = Clock::now();
  r->reset();
  std::optional<Events::Event> removed = events.wait(InstanceEvent::kRemoved, "p0", 5s);
  ASSERT_TRUE(removed) << "no 'removed' within 5 s";
  const double gone_ms = std::chrono::duration<double, std::milli>(removed->at - revoke).count();
  std::printf("[ measured ] registration destroyed to removed in the watcher: %.1f ms\n", gone_ms);
  EXPECT_LT(gone_ms, 1000.0);
  EXPECT_TRUE((*late)->wait_gone("p0", 1s).ok());
  EXPECT_TRUE((*w)->health().ok()) << (*w)->health().to_string();
}

TEST_F(DiscoveryTest, AChangedRecordIsReportedAsChangedAndAnInvalidOneIsSkipped) {
  Events events;
  Result<std::unique_ptr<Watcher>> w = Watcher::create(options_, events.callback());
  ASSERT_TRUE(w.ok()) << w.error().to_string();
  discovery::EtcdClient client(options_);
  ASSERT_TRUE(client.put(instance_key(options_, "d1"), *instance_record_to_json(record("d1", "decode")), 0).ok());
  ASSERT_TRUE(events.wait(InstanceEvent::kAdded, "d1", 5s));
  InstanceRecord changed = record("d1", "decode");
  changed.ranks.push_back("127.0.0.1:7002");
  ASSERT_TRUE(client.put(instance_key(options_, "d1"), *instance_record_to_json(changed), 0).ok());
  std::optional<Events::Event> e = events.wait(InstanceEvent::kChanged, "d1", 5s);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->record.ranks.size(), 3u);
  // Writing the same record again is no change.
  ASSERT_TRUE(client.put(instance_key(options_, "d1"), *instance_record_to_json(changed), 0).ok());
  // Not a record, and a record under another id's key: skipped, counted.
  ASSERT_TRUE(client.put(instance_key(options_, "junk"), "{not json", 0).ok());
  ASSERT_TRUE(client.put(instance_key(options_, "x"), *instance_record_to_json(record("y")), 0).ok());
  const Clock::time_point until = Clock::now() + 5s;
  while ((*w)->invalid_records() < 2 && Clock::now() < until) std::this_thread::sleep_for(10ms);
  EXPECT_EQ((*w)->invalid_records(), 2u);
  EXPECT_EQ((*w)->instances().size(), 1u);
  EXPECT_EQ(events.count(), 2u) << "added and changed only";
  // A valid record replaced by garbage is removed.
  ASSERT_TRUE(client.put(instance_key(options_, "d1"), "[]", 0).ok());
  EXPECT_TRUE(events.wait(InstanceEvent::kRemoved, "d1", 5s));
}

// Many large records (each near the record bound) add up to more than one
// answer may be: the listing reads them in pages at one revision, so every
// record is found, however many there are, and no answer grows with them.
TEST_F(DiscoveryTest, AListingOfMoreRecordsThanOneAnswerHoldsFindsEveryOne) {
  discovery::EtcdClient client(options_);
  const size_t n = 300;  // 300 x 60 KB: 24 MB of base64, past one answer's 16 MiB
  for (size_t i = 0; i < n; ++i) {
    InstanceRecord r = record("big-" + std::to_string(i));
    for (int l = 0; l < 60; ++l) r.labels["l" + std::to_string(l)] = std::string(250, static_cast<char>('a' + l % 26));
    r.ranks.clear();
    for (int k = 0; k < 200; ++k) r.ranks.push_back("host-" + std::string(200, 'x') + ":" + std::to_string(7000 + k));
    Result<std::string> json = instance_record_to_json(r);
    ASSERT_TRUE(json.ok()) << json.error().to_string();
    ASSERT_GT(json->size(), 55000u);
    ASSERT_TRUE(client.put(instance_key(options_, r.id), *json, 0).ok());
  }
  int64_t revision = 0;
  Result<std::vector<discovery::KeyValue>> all = client.list(instance_key(options_, ""), &revision);
  ASSERT_TRUE(all.ok()) << all.error().to_string();
  EXPECT_EQ(all->size(), n);
  EXPECT_GT(revision, 0);
  Result<std::unique_ptr<Watcher>> w = Watcher::create(options_);
  ASSERT_TRUE(w.ok()) << w.error().to_string();
  EXPECT_EQ((*w)->instances().size(), n);
  EXPECT_EQ((*w)->invalid_records(), 0u) << (*w)->last_invalid().to_string();
}

TEST_F(DiscoveryTest, AKilledRegistrantsKeyVanishesWithinItsTtl) {
  // The child registers and waits to be killed; nothing revokes its lease.
  // Forked before this process starts any thread of its own.
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    ::close(ready[0]);
    Result<std::unique_ptr<Registration>> r = Registration::create(options_, record("doomed"), 2s);
    const char byte = r.ok() ? '1' : '0';
    if (::write(ready[1], &byte, 1) != 1 || !r.ok()) ::_exit(1);
    for (;;) ::pause();
  }
  ::close(ready[1]);
  char byte = 0;
  const ssize_t n = ::read(ready[0], &byte, 1);
  ::close(ready[0]);
  ASSERT_EQ(n, 1);
  ASSERT_EQ(byte, '1') << "the child could not register";

  Events events;
  Result<std::unique_ptr<Watcher>> w = Watcher::create(options_, events.callback());
  ASSERT_TRUE(w.ok()) << w.error().to_string();
  ASSERT_TRUE(events.wait(InstanceEvent::kAdded, "doomed", 5s));
  // Let a keepalive or two pass: the key must outlive them while the child lives.
  std::this_thread::sleep_for(1500ms);
  ASSERT_TRUE((*w)->instances().contains("doomed"));

  const Clock::time_point killed = Clock::now();
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  std::optional<Events::Event> removed = events.wait(InstanceEvent::kRemoved, "doomed", 5s);
  ASSERT_TRUE(removed) << "the key outlived its 2 s TTL by more than 3 s";
  const double ms = std::chrono::duration<double, std::milli>(removed->at - killed).count();
  std::printf("[ measured ] registrant killed (TTL 2 s) to removed in the watcher: %.1f ms\n", ms);
  EXPECT_LT(ms, 2000.0 + 1000.0);  // the TTL, plus etcd's expiry check (every 500 ms) and margin
}

TEST_F(DiscoveryTest, ALostLeaseIsGrantedAgainAndTheKeyComesBack) {
  Result<std::unique_ptr<Registration>> r = Registration::create(options_, record("p1"), 3s);
  ASSERT_TRUE(r.ok()) << r.error().to_string();
  Events events;
  Result<std::unique_ptr<Watcher>> w = Watcher::create(options_, events.callback());
  ASSERT_TRUE(w.ok()) << w.error().to_string();
  ASSERT_TRUE(events.wait(InstanceEvent::kAdded, "p1", 5s));
  const int64_t lease = (*r)->lease();
  discovery::EtcdClient client(options_);
  ASSERT_TRUE(client.revoke(lease).ok());  // as if it expired while this process was frozen
  ASSERT_TRUE(events.wait(InstanceEvent::kRemoved, "p1", 5s));
  // The next renewal (every TTL/3 = 1 s) finds the lease gone and re-registers
  // (waited for up to 6 s: a loaded machine may delay a renewal).
  const Clock::time_point until = Clock::now() + 6s;
  while (!(*w)->instances().contains("p1") && Clock::now() < until) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE((*w)->instances().contains("p1")) << "not registered again within 6 s";
  EXPECT_EQ((*r)->regrants(), 1u);
  EXPECT_NE((*r)->lease(), lease);
}

TEST_F(DiscoveryTest, BadOptionsAndRecordsAreRefused) {
  EtcdOptions o = options_;
  o.prefix = "no-slash";
  Result<std::unique_ptr<Watcher>> w = Watcher::create(o);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.error().code(), Code::kInvalidArgument);
  Result<std::unique_ptr<Registration>> r = Registration::create(options_, record("p"), 1s);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("minimum of 2 s"), std::string::npos);
  InstanceRecord bad = record("p");
  bad.role = "router";
  r = Registration::create(options_, bad);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("'role'"), std::string::npos);
}

// An etcd that does not answer: a closed port, then a stopped process
// (connections accepted by the kernel, nothing answered).
TEST_F(DiscoveryTest, AnUnreachableOrStoppedEtcdIsUnavailableWithinBoundedTime) {
  EtcdOptions o = options_;
  o.endpoint = "http://127.0.0.1:1";
  o.connect_timeout = 500ms;
  o.request_timeout = 1000ms;
  Clock::time_point t = Clock::now();
  Result<std::unique_ptr<Registration>> r = Registration::create(o, record("p"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code(), Code::kUnavailable) << r.error().to_string();
  EXPECT_NE(r.error().message().find("etcd at http://127.0.0.1:1"), std::string::npos) << r.error().to_string();
  Result<std::unique_ptr<Watcher>> w = Watcher::create(o);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.error().code(), Code::kUnavailable) << w.error().to_string();
  EXPECT_NE(w.error().message().find("etcd at http://127.0.0.1:1"), std::string::npos) << w.error().to_string();
  EXPECT_LT(ms_since(t), 2000.0);

  o.endpoint = options_.endpoint;
  server_->signal(SIGSTOP);
  t = Clock::now();
  r = Registration::create(o, record("p"));
  w = Watcher::create(o);
  const double stopped_ms = ms_since(t);
  server_->signal(SIGCONT);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code(), Code::kUnavailable) << r.error().to_string();
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.error().code(), Code::kUnavailable) << w.error().to_string();
  EXPECT_LT(stopped_ms, 2 * 1000.0 + 1000.0) << "each call is bounded by the request timeout";
}

// Its own etcd: stopped and started again on the same ports and data dir.
TEST(DiscoveryRestartTest, AfterAnEtcdRestartTheWatcherResyncsAndTheRegistrationIsBack) {
  Result<std::unique_ptr<testing::EtcdServer>> s = testing::EtcdServer::start();
  if (!s.ok()) KVB_SKIP_UNLESS_REQUIRED("etcd", s.error().to_string() + " (scripts/deps.sh installs it)");
  testing::EtcdServer& server = **s;
  EtcdOptions o;
  o.endpoint = server.endpoint();
  o.prefix = "/kvb-restart";
  o.connect_timeout = 300ms;
  o.request_timeout = 1000ms;
  Result<std::unique_ptr<Registration>> r = Registration::create(o, record("p0"), 3s);
  ASSERT_TRUE(r.ok()) << r.error().to_string();
  Events events;
  Result<std::unique_ptr<Watcher>> w = Watcher::create(o, events.callback());
  ASSERT_TRUE(w.ok()) << w.error().to_string();
  ASSERT_TRUE(events.wait(InstanceEvent::kAdded, "p0", 5s));

  server.stop();
  // Both notice: the watch breaks at once, the next renewal (1 s) fails.
  Clock::time_point until = Clock::now() + 3s;
  while (((*w)->health().ok() || (*r)->health().ok()) && Clock::now() < until) std::this_thread::sleep_for(10ms);
  EXPECT_EQ((*w)->health().code(), Code::kUnavailable) << (*w)->health().to_string();
  EXPECT_EQ((*r)->health().code(), Code::kUnavailable) << (*r)->health().to_string();
  EXPECT_NE((*w)->health().message().find(o.endpoint), std::string::npos) << (*w)->health().to_string();

  const uint64_t resyncs = (*w)->resyncs();
  ASSERT_TRUE(server.restart().ok());
  const Clock::time_point restarted = Clock::now();
  until = restarted + 5s;
  while (((*w)->resyncs() == resyncs || !(*w)->health().ok() || !(*r)->health().ok()) && Clock::now() < until) {
    std::this_thread::sleep_for(10ms);
  }
  std::printf("[ measured ] etcd restarted to watcher and registration healthy: %.1f ms\n", ms_since(restarted));
  EXPECT_GT((*w)->resyncs(), resyncs);
  EXPECT_TRUE((*w)->health().ok()) << (*w)->health().to_string();
  EXPECT_TRUE((*r)->health().ok()) << (*r)->health().to_string();
  EXPECT_TRUE((*w)->instances().contains("p0"));
  // The watch works again: a new registration shows up.
  Result<std::unique_ptr<Registration>> r2 = Registration::create(o, record("p1"), 3s);
  ASSERT_TRUE(r2.ok()) << r2.error().to_string();
  EXPECT_TRUE(events.wait(InstanceEvent::kAdded, "p1", 1s));
  // And the first one stays: it outlives its TTL because it is renewed.
  std::this_thread::sleep_for(3500ms);
  EXPECT_TRUE((*w)->instances().contains("p0"));
}

}  // namespace
}  // namespace kvbridge
