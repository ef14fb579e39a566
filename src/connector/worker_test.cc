// ConnectorWorker in one process: prefill and decode ranks, each with its own
// engine over the local transport (one with a fault wrapper where a test
// needs a slow link), handshakes over the side channel, plans, reads,
// heartbeats and done messages, abort.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <set>
#include <thread>

#include "connector/worker_test_util.h"
#include "engine/engine_impl.h"
#include "kvbridge/connector.h"
#include "kvbridge/content.h"
#include "kvbridge/plan.h"
#include "kvbridge/presets.h"
#include "testing/fake_side_channel.h"
#include "testing/ports.h"
#include "transport/fault/fault.h"

namespace kvbridge {
namespace {

using namespace std::chrono_literals;
using namespace worker_test;

// A side channel bound to every interface advertises the address given for
// it; without one, the worker is refused (remote ranks could not dial it).
TEST(WorkerTest, AWildcardSideChannelAdvertisesTheGivenAddressOrIsRefused) {
  InstanceOptions o = opts("prefill", 1);
  o.worker.side_channel_host = "0.0.0.0";
  o.worker.side_channel_advertise_host = "127.0.0.1";
  auto prefill = instance(o);
  const std::string address = prefill[0]->worker->side_channel_address();
  EXPECT_EQ(address.rfind("127.0.0.1:", 0), 0u) << address;
  auto decode = instance(opts("decode", 1));
  for (auto& r : prefill) ASSERT_TRUE(fill_request(r->layout, request(), RequestSide::kRemote, 0, 11, r->spans).ok());
  ASSERT_TRUE(decode[0]->worker->add_remote("prefill", {address}).ok());
  ASSERT_TRUE(decode[0]->worker->start_load("1", "prefill", request()).ok());
  LoadResult r = wait_one(*decode[0]->worker);
  EXPECT_TRUE(r.error.ok()) << r.error.to_string();
  WorkerOptions w;
  w.instance_id = "x";
  w.side_channel_host = "0.0.0.0";
  Result<std::unique_ptr<ConnectorWorker>> refused =
      ConnectorWorker::create(*decode[0]->engine, decode[0]->layout, decode[0]->spans, w);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message().find("give side_channel_advertise_host"), std::string::npos)
      << refused.error().to_string();
}

// A side channel address that cannot be one fails when given, naming it.
TEST(WorkerTest, AddRemoteRefusesAnAddressThatIsNotHostPort) {
  auto decode = instance(opts("decode", 1));
  ConnectorWorker& d = *decode[0]->worker;
  Status s = d.add_remote("prefill", {"127.0.0.1:5000", "stop"});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("side channel address of instance 'prefill' rank 1"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("'stop'"), std::string::npos) << s.to_string();
  EXPECT_FALSE(d.add_remote("prefill", {"127.0.0.1:0"}).ok()) << "port 0 cannot be dialled";
  EXPECT_TRUE(d.add_remote("prefill", {"127.0.0.1:5000", "[::1]:5001"}).ok());
}

TEST(WorkerTest, PullsTwoPrefillRanksIntoOneDecodeRankByteExactWithOneHandshakePerRank) {
  auto prefill = instance(opts("prefill", 2));
  auto decode = instance(opts("decode", 1));
  for (auto& r : prefill) ASSERT_TRUE(fill_request(r->layout, request(), RequestSide::kRemote, 0, 11, r->spans).ok());
  ConnectorWorker& d = *decode[0]->worker;
  ASSERT_TRUE(d.add_remote("prefill", addresses(prefill)).ok());
  for (const RequestId id : {"req-1", "req-2"}) {
    ASSERT_TRUE(d.start_load(id, "prefill", request(id == "req-2" ? 16 : 0)).ok());
    LoadResult r = wait_one(d);
    ASSERT_TRUE(r.error.ok()) << r.error.to_string();
    EXPECT_EQ(r.request, id);
    EXPECT_EQ(r.sources, (std::vector<uint32_t>{0, 1}));
    EXPECT_GT(r.bytes, 0u);
    EXPECT_GT(r.descriptors, 0u);
    EXPECT_GT(r.naive_descriptors, 0u);
    Result<ContentReport> c = check_request(decode[0]->layout, request(id == "req-2" ? 16 : 0), RequestSide::kLocal,
                                            id == "req-2" ? 16 : 0, 11, decode[0]->spans);
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(c->bad_cells, 0u) << c->first_error;
  }
  // An id that cannot travel in the workers' messages is refused up front.
  const Status bad = d.start_load("req 3", "prefill", request());
  EXPECT_EQ(bad.code(), Code::kInvalidArgument);
  EXPECT_EQ(bad.message(),
            "request id 'req 3' has a space at byte 3; ids are 1 to 256 bytes of printable ASCII without spaces");
  EXPECT_EQ(d.stats().handshakes, 2u);  // once per remote rank, not per request
  EXPECT_EQ(d.stats().loads_ok, 2u);
  // Each prefill rank hears "done" for both requests from the decode rank.
  for (auto& p : prefill) {
    std::vector<ReaderEvent> done;
    for (int i = 0; i < 200 && done.size() < 2; ++i) {
      for (ReaderEvent& e : p->worker->take_reader_events()) {
        if (e.kind == ReaderEvent::Kind::kDone) done.push_back(e);
      }
      std::this_thread::sleep_for(5ms);
    }
    ASSERT_EQ(done.size(), 2u);
    EXPECT_EQ(done[0].reader, "decode/r0");
    EXPECT_EQ(p->worker->stats().handshakes_served, 1u);
  }
}

TEST(WorkerTest, AbortStopsEveryByteAndReportsTheLoadAsAborted) {
  auto prefill = instance(opts("prefill", 1));
  auto faults = std::make_shared<transport::Faults>();
  InstanceOptions o = opts("decode", 1);
  o.faults = faults;
  o.worker.heartbeat_interval = 10ms;
  auto decode = instance(o);
  ASSERT_TRUE(fill_request(prefill[0]->layout, request(), RequestSide::kRemote, 0, 3, prefill[0]->spans).ok());
  ConnectorWorker& d = *decode[0]->worker;
  ASSERT_TRUE(d.add_remote("prefill", addresses(prefill)).ok());
  faults->set_delay(5ms);  // per copy: the load takes far longer than the test
  ASSERT_TRUE(d.start_load("9", "prefill", request()).ok());
  // Abort once the prefill rank heard a heartbeat of the running load (on
  // a loaded machine the handshake alone can take longer than a fixed wait).
  bool heartbeat = false, done = false;
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (!heartbeat && std::chrono::steady_clock::now() < until) {
    for (ReaderEvent& e : prefill[0]->worker->take_reader_events()) {
      heartbeat = heartbeat || e.kind == ReaderEvent::Kind::kHeartbeat;
      done = done || e.kind == ReaderEvent::Kind::kDone;
    }
    std::this_thread::sleep_for(2ms);
  }
  ASSERT_TRUE(heartbeat) << "no heartbeat within 10 s of start_load()";
  ASSERT_FALSE(done) << "the load ended before it could be aborted";
  ASSERT_TRUE(d.abort("9").ok());
  const std::vector<std::vector<uint8_t>> after = decode[0]->mem;
  LoadResult r = wait_one(d);
  EXPECT_TRUE(r.aborted);
  EXPECT_EQ(r.error.code(), Code::kCancelled) << r.error.to_string();
  std::this_thread::sleep_for(50ms);
  EXPECT_TRUE(after == decode[0]->mem) << "a byte landed after abort() returned";
  EXPECT_EQ(d.abort("9").code(), Code::kNotFound);
  // The prefill rank heard heartbeats while the load ran (above), then done.
  for (int i = 0; i < 200 && !done; ++i) {
    for (ReaderEvent& e : prefill[0]->worker->take_reader_events()) done = done || e.kind == ReaderEvent::Kind::kDone;
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_TRUE(done);
}

TEST(WorkerTest, AChunkThatFailsMidLoadReportsItsFirstTokenAndEveryTokenBeforeItIsWhole) {
  auto prefill = instance(opts("prefill", 1));
  auto faults = std::make_shared<transport::Faults>();
  InstanceOptions o = opts("decode", 1);
  o.faults = faults;
  o.inline_bytes = uint64_t{64} << 20;  // every read runs inside submit(), in token order
  o.worker.load_chunk_tokens = 16;      // one block per chunk
  auto decode = instance(o);
  // 100 tokens in 7 blocks of 16: chunks from tokens 0, 16, 32, ..., 96.
  Request q;
  q.num_tokens = 100;
  q.blocks["full"] = {{6, 5, 4, 3, 2, 1, 0}, {0, 1, 2, 3, 4, 5, 6}};
  ASSERT_TRUE(fill_request(prefill[0]->layout, q, RequestSide::kRemote, 0, 21, prefill[0]->spans).ok());
  ConnectorWorker& d = *decode[0]->worker;
  ASSERT_TRUE(d.add_remote("prefill", addresses(prefill)).ok());
  // The fifth run fails: a read of a chunk (2 MiB) is split over the
  // engine's threads, so that is the third chunk's.
  faults->fail_run(5, Status::io_error("link down"));
  ASSERT_TRUE(d.start_load("4", "prefill", q).ok());
  LoadResult r = wait_one(d);
  ASSERT_FALSE(r.error.ok());
  EXPECT_EQ(r.first_bad_token, 32u) << r.error.to_string();
  const uint64_t fb = r.first_bad_token;
  ASSERT_TRUE(fb > 0 && fb % 16 == 0) << fb;
  const std::string chunk = "tokens " + std::to_string(fb) + ".." + std::to_string(fb + 16) + ", chunk " +
                            std::to_string(fb / 16 + 1) + " of 7";
  EXPECT_NE(r.error.to_string().find(chunk), std::string::npos) << r.error.to_string();
  EXPECT_NE(r.error.to_string().find("link down"), std::string::npos) << r.error.to_string();
  Request before = q;
  before.num_tokens = r.first_bad_token;
  Result<ContentReport> c = check_request(decode[0]->layout, before, RequestSide::kLocal, 0, 21, decode[0]->spans);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->bad_cells, 0u) << c->first_error;
  EXPECT_EQ(c->bytes, fb * 32 * 8 * 2 * 128 * 2) << "tokens x 32 layers x 8 heads x K,V x 128 x bf16";
  // The whole request then fails from that token on (its chunk did not
  // land), and nowhere before.
  Result<ContentReport> all = check_request(decode[0]->layout, q, RequestSide::kLocal, 0, 21, decode[0]->spans);
  ASSERT_TRUE(all.ok());
  EXPECT_GT(all->bad_cells, 0u);
  EXPECT_EQ(all->first_bad_token, fb);
  // The scheduler turns it into a recompute from there.
  DecodeScheduler s(1, FailurePolicy::kRecompute);
  ASSERT_TRUE(s.expect("4", 0, std::chrono::steady_clock::now() + 10s).ok());
  ASSERT_TRUE(s.rank_result(0, r).ok());
  std::vector<RequestOutcome> out = s.take_outcomes(std::chrono::steady_clock::now());
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].outcome, Outcome::kRecompute);
  EXPECT_EQ(out[0].recompute_from, fb);
}

