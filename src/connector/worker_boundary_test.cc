// The worker's boundary contracts (connector.h): readiness (a layer in device
// memory is read or pushed only after its producer's event, on the host
// fake whose producer kernels land late), finality (a read whose blocks were
// released under it is not ok; a lost done is asked again), derived holds,
// and membership (a restarted or moved instance, a removed one, a rank that
// is another process now, a rank listed under another instance's name).
#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <thread>

#include "connector/worker_test_util.h"
#include "device/device.h"
#include "kvbridge/connector.h"
#include "kvbridge/content.h"

namespace kvbridge {
namespace {

using namespace std::chrono_literals;
using namespace worker_test;

// A prefill rank's forward pass on the fake device: each layer's KV is
// computed into a host mirror and copied to the rank's device memory on its
// stream behind a kernel of `delay` (the layer's compute), and an event is
// recorded after it; the engine's hook runs at once, as engines call it
// when the kernels are queued.
struct Producer {
  explicit Producer(Rank& r) : rank(r) {
    device::Device& d = device::current();
    stream = *d.create_stream(0);
    for (const Tensor& t : r.layout.tensors) mirror.emplace_back(t.bytes, 0xa5);
    for (auto& m : mirror) mirror_spans.emplace_back(m);
    for (size_t l = 0; l < layer_order(r.layout).size(); ++l) {
      events.push_back(*d.create_event(0, true));
      handles.push_back(*d.export_event(events.back()));
    }
  }
  ~Producer() {
    device::Device& d = device::current();
    d.destroy_stream(stream);
    for (device::Event e : events) d.destroy_event(e);
  }
  // Queues layer `l` of `q` (seed 11) behind `delay`; returns its event's
  // IPC handle and this process's event.
  std::pair<std::string, uintptr_t> queue(size_t l, const Request& q, std::chrono::microseconds delay) {
    device::Device& d = device::current();
    const Layout one = keep_layers(rank.layout, {layer_order(rank.layout)[l]});
    EXPECT_TRUE(fill_request(one, q, RequestSide::kRemote, 0, 11, mirror_spans).ok());
    std::vector<device::DeviceCopy> copies;
    EXPECT_TRUE(for_each_cell(one, q, RequestSide::kRemote, 0, [&](size_t t, uint64_t off, uint64_t n, uint64_t) {
                  copies.push_back({rank.spans[t].data() + off, mirror[t].data() + off, n});
                }).ok());
    EXPECT_TRUE(d.fill_after(stream, rank.spans[0].data(), 0, 0, delay).ok());
    EXPECT_TRUE(d.copy(stream, copies, device::CopyMethod::kCopyEngine).ok());
    EXPECT_TRUE(d.record(events[l], stream).ok());
    return {handles[l], reinterpret_cast<uintptr_t>(events[l])};
  }
  Rank& rank;
  device::Stream stream = nullptr;
  std::vector<std::vector<uint8_t>> mirror;
  std::vector<std::span<uint8_t>> mirror_spans;
  std::vector<device::Event> events;
  std::vector<std::string> handles;
};

InstanceOptions on_device(std::string id, TransferMode mode, RemoteAccess access) {
  InstanceOptions o = opts(std::move(id), 1);
  o.device = true;
  o.worker.mode = mode;
  o.worker.remote_access = access;
  o.worker.transfer_timeout = 10s;
  return o;
}

class WorkerBoundaryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (device::current().name() != "fake") GTEST_FAIL() << "connector_test runs with KVB_DEVICE=fake";
  }
};

