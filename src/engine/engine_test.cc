// The engine as a whole, over the local transport: creation, registration
// through metadata, transport choice, and the Prometheus text. The transfer
// behaviour is in tests/conformance.
#include <gtest/gtest.h>

#include <algorithm>
#include <thread>

#include "engine/engine_impl.h"
#include "engine/metadata.h"
#include "kvbridge/engine.h"

namespace kvbridge {
namespace {

std::unique_ptr<Engine> make(const std::string& name, std::vector<std::string> transports = {"local"}) {
  EngineOptions o;
  o.name = name;
  o.transports = std::move(transports);
  Result<std::unique_ptr<Engine>> e = Engine::create(o);
  EXPECT_TRUE(e.ok()) << e.error().to_string();
  return e.ok() ? std::move(*e) : nullptr;
}

// Engine `a` (with `options`) connected to engine `b`, each with a 4 KiB
// buffer registered: x (a's, all 1) and y (b's, all 2).
struct LocalPair {
  explicit LocalPair(EngineOptions options = {}) {
    options.name = "a";
    options.transports = {"local"};
    Result<std::unique_ptr<Engine>> e = Engine::create(options);
    EXPECT_TRUE(e.ok()) << e.error().to_string();
    a = std::move(*e);
    b = make("b");
    rx = *a->register_memory(x.data(), x.size());
    ry = *b->register_memory(y.data(), y.size());
    peer = *a->connect(b->metadata());
  }
  std::unique_ptr<Engine> a, b;
  std::vector<uint8_t> x = std::vector<uint8_t>(4096, 1), y = std::vector<uint8_t>(4096, 2);
  RegionId rx = 0, ry = 0;
  PeerId peer = 0;
};

TEST(EngineTest, UnknownOrUnavailableTransportsAreRefusedAtCreate) {
  EngineOptions o;
  o.transports = {"carrier-pigeon"};
  Result<std::unique_ptr<Engine>> e = Engine::create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.error().code(), Code::kInvalidArgument);
  EXPECT_NE(e.error().message().find("carrier-pigeon"), std::string::npos);
  // Asking for a transport that cannot run here is refused with its reason;
  // one that can must start. ucx is either, depending on the build.
  Result<std::unique_ptr<Engine>> any = Engine::create(EngineOptions{});
  ASSERT_TRUE(any.ok()) << any.error().to_string();
  for (const TransportReport& t : (*any)->transports()) {
    o.transports = {t.name};
    e = Engine::create(o);
    if (t.available) {
      EXPECT_TRUE(e.ok()) << t.name << ": " << e.error().to_string();
    } else {
      ASSERT_FALSE(e.ok()) << t.name;
      EXPECT_EQ(e.error().code(), Code::kUnavailable);
      EXPECT_NE(e.error().message().find(t.name), std::string::npos) << e.error().to_string();
    }
  }
  o.transports = {"local", "local"};
  EXPECT_EQ(Engine::create(o).error().code(), Code::kInvalidArgument);
}

TEST(EngineTest, DefaultTransportsReportWhatIsMissingAndWhy) {
  EngineOptions o;
  Result<std::unique_ptr<Engine>> e = Engine::create(o);
  ASSERT_TRUE(e.ok()) << e.error().to_string();
  std::vector<TransportReport> reports = (*e)->transports();
  ASSERT_EQ(reports.size(), 5u);  // local, cuda_ipc, cma, tcp, ucx
  EXPECT_EQ(reports[0].name, "local");
  EXPECT_TRUE(reports[0].available);
  for (const TransportReport& r : reports) {
    EXPECT_TRUE(r.available || !r.reason.empty()) << r.name;
  }
}

// UCX's listener takes no part in the secret: with one, ucx runs only when
// asked for by name on a network declared trusted.
TEST(EngineTest, WithASecretUcxIsLeftOutUnlessItsNetworkIsTrusted) {
  EngineOptions o;
  o.secret = "0123456789abcdef0123456789abcdef";
  Result<std::unique_ptr<Engine>> e = Engine::create(o);
  ASSERT_TRUE(e.ok()) << e.error().to_string();
  bool reported = false;
  for (const TransportReport& r : (*e)->transports()) {
    if (r.name != "ucx") continue;
    reported = true;
    EXPECT_FALSE(r.available);
    EXPECT_NE(r.reason.find("shared secret"), std::string::npos) << r.reason;
  }
  EXPECT_TRUE(reported);
  // The metadata offers no ucx address to peers.
  Result<engine_internal::EngineMetadata> m = engine_internal::decode_metadata((*e)->metadata());
  ASSERT_TRUE(m.ok()) << m.error().to_string();
  for (const auto& t : m->transports) EXPECT_NE(t.name, "ucx");

  o.transports = {"ucx"};
  e = Engine::create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.error().code(), Code::kInvalidArgument);
  EXPECT_NE(e.error().message().find("ucx_trusted_network"), std::string::npos) << e.error().to_string();

