// What is particular to the tcp transport: its address blob, the server's
// bounds and access checks (its grants: tcp_grant_test.cc), stale
// instances, the secret, and hand-written peers that misbehave, with two
// transports in one process over loopback.
// What every Link must do (sizes, batches, concurrency, cancel, deadlines,
// a killed peer) is the Link conformance suite's (tests/conformance/link/).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <thread>

#include "net/opening.h"
#include "net/socket.h"
#include "net/wire.h"
#include "testing/link_run.h"
#include "testing/pattern.h"
#include "transport/copies.h"
#include "transport/tcp/tcp_link.h"
#include "transport/tcp/tcp_protocol.h"
#include "transport/tcp/tcp_server.h"
#include "transport/transport.h"

namespace kvbridge::transport {
namespace {

using namespace std::chrono_literals;

using testing::pattern;

class TcpTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kSegmentBytes = uint64_t{4} << 20;

  void SetUp() override {
    auto server = make_tcp_transport("127.0.0.1", 4, "");
    ASSERT_TRUE(server.ok()) << server.error().to_string();
    server_ = std::move(*server);
    auto client = make_tcp_transport("127.0.0.1", 4, "");
    ASSERT_TRUE(client.ok()) << client.error().to_string();
    client_ = std::move(*client);
    remote_.resize(kSegmentBytes);
    for (uint64_t i = 0; i < remote_.size(); ++i) remote_[i] = pattern(i);
    local_.assign(kSegmentBytes, 0);
    ASSERT_TRUE(server_->add_segment(Segment{7, remote_.data(), remote_.size(), "host", 3}).ok());
    auto link = client_->connect(peer());
    ASSERT_TRUE(link.ok()) << link.error().to_string();
    link_ = std::move(*link);
  }

  PeerInfo peer() const {
    PeerInfo p;
    p.name = "server";
    p.address = server_->address();
    p.segments.push_back({7, reinterpret_cast<uint64_t>(remote_.data()), remote_.size(), ""});
    return p;
  }

  Copy copy(uint64_t local_offset, uint64_t remote_offset, uint64_t bytes) {
    return Copy{local_.data() + local_offset, reinterpret_cast<uint64_t>(remote_.data()) + remote_offset, bytes, 7};
  }

  Status run(TransferOp op, const std::vector<Copy>& copies, std::chrono::milliseconds timeout = 20s) {
    return testing::run_link(*link_, op, copies, timeout);
  }

  // A link over one stream, so which stream a run takes is known.
  std::unique_ptr<Link> single_stream_link() {
    auto t = make_tcp_transport("127.0.0.1", 1, "");
    EXPECT_TRUE(t.ok());
    single_ = std::move(*t);
    auto link = single_->connect(peer());
    EXPECT_TRUE(link.ok()) << link.error().to_string();
    return link.ok() ? std::move(*link) : nullptr;
  }