// Pull: the prefill announces each layer as soon as its copy is queued (30
// ms behind a slow kernel); the decode's reads wait for the layer's event
// on the device, so every byte reported landed is the producer's.
TEST_F(WorkerBoundaryTest, AStreamedDeviceLayerIsReadOnlyAfterItsProducersEvent) {
  auto prefill = instance(on_device("prefill", TransferMode::kPull, RemoteAccess::kRead));
  auto decode = instance(on_device("decode", TransferMode::kPull, RemoteAccess::kNone));
  ConnectorWorker& p = *prefill[0]->worker;
  ConnectorWorker& d = *decode[0]->worker;
  ASSERT_TRUE(d.add_remote("prefill", addresses(prefill)).ok());
  ASSERT_TRUE(p.add_remote("decode", addresses(decode)).ok());
  Producer producer(*prefill[0]);
  const std::vector<std::string> layers = layer_order(prefill[0]->layout);
  ASSERT_TRUE(d.start_load("1", "prefill", request(), LoadOptions::streaming(true)).ok());
  ASSERT_TRUE(p.stream_to("1", "decode").ok());
  // A device layer without its producer's word is refused, naming it.
  Status bare = p.save_layer("1", layers[0]);
  EXPECT_EQ(bare.code(), Code::kInvalidArgument);
  EXPECT_NE(bare.message().find("device memory"), std::string::npos) << bare.to_string();
  for (size_t l = 0; l < layers.size(); ++l) {
    Readiness ready;
    ready.event_handle = producer.queue(l, request(), 30ms).first;
    ASSERT_TRUE(p.save_layer("1", layers[l], ready).ok()) << layers[l];
  }
  LoadResult r = wait_one(d);
  ASSERT_TRUE(r.error.ok()) << r.error.to_string();
  Result<ContentReport> all = check_request(decode[0]->layout, request(), RequestSide::kLocal, 0, 11, decode[0]->spans);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->bad_cells, 0u) << all->first_error;
  EXPECT_TRUE(p.wait_for_save("1", 5s).ok());
}

// The fake is as strict as a device: a producer that says it synchronised
// when its kernels are still queued is read before they land.
TEST_F(WorkerBoundaryTest, AProducerThatDoesNotWaitIsReadBeforeItsBytesLand) {
  auto prefill = instance(on_device("prefill", TransferMode::kPull, RemoteAccess::kRead));
  auto decode = instance(on_device("decode", TransferMode::kPull, RemoteAccess::kNone));
  ConnectorWorker& p = *prefill[0]->worker;
  ConnectorWorker& d = *decode[0]->worker;
  ASSERT_TRUE(d.add_remote("prefill", addresses(prefill)).ok());
  ASSERT_TRUE(p.add_remote("decode", addresses(decode)).ok());
  Producer producer(*prefill[0]);
  const std::vector<std::string> layers = layer_order(prefill[0]->layout);
  ASSERT_TRUE(d.start_load("2", "prefill", request(), LoadOptions::streaming(true)).ok());
  ASSERT_TRUE(p.stream_to("2", "decode").ok());
  Readiness lie;
  lie.host_synchronized = true;
  (void)producer.queue(0, request(), 300ms);
  ASSERT_TRUE(p.save_layer("2", layers[0], lie).ok());
  ASSERT_TRUE(d.wait_for_layer("2", layers[0], 5s).ok());
  EXPECT_EQ(bad_cells(*decode[0], request(), {layers[0]}, 11), cells(*decode[0], request(), {layers[0]}))
      << "the fake landed a queued copy before its kernel ran";
  ASSERT_TRUE(d.abort("2").ok());
}

// Push: each stage is written once its layers' events completed (this
// process's events: the prefill's own copies wait on them).
TEST_F(WorkerBoundaryTest, AStreamedDeviceLayerIsPushedOnlyAfterItsProducersEvent) {
  auto prefill = instance(on_device("prefill", TransferMode::kPush, RemoteAccess::kNone));
  auto decode = instance(on_device("decode", TransferMode::kPush, RemoteAccess::kWrite));
  ConnectorWorker& p = *prefill[0]->worker;
  ConnectorWorker& d = *decode[0]->worker;
  ASSERT_TRUE(d.add_remote("prefill", addresses(prefill)).ok());
  ASSERT_TRUE(p.add_remote("decode", addresses(decode)).ok());
  ASSERT_TRUE(p.add_remote("prefill", addresses(prefill)).ok());
  Producer producer(*prefill[0]);
  const std::vector<std::string> layers = layer_order(prefill[0]->layout);
  ASSERT_TRUE(d.start_load("3", "prefill", request(), LoadOptions::streaming(true)).ok());
  ASSERT_TRUE(p.push("3", "decode", request(), LoadOptions::streaming(true)).ok());
  for (size_t l = 0; l < layers.size(); ++l) {
    Readiness ready;
    ready.event = producer.queue(l, request(), 30ms).second;
    ASSERT_TRUE(p.save_layer("3", layers[l], ready).ok()) << layers[l];
  }
  LoadResult r = wait_one(d);
  ASSERT_TRUE(r.error.ok()) << r.error.to_string();
  EXPECT_EQ(bad_cells(*decode[0], request(), {layers.begin(), layers.end()}, 11), 0u);
  EXPECT_TRUE(p.wait_for_save("3", 5s).ok());
}

