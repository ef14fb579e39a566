// The tcp transport at the Transport/Link level: two transports in one
// process over loopback, plus hand-written peers that misbehave.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <thread>

#include "transport/tcp_link.h"
#include "transport/tcp_protocol.h"
#include "transport/tcp_socket.h"
#include "transport/transport.h"

namespace kvbridge::transport {
namespace {

using namespace std::chrono_literals;

uint8_t pattern(uint64_t i) { return static_cast<uint8_t>((i * 131 + (i >> 11) * 7 + 5) & 0xff); }

class TcpTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kSegmentBytes = uint64_t{72} << 20;

  void SetUp() override {
    auto server = make_tcp_transport("127.0.0.1", 4);
    ASSERT_TRUE(server.ok()) << server.error().to_string();
    server_ = std::move(*server);
    auto client = make_tcp_transport("127.0.0.1", 4);
    ASSERT_TRUE(client.ok()) << client.error().to_string();
    client_ = std::move(*client);
    remote_.resize(kSegmentBytes);
    for (uint64_t i = 0; i < remote_.size(); ++i) remote_[i] = pattern(i);
    local_.assign(kSegmentBytes, 0);
    ASSERT_TRUE(server_->add_segment(Segment{7, remote_.data(), remote_.size(), "host"}).ok());
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
    RunControl control;
    control.deadline = Clock::now() + timeout;
    Status s = link_->run(op, copies, control);
    if (s.ok()) {
      uint64_t total = 0;
      for (const Copy& c : copies) total += c.bytes;
      EXPECT_EQ(control.bytes_done.load(), total);
    }
    return s;
  }

  // A link over one stream, for runs whose copies overlap locally on purpose
  // (long runs in a small buffer): one thread writes them, so no data race.
  std::unique_ptr<Link> single_stream_link() {
    auto t = make_tcp_transport("127.0.0.1", 1);
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

TEST_F(TcpTest, ReadsEverySize) {
  for (uint64_t size : {uint64_t{1}, uint64_t{4095}, uint64_t{4096}, uint64_t{4097}, uint64_t{1} << 20,
                        uint64_t{64} << 20}) {
    std::fill(local_.begin(), local_.end(), 0);
    ASSERT_TRUE(run(TransferOp::kRead, {copy(5, 3, size)}).ok()) << size;
    ASSERT_TRUE(std::equal(local_.begin() + 5, local_.begin() + 5 + size, remote_.begin() + 3)) << size;
    EXPECT_EQ(local_[4], 0);
    EXPECT_EQ(local_[5 + size], 0);
  }
}

TEST_F(TcpTest, WritesEverySize) {
  for (uint64_t i = 0; i < local_.size(); ++i) local_[i] = static_cast<uint8_t>(~pattern(i));
  for (uint64_t size : {uint64_t{1}, uint64_t{4095}, uint64_t{4096}, uint64_t{4097}, uint64_t{1} << 20,
                        uint64_t{64} << 20}) {
    ASSERT_TRUE(run(TransferOp::kWrite, {copy(11, 9, size)}).ok()) << size;
    // Complete means in the peer's memory: check at once.
    ASSERT_TRUE(std::equal(local_.begin() + 11, local_.begin() + 11 + size, remote_.begin() + 9)) << size;
    EXPECT_EQ(remote_[9 + size], pattern(9 + size));
    EXPECT_EQ(remote_[8], pattern(8));
  }
}

TEST_F(TcpTest, BatchOf10000ShuffledDescriptors) {
  constexpr uint64_t kBlock = 2048, kCount = 10000;
  std::vector<uint64_t> order(kCount);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(42));
  std::vector<Copy> copies;
  for (uint64_t i = 0; i < kCount; ++i) copies.push_back(copy(i * kBlock, order[i] * kBlock, kBlock));
  ASSERT_TRUE(run(TransferOp::kRead, copies).ok());
  for (uint64_t i = 0; i < kCount; ++i) {
    ASSERT_TRUE(std::equal(local_.begin() + i * kBlock, local_.begin() + (i + 1) * kBlock,
                           remote_.begin() + order[i] * kBlock))
        << i;
  }
  for (uint64_t i = 0; i < kCount * kBlock; ++i) local_[i] = static_cast<uint8_t>(i * 3);
  ASSERT_TRUE(run(TransferOp::kWrite, copies).ok());
  for (uint64_t i = 0; i < kCount; ++i) {
    ASSERT_TRUE(std::equal(local_.begin() + i * kBlock, local_.begin() + (i + 1) * kBlock,
                           remote_.begin() + order[i] * kBlock))
        << i;
  }
}

TEST_F(TcpTest, ConcurrentRunsOnOneLink) {
  std::vector<std::thread> threads;
  std::vector<Status> results(6);
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 5 && results[t].ok(); ++round) {
        uint64_t off = uint64_t(t) * (4 << 20);
        results[t] = run(TransferOp::kRead, {copy(off, off + 17, (3 << 20) + round)});
      }
    });
  }
  for (auto& th : threads) th.join();
  for (auto& s : results) EXPECT_TRUE(s.ok()) << s.to_string();
  for (int t = 0; t < 6; ++t) {
    uint64_t off = uint64_t(t) * (4 << 20);
    EXPECT_TRUE(std::equal(local_.begin() + off, local_.begin() + off + (3 << 20), remote_.begin() + off + 17));
  }
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