// The handshake runs off the caller's thread: start_load queues the load,
// and a handshake failure comes back as its result, naming the cause (and
// from wait_connected()).
TEST(WorkerTest, HandshakeFailuresComeBackAsTheLoadsResultNamingTheCause) {
  InstanceOptions po = opts("prefill", 1);
  po.worker.secret = "s3cret";
  auto prefill = instance(po);
  InstanceOptions wrong = opts("decode", 1);
  wrong.worker.secret = "guess";
  auto decode = instance(wrong);
  ConnectorWorker& d = *decode[0]->worker;
  ASSERT_TRUE(d.add_remote("prefill", addresses(prefill)).ok());
  ASSERT_TRUE(d.start_load("1", "prefill", request(16)).ok());
  LoadResult r = wait_one(d);
  EXPECT_EQ(r.request, "1");
  EXPECT_FALSE(r.error.ok());
  EXPECT_NE(r.error.message().find("secret"), std::string::npos) << r.error.to_string();
  EXPECT_EQ(r.first_bad_token, 16u);
  Status w = d.wait_connected("prefill", 10s);
  EXPECT_NE(w.message().find("secret"), std::string::npos) << w.to_string();
  EXPECT_EQ(d.start_load("1", "nowhere", request()).code(), Code::kNotFound);
  EXPECT_EQ(d.connect("nowhere").code(), Code::kNotFound);
  EXPECT_EQ(d.stats().loads_queued, 1u);
  EXPECT_EQ(d.stats().loads_failed, 1u);
  testing::FakeSideChannel::Options f;
  f.mode = testing::FakeSideChannel::Mode::kOtherVersion;
  auto v3 = testing::FakeSideChannel::start(f);
  ASSERT_TRUE(v3.ok());
  auto plain = instance(opts("decode2", 1));
  ASSERT_TRUE(plain[0]->worker->add_remote("p", {(*v3)->address()}).ok());
  ASSERT_TRUE(plain[0]->worker->start_load("1", "p", request()).ok());
  r = wait_one(*plain[0]->worker);
  EXPECT_NE(r.error.message().find("version mismatch: local 2, peer 3"), std::string::npos) << r.error.to_string();
}