// A read whose blocks the prefill released before the reader's done came
// (its lease expired; the engine may give them to another request) is not
// ok, whatever the bytes say, and names why.
TEST(WorkerFinalityTest, AReadOfBlocksReleasedUnderItFailsNamingWhy) {
  auto prefill = instance(opts("prefill", 1));
  auto decode = instance(opts("decode", 1));
  for (auto& r : prefill) ASSERT_TRUE(fill_request(r->layout, request(), RequestSide::kRemote, 0, 11, r->spans).ok());
  ConnectorWorker& d = *decode[0]->worker;
  ASSERT_TRUE(d.add_remote("prefill", addresses(prefill)).ok());
  prefill[0]->worker->blocks_released("1");
  ASSERT_TRUE(d.start_load("1", "prefill", request()).ok());
  LoadResult r = wait_one(d);
  ASSERT_FALSE(r.error.ok());
  EXPECT_EQ(r.error.code(), Code::kUnavailable);
  EXPECT_NE(r.error.message().find("released the request's blocks"), std::string::npos) << r.error.to_string();
  EXPECT_EQ(r.first_bad_token, 0u);
  // Another request of the same prefill is read as before.
  ASSERT_TRUE(d.start_load("2", "prefill", request()).ok());
  r = wait_one(d);
  EXPECT_TRUE(r.error.ok()) << r.error.to_string();
}

// A reader of several prefill ranks sends each its done; the first to
// arrive can end the hold, and the engine free the blocks, before another
// arrives. The release names the readers whose done came first (their
// reads had ended while the blocks were held): a rank answers their late
// dones "held", and anyone else's "released".
TEST(WorkerFinalityTest, ALateDoneOfAReaderDoneBeforeTheReleaseIsHeldAndAnyOtherReleased) {
  auto prefill = instance(opts("prefill", 1));
  auto decode = instance(opts("decode", 1));
  for (auto& r : prefill) ASSERT_TRUE(fill_request(r->layout, request(), RequestSide::kRemote, 0, 11, r->spans).ok());
  ConnectorWorker& d = *decode[0]->worker;
  ASSERT_TRUE(d.add_remote("prefill", addresses(prefill)).ok());
  prefill[0]->worker->blocks_released("1", {"decode/r0"});
  prefill[0]->worker->blocks_released("2", {"decode/r7"});
  ASSERT_TRUE(d.start_load("1", "prefill", request()).ok());
  LoadResult r = wait_one(d);
  EXPECT_TRUE(r.error.ok()) << "a done of a reader named in the release: " << r.error.to_string();
  ASSERT_TRUE(d.start_load("2", "prefill", request()).ok());
  r = wait_one(d);
  EXPECT_EQ(r.error.code(), Code::kUnavailable) << "a done of a reader not named: " << r.error.to_string();
}

// End-to-end integrity, over host memory or device memory (hashed where it
// is, by the device's kernel: the fake runs the kernel's leaf code): a
// decode engine whose link reports reads it never made ends the load ok
// with wrong bytes; with verify_content the same load fails, naming the
// bytes that differ, and another request of the same prefill through an
// honest engine passes the check and counts its bytes.
void expect_the_content_check_to_catch_a_lying_link(bool device) {
  InstanceOptions po = opts("prefill", 1);
  po.device = device;
  auto prefill = instance(po);
  for (auto& r : prefill) ASSERT_TRUE(fill_request(r->layout, request(), RequestSide::kRemote, 0, 11, r->spans).ok());
  auto decode_with = [&](bool verify, std::string faults) {
    InstanceOptions o = opts("decode", 1);
    o.device = device;
    o.engine_faults = std::move(faults);
    o.worker.verify_content = verify;
    auto decode = instance(o);
    EXPECT_TRUE(decode[0]->worker->add_remote("prefill", addresses(prefill)).ok());
    return decode;
  };
  for (bool verify : {false, true}) {
    auto decode = decode_with(verify, "skip-copies=1");
    ConnectorWorker& d = *decode[0]->worker;
    ASSERT_TRUE(d.start_load(verify ? "2" : "1", "prefill", request()).ok());
    LoadResult r = wait_one(d);
    EXPECT_GT(bad_cells(*decode[0], request(), {}, 11), 0u) << "the lying link moved bytes";
    if (!verify) {
      EXPECT_TRUE(r.error.ok()) << "without the check, the load reports ok: " << r.error.to_string();
      continue;
    }
    ASSERT_FALSE(r.error.ok()) << "a load of bytes that never landed reported ok under verify_content";
    EXPECT_EQ(r.error.code(), Code::kIoError);
    EXPECT_NE(r.error.message().find("content check failed"), std::string::npos) << r.error.to_string();
  }
  auto decode = decode_with(true, "");
  ASSERT_TRUE(decode[0]->worker->start_load("3", "prefill", request()).ok());
  LoadResult r = wait_one(*decode[0]->worker);
  ASSERT_TRUE(r.error.ok()) << r.error.to_string();
  EXPECT_EQ(bad_cells(*decode[0], request(), {}, 11), 0u);
  EXPECT_GT(decode[0]->engine->metrics().bytes_content_checked, 0u);
}

