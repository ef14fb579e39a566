// Push mode (WorkerOptions::mode = kPush): prefill ranks write into the
// decode ranks' blocks, whole or layer by layer, and tell each decode rank
// after each stage; the decode rank reads nothing. Aborts, failures and mode
// mismatches.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <thread>

#include "connector/messages.h"
#include "connector/worker_test_util.h"

namespace kvbridge {
namespace {

using namespace std::chrono_literals;
using namespace worker_test;

InstanceOptions push_opts(std::string id, uint32_t tp, RemoteAccess access) {
  InstanceOptions o = opts(std::move(id), tp);
  o.worker.mode = TransferMode::kPush;
  o.worker.remote_access = access;
  return o;
}

// Two prefill ranks pushing into `decode_tp` decode ranks. Every rank knows
// both instances: a prefill rank plans over its own instance's ranks.
struct Pushing {
  // The writers last, so they are destroyed first: a push still writing
  // when a test ends (one whose load failed at its first bad stage) ends
  // before the decode ranks' memory goes.
  std::vector<std::unique_ptr<Rank>> decode, prefill;
  std::vector<std::string> layers;
  explicit Pushing(uint32_t decode_tp = 1, InstanceOptions d = {}, InstanceOptions p = {}) {
    if (d.id.empty()) d = push_opts("decode", decode_tp, RemoteAccess::kWrite);
    if (p.id.empty()) p = push_opts("prefill", 2, RemoteAccess::kNone);
    prefill = instance(p);
    decode = instance(d);
    layers = layer_order(decode[0]->layout);
    for (auto& r : decode) EXPECT_TRUE(r->worker->add_remote("prefill", addresses(prefill)).ok());
    for (auto& r : prefill) {
      EXPECT_TRUE(r->worker->add_remote("decode", addresses(decode)).ok());
      EXPECT_TRUE(r->worker->add_remote("prefill", addresses(prefill)).ok());
    }
  }
  void fill_all(uint64_t seed = 11) {
    for (auto& r : prefill) {
      ASSERT_TRUE(fill_request(r->layout, request(), RequestSide::kRemote, 0, seed, r->spans).ok());
    }
  }
  void push_all(RequestId id, bool stream = false) {
    for (auto& r : prefill) ASSERT_TRUE(r->worker->push(id, "decode", request(), LoadOptions::streaming(stream)).ok());
  }
  void compute(RequestId id, const std::string& layer, std::vector<size_t> ranks = {0, 1}) {
    for (size_t k : ranks) {
      Rank& r = *prefill[k];
      ASSERT_TRUE(fill_request(keep_layers(r.layout, {layer}), request(), RequestSide::kRemote, 0, 11, r.spans).ok());
      ASSERT_TRUE(r.worker->save_layer(id, layer).ok());
    }
  }
  uint64_t untouched(const std::vector<std::string>::const_iterator from) const {
    const std::set<std::string, std::less<>> rest(from, layers.cend());
    uint64_t out = 0;
    for (auto& d : decode) {
      out += cells(*d, request(), rest) - bad_cells(*d, request(), rest, 11);  // cells that are the pattern
    }
    return out;
  }
};

TEST(WorkerPushTest, EveryDecodeRankGetsItsBytesWrittenAndReadsNothing) {
  for (uint32_t decode_tp : {1u, 4u}) {
    Pushing s(decode_tp);
    s.fill_all();
    for (auto& d : s.decode) ASSERT_TRUE(d->worker->start_load("1", "prefill", request()).ok());
    s.push_all("1");
    for (auto& d : s.decode) {
      LoadResult r = wait_one(*d->worker);
      ASSERT_TRUE(r.error.ok()) << "decode TP " << decode_tp << ": " << r.error.to_string();
      EXPECT_GT(r.bytes, 0u);
      Result<ContentReport> all = check_request(d->layout, request(), RequestSide::kLocal, 0, 11, d->spans);
      ASSERT_TRUE(all.ok());
      EXPECT_EQ(all->bad_cells, 0u) << all->first_error;
      EXPECT_EQ(d->engine->metrics().transfers_submitted, 0u) << "a push-mode decode rank reads nothing";
    }
    for (auto& p : s.prefill) EXPECT_TRUE(p->worker->wait_for_save("1", 5s).ok());
    // Readers still say done to the ranks that wrote: the prefill scheduler's
    // release works as in pull mode.
    std::set<std::string> readers;
    const auto until = std::chrono::steady_clock::now() + 20s;  // sanitizer builds on a busy machine are slow
    while (readers.size() < decode_tp && std::chrono::steady_clock::now() < until) {
      for (auto& p : s.prefill) {
        for (const ReaderEvent& e : p->worker->take_reader_events()) {
          if (e.kind == ReaderEvent::Kind::kDone) readers.insert(e.reader);
        }
      }
      std::this_thread::sleep_for(10ms);
    }
    EXPECT_EQ(readers.size(), decode_tp);
  }
}

// Pushes are planned from their shape's template from its first on, on
// both sides, and written as runs (the later layers as moved runs of the
// first: their places hashed once per run), every byte where the load
// named, whatever the ids, for every decode rank of a TP the prefill does
// not share.
TEST(WorkerPushTest, PushesOfOneShapeAreWrittenAsRunsByteExact) {
  Pushing s(4);
  const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> ids = {
      {{1, 2, 3}, {4, 5, 6}}, {{7, 0, 5}, {2, 6, 0}}, {{3, 4, 6}, {5, 1, 7}}, {{6, 1, 2}, {0, 3, 4}}};
  uint64_t seed = 30;
  for (size_t n = 0; n < ids.size(); ++n, ++seed) {
    Request q = request();
    q.blocks["full"] = {ids[n].first, ids[n].second};
    const RequestId id = "r" + std::to_string(n);
    for (auto& r : s.prefill) ASSERT_TRUE(fill_request(r->layout, q, RequestSide::kRemote, 0, seed, r->spans).ok());
    for (auto& d : s.decode) ASSERT_TRUE(d->worker->start_load(id, "prefill", q).ok());
    for (auto& r : s.prefill) ASSERT_TRUE(r->worker->push(id, "decode", q, LoadOptions{}).ok());
    for (auto& r : s.prefill) ASSERT_TRUE(r->worker->wait_for_save(id, 5s).ok());
    for (auto& d : s.decode) {
      LoadResult r = wait_one(*d->worker);
      ASSERT_TRUE(r.error.ok()) << id << ": " << r.error.to_string();
      Result<ContentReport> c = check_request(d->layout, q, RequestSide::kLocal, 0, seed, d->spans);
      ASSERT_TRUE(c.ok());
      EXPECT_EQ(c->bad_cells, 0u) << id << ": " << c->first_error;
    }
  }
  uint64_t as_runs = 0;
  for (auto& r : s.prefill) {
    const WorkerStats st = r->worker->stats();
    EXPECT_EQ(st.plans_from_templates, ids.size() * s.decode.size() / 2) << "every push, per decode rank it writes";
    EXPECT_EQ(st.plans_not_templated, 0u);
    as_runs += st.writes_as_runs;
  }
  EXPECT_GT(as_runs, 0u) << "no push was written as runs";
}

// The attack: the prefill pushes request 1 into other decode blocks than
// the decode's start_load() named (it was told other ids, by a bug or a
// router). The decode never reports ok a load whose blocks were not
// written: each stage's "wrote" says where its writes went, and a stage
// written elsewhere fails the load, naming the rank and the stage.
TEST(WorkerPushTest, AStageWrittenToOtherBlocksThanTheLoadNamedFailsIt) {
  Pushing s;
  s.fill_all();
  ASSERT_TRUE(s.decode[0]->worker->start_load("1", "prefill", request()).ok());
  Request elsewhere = request();
  elsewhere.blocks["full"].local = {3, 2, 1};  // the decode's blocks, in another order
  for (auto& r : s.prefill) ASSERT_TRUE(r->worker->push("1", "decode", elsewhere, LoadOptions()).ok());
  LoadResult r = wait_one(*s.decode[0]->worker);
  ASSERT_FALSE(r.error.ok()) << "a load whose blocks were written elsewhere reported ok";
  EXPECT_NE(r.error.message().find("to other places than this load's blocks"), std::string::npos)
      << r.error.to_string();
  EXPECT_NE(r.error.message().find("prefill rank"), std::string::npos) << r.error.to_string();
}

// The same attack where the decode's transport serves the writes itself
// (tcp) and the decode registers its KV kGrantedWrite: each source may write
// only the places of the load's plan while it lasts. Writes into other blocks
// (another request's) are refused whole and land nowhere; the load fails.
// Pushed where the load named, over the same grant, the bytes land.
// (A refused write is tried again until the write's timeout: the decode
// rank may plan the load after the push, below.)
TEST(WorkerPushTest, OverTcpAWriteOutsideTheLoadsGrantIsRefusedAndLandsNowhere) {
  InstanceOptions d = push_opts("decode", 1, RemoteAccess::kGrantedWrite);
  InstanceOptions p = push_opts("prefill", 2, RemoteAccess::kNone);
  d.transport = p.transport = "tcp";
  d.worker.transfer_timeout = p.worker.transfer_timeout = 1s;
  Pushing s(1, d, p);
  s.fill_all();
  Rank& decode = *s.decode[0];
  ASSERT_TRUE(decode.worker->start_load("1", "prefill", request()).ok());
  std::vector<std::vector<uint8_t>> before;
  for (auto span : decode.spans) before.emplace_back(span.begin(), span.end());
  Request elsewhere = request();
  elsewhere.blocks["full"].local = {5, 6, 7};  // not this load's blocks: another request's
  for (auto& r : s.prefill) ASSERT_TRUE(r->worker->push("1", "decode", elsewhere, LoadOptions()).ok());
  LoadResult r = wait_one(*decode.worker);
  ASSERT_FALSE(r.error.ok()) << "a load whose blocks were written elsewhere reported ok";
  for (auto& pr : s.prefill) {
    Status saved = pr->worker->wait_for_save("1", 5s);
    EXPECT_EQ(saved.code(), Code::kPermissionDenied) << saved.to_string();
    EXPECT_NE(saved.message().find("not inside a write grant"), std::string::npos) << saved.to_string();
  }
  for (size_t t = 0; t < decode.spans.size(); ++t) {
    EXPECT_TRUE(std::equal(before[t].begin(), before[t].end(), decode.spans[t].begin()))
        << "tensor " << t << " changed: a write outside the grant landed";
  }
  // The grant ended with the load: the same places, pushed for a load that
  // names them, land.
  ASSERT_TRUE(decode.worker->start_load("2", "prefill", request()).ok());
  s.push_all("2");
  LoadResult ok = wait_one(*decode.worker);
  ASSERT_TRUE(ok.error.ok()) << ok.error.to_string();
  EXPECT_EQ(bad_cells(decode, request(), {s.layers.begin(), s.layers.end()}, 11), 0u);
}

// Push mode lets the prefill push before the decode rank's start_load(),
// which grants the places: over tcp the first tries are refused as not
// granted, and the pushers try again until the grant comes; every byte lands
// and the load is ok. The pushers check what they wrote (verify_content):
// the decode's server hashes it inside their grant.
TEST(WorkerPushTest, OverTcpAPushBeforeTheLoadIsGrantedLandsOnceItIs) {
  InstanceOptions d = push_opts("decode", 1, RemoteAccess::kGrantedWrite);
  InstanceOptions p = push_opts("prefill", 2, RemoteAccess::kNone);
  d.transport = p.transport = "tcp";
  p.worker.verify_content = true;
  Pushing s(1, d, p);
  s.fill_all();
  Rank& decode = *s.decode[0];
  s.push_all("1");
  std::this_thread::sleep_for(100ms);  // several tries refused meanwhile
  for (auto& r : s.prefill) {
    EXPECT_EQ(r->worker->wait_for_save("1", 0ms).code(), Code::kTimeout) << "a push ended before it was granted";
  }
  ASSERT_TRUE(decode.worker->start_load("1", "prefill", request()).ok());
  LoadResult r = wait_one(*decode.worker);
  ASSERT_TRUE(r.error.ok()) << r.error.to_string();
  EXPECT_EQ(bad_cells(decode, request(), {s.layers.begin(), s.layers.end()}, 11), 0u);
  for (auto& pr : s.prefill) {
    EXPECT_TRUE(pr->worker->wait_for_save("1", 5s).ok());
    EXPECT_GT(pr->engine->metrics().bytes_content_checked, 0u) << "the pusher's writes were not checked";
  }
}

TEST(WorkerPushTest, StreamedEachLayerIsWrittenOnceSavedAndNothingLaterMoves) {
  Pushing s;
  ConnectorWorker& d = *s.decode[0]->worker;
  ASSERT_TRUE(d.start_load("1", "prefill", request(), LoadOptions::streaming(true)).ok());
  s.push_all("1", true);
  for (size_t i = 0; i < s.layers.size(); ++i) {
    EXPECT_EQ(d.wait_for_layer("1", s.layers[i], 0ms).code(), Code::kTimeout);
    EXPECT_EQ(s.untouched(s.layers.begin() + static_cast<long>(i)), 0u) << s.layers[i];
    s.compute("1", s.layers[i]);
    ASSERT_TRUE(d.wait_for_layer("1", s.layers[i], 5s).ok()) << s.layers[i];
    EXPECT_EQ(bad_cells(*s.decode[0], request(), {s.layers[i]}, 11), 0u) << s.layers[i];
  }
  LoadResult r = wait_one(d);
  ASSERT_TRUE(r.error.ok()) << r.error.to_string();
  EXPECT_EQ(r.stages, 32u);
  for (auto& p : s.prefill) EXPECT_TRUE(p->worker->wait_for_save("1", 5s).ok());
}

// Streamed pushes of one shape, from its template on: a later layer's
// stage is the first layer's moved, on both sides. The prefill writes it as
// runs of a list of the first layer's items prepared once per decode rank,
// the decode grants its places as repeats of the first layer's (over tcp,
// kGrantedWrite: a write outside them is refused), and both hash the
// places. Every byte lands, also when the layers are saved last to first;
// a push told other blocks than the load named fails the load, moved
// stages too.
class WorkerPushMovedTest : public ::testing::TestWithParam<std::string> {};

TEST_P(WorkerPushMovedTest, StreamedPushesWriteLaterLayersAsTheFirstLayersItemsMoved) {
  const bool tcp = GetParam() == "tcp";
  InstanceOptions d = push_opts("decode", 2, tcp ? RemoteAccess::kGrantedWrite : RemoteAccess::kWrite);
  InstanceOptions p = push_opts("prefill", 2, RemoteAccess::kNone);
  d.transport = p.transport = GetParam();
  d.worker.transfer_timeout = p.worker.transfer_timeout = 2s;
  Pushing s(2, d, p);
  const std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> ids = {
      {{1, 2, 3}, {4, 5, 6}}, {{7, 0, 5}, {2, 6, 0}}, {{3, 4, 6}, {5, 1, 7}}, {{6, 1, 2}, {0, 3, 4}}};
  uint64_t seed = 40;
  for (size_t n = 0; n < ids.size(); ++n, ++seed) {
    Request q = request();
    q.blocks["full"] = {ids[n].first, ids[n].second};
    const RequestId id = "m" + std::to_string(n);
    for (auto& r : s.prefill) ASSERT_TRUE(fill_request(r->layout, q, RequestSide::kRemote, 0, seed, r->spans).ok());
    for (auto& r : s.decode) ASSERT_TRUE(r->worker->start_load(id, "prefill", q, LoadOptions::streaming(true)).ok());
    for (auto& r : s.prefill) ASSERT_TRUE(r->worker->push(id, "decode", q, LoadOptions::streaming(true)).ok());
    std::vector<std::string> order = s.layers;
    if (n == 2) std::reverse(order.begin(), order.end());
    for (const std::string& l : order) {
      for (auto& r : s.prefill) ASSERT_TRUE(r->worker->save_layer(id, l).ok());
    }
    for (auto& r : s.prefill) ASSERT_TRUE(r->worker->wait_for_save(id, 5s).ok()) << id;
    for (auto& r : s.decode) {
      LoadResult lr = wait_one(*r->worker);
      ASSERT_TRUE(lr.error.ok()) << id << ": " << lr.error.to_string();
      EXPECT_EQ(lr.stages, s.layers.size()) << "a streamed load is cut by layers only";
      Result<ContentReport> c = check_request(r->layout, q, RequestSide::kLocal, 0, seed, r->spans);
      ASSERT_TRUE(c.ok());
      EXPECT_EQ(c->bad_cells, 0u) << id << ": " << c->first_error;
    }
  }
  // Per prefill rank, every push (a push is planned from its shape's
  // template from the shape's first load on, on both sides) to the decode
  // rank that reads it (same TP): every layer after the first.
  // Through one prepared list per push, none held once its writes ended.
  for (auto& r : s.prefill) {
    const WorkerStats st = r->worker->stats();
    EXPECT_EQ(st.moved_stage_writes, ids.size() * (s.layers.size() - 1));
    EXPECT_EQ(st.prepared_lists, ids.size());
    EXPECT_EQ(st.prepared_lists_held, 0u) << "a push waited for still holds its prepared list";
  }
  // The decode ranks forget the prefill instance and learn it again: their
  // next load of the shape is its first (their templates are per fetched
  // layouts), the prefill's is not. Both plan it from a template all the
  // same, so the places each stage's "wrote" names are in the form the
  // decode rank computes.
  for (auto& r : s.decode) {
    ASSERT_TRUE(r->worker->remove_remote("prefill").ok());
    ASSERT_TRUE(r->worker->add_remote("prefill", addresses(s.prefill)).ok());
  }
  {
    Request q = request();
    q.blocks["full"] = {ids[1].first, ids[1].second};
    for (auto& r : s.prefill) ASSERT_TRUE(fill_request(r->layout, q, RequestSide::kRemote, 0, seed, r->spans).ok());
    for (auto& r : s.decode)
      ASSERT_TRUE(r->worker->start_load("again", "prefill", q, LoadOptions::streaming(true)).ok());
    for (auto& r : s.prefill) ASSERT_TRUE(r->worker->push("again", "decode", q, LoadOptions::streaming(true)).ok());
    for (const std::string& l : s.layers) {
      for (auto& r : s.prefill) ASSERT_TRUE(r->worker->save_layer("again", l).ok());
    }
    for (auto& r : s.prefill) ASSERT_TRUE(r->worker->wait_for_save("again", 5s).ok());
    for (auto& r : s.decode) {
      LoadResult lr = wait_one(*r->worker);
      ASSERT_TRUE(lr.error.ok()) << lr.error.to_string();
      Result<ContentReport> c = check_request(r->layout, q, RequestSide::kLocal, 0, seed, r->spans);
      ASSERT_TRUE(c.ok());
      EXPECT_EQ(c->bad_cells, 0u) << c->first_error;
    }
  }
  // Told other blocks than the load named (the same shape): the load fails.
  Request named = request();
  named.blocks["full"] = {ids[0].first, ids[0].second};
  Request elsewhere = named;
  elsewhere.blocks["full"].local = {ids[0].first[2], ids[0].first[1], ids[0].first[0]};
  for (auto& r : s.decode) ASSERT_TRUE(r->worker->start_load("x", "prefill", named, LoadOptions::streaming(true)).ok());
  for (auto& r : s.prefill) ASSERT_TRUE(r->worker->push("x", "decode", elsewhere, LoadOptions::streaming(true)).ok());
  for (const std::string& l : s.layers) {
    for (auto& r : s.prefill) ASSERT_TRUE(r->worker->save_layer("x", l).ok());
  }
  for (auto& r : s.decode) {
    LoadResult lr = wait_one(*r->worker);
    ASSERT_FALSE(lr.error.ok()) << "a load whose blocks were written elsewhere reported ok";
    if (!tcp) {
      EXPECT_NE(lr.error.message().find("to other places than this load's blocks"), std::string::npos)
          << lr.error.to_string();
    }
  }
  for (auto& r : s.prefill) {
    Status saved = r->worker->wait_for_save("x", 5s);
    if (tcp) {
      EXPECT_EQ(saved.code(), Code::kPermissionDenied) << saved.to_string();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, WorkerPushMovedTest, ::testing::Values("local", "tcp"));

// The prefill may finish before the decode rank's start_load(): what it
// said is kept for the load.
TEST(WorkerPushTest, StagesWrittenBeforeTheLoadStartsAreKept) {
  Pushing s;
  s.fill_all();
  s.push_all("5");
  for (auto& p : s.prefill) ASSERT_TRUE(p->worker->wait_for_save("5", 5s).ok());
  ConnectorWorker& d = *s.decode[0]->worker;
  ASSERT_TRUE(d.start_load("5", "prefill", request()).ok());
  LoadResult r = wait_one(d);
  ASSERT_TRUE(r.error.ok()) << r.error.to_string();
  EXPECT_EQ(bad_cells(*s.decode[0], request(), {s.layers.begin(), s.layers.end()}, 11), 0u);
}

// Answers (held, released, unread) never come as notifications: sent as
// ones by a source's own engine, before the load starts and while it
// waits for its stages, they are dropped, and the load finishes.
TEST(WorkerPushTest, AnswersSentAsNotificationsAreDropped) {
  Pushing s;
  s.fill_all();
  Result<PeerId> to = s.prefill[0]->engine->connect(s.decode[0]->engine->metadata());
  ASSERT_TRUE(to.ok()) << to.error().to_string();
  auto answers = [&](const RequestId& id) {
    using connector::Message;
    for (Message::Kind k : {Message::Kind::kHeld, Message::Kind::kReleased, Message::Kind::kUnread}) {
      ASSERT_TRUE(s.prefill[0]->engine->notify(*to, connector::format_message(k, id)).ok());
    }
  };
  answers("6");
  std::this_thread::sleep_for(50ms);  // taken by the decode rank before its load starts
  ConnectorWorker& d = *s.decode[0]->worker;
  ASSERT_TRUE(d.start_load("6", "prefill", request()).ok());
  answers("6");
  s.push_all("6");
  LoadResult r = wait_one(d);
  ASSERT_TRUE(r.error.ok()) << r.error.to_string();
  EXPECT_EQ(bad_cells(*s.decode[0], request(), {s.layers.begin(), s.layers.end()}, 11), 0u);
}

// abort() returns once every source confirmed that none of its writes can
// land: the later layers never do.
// Three times, the same shape: the later layers are moved stages written
// as runs of a prepared list, and an abort stops them as it stops any
// write.
TEST(WorkerPushTest, AnAbortMidStreamIsConfirmedByTheSourcesAndNothingLaterLands) {
  Pushing s;
  ConnectorWorker& d = *s.decode[0]->worker;
  for (const RequestId id : {"3", "4", "5"}) {
    ASSERT_TRUE(d.start_load(id, "prefill", request(), LoadOptions::streaming(true)).ok());
    s.push_all(id, true);
    for (size_t i = 0; i < 5; ++i) s.compute(id, s.layers[i]);
    ASSERT_TRUE(d.wait_for_layer(id, s.layers[4], 5s).ok());
    ASSERT_TRUE(d.abort(id).ok());
    for (size_t i = 5; i < s.layers.size(); ++i) s.compute(id, s.layers[i]);
    LoadResult r = wait_one(d);
    EXPECT_TRUE(r.aborted);
    EXPECT_EQ(r.error.code(), Code::kCancelled) << r.error.to_string();
    for (auto& p : s.prefill) EXPECT_TRUE(p->worker->wait_for_save(id, 5s).ok());
    std::this_thread::sleep_for(50ms);
    EXPECT_EQ(s.untouched(s.layers.begin() + 5), 0u) << id;
  }
  for (auto& p : s.prefill) {
    const WorkerStats st = p->worker->stats();
    EXPECT_GT(st.moved_stage_writes, 0u);
    EXPECT_EQ(st.prepared_lists_held, 0u);
  }
}

// A cancel that comes before push() (the decode rank aborted at once; the
// prefill ranks had not even fetched the decode instance): confirmed all
// the same, and nothing is ever written.
TEST(WorkerPushTest, AnAbortBeforeThePushIsConfirmedAndNothingIsWritten) {
  Pushing s;
  s.fill_all();
  ConnectorWorker& d = *s.decode[0]->worker;
  ASSERT_TRUE(d.wait_connected("prefill", 10s).ok());
  ASSERT_TRUE(d.start_load("4", "prefill", request()).ok());
  Status a = d.abort("4");
  ASSERT_TRUE(a.ok()) << a.to_string();
  EXPECT_TRUE(wait_one(d).aborted);
  s.push_all("4");
  for (auto& p : s.prefill) EXPECT_TRUE(p->worker->wait_for_save("4", 5s).ok());
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(s.untouched(s.layers.begin()), 0u);
}

// A prefill rank that never writes (died, or its message was lost): the
// load fails at its deadline naming the first stage not written.
TEST(WorkerPushTest, AStageNeverWrittenFailsTheLoadAtItsDeadline) {
  InstanceOptions o = push_opts("decode", 1, RemoteAccess::kWrite);
  o.worker.transfer_timeout = 300ms;
  Pushing s(1, o);
  s.fill_all();
  ConnectorWorker& d = *s.decode[0]->worker;
  ASSERT_TRUE(d.start_load("6", "prefill", request()).ok());
  ASSERT_TRUE(s.prefill[0]->worker->push("6", "decode", request(), {}).ok());  // rank 1 never pushes
  LoadResult r = wait_one(d);
  EXPECT_EQ(r.error.code(), Code::kTimeout) << r.error.to_string();
  EXPECT_NE(r.error.message().find("not written by every prefill rank"), std::string::npos) << r.error.to_string();
  EXPECT_EQ(r.first_bad_token, 0u);
}

// A write the decode rank refuses (its tensors grant no write access): the
// decode rank hears at once, and wait_for_save() names the cause.
TEST(WorkerPushTest, AWriteThatFailsFailsTheLoadAtOnce) {
  Pushing s(1, push_opts("decode", 1, RemoteAccess::kRead));
  s.fill_all();
  ConnectorWorker& d = *s.decode[0]->worker;
  ASSERT_TRUE(d.start_load("7", "prefill", request()).ok());
  const auto t0 = std::chrono::steady_clock::now();
  s.push_all("7");
  LoadResult r = wait_one(d);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  EXPECT_EQ(r.error.code(), Code::kIoError) << r.error.to_string();
  EXPECT_NE(r.error.message().find("could not write"), std::string::npos) << r.error.to_string();
  Status w = s.prefill[0]->worker->wait_for_save("7", 5s);
  EXPECT_EQ(w.code(), Code::kPermissionDenied) << w.to_string();
}

// The mode is part of the handshake: a pull decode rank and push prefill
// ranks refuse each other, naming it.
TEST(WorkerPushTest, AModeMismatchFailsTheHandshakeNamingIt) {
  Pushing s(1, opts("decode", 1));
  ConnectorWorker& d = *s.decode[0]->worker;
  ASSERT_TRUE(d.start_load("8", "prefill", request()).ok());
  LoadResult r = wait_one(d);
  EXPECT_EQ(r.error.code(), Code::kIncompatible) << r.error.to_string();
  EXPECT_NE(r.error.message().find("transfer_mode push"), std::string::npos) << r.error.to_string();
}

TEST(WorkerPushTest, PushCallsNameWhatIsWrong) {
  Pushing s;
  ConnectorWorker& p = *s.prefill[0]->worker;
  EXPECT_EQ(p.stream_to("1", "decode").code(), Code::kInvalidArgument);
  EXPECT_EQ(p.push("1", "nowhere", request(), {}).code(), Code::kNotFound);
  EXPECT_EQ(p.push("a b", "decode", request(), {}).code(), Code::kInvalidArgument);
  EXPECT_EQ(p.wait_for_save("1", 10ms).code(), Code::kNotFound);
  ASSERT_TRUE(p.push("1", "decode", request(), {}).ok());
  EXPECT_EQ(p.push("1", "decode", request(), {}).code(), Code::kAlreadyExists);
  // A prefill rank that does not know its own instance cannot plan as the
  // decode ranks do.
  auto lone = instance(push_opts("lone", 1, RemoteAccess::kNone));
  ASSERT_TRUE(lone[0]->worker->add_remote("decode", addresses(s.decode)).ok());
  Status e = lone[0]->worker->push("2", "decode", request(), {});
  EXPECT_EQ(e.code(), Code::kNotFound) << e.to_string();
  EXPECT_NE(e.message().find("add_remote('lone'"), std::string::npos) << e.to_string();
  // And a pull-mode worker has no push().
  auto pull = instance(opts("pull", 1));
  EXPECT_EQ(pull[0]->worker->push("3", "decode", request(), {}).code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace kvbridge