  // Declared trusted, it starts where UCX can run, and where it cannot it
  // is refused for that reason, not for the secret. Without a secret, the
  // same as without the flag.
  o.ucx_trusted_network = true;
  e = Engine::create(o);
  if (!e.ok()) {
    EXPECT_EQ(e.error().code(), Code::kUnavailable) << e.error().to_string();
    EXPECT_EQ(e.error().message().find("secret"), std::string::npos) << e.error().to_string();
  }
  const bool ucx_runs = e.ok();
  o.secret.clear();
  o.ucx_trusted_network = false;
  EXPECT_EQ(Engine::create(o).ok(), ucx_runs);
}

TEST(EngineTest, DescribeMetadataNamesTheEngineAndRefusesWhatIsNotMetadata) {
  std::unique_ptr<Engine> a = make("a");
  std::unique_ptr<Engine> b = make("a");  // the same name, another engine
  Result<EngineLabel> la = describe_metadata(a->metadata());
  Result<EngineLabel> lb = describe_metadata(b->metadata());
  ASSERT_TRUE(la.ok()) << la.error().to_string();
  ASSERT_TRUE(lb.ok()) << lb.error().to_string();
  EXPECT_EQ(la->name, "a");
  EXPECT_EQ(la->instance, a->instance());
  EXPECT_EQ(lb->instance, b->instance());
  EXPECT_NE(la->instance, lb->instance);
  Result<EngineLabel> bad = describe_metadata("not metadata");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code(), Code::kInvalidArgument) << bad.error().to_string();
  const std::string cut = a->metadata().substr(0, 10);
  Result<EngineLabel> short_one = describe_metadata(cut);
  ASSERT_FALSE(short_one.ok());
  EXPECT_NE(short_one.error().message().find("metadata"), std::string::npos) << short_one.error().to_string();
  EXPECT_EQ(describe_metadata(std::string(kMaxEngineMetadataBytes + 1, 'x')).error().code(), Code::kResourceExhausted);
}

TEST(EngineTest, MetadataDescribesMergedSegmentsAndEveryRegion) {
  std::unique_ptr<Engine> e = make("a");
  std::vector<uint8_t> memory(1 << 16);
  RegionId whole = *e->register_memory(memory.data(), memory.size());
  RegionId view = *e->register_memory(memory.data() + 100, 1000);
  EXPECT_EQ(*e->register_memory(memory.data() + 100, 1000), view);
  Result<engine_internal::EngineMetadata> m = engine_internal::decode_metadata(e->metadata());
  ASSERT_TRUE(m.ok()) << m.error().to_string();
  EXPECT_EQ(m->name, "a");
  EXPECT_EQ(m->segments.size(), 1u);
  ASSERT_EQ(m->regions.size(), 2u);
  EXPECT_EQ(m->find_region(view)->bytes, 1000u);
  EXPECT_EQ(m->find_region(whole)->segment, m->find_region(view)->segment);
  EXPECT_LE(e->metadata().size(), kMaxEngineMetadataBytes);
  EXPECT_TRUE(e->deregister_memory(view).ok());
  EXPECT_TRUE(e->deregister_memory(view).ok());
  EXPECT_EQ(e->deregister_memory(view).code(), Code::kNotFound);
}

