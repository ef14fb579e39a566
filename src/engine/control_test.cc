// Control connections: notifications with acknowledgements, peers that go
// away, and inbound bytes that do not follow the protocol.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <mutex>

#include "engine/control.h"

namespace kvbridge::engine_internal {
namespace {

using namespace std::chrono_literals;

struct Inbox {
  std::mutex mu;
  std::vector<Notification> notes;
  std::function<void(Notification)> sink() {
    return [this](Notification n) {
      std::lock_guard<std::mutex> lock(mu);
      notes.push_back(std::move(n));
    };
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu);
    return notes.size();
  }
};

std::unique_ptr<Control> make(const std::string& name, Inbox& inbox) {
  Result<std::unique_ptr<Control>> c = Control::create("127.0.0.1", name, inbox.sink());
  EXPECT_TRUE(c.ok()) << c.error().to_string();
  return std::move(*c);
}

int raw_connect(const std::string& address) {
  const uint16_t port = static_cast<uint16_t>(std::stoi(address.substr(address.rfind(':') + 1)));
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  return fd;
}

// Whether the other side closed `fd` within 5 s.
bool closed_by_peer(int fd) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, 5000) != 1) return false;
  char c;
  return ::recv(fd, &c, 1, 0) == 0;
}

std::string frame(uint32_t magic, uint16_t version, uint16_t type, uint64_t seq, std::string_view payload,
                  uint32_t length_override = UINT32_MAX) {
  std::string out;
  auto put = [&](uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  put(magic, 4);
  put(version, 2);
  put(type, 2);
  put(seq, 8);
  put(length_override == UINT32_MAX ? payload.size() : length_override, 4);
  out.append(payload);
  return out;
}

TEST(ControlTest, NotificationsAreAcknowledgedInOrder) {
  Inbox a_in, b_in;
  auto a = make("a", a_in);
  auto b = make("b", b_in);
  Result<std::shared_ptr<Channel>> ch = a->connect(b->address(), "'b'", nullptr, Clock::now() + 5s);
  ASSERT_TRUE(ch.ok()) << ch.error().to_string();
  for (int i = 0; i < 20; ++i) ASSERT_TRUE((*ch)->notify("m" + std::to_string(i), Clock::now() + 5s).ok());
  ASSERT_EQ(b_in.size(), 20u);  // acknowledged means delivered
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(b_in.notes[i].peer, "a");
    EXPECT_EQ(b_in.notes[i].message, "m" + std::to_string(i));
  }
}

TEST(ControlTest, APeerThatGoesAwayIsReportedOnceAndFailsNotify) {
  Inbox a_in, b_in;
  auto a = make("a", a_in);
  auto b = make("b", b_in);
  std::atomic<int> gone{0};
  Result<std::shared_ptr<Channel>> ch =
      a->connect(b->address(), "'b'", [&](const Status& why) {
        EXPECT_EQ(why.code(), Code::kIoError);
        ++gone;
      }, Clock::now() + 5s);
  ASSERT_TRUE(ch.ok());
  b.reset();
  for (int i = 0; i < 500 && gone == 0; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(gone.load(), 1);
  Status s = (*ch)->notify("late", Clock::now() + 1s);
  EXPECT_EQ(s.code(), Code::kIoError) << s.to_string();
  EXPECT_NE(s.message().find("peer 'b' is gone"), std::string::npos) << s.to_string();
  EXPECT_EQ(gone.load(), 1);
}

TEST(ControlTest, MalformedInboundFramesCloseTheConnectionOnly) {
  Inbox in;
  auto c = make("c", in);
  const std::vector<std::string> bad = {
      frame(0xdeadbeef, kControlVersion, 1, 0, "x"),           // magic
      frame(kControlMagic, 2, 1, 0, "x"),                      // version
      frame(kControlMagic, kControlVersion, 9, 0, ""),         // type
      frame(kControlMagic, kControlVersion, 2, 1, "early"),    // notify before hello
      frame(kControlMagic, kControlVersion, 1, 0, "", 1u << 30),  // length
      frame(kControlMagic, kControlVersion, 1, 0, ""),         // empty name
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    int fd = raw_connect(c->address());
    ASSERT_EQ(::send(fd, bad[i].data(), bad[i].size(), MSG_NOSIGNAL), static_cast<ssize_t>(bad[i].size()));
    EXPECT_TRUE(closed_by_peer(fd)) << "frame " << i << " was not refused";
    ::close(fd);
  }
  EXPECT_EQ(in.size(), 0u);
  // A well-formed client still gets through.
  int fd = raw_connect(c->address());
  std::string ok = frame(kControlMagic, kControlVersion, 1, 0, "raw") + frame(kControlMagic, kControlVersion, 2, 7, "hi");
  ASSERT_EQ(::send(fd, ok.data(), ok.size(), MSG_NOSIGNAL), static_cast<ssize_t>(ok.size()));
  char ack[kControlHeaderBytes];
  size_t got = 0;
  while (got < sizeof(ack)) {
    ssize_t n = ::recv(fd, ack + got, sizeof(ack) - got, 0);
    ASSERT_GT(n, 0);
    got += static_cast<size_t>(n);
  }
  EXPECT_EQ(static_cast<uint8_t>(ack[8]), 7);  // the ack echoes the sequence
  ::close(fd);
  ASSERT_EQ(in.size(), 1u);
  EXPECT_EQ(in.notes[0].peer, "raw");
  EXPECT_EQ(in.notes[0].message, "hi");
}

}  // namespace
}  // namespace kvbridge::engine_internal
