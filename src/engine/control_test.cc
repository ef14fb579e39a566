// Control connections: notifications with acknowledgements, peers that go
// away or stop reading, secrets, and inbound bytes that do not follow the
// protocol.
#include <poll.h>
#include <sys/socket.h>

#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <mutex>
#include <thread>

#include "engine/control.h"
#include "net/opening.h"
#include "net/socket.h"
#include "net/wire.h"

namespace kvbridge::engine_internal {
namespace {

using namespace std::chrono_literals;

struct Inbox {
  std::mutex mu;
  std::vector<Notification> notes;
  std::function<std::string(Notification)> sink() {
    return [this](Notification n) {
      std::lock_guard<std::mutex> lock(mu);
      std::string answer = n.message.rfind("ask ", 0) == 0 ? "answer to " + n.message.substr(4) : "";
      if (n.message == "ask long") answer.assign(2 * kMaxNotificationAnswerBytes, 'x');
      notes.push_back(std::move(n));
      return answer;
    };
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu);
    return notes.size();
  }
};

constexpr uint64_t kInstanceA = 0xa, kInstanceB = 0xb;

std::unique_ptr<Control> make(const std::string& name, uint64_t instance, Inbox& inbox, std::string secret = "") {
  ControlOptions o;
  o.self = ControlIdentity{name, instance, 1};
  o.secret = std::move(secret);
  o.open_timeout = 2s;
  Result<std::unique_ptr<Control>> c = Control::create(std::move(o), inbox.sink());
  EXPECT_TRUE(c.ok()) << c.error().to_string();
  return std::move(*c);
}

net::Fd raw_connect(const std::string& address) {
  Result<net::Fd> fd = net::dial(*net::parse_host_port(address, "a"), {Clock::now() + 5s}, "raw");
  EXPECT_TRUE(fd.ok());
  return std::move(*fd);
}

// Whether the other side closed `fd` within 5 s (after whatever it sent).
bool closed_by_peer(int fd) {
  const auto deadline = Clock::now() + 5s;
  char c[256];
  while (Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) != 1) continue;
    const ssize_t n = ::recv(fd, c, sizeof c, 0);
    if (n <= 0) return true;
  }
  return false;
}

std::string open_body(const std::string& name, uint64_t instance, uint64_t target) {
  net::WireWriter w;
  w.str(name);
  w.u64(instance);
  w.u64(1);
  w.u64(target);
  return w.take();
}

net::OpeningConfig config(std::string secret) {
  return net::OpeningConfig{net::Protocol::kControl, kControlVersion, std::move(secret),
                            net::OpeningLimits{4 + 256 + 24, 0}};
}

TEST(ControlTest, NotificationsAreAcknowledgedInOrderAndNameTheSender) {
  Inbox a_in, b_in;
  auto a = make("a", kInstanceA, a_in);
  auto b = make("b", kInstanceB, b_in);
  Result<std::shared_ptr<Channel>> ch = a->connect(b->address(), kInstanceB, "'b'", nullptr);
  ASSERT_TRUE(ch.ok()) << ch.error().to_string();
  for (int i = 0; i < 20; ++i) ASSERT_TRUE((*ch)->notify_and_wait("m" + std::to_string(i), Clock::now() + 5s).ok());
  ASSERT_EQ(b_in.size(), 20u);  // acknowledged means delivered
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(b_in.notes[i].peer, "a");
    EXPECT_EQ(b_in.notes[i].peer_instance, kInstanceA);
    EXPECT_EQ(b_in.notes[i].message, "m" + std::to_string(i));
  }
}

// The receiver's word on a notification comes back in its acknowledgement,
// cut to the bound; a notification it does not answer gets an empty answer.
TEST(ControlTest, AnAcknowledgementCarriesTheReceiversAnswer) {
  Inbox a_in, b_in;
  auto a = make("a", kInstanceA, a_in);
  auto b = make("b", kInstanceB, b_in);
  Result<std::shared_ptr<Channel>> ch = a->connect(b->address(), kInstanceB, "'b'", nullptr);
  ASSERT_TRUE(ch.ok()) << ch.error().to_string();
  for (const std::string m : {"ask 1", "plain", "ask long", "ask 2"}) {
    std::promise<std::pair<Status, std::string>> got;
    (*ch)->notify(m, Clock::now() + 5s, [&](Status s, std::string answer) { got.set_value({s, answer}); });
    auto [s, answer] = got.get_future().get();
    ASSERT_TRUE(s.ok()) << s.to_string();
    if (m == "plain") {
      EXPECT_EQ(answer, "");
    } else if (m == "ask long") {
      EXPECT_EQ(answer, std::string(kMaxNotificationAnswerBytes, 'x'));
    } else {
      EXPECT_EQ(answer, "answer to " + m.substr(4));
    }
  }
}