// A peer that accepts and never answers: start_load returns without waiting
// for it (well inside the handshake timeout), the load waits queued
// (wait_for_layer waits with it), an abort ends it at once, and a load left
// queued fails when the handshake times out.
TEST(WorkerTest, ASilentPeerNeverHoldsUpTheCaller) {
  auto silent = std::make_unique<testing::SilentListener>();
  ASSERT_TRUE(silent->ok());
  InstanceOptions o = opts("decode", 1);
  o.worker.handshake_timeout = 2000ms;
  auto decode = instance(o);
  ConnectorWorker& d = *decode[0]->worker;
  ASSERT_TRUE(d.add_remote("silent", {silent->address()}).ok());
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(d.start_load("a", "silent", request()).ok());
  ASSERT_TRUE(d.start_load("b", "silent", request()).ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1000ms) << "start_load waited on the silent peer";
  EXPECT_EQ(d.start_load("a", "silent", request()).code(), Code::kAlreadyExists);
  EXPECT_EQ(d.wait_for_layer("b", "layers.0", 50ms).code(), Code::kTimeout);
  ASSERT_TRUE(d.abort("b").ok());
  LoadResult r = wait_one(d);
  EXPECT_EQ(r.request, "b");
  EXPECT_TRUE(r.aborted);
  EXPECT_EQ(r.error.code(), Code::kCancelled);
  r = wait_one(d);
  EXPECT_EQ(r.request, "a");
  EXPECT_FALSE(r.error.ok());
  EXPECT_FALSE(r.aborted);
  EXPECT_EQ(d.wait_for_layer("a", "layers.0", 10ms).code(), r.error.code());
  silent.reset();
}

