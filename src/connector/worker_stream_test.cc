// ConnectorWorker's layer-wise streaming in one process (LoadOptions::stream,
// stream_to, save_layer): a stage per layer, read once every prefill rank
// announced it, and announcements only to the ranks that read them.
#include <gtest/gtest.h>

#include <set>
#include <thread>

#include "connector/worker_test_util.h"
#include "kvbridge/connector.h"
#include "kvbridge/content.h"

namespace kvbridge {
namespace {

using namespace std::chrono_literals;
using namespace worker_test;

struct Streaming {
  std::vector<std::unique_ptr<Rank>> prefill, decode;
  std::vector<std::string> layers;
  explicit Streaming(InstanceOptions d = opts("decode", 1)) {
    prefill = instance(opts("prefill", 2));
    decode = instance(d);
    layers = layer_order(decode[0]->layout);
    for (auto& r : decode) EXPECT_TRUE(r->worker->add_remote("prefill", addresses(prefill)).ok());
    for (auto& r : prefill) EXPECT_TRUE(r->worker->add_remote("decode", addresses(decode)).ok());
  }
  // Prefill computes `layer` (writes its cells) on `ranks` and saves it.
  void compute(RequestId id, const std::string& layer, std::vector<size_t> ranks = {0, 1}) {
    for (size_t k : ranks) {
      Rank& r = *prefill[k];
      ASSERT_TRUE(fill_request(keep_layers(r.layout, {layer}), request(), RequestSide::kRemote, 0, 11, r.spans).ok());
      ASSERT_TRUE(r.worker->save_layer(id, layer).ok());
    }
  }
};

TEST(WorkerStreamTest, EachLayerIsReadOnlyOnceEveryPrefillRankSavedItAndLandsBeforeTheNext) {
  Streaming s;
  ConnectorWorker& d = *s.decode[0]->worker;
  ASSERT_EQ(s.layers.size(), 32u);
  ASSERT_TRUE(d.start_load("1", "prefill", request(), LoadOptions::streaming(true)).ok());
  for (auto& r : s.prefill) ASSERT_TRUE(r->worker->stream_to("1", "decode").ok());
  for (size_t i = 0; i < s.layers.size(); ++i) {
    const std::set<std::string, std::less<>> later(s.layers.begin() + static_cast<long>(i), s.layers.end());
    // Not saved yet by anyone: nothing of it or later has moved.
    EXPECT_EQ(d.wait_for_layer("1", s.layers[i], 0ms).code(), Code::kTimeout);
    EXPECT_EQ(bad_cells(*s.decode[0], request(), later, 11), cells(*s.decode[0], request(), later)) << s.layers[i];
    s.compute("1", s.layers[i], {0});
    if (i % 8 == 0) {  // one rank saved it, the other not yet: still not read
      std::this_thread::sleep_for(20ms);
      EXPECT_EQ(d.wait_for_layer("1", s.layers[i], 0ms).code(), Code::kTimeout) << s.layers[i];
    }
    s.compute("1", s.layers[i], {1});
    ASSERT_TRUE(d.wait_for_layer("1", s.layers[i], 5s).ok()) << s.layers[i];
    EXPECT_EQ(bad_cells(*s.decode[0], request(), {s.layers[i]}, 11), 0u) << s.layers[i];
  }
  LoadResult r = wait_one(d);
  ASSERT_TRUE(r.error.ok()) << r.error.to_string();
  EXPECT_EQ(r.stages, 32u);
  // The last stage's reads (one layer) against the whole load, which waited
  // for 32 layers of compute and four 20 ms pauses.
  EXPECT_LE(r.last_stage_time, r.transfer_time / 4);
  Result<ContentReport> all =
      check_request(s.decode[0]->layout, request(), RequestSide::kLocal, 0, 11, s.decode[0]->spans);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->bad_cells, 0u) << all->first_error;
  for (auto& p : s.prefill) EXPECT_TRUE(p->worker->wait_for_save("1", 5s).ok());
  // After the load: its outcome.
  EXPECT_TRUE(d.wait_for_layer("1", s.layers[3], 0ms).ok());
  EXPECT_EQ(d.wait_for_layer("99", s.layers[3], 0ms).code(), Code::kNotFound);
  EXPECT_EQ(d.wait_for_layer("1", "layers.99", 0ms).code(), Code::kInvalidArgument);
}

TEST(WorkerStreamTest, LayersSavedBeforeTheLoadStartsOrBeforeStreamToAreKept) {
  Streaming s;
  ConnectorWorker& d = *s.decode[0]->worker;
  for (const std::string& l : s.layers) s.compute("7", l);  // before stream_to: kept
  for (auto& r : s.prefill) ASSERT_TRUE(r->worker->stream_to("7", "decode").ok());
  for (auto& r : s.prefill) ASSERT_TRUE(r->worker->wait_for_save("7", 5s).ok());  // announced before the load
  ASSERT_TRUE(d.start_load("7", "prefill", request(), LoadOptions::streaming(true)).ok());
  LoadResult r = wait_one(d);
  ASSERT_TRUE(r.error.ok()) << r.error.to_string();
  EXPECT_EQ(bad_cells(*s.decode[0], request(), {s.layers.begin(), s.layers.end()}, 11), 0u);
}

// A prefill rank that dies (or whose announcement is lost) after layer 9:
// the load fails at its deadline naming layer 10, the first bad token is
// where a recompute must start, and nothing of layer 10 or later lands.
TEST(WorkerStreamTest, AStageNeverAnnouncedFailsTheLoadNamingItsLayerAndNothingLaterLands) {
  InstanceOptions o = opts("decode", 1);
  o.worker.transfer_timeout = 300ms;
  Streaming s(o);
  ConnectorWorker& d = *s.decode[0]->worker;
  // The deadline runs from start_load: the load may not fail before it
  // (however long the layers before took, e.g. under a sanitizer).
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(d.start_load("2", "prefill", request(), LoadOptions::streaming(true)).ok());
  for (auto& r : s.prefill) ASSERT_TRUE(r->worker->stream_to("2", "decode").ok());
  for (size_t i = 0; i < 10; ++i) s.compute("2", s.layers[i]);
  s.compute("2", s.layers[10], {0});  // rank 1 never saves layer 10
  LoadResult r = wait_one(d);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, o.worker.transfer_timeout);
  ASSERT_FALSE(r.error.ok());
  EXPECT_EQ(r.error.code(), Code::kTimeout) << r.error.to_string();
  EXPECT_NE(r.error.message().find("layers.10"), std::string::npos) << r.error.to_string();
  EXPECT_EQ(r.first_bad_layer, "layers.10");
  EXPECT_EQ(r.first_bad_token, 0u);
  const std::set<std::string, std::less<>> landed(s.layers.begin(), s.layers.begin() + 10);
  const std::set<std::string, std::less<>> rest(s.layers.begin() + 10, s.layers.end());
  EXPECT_EQ(bad_cells(*s.decode[0], request(), landed, 11), 0u);
  EXPECT_EQ(bad_cells(*s.decode[0], request(), rest, 11), cells(*s.decode[0], request(), rest));
  EXPECT_EQ(d.wait_for_layer("2", s.layers[12], 0ms).code(), Code::kTimeout);  // the load's outcome
  // Announcements after the end are dropped: nothing lands late, and a
  // later load of the same request id is not started by them.
  for (size_t i = 10; i < s.layers.size(); ++i) s.compute("2", s.layers[i]);
  for (auto& r : s.prefill) EXPECT_TRUE(r->worker->wait_for_save("2", 5s).ok());
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(bad_cells(*s.decode[0], request(), rest, 11), cells(*s.decode[0], request(), rest));
  ASSERT_TRUE(d.start_load("2", "prefill", request(), LoadOptions::streaming(true)).ok());
  EXPECT_EQ(d.wait_for_layer("2", s.layers[10], 100ms).code(), Code::kTimeout);
  ASSERT_TRUE(d.abort("2").ok());
  EXPECT_TRUE(wait_one(d).aborted);
}