TEST_F(TcpTest, CancelStopsBeforeRunReturnsAndNothingLandsAfter) {
  link_ = single_stream_link();
  RunControl control;
  control.deadline = Clock::now() + 20s;
  std::vector<Copy> copies;
  for (int i = 0; i < 200; ++i) copies.push_back(copy(0, 0, 64 << 20));  // ~12.8 GiB: cannot finish first
  Status result;
  std::thread t([&] { result = link_->run(TransferOp::kRead, copies, control); });
  while (control.bytes_done.load() < (8 << 20)) std::this_thread::sleep_for(1ms);
  control.cancel.store(true);
  t.join();
  EXPECT_EQ(result.code(), Code::kCancelled) << result.to_string();
  std::vector<uint8_t> snapshot(local_.begin(), local_.begin() + (64 << 20));
  std::this_thread::sleep_for(100ms);
  EXPECT_TRUE(std::equal(snapshot.begin(), snapshot.end(), local_.begin())) << "a byte landed after run returned";
  std::fill(local_.begin(), local_.end(), 0);
  ASSERT_TRUE(run(TransferOp::kRead, {copy(0, 1, 5 << 20)}).ok()) << "the link recovers";
  EXPECT_TRUE(std::equal(local_.begin(), local_.begin() + (5 << 20), remote_.begin() + 1));
}

TEST_F(TcpTest, DeadlineEndsARunThatCannotFinish) {
  link_ = single_stream_link();
  std::vector<Copy> copies;
  for (int i = 0; i < 200; ++i) copies.push_back(copy(0, 0, 64 << 20));
  auto start = Clock::now();
  Status s = run(TransferOp::kRead, copies, 150ms);
  EXPECT_EQ(s.code(), Code::kTimeout) << s.to_string();
  EXPECT_LT(Clock::now() - start, 2s);
  ASSERT_TRUE(run(TransferOp::kRead, {copy(0, 0, 4096)}).ok());
}