// The attack: records (from etcd or params) naming instances at silent
// ports. Connect attempts run in parallel, so they delay only their own
// loads: a real prefill's load lands while three silent instances are being
// handshaken; and a load parked for a silent instance fails at its transfer
// timeout, not after the handshake's.
TEST(WorkerTest, SilentInstancesDelayOnlyTheirOwnLoadsAndParkedLoadsKeepTheirTimeout) {
  std::vector<std::unique_ptr<testing::SilentListener>> silent;
  for (int i = 0; i < 3; ++i) {
    silent.push_back(std::make_unique<testing::SilentListener>());
    ASSERT_TRUE(silent.back()->ok());
  }
  auto prefill = instance(opts("prefill", 2));
  for (auto& r : prefill) ASSERT_TRUE(fill_request(r->layout, request(), RequestSide::kRemote, 0, 11, r->spans).ok());
  InstanceOptions o = opts("decode", 1);
  o.worker.handshake_timeout = 5000ms;
  o.worker.transfer_timeout = 1500ms;
  auto decode = instance(o);
  ConnectorWorker& d = *decode[0]->worker;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 3; ++i) {
    const std::string name = "bogus-" + std::to_string(i);
    ASSERT_TRUE(d.add_remote(name, {silent[i]->address()}).ok());
    ASSERT_TRUE(d.start_load("s" + std::to_string(i), name, request()).ok());
  }
  ASSERT_TRUE(d.add_remote("prefill", addresses(prefill)).ok());
  ASSERT_TRUE(d.start_load("real", "prefill", request()).ok());
  std::map<RequestId, std::pair<LoadResult, double>> results;
  while (results.size() < 4 && std::chrono::steady_clock::now() - t0 < 10s) {
    for (LoadResult& r : d.take_results()) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const RequestId id = r.request;
      results[id] = {std::move(r), s};
    }
    d.wait_results(10ms);
  }
  for (auto& [k, v] : results)
    std::printf("[ measured ] %s ended after %.2f s: %s\n", k.c_str(), v.second, v.first.error.to_string().c_str());
  ASSERT_EQ(results.size(), 4u);
  EXPECT_TRUE(results["real"].first.error.ok()) << results["real"].first.error.to_string();
  EXPECT_LT(results["real"].second, 1.5) << "the real load waited behind the silent instances' handshakes";
  for (int i = 0; i < 3; ++i) {
    const auto& [r, s] = results["s" + std::to_string(i)];
    EXPECT_EQ(r.error.code(), Code::kTimeout) << r.error.to_string();
    EXPECT_NE(r.error.message().find("transfer timeout passed"), std::string::npos) << r.error.to_string();
    EXPECT_LT(s, 3.5) << "a parked load outlived its 1.5 s transfer timeout by far";
  }
  Result<ContentReport> c = check_request(decode[0]->layout, request(), RequestSide::kLocal, 0, 11, decode[0]->spans);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->bad_cells, 0u);
  silent.clear();  // the handshakes under way end now
}