TEST(WorkerIntegrityTest, ALoadWhoseBytesNeverLandedFailsTheContentCheck) {
  expect_the_content_check_to_catch_a_lying_link(false);
}

TEST(WorkerIntegrityTest, OverDeviceMemoryTheContentCheckHashesOnTheDevice) {
  expect_the_content_check_to_catch_a_lying_link(true);
}

// A done lost on the way is asked again: the load ends ok, and the prefill
// hears the reader once.
TEST(WorkerFinalityTest, ALostDoneIsAskedAgainAndTheReaderCountedOnce) {
  auto prefill = instance(opts("prefill", 1));
  InstanceOptions o = opts("decode", 1);
  o.engine_faults = "drop-done=1";
  o.worker.heartbeat_interval = 100ms;
  auto decode = instance(o);
  for (auto& r : prefill) ASSERT_TRUE(fill_request(r->layout, request(), RequestSide::kRemote, 0, 11, r->spans).ok());
  ConnectorWorker& d = *decode[0]->worker;
  ASSERT_TRUE(d.add_remote("prefill", addresses(prefill)).ok());
  PrefillScheduler hold(10s);
  ASSERT_TRUE(hold.hold("1", SteadyTime(std::chrono::steady_clock::now())).ok());
  ASSERT_TRUE(d.start_load("1", "prefill", request()).ok());
  LoadResult r = wait_one(d);
  ASSERT_TRUE(r.error.ok()) << r.error.to_string();
  EXPECT_EQ(bad_cells(*decode[0], request(), {}, 11), 0u);
  std::vector<Release> released;
  for (int i = 0; i < 200 && released.empty(); ++i) {
    for (const ReaderEvent& e : prefill[0]->worker->take_reader_events()) {
      EXPECT_EQ(e.readers, 1u);
      hold.on_event(e, std::chrono::steady_clock::now());
    }
    released = hold.take_releases(std::chrono::steady_clock::now());
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(released.size(), 1u);
  EXPECT_EQ(released[0].reason, ReleaseReason::kRead);
}

// Membership: the same instance at new addresses (a restart) is read after
// add_remote() replaces them; a load that names the old process's
// incarnation fails naming both; a removed instance takes no loads.
TEST(WorkerMembershipTest, ARestartedInstanceIsReadAgainAndItsOldIncarnationIsNamed) {
  auto decode = instance(opts("decode", 1));
  ConnectorWorker& d = *decode[0]->worker;
  std::string old_incarnation;
  {
    auto prefill = instance(opts("prefill", 1));
    ASSERT_TRUE(fill_request(prefill[0]->layout, request(), RequestSide::kRemote, 0, 11, prefill[0]->spans).ok());
    old_incarnation = prefill[0]->worker->incarnation();
    ASSERT_TRUE(d.add_remote("prefill", addresses(prefill)).ok());
    ASSERT_TRUE(d.start_load("1", "prefill", request()).ok());
    LoadResult r = wait_one(d);
    ASSERT_TRUE(r.error.ok()) << r.error.to_string();
  }
  auto prefill = instance(opts("prefill", 1));
  ASSERT_TRUE(fill_request(prefill[0]->layout, request(), RequestSide::kRemote, 0, 12, prefill[0]->spans).ok());
  ASSERT_NE(prefill[0]->worker->incarnation(), old_incarnation);
  ASSERT_TRUE(d.add_remote("prefill", addresses(prefill)).ok());  // it moved: the new addresses replace the old
  LoadOptions named;
  named.incarnations = {prefill[0]->worker->incarnation()};
  ASSERT_TRUE(d.start_load("2", "prefill", request(), named).ok());
  LoadResult r = wait_one(d);
  ASSERT_TRUE(r.error.ok()) << r.error.to_string();
  EXPECT_EQ(bad_cells(*decode[0], request(), {}, 12), 0u);
  // A hand-off by the old process: its KV went with it.
  named.incarnations = {old_incarnation};
  ASSERT_TRUE(d.start_load("3", "prefill", request(), named).ok());
  r = wait_one(d);
  ASSERT_EQ(r.error.code(), Code::kUnavailable) << r.error.to_string();
  EXPECT_NE(r.error.message().find(old_incarnation), std::string::npos) << r.error.to_string();
  EXPECT_NE(r.error.message().find(prefill[0]->worker->incarnation()), std::string::npos) << r.error.to_string();
  EXPECT_NE(r.error.message().find("restarted"), std::string::npos) << r.error.to_string();
  // Removed: no more loads from it.
  ASSERT_TRUE(d.remove_remote("prefill").ok());
  EXPECT_EQ(d.start_load("4", "prefill", request()).code(), Code::kNotFound);
  EXPECT_EQ(d.remove_remote("prefill").code(), Code::kNotFound);
}

// A hand-off that names other addresses than the instance's (its ranks
// moved) is read from them without disturbing the instance's own; one whose
// addresses are gone fails on its own, saying how the instance answers now.
TEST(WorkerMembershipTest, AHandOffAtOtherAddressesIsReadThereWithoutReplacingTheInstances) {
  auto decode = instance(opts("decode", 1));
  ConnectorWorker& d = *decode[0]->worker;
  auto first = instance(opts("prefill", 1));
  ASSERT_TRUE(fill_request(first[0]->layout, request(), RequestSide::kRemote, 0, 21, first[0]->spans).ok());
  ASSERT_TRUE(d.add_remote("prefill", addresses(first)).ok());
  std::vector<std::string> gone;
  std::string gone_incarnation;
  {
    auto second = instance(opts("prefill", 1));
    ASSERT_TRUE(fill_request(second[0]->layout, request(), RequestSide::kRemote, 0, 22, second[0]->spans).ok());
    LoadOptions at;
    at.addresses = addresses(second);
    at.incarnations = {second[0]->worker->incarnation()};
    ASSERT_TRUE(d.start_load("1", "prefill", request(), at).ok());
    LoadResult r = wait_one(d);
    ASSERT_TRUE(r.error.ok()) << r.error.to_string();
    EXPECT_EQ(bad_cells(*decode[0], request(), {}, 22), 0u);
    gone = at.addresses;
    gone_incarnation = at.incarnations[0];
  }
  // The instance's own addresses still serve.
  ASSERT_TRUE(d.start_load("2", "prefill", request()).ok());
  LoadResult r = wait_one(d);
  ASSERT_TRUE(r.error.ok()) << r.error.to_string();
  EXPECT_EQ(bad_cells(*decode[0], request(), {}, 21), 0u);
  LoadOptions at;
  at.addresses = gone;
  at.incarnations = {gone_incarnation};
  ASSERT_TRUE(d.start_load("3", "prefill", request(), at).ok());
  r = wait_one(d);
  ASSERT_FALSE(r.error.ok());
  EXPECT_NE(r.error.message().find("cannot be reached"), std::string::npos) << r.error.to_string();
  EXPECT_NE(r.error.message().find(first[0]->worker->incarnation()), std::string::npos) << r.error.to_string();
}

// An address listed under an instance's name whose rank says it belongs to
// another instance is refused by name: nothing is read from it.
TEST(WorkerMembershipTest, ARankListedUnderAnotherInstancesNameIsRefused) {
  auto other = instance(opts("prefill-b", 1));
  auto decode = instance(opts("decode", 1));
  ConnectorWorker& d = *decode[0]->worker;
  ASSERT_TRUE(d.add_remote("prefill-a", addresses(other)).ok());
  ASSERT_TRUE(d.start_load("1", "prefill-a", request()).ok());
  LoadResult r = wait_one(d);
  ASSERT_EQ(r.error.code(), Code::kIncompatible) << r.error.to_string();
  EXPECT_NE(r.error.message().find("is a rank of instance 'prefill-b', not 'prefill-a'"), std::string::npos)
      << r.error.to_string();
}

}  // namespace
}  // namespace kvbridge