TEST_F(TcpTest, PeerGoneMidTransferIsAnIoErrorNamingThePeer) {
  link_ = single_stream_link();
  RunControl control;
  control.deadline = Clock::now() + 20s;
  std::vector<Copy> copies;
  for (int i = 0; i < 200; ++i) copies.push_back(copy(0, 0, 64 << 20));
  Status result;
  std::thread t([&] { result = link_->run(TransferOp::kRead, copies, control); });
  while (control.bytes_done.load() < (8 << 20)) std::this_thread::sleep_for(1ms);
  auto start = Clock::now();
  server_.reset();  // closes every stream
  t.join();
  EXPECT_EQ(result.code(), Code::kIoError) << result.to_string();
  EXPECT_NE(result.message().find("'server'"), std::string::npos) << result.message();
  EXPECT_LT(Clock::now() - start, 5s);
  // A new run dials, and the refused connection is an error too, not a hang.
  Status again = run(TransferOp::kRead, {copy(0, 0, 10)}, 2s);
  EXPECT_EQ(again.code(), Code::kIoError) << again.to_string();
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

// A hand-written server: accepts one stream, says hello, then does `after`.
class FakeServer {
 public:
  explicit FakeServer(std::function<void(int fd)> after) {
    uint16_t port = 0;
    fd_ = *tcp::listen_on("127.0.0.1", 0, &port);
    address_ = tcp::format_address({"127.0.0.1", port}, 0x42);
    thread_ = std::thread([this, after = std::move(after)] {
      int fd = -1;
      while (fd < 0 && !stop_) {
        fd = ::accept(fd_, nullptr, nullptr);
        if (fd < 0) std::this_thread::sleep_for(1ms);
      }
      if (fd < 0) return;
      tcp::IoLimits limits{Clock::now() + 5s};
      uint8_t head[tcp::kHeaderBytes];
      if (!tcp::recv_bytes(fd, head, sizeof head, limits, "fake").ok()) return;
      std::vector<uint8_t> body(tcp::decode_header(head)->payload_bytes);
      (void)tcp::recv_bytes(fd, body.data(), body.size(), limits, "fake");
      std::string out;
      tcp::encode_hello(tcp::FrameType::kHelloOk, tcp::Hello{1, 1, 0x42, "fake"}, out);
      (void)tcp::send_bytes(fd, out.data(), out.size(), limits, "fake");
      after(fd);
      ::close(fd);
    });
  }
  ~FakeServer() {
    stop_ = true;
    thread_.join();
    ::close(fd_);
  }
  PeerInfo peer() const { return PeerInfo{"fake", 0, "", address_, {}}; }

 private:
  int fd_ = -1;
  std::string address_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

Status run_against(FakeServer& fake, TransferOp op, std::chrono::milliseconds timeout) {
  auto client = make_tcp_transport("127.0.0.1", 1);
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
    std::string out;
    tcp::encode_header({tcp::FrameType::kReadData, 1, 0}, out);
    out.append(100, 'x');  // then the peer dies
    (void)tcp::send_bytes(fd, out.data(), out.size(), {Clock::now() + 1s}, "fake");
  });
  Status s = run_against(fake, TransferOp::kRead, 5s);
  EXPECT_EQ(s.code(), Code::kIoError) << s.to_string();
  EXPECT_NE(s.message().find("'fake'"), std::string::npos) << s.message();
}

TEST(TcpFakePeerTest, MalformedReplyIsAnIoError) {
  FakeServer fake([](int fd) {
    std::this_thread::sleep_for(20ms);
    std::string out(16, '\xff');
    (void)tcp::send_bytes(fd, out.data(), out.size(), {Clock::now() + 1s}, "fake");
    std::this_thread::sleep_for(200ms);
  });
  Status s = run_against(fake, TransferOp::kRead, 5s);
  EXPECT_EQ(s.code(), Code::kIoError) << s.to_string();
}

TEST(TcpFakePeerTest, ReplyForTheWrongRequestIsAnIoError) {
  FakeServer fake([](int fd) {
    std::this_thread::sleep_for(20ms);
    std::string out;
    tcp::encode_header({tcp::FrameType::kWriteAck, 1, 0}, out);  // to a read
    (void)tcp::send_bytes(fd, out.data(), out.size(), {Clock::now() + 1s}, "fake");
    std::this_thread::sleep_for(200ms);
  });
  Status s = run_against(fake, TransferOp::kRead, 5s);
  EXPECT_EQ(s.code(), Code::kIoError) << s.to_string();
}

