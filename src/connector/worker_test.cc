// ConnectorWorker in one process: prefill and decode ranks, each with its own
// engine over the local transport (one with a fault wrapper where a test
// needs a slow link), handshakes over the side channel, plans, reads,
// heartbeats and done messages, abort.
#include <gtest/gtest.h>

#include <thread>

#include "engine/engine_impl.h"
#include "kvbridge/connector.h"
#include "kvbridge/content.h"
#include "kvbridge/presets.h"
#include "testing/fake_side_channel.h"
#include "transport/fault/fault.h"

namespace kvbridge {
namespace {

using namespace std::chrono_literals;

struct Rank {
  Layout layout;
  std::vector<std::vector<uint8_t>> mem;
  std::vector<std::span<uint8_t>> spans;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<ConnectorWorker> worker;
};

struct InstanceOptions {
  std::string id;
  uint32_t tp = 1;
  uint64_t block_tokens = 16;
  WorkerOptions worker;
  std::shared_ptr<transport::Faults> faults;  // wraps the local transport when set
  uint64_t inline_bytes = EngineOptions{}.inline_bytes;
};

InstanceOptions opts(std::string id, uint32_t tp) {
  InstanceOptions o;
  o.id = std::move(id);
  o.tp = tp;
  return o;
}

std::vector<std::unique_ptr<Rank>> instance(const InstanceOptions& o) {
  std::vector<std::unique_ptr<Rank>> ranks;
  for (uint32_t r = 0; r < o.tp; ++r) {
    auto rank = std::make_unique<Rank>();
    PresetOptions p;
    p.name = "llama3-8b";
    p.tp_size = o.tp;
    p.tp_rank = r;
    p.block_tokens = o.block_tokens;
    p.num_blocks = 8;
    rank->layout = *make_preset(p);
    for (const Tensor& t : rank->layout.tensors) rank->mem.emplace_back(t.bytes, 0xa5);
    for (auto& m : rank->mem) rank->spans.emplace_back(m);
    EngineOptions e;
    e.name = o.id + "/r" + std::to_string(r);
    e.transports = {"local"};
    e.default_timeout = 2s;
    e.inline_bytes = o.inline_bytes;
    e.secret = o.worker.secret;  // one trust for the side channel and the engine
    std::vector<std::unique_ptr<transport::Transport>> ts;
    std::unique_ptr<transport::Transport> local = *transport::make_local_transport();
    ts.push_back(o.faults ? transport::make_fault_transport(std::move(local), o.faults) : std::move(local));
    Result<std::unique_ptr<Engine>> engine = engine_internal::create_engine(e, std::move(ts));
    EXPECT_TRUE(engine.ok()) << engine.error().to_string();
    rank->engine = std::move(*engine);
    WorkerOptions w = o.worker;
    w.instance_id = o.id;
    Result<std::unique_ptr<ConnectorWorker>> worker =
        ConnectorWorker::create(*rank->engine, rank->layout, rank->spans, w);
    EXPECT_TRUE(worker.ok()) << worker.error().to_string();
    rank->worker = std::move(*worker);
    ranks.push_back(std::move(rank));
  }
  return ranks;
}

std::vector<std::string> addresses(const std::vector<std::unique_ptr<Rank>>& ranks) {
  std::vector<std::string> out;
  for (const auto& r : ranks) out.push_back(r->worker->side_channel_address());
  return out;
}

// 40 tokens: prefill blocks {4,5,6} of 16 tokens, decode blocks {1,2,3}.
Request request(uint64_t skip = 0) {
  Request q;
  q.num_tokens = 40;
  q.skip_tokens = skip;
  q.blocks["full"] = {{1, 2, 3}, {4, 5, 6}};
  return q;
}

LoadResult wait_one(ConnectorWorker& w) {
  for (int i = 0; i < 500; ++i) {
    std::vector<LoadResult> r = w.take_results();
    if (!r.empty()) return r.front();
    w.wait_results(10ms);
  }
  ADD_FAILURE() << "no load result within 5 s";
  return {};
}

TEST(WorkerTest, PullsTwoPrefillRanksIntoOneDecodeRankByteExactWithOneHandshakePerRank) {
  auto prefill = instance(opts("prefill", 2));
  auto decode = instance(opts("decode", 1));
  for (auto& r : prefill) ASSERT_TRUE(fill_request(r->layout, request(), RequestSide::kRemote, 0, 11, r->spans).ok());
  ConnectorWorker& d = *decode[0]->worker;
  ASSERT_TRUE(d.add_remote("prefill", addresses(prefill)).ok());
  for (RequestId id : {1, 2}) {
    ASSERT_TRUE(d.start_load(id, "prefill", request(id == 2 ? 16 : 0)).ok());
    LoadResult r = wait_one(d);
    ASSERT_TRUE(r.error.ok()) << r.error.to_string();
    EXPECT_EQ(r.request, static_cast<RequestId>(id));
    EXPECT_EQ(r.sources, (std::vector<uint32_t>{0, 1}));
    EXPECT_GT(r.bytes, 0u);
    EXPECT_GT(r.descriptors, 0u);
    EXPECT_GT(r.naive_descriptors, 0u);
    Result<ContentReport> c = check_request(decode[0]->layout, request(id == 2 ? 16 : 0), RequestSide::kLocal,
                                            id == 2 ? 16 : 0, 11, decode[0]->spans);
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(c->bad_cells, 0u) << c->first_error;
  }
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

TEST(WorkerTest, VerifiesEveryPlanBeforeItRunsWhenAsked) {
  auto prefill = instance(opts("prefill", 2));
  InstanceOptions o = opts("decode", 1);
  o.worker.verify_plans = true;
  auto decode = instance(o);
  for (auto& r : prefill) ASSERT_TRUE(fill_request(r->layout, request(), RequestSide::kRemote, 0, 5, r->spans).ok());
  ConnectorWorker& d = *decode[0]->worker;
  ASSERT_TRUE(d.add_remote("prefill", addresses(prefill)).ok());
  ASSERT_TRUE(d.start_load(1, "prefill", request()).ok());
  LoadResult r = wait_one(d);
  ASSERT_TRUE(r.error.ok()) << r.error.to_string();
  EXPECT_EQ(d.stats().plans_verified, 1u);
  EXPECT_EQ(d.stats().plans_rejected, 0u);
  Result<ContentReport> c = check_request(decode[0]->layout, request(), RequestSide::kLocal, 0, 5, decode[0]->spans);
  EXPECT_EQ(c->bad_cells, 0u) << c->first_error;
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
  ASSERT_TRUE(d.start_load(9, "prefill", request()).ok());
  std::this_thread::sleep_for(60ms);
  ASSERT_TRUE(d.abort(9).ok());
  const std::vector<std::vector<uint8_t>> after = decode[0]->mem;
  LoadResult r = wait_one(d);
  EXPECT_TRUE(r.aborted);
  EXPECT_EQ(r.error.code(), Code::kCancelled) << r.error.to_string();
  std::this_thread::sleep_for(50ms);
  EXPECT_TRUE(after == decode[0]->mem) << "a byte landed after abort() returned";
  EXPECT_EQ(d.abort(9).code(), Code::kNotFound);
  // The prefill rank heard heartbeats while the load ran, then done.
  bool heartbeat = false, done = false;
  for (int i = 0; i < 200 && !done; ++i) {
    for (ReaderEvent& e : prefill[0]->worker->take_reader_events()) {
      heartbeat = heartbeat || e.kind == ReaderEvent::Kind::kHeartbeat;
      done = done || e.kind == ReaderEvent::Kind::kDone;
    }
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_TRUE(heartbeat);
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
  ASSERT_TRUE(d.start_load(4, "prefill", q).ok());
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
  ASSERT_TRUE(s.expect(4, 0, std::chrono::steady_clock::now() + 10s).ok());
  ASSERT_TRUE(s.rank_result(0, r).ok());
  std::vector<RequestOutcome> out = s.take_outcomes(std::chrono::steady_clock::now());
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].outcome, Outcome::kRecompute);
  EXPECT_EQ(out[0].recompute_from, fb);
}

TEST(WorkerTest, HandshakeFailuresComeBackFromStartLoadNamingTheCause) {
  InstanceOptions po = opts("prefill", 1);
  po.worker.secret = "s3cret";
  auto prefill = instance(po);
  InstanceOptions wrong = opts("decode", 1);
  wrong.worker.secret = "guess";
  auto decode = instance(wrong);
  ASSERT_TRUE(decode[0]->worker->add_remote("prefill", addresses(prefill)).ok());
  Status s = decode[0]->worker->start_load(1, "prefill", request());
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("secret"), std::string::npos) << s.to_string();
  EXPECT_EQ(decode[0]->worker->start_load(1, "nowhere", request()).code(), Code::kNotFound);
  testing::FakeSideChannel::Options f;
  f.mode = testing::FakeSideChannel::Mode::kOtherVersion;
  auto v3 = testing::FakeSideChannel::start(f);
  ASSERT_TRUE(v3.ok());
  auto plain = instance(opts("decode2", 1));
  ASSERT_TRUE(plain[0]->worker->add_remote("p", {(*v3)->address()}).ok());
  s = plain[0]->worker->start_load(1, "p", request());
  EXPECT_NE(s.message().find("version mismatch: local 2, peer 3"), std::string::npos) << s.to_string();
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

TEST(WorkerTest, PlanErrorsComeBackBeforeAnythingMoves) {
  auto prefill = instance(opts("prefill", 1));
  auto decode = instance(opts("decode", 1));
  ASSERT_TRUE(decode[0]->worker->add_remote("prefill", addresses(prefill)).ok());
  Request q = request();
  q.blocks["full"].local = {1, 2, 99};
  Status s = decode[0]->worker->start_load(1, "prefill", q);
  EXPECT_EQ(s.code(), Code::kOutOfRange) << s.to_string();
  EXPECT_EQ(decode[0]->engine->metrics().transfers_submitted, 0u);
}

}  // namespace
}  // namespace kvbridge