TEST(WorkerStreamTest, AnAbortMidStreamStartsNoFurtherStage) {
  Streaming s;
  ConnectorWorker& d = *s.decode[0]->worker;
  ASSERT_TRUE(d.start_load("3", "prefill", request(), LoadOptions::streaming(true)).ok());
  for (auto& r : s.prefill) ASSERT_TRUE(r->worker->stream_to("3", "decode").ok());
  for (size_t i = 0; i < 5; ++i) s.compute("3", s.layers[i]);
  ASSERT_TRUE(d.wait_for_layer("3", s.layers[4], 5s).ok());
  ASSERT_TRUE(d.abort("3").ok());
  for (size_t i = 5; i < s.layers.size(); ++i) s.compute("3", s.layers[i]);
  LoadResult r = wait_one(d);
  EXPECT_TRUE(r.aborted);
  EXPECT_EQ(r.error.code(), Code::kCancelled);
  std::this_thread::sleep_for(50ms);
  const std::set<std::string, std::less<>> rest(s.layers.begin() + 5, s.layers.end());
  EXPECT_EQ(bad_cells(*s.decode[0], request(), rest, 11), cells(*s.decode[0], request(), rest));
}

// Only the engines of the prefill ranks a stage reads from can start it.
TEST(WorkerStreamTest, AnnouncementsFromAnEngineThatIsNotASourceAreIgnored) {
  Streaming s;
  auto other = instance(opts("other", 1));
  ASSERT_TRUE(other[0]->worker->add_remote("decode", addresses(s.decode)).ok());
  ConnectorWorker& d = *s.decode[0]->worker;
  ASSERT_TRUE(d.start_load("4", "prefill", request(), LoadOptions::streaming(true)).ok());
  ASSERT_TRUE(other[0]->worker->stream_to("4", "decode").ok());
  for (const std::string& l : s.layers) ASSERT_TRUE(other[0]->worker->save_layer("4", l).ok());
  ASSERT_TRUE(other[0]->worker->wait_for_save("4", 5s).ok());  // the decode rank took them, and ignored them
  EXPECT_EQ(d.wait_for_layer("4", s.layers[0], 50ms).code(), Code::kTimeout);
  for (auto& r : s.prefill) ASSERT_TRUE(r->worker->stream_to("4", "decode").ok());
  for (const std::string& l : s.layers) s.compute("4", l);
  LoadResult r = wait_one(d);
  ASSERT_TRUE(r.error.ok()) << r.error.to_string();
  EXPECT_EQ(bad_cells(*s.decode[0], request(), {s.layers.begin(), s.layers.end()}, 11), 0u);
}