TEST(ControlTest, ConnectingToAnotherInstanceIsRefusedAsStale) {
  Inbox a_in, b_in;
  auto a = make("a", kInstanceA, a_in);
  auto b = make("b", kInstanceB, b_in);
  Result<std::shared_ptr<Channel>> ch = a->connect(b->address(), kInstanceB + 1, "'b'", nullptr);
  ASSERT_FALSE(ch.ok());
  EXPECT_EQ(ch.error().code(), Code::kUnavailable);
  EXPECT_NE(ch.error().message().find("stale metadata"), std::string::npos) << ch.error().to_string();
}

TEST(ControlTest, APeerThatGoesAwayIsReportedOnceAndFailsNotify) {
  Inbox a_in, b_in;
  auto a = make("a", kInstanceA, a_in);
  auto b = make("b", kInstanceB, b_in);
  std::atomic<int> gone{0};
  Result<std::shared_ptr<Channel>> ch = a->connect(b->address(), kInstanceB, "'b'", [&](const Status& why) {
    EXPECT_EQ(why.code(), Code::kIoError);
    ++gone;
  });
  ASSERT_TRUE(ch.ok());
  b.reset();
  for (int i = 0; i < 500 && gone == 0; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(gone.load(), 1);
  Status s = (*ch)->notify_and_wait("late", Clock::now() + 1s);
  EXPECT_EQ(s.code(), Code::kIoError) << s.to_string();
  EXPECT_NE(s.message().find("peer 'b' is gone"), std::string::npos) << s.to_string();
  EXPECT_EQ(gone.load(), 1);
}

// A peer that accepted and then stopped (SIGSTOP, a stuck process): notify
// returns at once, the notification fails at its own deadline, and another
// peer's notifications go through meanwhile.
TEST(ControlTest, AStoppedPeerDelaysOnlyItsOwnNotifications) {
  Inbox a_in, c_in;
  auto a = make("a", kInstanceA, a_in);
  auto c = make("c", 0xc, c_in);
  Result<net::Listening> l = net::listen_on({"127.0.0.1", 0}, 4, "stopped");
  ASSERT_TRUE(l.ok());
  std::thread stopped([&] {
    pollfd p{l->fd.get(), POLLIN, 0};
    ASSERT_EQ(::poll(&p, 1, 5000), 1);  // the listening socket is non-blocking
    net::Fd fd(::accept(l->fd.get(), nullptr, nullptr));
    net::FrameReader reader(net::Protocol::kControl, kControlVersion, control_payload_limit);
    net::Session none;
    Status got = net::read_frame(fd.get(), reader, none, {Clock::now() + 5s}, "stopped");
    ASSERT_TRUE(got.ok()) << got.to_string();
    net::WireWriter accept;
    accept.u64(0x5);
    std::string out;
    net::append_frame(out, {net::Protocol::kControl, 16, kControlVersion, 0, false}, accept.out(), none);
    ASSERT_TRUE(net::send_bytes(fd.get(), out.data(), out.size(), {Clock::now() + 5s}, "stopped").ok());
    std::this_thread::sleep_for(1500ms);  // never reads, never acknowledges
  });
  Result<std::shared_ptr<Channel>> slow = a->connect(net::format_host_port(l->bound), 0x5, "'stopped'", nullptr);
  ASSERT_TRUE(slow.ok()) << slow.error().to_string();
  Result<std::shared_ptr<Channel>> fast = a->connect(c->address(), 0xc, "'c'", nullptr);
  ASSERT_TRUE(fast.ok());
  std::promise<Status> result;
  const auto start = Clock::now();
  (*slow)->notify("hb 1", Clock::now() + 300ms, [&](Status s) { result.set_value(s); });
  EXPECT_LT(Clock::now() - start, 50ms) << "notify waited for the stopped peer";
  EXPECT_TRUE((*fast)->notify_and_wait("done 2", Clock::now() + 2s).ok());
  EXPECT_LT(Clock::now() - start, 250ms) << "the healthy peer waited behind the stopped one";
  Status s = result.get_future().get();
  EXPECT_EQ(s.code(), Code::kTimeout) << s.to_string();
  EXPECT_LT(Clock::now() - start, 1000ms);
  stopped.join();
}

TEST(ControlTest, WithASecretOnlyClientsThatProveItAreHeard) {
  Inbox a_in, b_in, x_in;
  auto b = make("b", kInstanceB, b_in, "s3cret");
  auto a = make("a", kInstanceA, a_in, "s3cret");
  auto x = make("x", 0x99, x_in, "guess");
  auto none = make("n", 0x98, x_in);
  EXPECT_EQ(x->connect(b->address(), kInstanceB, "'b'", nullptr).error().code(), Code::kPermissionDenied);
  EXPECT_EQ(none->connect(b->address(), kInstanceB, "'b'", nullptr).error().code(), Code::kPermissionDenied);
  // A raw client that skips the opening and sends a notification: closed,
  // nothing delivered.
  net::Fd fd = raw_connect(b->address());
  std::string spoof;
  net::Session plain;
  net::WireWriter notify;
  notify.u64(1);
  notify.raw("kvb/1 done 1");
  net::append_frame(spoof, {net::Protocol::kControl, 17, kControlVersion, 0, false}, notify.out(), plain);
  ASSERT_EQ(::send(fd.get(), spoof.data(), spoof.size(), MSG_NOSIGNAL), static_cast<ssize_t>(spoof.size()));
  EXPECT_TRUE(closed_by_peer(fd.get()));
  Result<std::shared_ptr<Channel>> ch = a->connect(b->address(), kInstanceB, "'b'", nullptr);
  ASSERT_TRUE(ch.ok()) << ch.error().to_string();
  ASSERT_TRUE((*ch)->notify_and_wait("kvb/1 done 7", Clock::now() + 5s).ok());
  ASSERT_EQ(b_in.size(), 1u);
  EXPECT_EQ(b_in.notes[0].message, "kvb/1 done 7");
  EXPECT_EQ(b_in.notes[0].peer, "a");
}

TEST(ControlTest, MalformedInboundFramesCloseTheConnectionOnly) {
  Inbox in;
  auto c = make("c", 0xc, in);
  std::vector<std::string> bad = {
      std::string(16, '\xff'),                         // magic
      "KVBC\x01\x00\x01\x00" + std::string(12, '\0'),  // the format before the shared header
  };
  {
    std::string notify_first;  // a Notify where the Open belongs
    net::Session none;
    net::append_frame(notify_first, {net::Protocol::kControl, 17, kControlVersion, 0, false}, std::string(8, '\0'),
                      none);
    bad.push_back(notify_first);
    std::string huge;
    net::encode_header({net::Protocol::kControl, net::kOpen, kControlVersion, 1u << 30, false}, huge);
    bad.push_back(huge);
  }
  for (size_t i = 0; i < bad.size(); ++i) {
    net::Fd fd = raw_connect(c->address());
    ASSERT_EQ(::send(fd.get(), bad[i].data(), bad[i].size(), MSG_NOSIGNAL), static_cast<ssize_t>(bad[i].size()));
    EXPECT_TRUE(closed_by_peer(fd.get())) << "frame " << i << " was not refused";
  }
  EXPECT_EQ(in.size(), 0u);
  // An opened client that then breaks the protocol is closed too.
  net::Fd fd = raw_connect(c->address());
  Result<net::Opened> o = net::open_client(fd.get(), config(""), open_body("raw", 0x77, 0xc), control_payload_limit,
                                           {Clock::now() + 5s}, "raw");
  ASSERT_TRUE(o.ok()) << o.error().to_string();
  std::string ack;  // an Ack from a client
  net::append_frame(ack, {net::Protocol::kControl, 18, kControlVersion, 0, false}, std::string(8, '\0'), o->session);
  ASSERT_EQ(::send(fd.get(), ack.data(), ack.size(), MSG_NOSIGNAL), static_cast<ssize_t>(ack.size()));
  EXPECT_TRUE(closed_by_peer(fd.get()));
  EXPECT_EQ(in.size(), 0u);
}

TEST(ControlTest, OneIdentityMayHoldOnlySoManyConnections) {
  Inbox in;
  auto c = make("c", 0xc, in);
  std::vector<net::Fd> held;
  for (size_t i = 0; i < kMaxInboundPerPeer; ++i) {
    held.push_back(raw_connect(c->address()));
    ASSERT_TRUE(net::open_client(held.back().get(), config(""), open_body("greedy", 0x77, 0xc), control_payload_limit,
                                 {Clock::now() + 5s}, "raw")
                    .ok());
  }
  std::this_thread::sleep_for(100ms);  // the control thread adopts them
  net::Fd more = raw_connect(c->address());
  Result<net::Opened> refused = net::open_client(more.get(), config(""), open_body("greedy", 0x77, 0xc),
                                                 control_payload_limit, {Clock::now() + 5s}, "raw");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code(), Code::kUnavailable);
  EXPECT_NE(refused.error().message().find("already has"), std::string::npos) << refused.error().to_string();
  // Another identity still gets in.
  net::Fd other = raw_connect(c->address());
  EXPECT_TRUE(net::open_client(other.get(), config(""), open_body("modest", 0x78, 0xc), control_payload_limit,
                               {Clock::now() + 5s}, "raw")
                  .ok());
}

}  // namespace
}  // namespace kvbridge::engine_internal