TEST(EngineTest, MalformedOrIncompatibleMetadataIsRejectedAtConnect) {
  std::unique_ptr<Engine> e = make("a");
  EXPECT_EQ(e->connect("").error().code(), Code::kInvalidArgument);
  EXPECT_EQ(e->connect("garbage that is not metadata").error().code(), Code::kInvalidArgument);
  std::string md = make("b")->metadata();
  md[4] = 9;  // version
  Result<PeerId> p = e->connect(md);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.error().code(), Code::kIncompatible);
}

TEST(EngineTest, NoSharedTransportListsBothSidesAndTheReasons) {
  std::unique_ptr<Engine> a = make("a", {"local"});
  std::unique_ptr<Engine> b = make("b", {"tcp"});
  Result<PeerId> p = a->connect(b->metadata());
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.error().code(), Code::kUnavailable);
  const std::string& m = p.error().message();
  EXPECT_NE(m.find("this engine offers [local]"), std::string::npos) << m;
  EXPECT_NE(m.find("the peer offers [tcp]"), std::string::npos) << m;
  EXPECT_NE(m.find("local: the peer does not offer it"), std::string::npos) << m;
}

TEST(EngineTest, LocalRefusesAPeerInAnotherProcess) {
  std::unique_ptr<Engine> a = make("a");
  Result<engine_internal::EngineMetadata> m = engine_internal::decode_metadata(make("b")->metadata());
  ASSERT_TRUE(m.ok());
  m->pid += 1;
  Result<PeerId> p = a->connect(*engine_internal::encode_metadata(*m));
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.error().message().find("not this process"), std::string::npos) << p.error().to_string();
}