  // Memory first: it must outlive the transports, whose server threads may
  // still be finishing a frame that a cancelled client abandoned.
  std::vector<uint8_t> remote_, local_;
  std::unique_ptr<Transport> server_, client_, single_;
  std::unique_ptr<Link> link_;
};

TEST_F(TcpTest, AddressCarriesHostPortAndInstance) {
  std::string a = server_->address();
  EXPECT_EQ(a.rfind("127.0.0.1:", 0), 0u) << a;
  EXPECT_TRUE(server_->can_reach(peer()).ok());
  PeerInfo bad = peer();
  bad.address = "nonsense";
  EXPECT_EQ(server_->can_reach(bad).code(), Code::kInvalidArgument);
}

TEST_F(TcpTest, ServerRejectsRangesOutsideItsSegmentsAndStaysUsable) {
  // The engine would never post these; a buggy or hostile peer might.
  Status s = run(TransferOp::kRead, {copy(0, kSegmentBytes - 10, 11)});
  EXPECT_EQ(s.code(), Code::kOutOfRange) << s.to_string();
  EXPECT_NE(s.message().find("server"), std::string::npos) << s.message();
  Copy unknown = copy(0, 0, 16);
  unknown.segment = 99;
  EXPECT_EQ(run(TransferOp::kRead, {unknown}).code(), Code::kOutOfRange);
  std::vector<uint8_t> before(remote_.begin(), remote_.begin() + 64);
  Copy write_past = copy(0, kSegmentBytes - 8, 64);
  EXPECT_EQ(run(TransferOp::kWrite, {copy(0, 0, 64), write_past}).code(), Code::kOutOfRange);
  EXPECT_TRUE(std::equal(before.begin(), before.end(), remote_.begin())) << "nothing of a rejected frame lands";
  ASSERT_TRUE(run(TransferOp::kRead, {copy(0, 100, 1000)}).ok());
  EXPECT_TRUE(std::equal(local_.begin(), local_.begin() + 1000, remote_.begin() + 100));
}

TEST_F(TcpTest, RemovedSegmentIsNoLongerServed) {
  ASSERT_TRUE(server_->remove_segment(7).ok());
  EXPECT_EQ(run(TransferOp::kRead, {copy(0, 0, 10)}).code(), Code::kOutOfRange);
}

// A run whose pooled stream a server that is gone closed dials afresh and is
// refused at once: an error, not a wait until the deadline. (A peer killed
// mid-run is the Link suite's.)
TEST_F(TcpTest, AfterTheServerIsGoneTheNextDialIsRefusedAtOnce) {
  link_ = single_stream_link();
  ASSERT_TRUE(run(TransferOp::kRead, {copy(0, 0, 4096)}).ok());
  server_.reset();  // closes every stream and the listener
  for (int i = 0; i < 2; ++i) {
    auto start = Clock::now();
    Status again = run(TransferOp::kRead, {copy(0, 0, 10)}, 2s);
    EXPECT_EQ(again.code(), Code::kUnavailable) << again.to_string();
    EXPECT_NE(again.message().find("'server'"), std::string::npos) << again.message();
    EXPECT_NE(again.message().find("Connection refused"), std::string::npos) << again.to_string();
    EXPECT_LT(Clock::now() - start, 1s);
  }
}

// Stronger than the Link contract (nothing leaves local memory after the
// end), as ucx: a cancelled write finishes the frame it is sending and waits
// for the acknowledgement of every frame sent before run() returns, so the
// peer's memory does not change afterwards (its server writes a frame's
// bytes as they arrive, so frames still in the socket would land late).
// The stream stays open for the next run.
TEST_F(TcpTest, CancelledWriteLandsNothingAfterReturn) {
  link_ = single_stream_link();  // one server thread: the writes below overlap, in order
  for (size_t i = 0; i < local_.size(); ++i) local_[i] = static_cast<uint8_t>(i >> 20);
  // 4 GiB of 1 MiB writes (long enough to stop mid-way), each remote MiB
  // getting another local MiB than the write before it, so a late one shows.
  std::vector<Copy> copies;
  for (size_t i = 0; i < 4096; ++i) copies.push_back(copy((i % 4) << 20, ((i + i / 4) % 4) << 20, 1 << 20));
  RunControl control;
  control.deadline = std::chrono::steady_clock::now() + 60s;
  Status result;
  std::thread runner([&] { result = link_->run(TransferOp::kWrite, copies, control); });
  while (control.bytes_done.load() == 0) std::this_thread::sleep_for(100us);
  control.cancel.store(true);
  runner.join();
  EXPECT_EQ(result.code(), Code::kCancelled) << result.to_string();
  EXPECT_EQ(result.message().find("may still land"), std::string::npos) << result.to_string();
  std::vector<uint8_t> before = remote_;
  std::fill(local_.begin(), local_.end(), uint8_t{0xee});
  std::this_thread::sleep_for(300ms);
  EXPECT_TRUE(before == remote_) << "a byte landed after run() returned";
  ASSERT_TRUE(run(TransferOp::kRead, {copy(0, 0, 4096)}).ok());
}

TEST_F(TcpTest, ConnectRefusesAStaleInstance) {
  PeerInfo p = peer();
  std::string a = p.address;
  a.back() = a.back() == '0' ? '1' : '0';
  p.address = a;
  auto link = client_->connect(p);
  ASSERT_FALSE(link.ok());
  EXPECT_EQ(link.error().code(), Code::kUnavailable) << link.error().to_string();
}

namespace n = ::kvbridge::net;

const n::OpeningConfig kOpening{n::Protocol::kTcp, tcp::kVersion, "", n::OpeningLimits{8 + 4 + tcp::kMaxLabelBytes, 0}};

// One tcp frame, untagged (these connections have no secret).
std::string frame(uint8_t type, std::string_view payload) {
  n::Session none;
  std::string out;
  n::append_frame(out, {n::Protocol::kTcp, type, tcp::kVersion, 0, false}, payload, none);
  return out;
}

// A hand-written server: accepts `streams` streams one after the other,
// runs the opening exchange on each, answers Accept, then does after(i, fd)
// for the i-th.
class FakeServer {
 public:
  explicit FakeServer(std::function<void(int fd)> after)
      : FakeServer(1, [after = std::move(after)](int, int fd) { after(fd); }) {}
  FakeServer(int streams, std::function<void(int i, int fd)> after) {
    Result<n::Listening> l = n::listen_on({"127.0.0.1", 0}, 16, "fake");
    listening_ = std::move(l->fd);
    address_ = tcp::format_address(l->bound, 0x42);
    thread_ = std::thread([this, streams, after = std::move(after)] {
      for (int i = 0; i < streams; ++i) {
        int fd = -1;
        while (fd < 0 && !stop_) {
          fd = ::accept(listening_.get(), nullptr, nullptr);
          if (fd < 0) std::this_thread::sleep_for(1ms);
        }
        if (fd < 0) return;
        n::Fd owned(fd);
        n::IoLimits limits{Clock::now() + 5s};
        n::FrameReader reader(n::Protocol::kTcp, tcp::kVersion, tcp::payload_limit);
        n::Session none;
        if (!n::read_frame(fd, reader, none, limits, "fake").ok()) return;
        n::ServerOpening opening(kOpening);
        if (opening.on_frame(reader.header(), reader.raw_header(), reader.payload()).kind !=
            n::ServerOpening::Step::Kind::kOpened)
          return;
        n::WireWriter label;
        label.str("fake");
        const std::string out = frame(tcp::kAccept, label.out());
        (void)n::send_bytes(fd, out.data(), out.size(), limits, "fake");
        after(i, fd);
      }
    });
  }
  ~FakeServer() {
    stop_ = true;
    thread_.join();
  }
  PeerInfo peer() const { return PeerInfo{"fake", 0, "", address_, {}}; }