// A hand-written client against the real server.
class RawClient {
 public:
  explicit RawClient(const std::string& address) {
    auto peer = tcp::parse_address(address, "server");
    fd_ = *tcp::dial(peer->address, {Clock::now() + 5s}, "raw");
    instance_ = peer->instance;
  }
  ~RawClient() { ::close(fd_); }
  void send(const std::string& bytes) {
    ASSERT_TRUE(tcp::send_bytes(fd_, bytes.data(), bytes.size(), {Clock::now() + 5s}, "raw").ok());
  }
  void hello() {
    std::string out;
    tcp::encode_hello(tcp::FrameType::kHello, tcp::Hello{1, 1, instance_, "raw"}, out);
    send(out);
    tcp::FrameHeader h = reply();
    ASSERT_EQ(h.type, tcp::FrameType::kHelloOk);
    std::vector<uint8_t> body(h.payload_bytes);
    ASSERT_TRUE(tcp::recv_bytes(fd_, body.data(), body.size(), {Clock::now() + 5s}, "raw").ok());
  }
  tcp::FrameHeader reply() {
    uint8_t head[tcp::kHeaderBytes];
    EXPECT_TRUE(tcp::recv_bytes(fd_, head, sizeof head, {Clock::now() + 5s}, "raw").ok());
    auto h = tcp::decode_header(head);
    EXPECT_TRUE(h.ok());
    return h.ok() ? *h : tcp::FrameHeader{};
  }
  Status error_reply() {
    tcp::FrameHeader h = reply();
    EXPECT_EQ(h.type, tcp::FrameType::kError);
    std::vector<uint8_t> body(h.payload_bytes);
    EXPECT_TRUE(tcp::recv_bytes(fd_, body.data(), body.size(), {Clock::now() + 5s}, "raw").ok());
    return tcp::decode_error(body);
  }
  bool closed_by_peer() {
    uint8_t b;
    Status s = tcp::recv_bytes(fd_, &b, 1, {Clock::now() + 5s}, "raw");
    return s.code() == Code::kIoError;
  }

  int fd_ = -1;
  uint64_t instance_ = 0;
};

TEST_F(TcpTest, ServerAnswersAMalformedFrameWithAnErrorAndCloses) {
  RawClient raw(server_->address());
  raw.hello();
  std::string garbage(16, '\0');
  garbage[0] = 'N';
  raw.send(garbage);
  EXPECT_EQ(raw.error_reply().code(), Code::kInvalidArgument);
  EXPECT_TRUE(raw.closed_by_peer());
}

TEST_F(TcpTest, ServerRefusesAHelloForAnotherVersion) {
  RawClient raw(server_->address());
  std::string out;
  tcp::encode_hello(tcp::FrameType::kHello, tcp::Hello{2, 3, raw.instance_, "future"}, out);
  raw.send(out);
  Status s = raw.error_reply();
  EXPECT_EQ(s.code(), Code::kIncompatible) << s.to_string();
  EXPECT_TRUE(raw.closed_by_peer());
}

TEST_F(TcpTest, ServerDrainsARejectedWriteAndStaysInStep) {
  RawClient raw(server_->address());
  raw.hello();
  uint64_t base = reinterpret_cast<uint64_t>(remote_.data());
  std::string out;
  tcp::encode_ranges_header(tcp::FrameType::kWrite, std::vector<tcp::Range>{{7, base + kSegmentBytes, 100}}, out);
  out.append(100, 'z');
  raw.send(out);
  EXPECT_EQ(raw.error_reply().code(), Code::kOutOfRange);
  out.clear();
  tcp::encode_ranges_header(tcp::FrameType::kRead, std::vector<tcp::Range>{{7, base + 10, 4}}, out);
  raw.send(out);
  tcp::FrameHeader h = raw.reply();
  EXPECT_EQ(h.type, tcp::FrameType::kReadData);
  uint8_t data[4];
  ASSERT_TRUE(tcp::recv_bytes(raw.fd_, data, 4, {Clock::now() + 5s}, "raw").ok());
  EXPECT_EQ(data[0], pattern(10));
  EXPECT_EQ(data[3], pattern(13));
}

}  // namespace
}  // namespace kvbridge::transport
