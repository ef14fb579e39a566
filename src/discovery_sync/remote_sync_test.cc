// Two real ConnectorWorker instances where the decode side learns the
// prefill instance only through etcd, and a load lands byte-exact; and the
// same load with static addresses and no etcd at all.
#include <gtest/gtest.h>

#include <thread>

#include "connector/handshake.h"
#include "connector/worker_test_util.h"
#include "discovery/etcd_client.h"
#include "kvbridge/discovery.h"
#include "kvbridge/discovery_sync.h"
#include "testing/etcd_server.h"
#include "testing/require.h"

namespace kvbridge {
namespace {

using namespace worker_test;

InstanceRecord record_of(const std::string& id, const std::vector<std::unique_ptr<Rank>>& ranks) {
  InstanceRecord r;
  r.id = id;
  r.role = "prefill";
  r.ranks = addresses(ranks);
  r.identity = compatibility_hash_hex(ranks[0]->layout);
  r.protocol = connector::kHandshakeVersion;
  return r;
}

void expect_load_lands(Rank& decode, const std::string& instance) {
  ASSERT_TRUE(decode.worker->start_load("req-1", instance, request()).ok());
  LoadResult r = wait_one(*decode.worker);
  EXPECT_TRUE(r.error.ok()) << r.error.to_string();
  Result<ContentReport> c = check_request(decode.layout, request(), RequestSide::kLocal, 0, 11, decode.spans);
  ASSERT_TRUE(c.ok()) << c.error().to_string();
  EXPECT_GT(c->cells, 0u);
  EXPECT_EQ(c->bad_cells, 0u);
}

TEST(RemoteSyncTest, ADecodeRankLearnsThePrefillInstanceThroughEtcdAndLoadsByteExact) {
  Result<std::unique_ptr<testing::EtcdServer>> server = testing::EtcdServer::start();
  if (!server.ok()) KVB_SKIP_UNLESS_REQUIRED("etcd", server.error().to_string() + " (scripts/deps.sh installs it)");
  EtcdOptions o;
  o.endpoint = (*server)->endpoint();
  o.prefix = "/kvb-sync";

  auto prefill = instance(opts("prefill-0", 2));
  for (auto& r : prefill) ASSERT_TRUE(fill_request(r->layout, request(), RequestSide::kRemote, 0, 11, r->spans).ok());
  auto decode = instance(opts("decode-0", 1));
  Rank& d = *decode[0];

  RemoteSyncOptions so;
  so.identity = compatibility_hash_hex(d.layout);
  so.self = "decode-0";
  RemoteSync sync(*d.worker, so);
  Result<std::unique_ptr<Watcher>> watcher = Watcher::create(o, sync.callback());
  ASSERT_TRUE(watcher.ok()) << watcher.error().to_string();

  // Registered after the watcher started: learnt from the watch.
  Result<std::unique_ptr<Registration>> reg = Registration::create(o, record_of("prefill-0", prefill), 5s);
  ASSERT_TRUE(reg.ok()) << reg.error().to_string();
  // Not added: another model's layout, a decode instance, this instance itself.
  InstanceRecord other = record_of("prefill-other", prefill);
  other.identity = "ffffffffffffffff";
  InstanceRecord peer = record_of("decode-1", prefill);
  peer.role = "decode";
  InstanceRecord self = record_of("decode-0", prefill);
  self.role = "prefill";
  std::vector<std::unique_ptr<Registration>> others;
  for (const InstanceRecord& r : {other, peer, self}) {
    Result<std::unique_ptr<Registration>> x = Registration::create(o, r, 5s);
    ASSERT_TRUE(x.ok()) << x.error().to_string();
    others.push_back(std::move(*x));
  }
  ASSERT_TRUE((*watcher)->wait_for("prefill-0", 2s).ok());
  ASSERT_TRUE((*watcher)->wait_for("decode-1", 2s).ok());
  const auto until = std::chrono::steady_clock::now() + 2s;
  while (sync.last_error().ok() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(sync.added(), std::set<std::string>{"prefill-0"});
  EXPECT_EQ(sync.last_error().code(), Code::kIncompatible) << sync.last_error().to_string();
  EXPECT_NE(sync.last_error().message().find("prefill-other"), std::string::npos);

  ASSERT_TRUE(d.worker->wait_connected("prefill-0", 5s).ok());
  expect_load_lands(d, "prefill-0");
}

// Two instances of one deployment (one secret). A writer to etcd without
// the secret points "prefill-a" at prefill-b's ranks: the watcher takes
// only signed records, so the decode still reads a's ranks. A record that
// is signed (a stale one, or written by a holder of the secret) naming b's
// ranks as a's is refused at the handshake, by both names: no load of a's
// request ever reads b's bytes.
TEST(RemoteSyncTest, AnEtcdWriterCannotPointAnInstancesNameAtAnothersRanks) {
  Result<std::unique_ptr<testing::EtcdServer>> server = testing::EtcdServer::start();
  if (!server.ok()) KVB_SKIP_UNLESS_REQUIRED("etcd", server.error().to_string() + " (scripts/deps.sh installs it)");
  const std::string secret = "one-deployment-secret-0123";
  EtcdOptions o;
  o.endpoint = (*server)->endpoint();
  o.prefix = "/kvb-trust";
  o.secret = secret;
  auto with_secret = [&](std::string id, uint32_t tp) {
    InstanceOptions io = opts(std::move(id), tp);
    io.worker.secret = secret;
    return io;
  };
  auto a = instance(with_secret("prefill-a", 1));
  auto b = instance(with_secret("prefill-b", 1));
  ASSERT_TRUE(fill_request(a[0]->layout, request(), RequestSide::kRemote, 0, 11, a[0]->spans).ok());
  ASSERT_TRUE(fill_request(b[0]->layout, request(), RequestSide::kRemote, 0, 99, b[0]->spans).ok());
  auto decode = instance(with_secret("decode-0", 1));
  Rank& d = *decode[0];
  RemoteSyncOptions so;
  so.self = "decode-0";
  RemoteSync sync(*d.worker, so);
  Result<std::unique_ptr<Watcher>> watcher = Watcher::create(o, sync.callback());
  ASSERT_TRUE(watcher.ok()) << watcher.error().to_string();
  Result<std::unique_ptr<Registration>> reg = Registration::create(o, record_of("prefill-a", a), 5s);
  ASSERT_TRUE(reg.ok()) << reg.error().to_string();
  ASSERT_TRUE((*watcher)->wait_for("prefill-a", 2s).ok());

  // The forger: etcd access, no secret. Its record is skipped and says why.
  EtcdOptions forger = o;
  forger.secret.clear();
  discovery::EtcdClient client(forger);
  ASSERT_TRUE(client.put(instance_key(o, "prefill-a"), *instance_record_to_json(record_of("prefill-a", b)), 0).ok());
  const auto until = std::chrono::steady_clock::now() + 5s;
  while ((*watcher)->invalid_records() == 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ((*watcher)->invalid_records(), 1u);
  EXPECT_EQ((*watcher)->last_invalid().code(), Code::kPermissionDenied) << (*watcher)->last_invalid().to_string();
  EXPECT_NE((*watcher)->last_invalid().message().find("not signed"), std::string::npos);
  // Skipped, the key no longer holds a valid record: a's name is forgotten,
  // never pointed at b.
  ASSERT_TRUE((*watcher)->wait_gone("prefill-a", 2s).ok());
  // (instances() may show the change before the callback ran.)
  while (sync.added().count("prefill-a") > 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_EQ(d.worker->start_load("req-1", "prefill-a", request()).code(), Code::kNotFound);

  // Signed, but naming b's ranks as a's: refused at the handshake by both
  // names, and nothing of b's is read.
  sync.on_event(InstanceEvent::kAdded, record_of("prefill-a", b));
  ASSERT_TRUE(d.worker->start_load("req-2", "prefill-a", request()).ok());
  LoadResult r = wait_one(*d.worker);
  ASSERT_FALSE(r.error.ok());
  EXPECT_NE(r.error.message().find("is a rank of instance 'prefill-b', not 'prefill-a'"), std::string::npos)
      << r.error.to_string();
  Result<ContentReport> c = check_request(d.layout, request(), RequestSide::kLocal, 0, 99, d.spans);
  ASSERT_TRUE(c.ok()) << c.error().to_string();
  EXPECT_EQ(c->bad_cells, c->cells) << "none of b's bytes landed";

  // a's own signed record again: read byte-exact.
  sync.on_event(InstanceEvent::kChanged, record_of("prefill-a", a));
  expect_load_lands(d, "prefill-a");
}

// An instance that restarts re-registers at other addresses: the worker
// loads from the new ranks without a restart of its own. One that leaves is
// forgotten. (The Watcher's events, given directly.)
TEST(RemoteSyncTest, ARestartedInstanceIsReadAtItsNewAddressesAndARemovedOneIsForgotten) {
  auto decode = instance(opts("decode-0", 1));
  Rank& d = *decode[0];
  RemoteSyncOptions so;
  so.self = "decode-0";
  RemoteSync sync(*d.worker, so);
  {
    auto first = instance(opts("prefill-0", 2));
    for (auto& r : first) ASSERT_TRUE(fill_request(r->layout, request(), RequestSide::kRemote, 0, 11, r->spans).ok());
    sync.on_event(InstanceEvent::kAdded, record_of("prefill-0", first));
    ASSERT_TRUE(sync.last_error().ok()) << sync.last_error().to_string();
    expect_load_lands(d, "prefill-0");
  }
  auto again = instance(opts("prefill-0", 2));  // the restart: new processes, new ports
  for (auto& r : again) ASSERT_TRUE(fill_request(r->layout, request(), RequestSide::kRemote, 0, 11, r->spans).ok());
  sync.on_event(InstanceEvent::kChanged, record_of("prefill-0", again));
  ASSERT_TRUE(sync.last_error().ok()) << sync.last_error().to_string();
  ASSERT_TRUE(d.worker->start_load("req-2", "prefill-0", request()).ok());
  LoadResult r = wait_one(*d.worker);
  EXPECT_TRUE(r.error.ok()) << r.error.to_string();
  sync.on_event(InstanceEvent::kRemoved, record_of("prefill-0", again));
  EXPECT_TRUE(sync.added().empty());
  EXPECT_EQ(d.worker->start_load("req-3", "prefill-0", request()).code(), Code::kNotFound);
}

// The connector does not depend on discovery: static addresses, no etcd.
TEST(RemoteSyncTest, StaticAddressesWorkWithoutEtcd) {
  auto prefill = instance(opts("prefill-0", 2));
  for (auto& r : prefill) ASSERT_TRUE(fill_request(r->layout, request(), RequestSide::kRemote, 0, 11, r->spans).ok());
  auto decode = instance(opts("decode-0", 1));
  ASSERT_TRUE(decode[0]->worker->add_remote("prefill-0", addresses(prefill)).ok());
  expect_load_lands(*decode[0], "prefill-0");
}

}  // namespace
}  // namespace kvbridge