 private:
  n::Fd listening_;
  std::string address_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

Status run_against(FakeServer& fake, TransferOp op, std::chrono::milliseconds timeout) {
  auto client = make_tcp_transport("127.0.0.1", 1, "");
  auto link = (*client)->connect(fake.peer());
  if (!link.ok()) return link.error();
  std::vector<uint8_t> buf(1 << 16, 0);
  RunControl control;
  control.deadline = Clock::now() + timeout;
  return (*link)->run(op, std::vector<Copy>{{buf.data(), 0x1000, buf.size(), 1}}, control);
}

TEST(TcpFakePeerTest, SilentPeerHitsTheDeadline) {
  FakeServer fake([](int) { std::this_thread::sleep_for(400ms); });
  auto start = Clock::now();
  Status s = run_against(fake, TransferOp::kRead, 200ms);
  EXPECT_EQ(s.code(), Code::kTimeout) << s.to_string();
  EXPECT_LT(Clock::now() - start, 900ms);
}

TEST(TcpFakePeerTest, PeerClosingMidReplyIsAnIoError) {
  FakeServer fake([](int fd) {
    std::this_thread::sleep_for(20ms);
    std::string out = frame(tcp::kReadData, tcp::encode_count(1));
    out.append(100, 'x');  // then the peer dies
    (void)n::send_bytes(fd, out.data(), out.size(), {Clock::now() + 1s}, "fake");
  });
  Status s = run_against(fake, TransferOp::kRead, 5s);
  EXPECT_EQ(s.code(), Code::kIoError) << s.to_string();
  EXPECT_NE(s.message().find("'fake'"), std::string::npos) << s.message();
}

TEST(TcpFakePeerTest, MalformedReplyIsAnIoError) {
  FakeServer fake([](int fd) {
    std::this_thread::sleep_for(20ms);
    std::string out(16, '\xff');
    (void)n::send_bytes(fd, out.data(), out.size(), {Clock::now() + 1s}, "fake");
    std::this_thread::sleep_for(200ms);
  });
  Status s = run_against(fake, TransferOp::kRead, 5s);
  EXPECT_EQ(s.code(), Code::kIoError) << s.to_string();
}

TEST(TcpFakePeerTest, ReplyForTheWrongRequestIsAnIoError) {
  FakeServer fake([](int fd) {
    std::this_thread::sleep_for(20ms);
    const std::string out = frame(tcp::kWriteAck, tcp::encode_count(1));  // to a read
    (void)n::send_bytes(fd, out.data(), out.size(), {Clock::now() + 1s}, "fake");
    std::this_thread::sleep_for(200ms);
  });
  Status s = run_against(fake, TransferOp::kRead, 5s);
  EXPECT_EQ(s.code(), Code::kIoError) << s.to_string();
}

// Reads one Read request on `fd` and answers it with `fill` bytes.
bool answer_read(int fd, char fill) {
  n::FrameReader reader(n::Protocol::kTcp, tcp::kVersion, tcp::payload_limit);
  n::Session none;
  if (!n::read_frame(fd, reader, none, {Clock::now() + 5s}, "fake").ok()) return false;
  const std::string_view p = reader.payload();
  const Result<uint64_t> bytes = tcp::announced_bytes(p);
  if (!bytes.ok()) return false;
  std::string out = frame(tcp::kReadData, tcp::encode_count(static_cast<uint32_t>(p.size() / tcp::kRangeBytes)));
  out.append(*bytes, fill);
  return n::send_bytes(fd, out.data(), out.size(), {Clock::now() + 5s}, "fake").ok();
}

// A server may close a pooled idle stream (its listener reclaims the place
// for another client) just as a run sends on it, before reading a byte of
// it. The run opens another stream and sends again: nothing of the first
// try was served.
TEST(TcpFakePeerTest, APooledStreamClosedBeforeItsRequestWasReadIsOpenedAgain) {
  FakeServer fake(2, [](int i, int fd) {
    if (i == 0) {
      answer_read(fd, 'a');
      // The next request arrives; the stream closes in order without
      // serving it, as a server whose listener reclaimed it: its end first,
      // then what the client sends is dropped until the client closes.
      pollfd p{fd, POLLIN, 0};
      (void)::poll(&p, 1, 5000);
      ::shutdown(fd, SHUT_WR);
      char sink[4096];
      while (::poll(&p, 1, 2000) == 1 && ::recv(fd, sink, sizeof sink, 0) > 0) {
      }
      return;
    }
    answer_read(fd, 'b');
    std::this_thread::sleep_for(100ms);
  });
  auto client = make_tcp_transport("127.0.0.1", 1, "");
  auto link = (*client)->connect(fake.peer());
  ASSERT_TRUE(link.ok()) << link.error().to_string();
  std::vector<uint8_t> buf(1 << 16, 0);
  for (char fill : {'a', 'b'}) {
    RunControl control;
    control.deadline = Clock::now() + 5s;
    Status s = (*link)->run(TransferOp::kRead, std::vector<Copy>{{buf.data(), 0x1000, buf.size(), 1}}, control);
    ASSERT_TRUE(s.ok()) << "run " << fill << ": " << s.to_string();
    EXPECT_TRUE(std::all_of(buf.begin(), buf.end(), [&](uint8_t c) { return c == static_cast<uint8_t>(fill); }));
  }
}

// A peer that resets a pooled stream without a reply did not close it in
// order: the run fails (its bytes may have been served), and is not sent again.
TEST(TcpFakePeerTest, APooledStreamResetWithoutAReplyFailsTheRun) {
  std::atomic<int> served{0};
  FakeServer fake(2, [&](int i, int fd) {
    ++served;
    if (i == 0) {
      answer_read(fd, 'a');
      pollfd p{fd, POLLIN, 0};
      (void)::poll(&p, 1, 5000);
      linger reset{1, 0};
      ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof reset);  // close() resets
      return;
    }
    answer_read(fd, 'b');
  });
  auto client = make_tcp_transport("127.0.0.1", 1, "");
  auto link = (*client)->connect(fake.peer());
  ASSERT_TRUE(link.ok()) << link.error().to_string();
  std::vector<uint8_t> buf(1 << 16, 0);
  RunControl control;
  control.deadline = Clock::now() + 5s;
  ASSERT_TRUE((*link)->run(TransferOp::kRead, std::vector<Copy>{{buf.data(), 0x1000, buf.size(), 1}}, control).ok());
  RunControl again;
  again.deadline = Clock::now() + 5s;
  Status s = (*link)->run(TransferOp::kRead, std::vector<Copy>{{buf.data(), 0x1000, buf.size(), 1}}, again);
  EXPECT_EQ(s.code(), Code::kIoError) << s.to_string();
  EXPECT_EQ(served.load(), 1) << "the run was sent again on a new stream";
}

// A hand-written client against the real server.
class RawClient {
 public:
  explicit RawClient(const std::string& address, std::string secret = "") : secret_(std::move(secret)) {
    auto peer = tcp::parse_address(address, "server");
    fd_ = std::move(*n::dial(peer->address, {Clock::now() + 5s}, "raw"));
    instance_ = peer->instance;
  }
  void send(const std::string& bytes) {
    ASSERT_TRUE(n::send_bytes(fd_.get(), bytes.data(), bytes.size(), {Clock::now() + 5s}, "raw").ok());
  }
  Status open(uint64_t instance = 0, const std::string& label = "raw") {
    n::OpeningConfig c = kOpening;
    c.secret = secret_;
    Result<n::Opened> o = n::open_client(fd_.get(), c, tcp::encode_open_body(instance ? instance : instance_, label),
                                         tcp::payload_limit, {Clock::now() + 5s}, "raw");
    if (!o.ok()) return o.error();
    session_ = std::move(o->session);
    return o->header.type == tcp::kAccept ? Status() : Status::internal("not an Accept");
  }
  void request(uint8_t type, const std::vector<tcp::Range>& ranges, std::string_view data = {}) {
    std::string out;
    n::append_frame(out, {n::Protocol::kTcp, type, tcp::kVersion, 0, false}, tcp::encode_ranges(ranges), session_);
    out.append(data);
    send(out);
  }
  Result<uint8_t> reply(std::string* payload) {
    n::FrameReader reader(n::Protocol::kTcp, tcp::kVersion, tcp::payload_limit);
    KVB_RETURN_IF_ERROR(n::read_frame(fd_.get(), reader, session_, {Clock::now() + 5s}, "raw"));
    *payload = std::string(reader.payload());
    return reader.header().type;
  }
  Status error_reply() {
    std::string payload;
    Result<uint8_t> t = reply(&payload);
    if (!t.ok()) return Status::internal("no reply: " + t.error().to_string());
    EXPECT_EQ(*t, tcp::kError);
    return tcp::decode_error(payload);
  }
  bool closed_by_peer() {
    uint8_t b;
    Status s = n::recv_bytes(fd_.get(), &b, 1, {Clock::now() + 5s}, "raw");
    return s.code() == Code::kIoError;
  }