// A decode rank that reads nothing from a prefill rank (TP 2 to TP 2: each
// reads its own) answers that rank's first announcement "unread", and gets
// no more from it; the rank it reads still gets every layer, and a rank
// that does not know the announcing instance answers nothing.
TEST(WorkerStreamTest, ARankThatReadsNothingFromAPrefillRankIsNotAnnouncedToAgain) {
  Streaming s(opts("decode", 2));
  auto stream = [&](const RequestId& id) {
    for (auto& d : s.decode)
      ASSERT_TRUE(d->worker->start_load(id, "prefill", request(), LoadOptions::streaming(true)).ok());
    for (auto& r : s.prefill) ASSERT_TRUE(r->worker->stream_to(id, "decode").ok());
    for (const std::string& l : s.layers) s.compute(id, l);
    for (auto& r : s.prefill) ASSERT_TRUE(r->worker->wait_for_save(id, 5s).ok()) << id;
    for (auto& d : s.decode) {
      LoadResult r = wait_one(*d->worker);
      ASSERT_TRUE(r.error.ok()) << id << ": " << r.error.to_string();
      EXPECT_EQ(bad_cells(*d, request(), {s.layers.begin(), s.layers.end()}, 11), 0u) << id;
    }
  };
  // The decode ranks know the prefill instance's layouts before the first
  // announcement comes (until then a rank cannot tell, and answers
  // nothing).
  for (auto& d : s.decode) ASSERT_TRUE(d->worker->wait_connected("prefill", 5s).ok());
  const uint64_t layers = s.layers.size();
  stream("first");
  // Each prefill rank announced to both decode ranks at first (at most
  // every layer to both: the answers came back while it was saving).
  for (auto& r : s.prefill) {
    const WorkerStats st = r->worker->stats();
    EXPECT_GE(st.announcements_sent, layers + 1);
    EXPECT_LE(st.announcements_sent, 2 * layers);
    EXPECT_EQ(st.announcements_sent + st.announcements_skipped, 2 * layers);
  }
  std::vector<WorkerStats> before;
  for (auto& r : s.prefill) before.push_back(r->worker->stats());
  stream("second");
  for (size_t k = 0; k < s.prefill.size(); ++k) {
    const WorkerStats st = s.prefill[k]->worker->stats();
    EXPECT_EQ(st.announcements_sent - before[k].announcements_sent, layers) << "only to the rank that reads it";
    EXPECT_EQ(st.announcements_skipped - before[k].announcements_skipped, layers);
  }
  // An instance the decode ranks do not know: nobody answers "unread", so
  // it keeps announcing to both (and they ignore it).
  auto other = instance(opts("other", 1));
  ASSERT_TRUE(other[0]->worker->add_remote("decode", addresses(s.decode)).ok());
  for (const RequestId id : {"o1", "o2"}) {
    ASSERT_TRUE(other[0]->worker->stream_to(id, "decode").ok());
    for (const std::string& l : s.layers) ASSERT_TRUE(other[0]->worker->save_layer(id, l).ok());
    ASSERT_TRUE(other[0]->worker->wait_for_save(id, 5s).ok());
  }
  EXPECT_EQ(other[0]->worker->stats().announcements_sent, 2 * 2 * layers);
  EXPECT_EQ(other[0]->worker->stats().announcements_skipped, 0u);
}

TEST(WorkerStreamTest, PrefillHooksNameWhatIsWrong) {
  auto prefill = instance(opts("prefill", 1));
  ConnectorWorker& p = *prefill[0]->worker;
  EXPECT_EQ(p.save_layer("1", "layers.32").code(), Code::kInvalidArgument);
  EXPECT_TRUE(p.save_layer("1", "layers.0").ok());
  EXPECT_TRUE(p.save_layer("1", "layers.0").ok());                // again: a no-op
  EXPECT_EQ(p.wait_for_save("1", 10ms).code(), Code::kNotFound);  // never streamed
  EXPECT_EQ(p.stream_to("1", "nowhere").code(), Code::kNotFound);
}

}  // namespace
}  // namespace kvbridge