// A load aborted before it started (queued behind its instance's
// handshake) reads nothing, yet the prefill ranks it would have read hold
// its blocks: once connected, the worker tells each of them it is done, so
// no block waits for the lease.
TEST(WorkerTest, ALoadAbortedWhileQueuedStillReleasesItsSources) {
  auto prefill = instance(opts("prefill", 2));
  auto decode = instance(opts("decode", 1));
  ConnectorWorker& d = *decode[0]->worker;
  ASSERT_TRUE(d.add_remote("prefill", addresses(prefill)).ok());
  ASSERT_TRUE(d.start_load("q1", "prefill", request()).ok());
  ASSERT_TRUE(d.abort("q1").ok());  // at once: the handshake has not even begun
  LoadResult r = wait_one(d);
  EXPECT_EQ(r.request, "q1");
  EXPECT_TRUE(r.aborted);
  EXPECT_EQ(d.stats().loads_started, 0u);
  for (auto& p : prefill) {
    PrefillScheduler s(std::chrono::seconds(60));
    ASSERT_TRUE(s.hold("q1", 1u, std::chrono::steady_clock::now()).ok());
    std::vector<Release> released;
    for (int i = 0; i < 1000 && released.empty(); ++i) {
      for (ReaderEvent& e : p->worker->take_reader_events()) {
        if (e.kind == ReaderEvent::Kind::kDone) s.reader_done(e.request, e.reader, std::chrono::steady_clock::now());
      }
      released = s.take_releases(std::chrono::steady_clock::now());
      std::this_thread::sleep_for(5ms);
    }
    ASSERT_EQ(released.size(), 1u) << "a prefill rank never heard that the aborted load is done";
    EXPECT_EQ(released[0].reason, ReleaseReason::kRead);
  }
}