// Whether a peer is still there is a cheap question, answered from the
// control connection: OK while open, the engine's word once it is gone.
TEST(EngineTest, PeerStatusSaysWhenAPeerIsGone) {
  LocalPair p;
  EXPECT_TRUE(p.a->peer_status(p.peer).ok());
  EXPECT_EQ(p.a->peer_status(p.peer + 100).code(), Code::kNotFound);
  p.b.reset();
  Status s;
  for (int i = 0; i < 500; ++i) {
    s = p.a->peer_status(p.peer);
    if (!s.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(s.code(), Code::kIoError) << s.to_string();
  EXPECT_NE(s.message().find("'b'"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("gone"), std::string::npos) << s.to_string();
}

TEST(EngineTest, PrometheusTextCountsTransfers) {
  LocalPair p;
  TransferItem item{p.rx, 0, p.ry, 0, 4096};
  TransferId id = *p.a->submit(p.peer, TransferOp::kRead, std::span<const TransferItem>(&item, 1));
  EXPECT_EQ(p.a->wait(id, std::chrono::seconds(30)).state, TransferState::kDone);
  EXPECT_EQ(p.x[4095], 2);
  const std::string text = p.a->metrics_prometheus();
  EXPECT_NE(text.find("kvbridge_transfers_total{state=\"done\"} 1"), std::string::npos) << text;
  EXPECT_NE(text.find("kvbridge_bytes_total{op=\"read\"} 4096"), std::string::npos) << text;
  EXPECT_NE(text.find("kvbridge_transfer_latency_seconds_count 1"), std::string::npos) << text;
  EXPECT_EQ(transfer_state_name(TransferState::kCancelled), "cancelled");
}

// EngineOptions::inline_bytes: a small transfer on a same-host transport has
// ended when submit() returns; a larger one, or one with a notification,
// goes to the engine's threads and still completes.
TEST(EngineTest, SmallSameHostTransfersHaveEndedWhenSubmitReturns) {
  std::unique_ptr<Engine> a = make("a");
  std::unique_ptr<Engine> b = make("b");
  std::vector<uint8_t> x(1 << 20, 1), y(1 << 20, 2);
  RegionId rx = *a->register_memory(x.data(), x.size());
  RegionId ry = *b->register_memory(y.data(), y.size());
  PeerId peer = *a->connect(b->metadata());
  TransferItem small{rx, 0, ry, 0, 4096};
  TransferId id = *a->submit(peer, TransferOp::kRead, std::span<const TransferItem>(&small, 1));
  TransferStatus st = a->status(id);
  EXPECT_EQ(st.state, TransferState::kDone);
  EXPECT_EQ(st.bytes_done, 4096u);
  EXPECT_EQ(x[0], 2);
  EXPECT_EQ(x[4095], 2);
  EXPECT_EQ(x[4096], 1);
  EXPECT_TRUE(a->release(id).ok());
  // Above inline_bytes (256 KiB): queued, done by wait().
  TransferItem large{rx, 0, ry, 0, 1 << 20};
  std::fill(y.begin(), y.end(), uint8_t{3});
  id = *a->submit(peer, TransferOp::kRead, std::span<const TransferItem>(&large, 1));
  EXPECT_EQ(a->wait(id, std::chrono::seconds(30)).state, TransferState::kDone);
  EXPECT_EQ(x[(1 << 20) - 1], 3);
  // With a notification: the notification is sent after the bytes, by a
  // worker (it waits for the peer's acknowledgement).
  id = *a->submit(peer, TransferOp::kWrite, std::span<const TransferItem>(&small, 1), "note");
  EXPECT_EQ(a->wait(id, std::chrono::seconds(30)).state, TransferState::kDone);
  std::vector<Notification> got;
  for (int i = 0; i < 300 && got.empty(); ++i) {
    got = b->take_notifications();
    if (got.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].message, "note");
  EngineMetrics m = a->metrics();
  EXPECT_EQ(m.transfers_submitted, 3u);
  EXPECT_EQ(m.transfers_done, 3u);
}

// Bound to every interface, an engine tells peers the address they can dial;
// without one to tell, it refuses to start.
TEST(EngineTest, AWildcardBindAdvertisesTheGivenAddressOrIsRefused) {
  std::vector<uint8_t> x(8192, 1), y(8192, 2);  // registered below: they outlive both engines
  EngineOptions o;
  o.name = "wild";
  o.transports = {"tcp"};
  o.host = "0.0.0.0";
  Result<std::unique_ptr<Engine>> refused = Engine::create(o);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code(), Code::kInvalidArgument);
  EXPECT_NE(refused.error().message().find("give advertise_host"), std::string::npos) << refused.error().to_string();
  o.advertise_host = "0.0.0.0";
  EXPECT_FALSE(Engine::create(o).ok()) << "a wildcard advertised";
  o.advertise_host = "127.0.0.1:80";
  EXPECT_FALSE(Engine::create(o).ok()) << "a port advertised";
  o.advertise_host = "127.0.0.1";
  Result<std::unique_ptr<Engine>> a = Engine::create(o);
  ASSERT_TRUE(a.ok()) << a.error().to_string();
  Result<engine_internal::EngineMetadata> m = engine_internal::decode_metadata((*a)->metadata());
  ASSERT_TRUE(m.ok()) << m.error().to_string();
  EXPECT_EQ(m->control_address.find("0.0.0.0"), std::string::npos) << m->control_address;
  EXPECT_EQ(m->control_address.rfind("127.0.0.1:", 0), 0u) << m->control_address;
  for (const auto& t : m->transports) EXPECT_EQ(t.address.find("0.0.0.0"), std::string::npos) << t.address;
  // A peer dials the advertised addresses and moves bytes over tcp.
  std::unique_ptr<Engine> b = make("b", {"tcp"});
  RegionId rx = *(*a)->register_memory(x.data(), x.size());
  RegionId ry = *b->register_memory(y.data(), y.size());
  Result<PeerId> peer = b->connect((*a)->metadata());
  ASSERT_TRUE(peer.ok()) << peer.error().to_string();
  TransferItem item{ry, 0, rx, 0, 8192};
  Result<TransferId> id = b->submit(*peer, TransferOp::kRead, std::span<const TransferItem>(&item, 1), "read it");
  ASSERT_TRUE(id.ok()) << id.error().to_string();
  EXPECT_EQ(b->wait(*id, std::chrono::seconds(30)).state, TransferState::kDone);
  EXPECT_EQ(y[0], 1);
  EXPECT_EQ(y[8191], 1);
}

TEST(EngineTest, InlineBytesZeroRunsEverythingOnTheEngineThreads) {
  EngineOptions o;
  o.inline_bytes = 0;
  LocalPair p(o);
  TransferItem item{p.rx, 0, p.ry, 0, 4096};
  for (int i = 0; i < 50; ++i) {
    TransferId id = *p.a->submit(p.peer, TransferOp::kRead, std::span<const TransferItem>(&item, 1));
    ASSERT_EQ(p.a->wait(id, std::chrono::seconds(30)).state, TransferState::kDone);
    ASSERT_TRUE(p.a->release(id).ok());
  }
  EXPECT_EQ(p.x[4095], 2);
}

// Items adjacent on both sides are merged into one copy; items adjacent on
// one side only, out of order, or repeated are not. Every byte lands where
// its item says, and metrics count the items as submitted.
TEST(EngineTest, AdjacentItemsMergeWithoutChangingWhatLandsWhere) {
  for (uint64_t inline_bytes : {uint64_t{0}, uint64_t{256} << 10}) {
    EngineOptions o;
    o.name = "a";
    o.transports = {"local"};
    o.inline_bytes = inline_bytes;
    std::unique_ptr<Engine> a = std::move(*Engine::create(o));
    std::unique_ptr<Engine> b = make("b");
    constexpr uint64_t kSize = 64 * 1024;
    std::vector<uint8_t> x(kSize, 0), y(kSize);
    for (uint64_t i = 0; i < kSize; ++i) y[i] = static_cast<uint8_t>(i * 7 + i / 251);
    RegionId rx = *a->register_memory(x.data(), x.size());
    RegionId ry = *b->register_memory(y.data(), y.size());
    PeerId peer = *a->connect(b->metadata());
    const std::vector<TransferItem> items = {
        {rx, 0, ry, 0, 1000},         {rx, 1000, ry, 1000, 24},      // adjacent on both sides
        {rx, 1024, ry, 1024, 1024},                                  // and again
        {rx, 2048, ry, 8192, 512},                                   // adjacent locally only
        {rx, 2560, ry, 8704, 512},                                   // adjacent on both again
        {rx, 4096, ry, 3072, 1024},                                  // adjacent remotely only
        {rx, 8192, ry, 16384, 100},   {rx, 8292, ry, 16384, 100},    // the same remote bytes twice
        {rx, 20000, ry, 30000, 4000}, {rx, 16000, ry, 26000, 4000},  // adjacent, but in reverse order
    };
    TransferId id = *a->submit(peer, TransferOp::kRead, items);
    ASSERT_EQ(a->wait(id, std::chrono::seconds(30)).state, TransferState::kDone);
    std::vector<uint8_t> want(kSize, 0);
    for (const TransferItem& it : items)
      std::copy_n(y.begin() + it.remote_offset, it.bytes, want.begin() + it.local_offset);
    EXPECT_TRUE(x == want) << "inline_bytes " << inline_bytes;
    EXPECT_EQ(a->metrics().descriptors, items.size());
  }
}

// A grant given as ranges and repeats of them (a request's blocks in one
// tensor, and again in another tensor and another layer), served over tcp:
// a write inside any of its places lands, one outside is refused and
// nothing of it lands; a repeat that is not of the list, of one region, or
// inside its region is refused when granted.
TEST(EngineTest, GrantedWritesTakeRepeatsAndLandOnlyInTheirPlaces) {
  constexpr uint64_t kBlock = 512;
  std::vector<uint8_t> x(8192, 7), k(8192, 0), v(8192, 0);
  std::unique_ptr<Engine> writer = make("prefill", {"tcp"});
  std::unique_ptr<Engine> decode = make("decode", {"tcp"});
  ASSERT_TRUE(writer && decode);
  const RegionId rx = *writer->register_memory(x.data(), x.size());
  const RegionId rk = *decode->register_memory(k.data(), k.size(), "host", RemoteAccess::kGrantedWrite);
  const RegionId rv = *decode->register_memory(v.data(), v.size(), "host", RemoteAccess::kGrantedWrite);
  const PeerId to_decode = *writer->connect(decode->metadata());
  const PeerId to_writer = *decode->connect(writer->metadata());
  // Blocks 1 and 3 of layer 0 (the first 4 KiB) of k, of v, and of layer 1.
  const std::vector<WriteGrant> blocks = {{rk, 1 * kBlock, kBlock}, {rk, 3 * kBlock, kBlock}};
  const std::vector<GrantRepeat> repeats = {{0, 2, rv, 0}, {0, 2, rk, 4096}, {0, 2, rv, 4096}};
  Result<GrantId> g = decode->grant_writes(to_writer, blocks, repeats);
  ASSERT_TRUE(g.ok()) << g.error().to_string();
  auto write = [&](RegionId region, uint64_t offset, uint64_t bytes) {
    const TransferItem item{rx, 0, region, offset, bytes};
    Result<TransferId> id = writer->submit(to_decode, TransferOp::kWrite, std::span<const TransferItem>(&item, 1));
    EXPECT_TRUE(id.ok()) << id.error().to_string();
    return id.ok() ? writer->wait(*id, std::chrono::seconds(30)) : TransferStatus{};
  };
  for (auto [region, offset] : {std::pair{rk, 512}, {rk, 1536}, {rv, 512}, {rv, 1536}, {rk, 4608}, {rv, 5632}}) {
    EXPECT_EQ(write(region, offset, kBlock).state, TransferState::kDone) << "region " << region << " at " << offset;
  }
  EXPECT_EQ(k[512], 7);
  EXPECT_EQ(v[5632 + 511], 7);
  for (auto [region, offset] : {std::pair{rk, 0}, {rv, 1024}, {rk, 4096}, {rv, 4096 + 2048}, {rk, 1536 + 256}}) {
    const TransferStatus st = write(region, offset, kBlock);
    EXPECT_EQ(st.state, TransferState::kFailed) << "region " << region << " at " << offset;
    EXPECT_EQ(st.error.code(), Code::kPermissionDenied) << st.error.to_string();
  }
  EXPECT_EQ(k[0], 0);
  EXPECT_EQ(v[1024], 0);
  EXPECT_EQ(k[4096], 0);
  EXPECT_EQ(k[1536 + kBlock], 0) << "nothing of a write partly outside lands";
  decode->revoke_writes(*g);
  EXPECT_EQ(write(rv, 5632, kBlock).error.code(), Code::kPermissionDenied) << "revoked";

  auto refused = [&](std::vector<WriteGrant> ranges, std::vector<GrantRepeat> r) {
    Result<GrantId> made = decode->grant_writes(to_writer, ranges, r);
    return made.ok() ? Status() : made.error();
  };
  EXPECT_EQ(refused(blocks, {{1, 2, rv, 0}}).code(), Code::kInvalidArgument) << "past the list";
  EXPECT_EQ(refused(blocks, {{0, 0, rv, 0}}).code(), Code::kInvalidArgument) << "no ranges";
  Status mixed = refused({{rk, 0, kBlock}, {rv, 0, kBlock}}, {{0, 2, rv, 4096}});
  EXPECT_EQ(mixed.code(), Code::kInvalidArgument);
  EXPECT_NE(mixed.message().find("of one region"), std::string::npos) << mixed.to_string();
  Status past = refused(blocks, {{0, 2, rv, 8192 - 3 * kBlock}});
  EXPECT_EQ(past.code(), Code::kOutOfRange) << past.to_string();
  EXPECT_NE(past.message().find("repeat 0"), std::string::npos) << past.to_string();
  EXPECT_EQ(refused(blocks, {{0, 2, rv, static_cast<uint64_t>(-1024)}}).code(), Code::kOutOfRange) << "below 0";
  EXPECT_TRUE(refused(blocks, {{0, 2, rv, static_cast<uint64_t>(-512)}}).ok()) << "a shift down, inside";
  EXPECT_EQ(refused(blocks, {{0, 2, 999, 0}}).code(), Code::kNotFound);
}

}  // namespace
}  // namespace kvbridge