  n::Fd fd_;
  uint64_t instance_ = 0;
  std::string secret_;
  n::Session session_;
};

TEST_F(TcpTest, ServerAnswersAnUnexpectedFrameWithAnErrorAndCloses) {
  RawClient raw(server_->address());
  ASSERT_TRUE(raw.open().ok());
  raw.send(frame(tcp::kWriteAck, tcp::encode_count(1)));  // a reply type, from a client
  EXPECT_EQ(raw.error_reply().code(), Code::kInvalidArgument);
  EXPECT_TRUE(raw.closed_by_peer());
}

TEST_F(TcpTest, ServerClosesAStreamThatSendsGarbage) {
  RawClient raw(server_->address());
  ASSERT_TRUE(raw.open().ok());
  raw.send(std::string(16, 'N'));
  EXPECT_TRUE(raw.closed_by_peer());
}

TEST_F(TcpTest, ServerRefusesAnOpenForAnotherInstance) {
  RawClient raw(server_->address());
  Status s = raw.open(raw.instance_ ^ 1);
  EXPECT_EQ(s.code(), Code::kUnavailable) << s.to_string();
  EXPECT_NE(s.message().find("stale"), std::string::npos) << s.to_string();
}

TEST_F(TcpTest, ServerDrainsARejectedWriteAndStaysInStep) {
  RawClient raw(server_->address());
  ASSERT_TRUE(raw.open().ok());
  uint64_t base = reinterpret_cast<uint64_t>(remote_.data());
  raw.request(tcp::kWrite, {{7, base + kSegmentBytes, 100}}, std::string(100, 'z'));
  EXPECT_EQ(raw.error_reply().code(), Code::kOutOfRange);
  raw.request(tcp::kRead, {{7, base + 10, 4}});
  std::string payload;
  Result<uint8_t> t = raw.reply(&payload);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(*t, tcp::kReadData);
  uint8_t data[4];
  ASSERT_TRUE(n::recv_bytes(raw.fd_.get(), data, 4, {Clock::now() + 5s}, "raw").ok());
  EXPECT_EQ(data[0], pattern(10));
  EXPECT_EQ(data[3], pattern(13));
}

// A segment registered read-only (a pull-mode prefill's KV) refuses writes,
// whoever sends them, and keeps its bytes.
TEST_F(TcpTest, AReadOnlySegmentRefusesWritesAndKeepsItsBytes) {
  ASSERT_TRUE(server_->add_segment(Segment{8, remote_.data(), 4096, "host", 1}).ok());
  RawClient raw(server_->address());
  ASSERT_TRUE(raw.open().ok());
  const uint64_t base = reinterpret_cast<uint64_t>(remote_.data());
  raw.request(tcp::kWrite, {{8, base, 64}}, std::string(64, 'w'));
  Status s = raw.error_reply();
  EXPECT_EQ(s.code(), Code::kPermissionDenied) << s.to_string();
  EXPECT_NE(s.message().find("does not allow remote writes"), std::string::npos) << s.to_string();
  EXPECT_EQ(remote_[0], pattern(0));
  raw.request(tcp::kRead, {{8, base, 4}});
  std::string payload;
  ASSERT_EQ(*raw.reply(&payload), tcp::kReadData);
}

// With a secret, a stream must prove it; one that does gets tagged frames.
TEST(TcpSecretTest, StreamsWithoutTheSecretAreRefusedAndTaggedOnesServed) {
  // Memory first: the server's threads read it until the server is gone.
  std::vector<uint8_t> mem(4096, 9);
  auto server = make_tcp_transport("127.0.0.1", 1, "s3cret");
  ASSERT_TRUE(server.ok());
  ASSERT_TRUE((*server)->add_segment(Segment{1, mem.data(), mem.size(), "host", 3}).ok());
  RawClient none((*server)->address());
  EXPECT_EQ(none.open().code(), Code::kPermissionDenied);
  RawClient wrong((*server)->address(), "guess");
  EXPECT_EQ(wrong.open().code(), Code::kPermissionDenied);
  auto client = make_tcp_transport("127.0.0.1", 1, "s3cret");
  PeerInfo p{"server", 0, "", (*server)->address(), {}};
  auto link = (*client)->connect(p);
  ASSERT_TRUE(link.ok()) << link.error().to_string();
  std::vector<uint8_t> local(4096, 0);
  RunControl control;
  control.deadline = Clock::now() + 5s;
  ASSERT_TRUE((*link)
                  ->run(TransferOp::kRead,
                        std::vector<Copy>{{local.data(), reinterpret_cast<uint64_t>(mem.data()), 4096, 1}}, control)
                  .ok());
  EXPECT_EQ(local[4095], 9);
  auto plain = make_tcp_transport("127.0.0.1", 1, "");
  EXPECT_FALSE((*plain)->connect(p).ok()) << "a client without the secret connected";
}

// Every place of the server taken by idle streams: a new client gets the
// place of the one idle the longest (here the link's pooled stream), and the
// link, finding its stream closed, opens another the same way.
TEST_F(TcpTest, AllPlacesTakenByIdleStreamsANewClientTakesTheOldestOnesPlace) {
  link_ = single_stream_link();
  ASSERT_TRUE(run(TransferOp::kRead, {copy(0, 0, 4096)}).ok());  // its stream is now pooled and idle
  std::vector<std::unique_ptr<RawClient>> idle;
  for (size_t i = 0; i + 1 < tcp::kMaxStreams; ++i) {
    idle.push_back(std::make_unique<RawClient>(server_->address()));
    ASSERT_TRUE(idle.back()->open(0, "idle " + std::to_string(i)).ok()) << i;
    if (i == 0) std::this_thread::sleep_for(50ms);  // the oldest idle raw stream: its thread waits first
  }
  std::this_thread::sleep_for(100ms);  // every stream adopted and waiting
  RawClient late(server_->address());
  ASSERT_TRUE(late.open(0, "late").ok()) << "a new client was refused while every stream was idle";
  ASSERT_TRUE(run(TransferOp::kRead, {copy(0, 100, 4096)}).ok()) << "the link did not open another stream";
  EXPECT_TRUE(std::equal(local_.begin(), local_.begin() + 4096, remote_.begin() + 100));
  EXPECT_TRUE(idle[0]->closed_by_peer()) << "the oldest idle raw stream gave its place to the link";
  late.request(tcp::kRead, {tcp::Range{7, reinterpret_cast<uint64_t>(remote_.data()), 16}});
  std::string payload;
  Result<uint8_t> t = late.reply(&payload);
  ASSERT_TRUE(t.ok()) << t.error().to_string();
  EXPECT_EQ(*t, tcp::kReadData);
}

}  // namespace
}  // namespace kvbridge::transport