// connect() ahead of the first load: after wait_connected() no load waits
// for a handshake (none is parked).
TEST(WorkerTest, ConnectAheadThenLoadsStartOnTheCallersThread) {
  auto prefill = instance(opts("prefill", 1));
  for (auto& r : prefill) ASSERT_TRUE(fill_request(r->layout, request(), RequestSide::kRemote, 0, 11, r->spans).ok());
  auto decode = instance(opts("decode", 1));
  ConnectorWorker& d = *decode[0]->worker;
  ASSERT_TRUE(d.add_remote("prefill", addresses(prefill)).ok());
  ASSERT_TRUE(d.connect("prefill").ok());
  ASSERT_TRUE(d.connect("prefill").ok());  // one attempt at a time
  ASSERT_TRUE(d.wait_connected("prefill", 10s).ok());
  EXPECT_EQ(d.stats().handshakes, 1u);
  ASSERT_TRUE(d.start_load("r1", "prefill", request()).ok());
  LoadResult r = wait_one(d);
  ASSERT_TRUE(r.error.ok()) << r.error.to_string();
  EXPECT_EQ(d.stats().loads_queued, 0u);
  Result<ContentReport> c = check_request(decode[0]->layout, request(), RequestSide::kLocal, 0, 11, decode[0]->spans);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->bad_cells, 0u) << c->first_error;
}

TEST(WorkerTest, AWorkerAndItsEngineMustAgreeOnHavingASecret) {
  Layout layout = *make_preset({.name = "llama3-8b", .num_blocks = 8});
  std::vector<std::vector<uint8_t>> mem;
  std::vector<std::span<uint8_t>> spans;
  for (const Tensor& t : layout.tensors) mem.emplace_back(t.bytes);
  for (auto& m : mem) spans.emplace_back(m);
  EngineOptions e;
  e.transports = {"local"};
  std::unique_ptr<Engine> plain = std::move(*Engine::create(e));
  WorkerOptions w;
  w.secret = "s3cret";
  Result<std::unique_ptr<ConnectorWorker>> bad = ConnectorWorker::create(*plain, layout, spans, w);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message().find("its engine has none"), std::string::npos) << bad.error().to_string();
  e.secret = "s3cret";
  std::unique_ptr<Engine> keyed = std::move(*Engine::create(e));
  w.secret.clear();
  bad = ConnectorWorker::create(*keyed, layout, spans, w);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message().find("the engine has a shared secret but the worker has none"), std::string::npos);
}

TEST(WorkerTest, PlanErrorsComeBackAsTheLoadsResultBeforeAnythingMoves) {
  auto prefill = instance(opts("prefill", 1));
  auto decode = instance(opts("decode", 1));
  ASSERT_TRUE(decode[0]->worker->add_remote("prefill", addresses(prefill)).ok());
  Request q = request();
  q.blocks["full"].local = {1, 2, 99};
  // Not connected yet, or connected: the start thread plans it, and the
  // error is the load's result.
  ASSERT_TRUE(decode[0]->worker->start_load("1", "prefill", q).ok());
  LoadResult r = wait_one(*decode[0]->worker);
  EXPECT_EQ(r.error.code(), Code::kOutOfRange) << r.error.to_string();
  EXPECT_EQ(r.first_bad_token, 0u);
  ASSERT_TRUE(decode[0]->worker->wait_connected("prefill", 10s).ok());
  ASSERT_TRUE(decode[0]->worker->start_load("2", "prefill", q).ok());
  r = wait_one(*decode[0]->worker);
  EXPECT_EQ(r.request, "2");
  EXPECT_EQ(r.error.code(), Code::kOutOfRange) << r.error.to_string();
  EXPECT_EQ(decode[0]->engine->metrics().transfers_submitted, 0u);
}

}  // namespace
}  // namespace kvbridge
