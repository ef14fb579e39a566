#include "net/listener.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <thread>
#include <vector>

#include "net/socket.h"

namespace kvbridge::net {
namespace {

using namespace std::chrono_literals;
constexpr OpeningLimits kListenerLimits{256, 0};
size_t listener_limit(uint8_t type) { return type >= kFirstProtocolType ? 4096 : opening_limit(type, kListenerLimits); }

struct Fixture {
  std::atomic<int> kept{0};
  std::vector<Accepted> held;
  std::mutex mu;
  std::unique_ptr<Listener> listener;  // last: stopped first, before what its thread touches
};

std::unique_ptr<Fixture> start(std::string secret, size_t max_pending = 8, size_t max_open = 4,
                               std::chrono::milliseconds open_timeout = 2000ms,
                               std::chrono::milliseconds idle_grace = 500ms) {
  auto f = std::make_unique<Fixture>();
  ListenerOptions o;
  o.name = "test listener";
  o.bind = HostPort{"127.0.0.1", 0};
  o.opening = OpeningConfig{Protocol::kControl, 2, std::move(secret), kListenerLimits};
  o.limit = listener_limit;
  o.max_pending = max_pending;
  o.max_open = max_open;
  o.open_timeout = open_timeout;
  o.idle_grace = idle_grace;
  Fixture* raw = f.get();
  o.on_open = [](const OpenRequest& r) {
    if (r.body == "refuse me") return Answer::refuse(RefuseCode::kDenied, "not you");
    if (r.body == "reply") return Answer::reply(16, "one answer");
    return Answer::keep(16, std::string(r.body));
  };
  o.on_keep = [raw](Accepted a) {
    std::lock_guard<std::mutex> lock(raw->mu);
    raw->held.push_back(std::move(a));
    ++raw->kept;
  };
  Result<std::unique_ptr<Listener>> l = Listener::start(std::move(o));
  EXPECT_TRUE(l.ok()) << l.error().to_string();
  f->listener = std::move(*l);
  return f;
}

// `n` connections to `l` that never send a byte (a flood); an empty vector
// when one cannot be dialled (the test fails on the size).
std::vector<Fd> dial_idle(const Listener& l, int n) {
  std::vector<Fd> idle;
  for (int i = 0; i < n; ++i) {
    Result<Fd> d = dial(l.address(), IoLimits{Clock::now() + 5s, nullptr, nullptr}, "idle");
    EXPECT_TRUE(d.ok()) << d.error().to_string();
    if (!d.ok()) return {};
    idle.push_back(std::move(*d));
  }
  return idle;
}

// Waits up to `within` for the listener's stats to satisfy `done`.
template <typename Done>
bool stats_reach(const Listener& l, Done done, std::chrono::milliseconds within = 5000ms) {
  for (const auto until = Clock::now() + within; Clock::now() < until;) {
    if (done(l.stats())) return true;
    std::this_thread::sleep_for(2ms);
  }
  return done(l.stats());
}

// Opens as kvbridge's clients do (dial_and_open: again when closed unanswered).
Result<Opened> open(const Listener& l, std::string body, std::string secret = "", Fd* keep_fd = nullptr) {
  IoLimits limits{Clock::now() + 5s, nullptr, nullptr};
  KVB_ASSIGN_OR_RETURN(
      Dialed d, dial_and_open(l.address(), OpeningConfig{Protocol::kControl, 2, std::move(secret), kListenerLimits},
                              std::move(body), listener_limit, limits, "test client"));
  if (keep_fd) *keep_fd = std::move(d.fd);
  return std::move(d.opened);
}

TEST(ListenerTest, KeepsRepliesAndRefusesAsTheProtocolSays) {
  auto f = start("");
  Result<Opened> kept = open(*f->listener, "hello");
  ASSERT_TRUE(kept.ok()) << kept.error().to_string();
  EXPECT_EQ(kept->payload, "hello");
  Result<Opened> replied = open(*f->listener, "reply");
  ASSERT_TRUE(replied.ok());
  EXPECT_EQ(replied->payload, "one answer");
  Result<Opened> refused = open(*f->listener, "refuse me");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code(), Code::kPermissionDenied);
  EXPECT_NE(refused.error().message().find("not you"), std::string::npos);
  for (int i = 0; i < 100 && f->kept.load() < 1; ++i) std::this_thread::sleep_for(10ms);
  ListenerStats s = f->listener->stats();
  EXPECT_EQ(s.kept, 1u);
  EXPECT_EQ(s.replied, 1u);
  EXPECT_EQ(s.refused, 1u);
  EXPECT_NE(s.last_failure.find("not you"), std::string::npos);
}

TEST(ListenerTest, TheSecretIsRequiredAndKeptConnectionsAreTagged) {
  auto f = start("s3cret");
  EXPECT_EQ(open(*f->listener, "x").error().code(), Code::kPermissionDenied);
  EXPECT_EQ(open(*f->listener, "x", "guess").error().code(), Code::kPermissionDenied);
  Result<Opened> ok = open(*f->listener, "x", "s3cret");
  ASSERT_TRUE(ok.ok()) << ok.error().to_string();
  EXPECT_TRUE(ok->session.keyed());
  for (int i = 0; i < 100 && f->kept.load() < 1; ++i) std::this_thread::sleep_for(10ms);
  std::lock_guard<std::mutex> lock(f->mu);
  ASSERT_EQ(f->held.size(), 1u);
  EXPECT_TRUE(f->held[0].session.keyed());
}

// A client on this host is counted by the user owning its socket, as the
// kernel says (never by what it claims); this process's own user is not
// bounded per source, so its clients reach max_open as before.
TEST(ListenerTest, AClientOnThisHostIsCountedByItsUser) {
  auto f = start("", 8, 4);
  for (const char* who : {"a", "b", "c"}) ASSERT_TRUE(open(*f->listener, who).ok()) << who;
  for (int i = 0; i < 100 && f->kept.load() < 3; ++i) std::this_thread::sleep_for(10ms);
  std::lock_guard<std::mutex> lock(f->mu);
  ASSERT_EQ(f->held.size(), 3u);
  EXPECT_EQ(connection_source(f->held[0].fd.get()), "uid " + std::to_string(::geteuid()) + " on this host");
  EXPECT_EQ(f->listener->stats().refused_source, 0u) << "more than half of max_open from this process's own user";
}

TEST(ListenerTest, PastMaxOpenClientsAreRefusedAsBusyUntilASlotIsFreed) {
  auto f = start("", 8, 2);
  ASSERT_TRUE(open(*f->listener, "a").ok());
  ASSERT_TRUE(open(*f->listener, "b").ok());
  for (int i = 0; i < 100 && f->kept.load() < 2; ++i) std::this_thread::sleep_for(10ms);
  Result<Opened> busy = open(*f->listener, "c");
  ASSERT_FALSE(busy.ok());
  EXPECT_EQ(busy.error().code(), Code::kUnavailable);
  EXPECT_NE(busy.error().message().find("busy"), std::string::npos) << busy.error().to_string();
  {
    std::lock_guard<std::mutex> lock(f->mu);
    f->held.clear();  // the slots go with the connections
  }
  EXPECT_TRUE(open(*f->listener, "d").ok());
}

// A protocol that lets its idle connections be reclaimed: with every place
// taken, a new client gets the place idle the longest; a busy connection, or
// one that is not reapable, keeps its place.
TEST(ListenerTest, PastMaxOpenTheConnectionIdleTheLongestMakesRoom) {
  auto f = start("", 8, 3);
  ASSERT_TRUE(open(*f->listener, "a").ok());
  ASSERT_TRUE(open(*f->listener, "b").ok());
  ASSERT_TRUE(open(*f->listener, "c").ok());
  for (int i = 0; i < 100 && f->kept.load() < 3; ++i) std::this_thread::sleep_for(10ms);
  {
    std::lock_guard<std::mutex> lock(f->mu);
    ASSERT_EQ(f->held.size(), 3u);
    // a: reapable, idle first; b: reapable, idle later; c: not reapable.
    for (int i : {0, 1}) f->held[i].slot->set_reapable();
    f->held[0].slot->idle();
    std::this_thread::sleep_for(2ms);
    f->held[1].slot->idle();
    f->held[2].slot->idle();
  }
  Result<Opened> d = open(*f->listener, "d");
  ASSERT_TRUE(d.ok()) << d.error().to_string();
  EXPECT_EQ(f->listener->stats().reclaimed, 1u);
  {
    std::lock_guard<std::mutex> lock(f->mu);
    EXPECT_TRUE(f->held[0].slot->reclaimed());
    EXPECT_FALSE(f->held[0].slot->busy()) << "a was idle the longest: its place went to d";
    EXPECT_TRUE(f->held[1].slot->busy()) << "b turns busy: a request arrived before any reclaim";
  }
  // Full again (b busy, c not reapable, d not reapable): busy.
  for (int i = 0; i < 100 && f->kept.load() < 4; ++i) std::this_thread::sleep_for(10ms);
  Result<Opened> e = open(*f->listener, "e");
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.error().message().find("busy"), std::string::npos) << e.error().to_string();
  EXPECT_EQ(f->listener->stats().reclaimed, 1u);
}

TEST(ListenerTest, IdleConnectionsNeverLockOutARealClient) {
  auto f = start("s3cret", 16, 64, 10s);
  const std::vector<Fd> idle = dial_idle(*f->listener, 400);
  ASSERT_EQ(idle.size(), 400u);
  // The kernel hands the silent connections over once their deferral ends.
  ASSERT_TRUE(stats_reach(*f->listener, [](const ListenerStats& s) { return s.accepted >= 400; }));
  const auto start_time = Clock::now();
  Result<Opened> real = open(*f->listener, "real", "s3cret");
  ASSERT_TRUE(real.ok()) << real.error().to_string();
  EXPECT_LT(Clock::now() - start_time, 3s);
  EXPECT_GT(f->listener->stats().evicted, 0u);
  EXPECT_LE(f->listener->stats().pending, 16u);
}

// A flood that arrives while a real client is in the middle of its opening
// (its Open read, the Challenge answered next) pushes out idle connections,
// never the client that got further.
TEST(ListenerTest, AFloodDuringARealClientsOpeningDoesNotPushItOut) {
  auto f = start("s3cret", 16, 64, 10s);
  const IoLimits limits{Clock::now() + 5s, nullptr, nullptr};
  Result<Fd> fd = dial(f->listener->address(), limits, "real");
  ASSERT_TRUE(fd.ok()) << fd.error().to_string();
  const OpeningConfig config{Protocol::kControl, 2, "s3cret", kListenerLimits};
  ClientOpening opening(config, "real");
  ASSERT_TRUE(send_bytes(fd->get(), opening.open_frame().data(), opening.open_frame().size(), limits, "real").ok());
  const auto read_one = [&](FrameReader& reader) -> Status {
    while (!reader.ready()) {
      std::string buf(reader.wanted(), '\0');
      KVB_RETURN_IF_ERROR(recv_bytes(fd->get(), buf.data(), buf.size(), limits, "real"));
      KVB_RETURN_IF_ERROR(reader.feed(buf));
    }
    return Status();
  };
  FrameReader reader(config.protocol, config.version, listener_limit);
  ASSERT_TRUE(read_one(reader).ok());  // the Challenge: the server has read our Open
  ClientOpening::Step proof = opening.on_frame(reader.header(), reader.raw_header(), reader.payload(), reader.tag());
  ASSERT_EQ(proof.kind, ClientOpening::Step::Kind::kSend);
  reader.next();

  const std::vector<Fd> idle = dial_idle(*f->listener, 400);
  ASSERT_EQ(idle.size(), 400u);
  // The flood was accepted past the table, many times over.
  EXPECT_TRUE(stats_reach(*f->listener, [](const ListenerStats& s) { return s.evicted >= 300; }))
      << f->listener->stats().evicted;

  ASSERT_TRUE(send_bytes(fd->get(), proof.bytes.data(), proof.bytes.size(), limits, "real").ok());
  Status answered = read_one(reader);
  ASSERT_TRUE(answered.ok()) << answered.to_string() << "; " << f->listener->stats().last_failure;
  ClientOpening::Step opened = opening.on_frame(reader.header(), reader.raw_header(), reader.payload(), reader.tag());
  EXPECT_EQ(opened.kind, ClientOpening::Step::Kind::kOpened) << opened.error.to_string();
}

// A real client that has connected but not yet written its Open (a loaded
// machine can hold it between connect() and send()) is not pushed out by a
// flood of idle connections arriving meanwhile: within the grace the silent
// newcomers are closed instead.
TEST(ListenerTest, AClientSlowToSendItsOpenIsNotPushedOutByAFlood) {
  auto f = start("s3cret", 16, 64, 20s, 8s);
  const IoLimits limits{Clock::now() + 15s, nullptr, nullptr};
  Result<Fd> fd = dial(f->listener->address(), limits, "slow");
  ASSERT_TRUE(fd.ok()) << fd.error().to_string();
  // Silent, it reaches the listener once the kernel's deferral ends.
  ASSERT_TRUE(stats_reach(*f->listener, [](const ListenerStats& s) { return s.accepted >= 1; }));
  const std::vector<Fd> idle = dial_idle(*f->listener, 400);
  ASSERT_EQ(idle.size(), 400u);
  // The flood went past the table, many times over.
  EXPECT_TRUE(stats_reach(*f->listener, [](const ListenerStats& s) { return s.evicted >= 300; }))
      << f->listener->stats().evicted;
  EXPECT_LE(f->listener->stats().pending, 16u);
  // Only now does the slow client speak.
  Result<Opened> r = open_client(fd->get(), OpeningConfig{Protocol::kControl, 2, "s3cret", kListenerLimits}, "slow",
                                 listener_limit, limits, "slow");
  ASSERT_TRUE(r.ok()) << r.error().to_string() << "; " << f->listener->stats().last_failure;
}

// A client held between its connect() and its Open (a loaded machine) while
// the table is full of silent connections within their grace is not closed
// as silent: the listener first sees it when its Open has arrived. (Without
// the deferred accept the listener saw it at once, silent, and closed it.)
TEST(ListenerTest, AClientThatWritesItsOpenLateAfterConnectIsNotClosedAsSilent) {
  auto f = start("s3cret", 4, 64, 20s, 8s);
  const IoLimits limits{Clock::now() + 15s, nullptr, nullptr};
  const std::vector<Fd> idle = dial_idle(*f->listener, 4);
  ASSERT_EQ(idle.size(), 4u);
  ASSERT_TRUE(stats_reach(*f->listener, [](const ListenerStats& s) { return s.pending >= 4; }));
  Result<Fd> fd = dial(f->listener->address(), limits, "late writer");
  ASSERT_TRUE(fd.ok()) << fd.error().to_string();
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(f->listener->stats().accepted, 4u);  // not handed over yet: it has not spoken
  Result<Opened> r = open_client(fd->get(), OpeningConfig{Protocol::kControl, 2, "s3cret", kListenerLimits},
                                 "late writer", listener_limit, limits, "late writer");
  ASSERT_TRUE(r.ok()) << r.error().to_string() << "; " << f->listener->stats().last_failure;
  EXPECT_EQ(f->listener->stats().evicted, 1u);  // a silent one made room
}

// Past the grace, a silent connection is fair game again: the table cannot
// be held by idle connections longer than that.
TEST(ListenerTest, SilentConnectionsPastTheGraceMakeRoom) {
  auto f = start("s3cret", 4, 64, 20s, 100ms);
  const IoLimits limits{Clock::now() + 15s, nullptr, nullptr};
  const std::vector<Fd> idle = dial_idle(*f->listener, 4);
  ASSERT_EQ(idle.size(), 4u);
  ASSERT_TRUE(stats_reach(*f->listener, [](const ListenerStats& s) { return s.pending >= 4; }));
  std::this_thread::sleep_for(200ms);
  Result<Fd> late = dial(f->listener->address(), limits, "late idle");
  ASSERT_TRUE(late.ok());
  ASSERT_TRUE(stats_reach(*f->listener, [](const ListenerStats& s) { return s.accepted >= 5; }));
  const ListenerStats s = f->listener->stats();
  EXPECT_EQ(s.evicted, 1u);
  EXPECT_EQ(s.pending, 4u);
  EXPECT_NE(s.last_failure.find("closed for a newer connection"), std::string::npos) << s.last_failure;
}

// dial_and_open() opens again when a listener closed it unanswered (as a
// listener under a flood closes a newcomer that has not spoken yet), and
// never when it was answered: here a server that closes its first two
// connections at once and answers the third.
TEST(ListenerTest, DialAndOpenTriesAgainWhenClosedUnanswered) {
  Result<Listening> l = listen_on(HostPort{"127.0.0.1", 0}, 16, "test server");
  ASSERT_TRUE(l.ok()) << l.error().to_string();
  const OpeningConfig config{Protocol::kControl, 2, "", kListenerLimits};
  std::atomic<int> accepted{0};
  std::thread server([&] {
    for (int i = 0; i < 3; ++i) {
      pollfd p{l->fd.get(), POLLIN, 0};
      if (::poll(&p, 1, 5000) != 1) return;
      Fd c(::accept4(l->fd.get(), nullptr, nullptr, SOCK_CLOEXEC));
      ++accepted;
      if (i < 2) continue;  // closed unanswered
      const IoLimits limits{Clock::now() + 5s, nullptr, nullptr};
      FrameReader reader(config.protocol, config.version, listener_limit);
      while (!reader.ready()) {
        std::string buf(reader.wanted(), '\0');
        if (!recv_bytes(c.get(), buf.data(), buf.size(), limits, "server").ok() || !reader.feed(buf).ok()) return;
      }
      ServerOpening s(config);
      ServerOpening::Step st = s.on_frame(reader.header(), reader.raw_header(), reader.payload());
      if (st.kind != ServerOpening::Step::Kind::kOpened) return;
      Session session = s.take_session();
      std::string out;
      append_frame(out, {Protocol::kControl, 16, 2, 0, false}, "welcome", session);
      (void)send_bytes(c.get(), out.data(), out.size(), limits, "server");
    }
  });
  const IoLimits limits{Clock::now() + 5s, nullptr, nullptr};
  Result<Dialed> d = dial_and_open(l->bound, config, "me", listener_limit, limits, "test client");
  server.join();
  ASSERT_TRUE(d.ok()) << d.error().to_string();
  EXPECT_EQ(accepted.load(), 3);
  EXPECT_EQ(d->opened.payload, "welcome");

  // With a secret the opening has rounds: a connection reset after the
  // server's challenge (as a listener under churn does to one that got
  // least far) is tried again too, and the third try opens.
  const OpeningConfig keyed{Protocol::kControl, 2, "s3cret-for-the-test", kListenerLimits};
  Result<Listening> l2 = listen_on(HostPort{"127.0.0.1", 0}, 16, "test server");
  ASSERT_TRUE(l2.ok()) << l2.error().to_string();
  std::atomic<int> challenged{0};
  std::thread keyed_server([&] {
    for (int i = 0; i < 3; ++i) {
      pollfd p{l2->fd.get(), POLLIN, 0};
      if (::poll(&p, 1, 5000) != 1) return;
      Fd c(::accept4(l2->fd.get(), nullptr, nullptr, SOCK_CLOEXEC));
      const IoLimits lim{Clock::now() + 5s, nullptr, nullptr};
      ServerOpening s(keyed);
      for (;;) {
        FrameReader reader(keyed.protocol, keyed.version, listener_limit);
        while (!reader.ready()) {
          std::string buf(reader.wanted(), '\0');
          if (!recv_bytes(c.get(), buf.data(), buf.size(), lim, "server").ok() || !reader.feed(buf).ok()) return;
        }
        ServerOpening::Step st = s.on_frame(reader.header(), reader.raw_header(), reader.payload());
        if (st.kind == ServerOpening::Step::Kind::kSend) {
          (void)send_bytes(c.get(), st.bytes.data(), st.bytes.size(), lim, "server");
          ++challenged;
          if (i < 2) {
            const linger hard{1, 0};  // a reset, not a close
            ::setsockopt(c.get(), SOL_SOCKET, SO_LINGER, &hard, sizeof hard);
            break;
          }
          continue;
        }
        if (st.kind != ServerOpening::Step::Kind::kOpened) return;
        Session session = s.take_session();
        std::string out;
        append_frame(out, {Protocol::kControl, 16, 2, 0, false}, "welcome", session);
        (void)send_bytes(c.get(), out.data(), out.size(), lim, "server");
        break;
      }
    }
  });
  Result<Dialed> k = dial_and_open(l2->bound, keyed, "me", listener_limit, limits, "test client");
  keyed_server.join();
  ASSERT_TRUE(k.ok()) << k.error().to_string();
  EXPECT_EQ(challenged.load(), 3);

  // A refusal is an answer: one try only.
  auto f = start("s3cret");
  const auto before = f->listener->stats().accepted;
  Result<Dialed> refused =
      dial_and_open(f->listener->address(), OpeningConfig{Protocol::kControl, 2, "wrong", kListenerLimits}, "me",
                    listener_limit, limits, "test client");
  EXPECT_FALSE(refused.ok());
  EXPECT_EQ(f->listener->stats().accepted, before + 1);
}

TEST(ListenerTest, ASilentClientIsClosedAtTheOpenTimeout) {
  auto f = start("", 8, 4, 200ms);
  Result<Fd> fd = dial(f->listener->address(), IoLimits{Clock::now() + 5s, nullptr, nullptr}, "silent");
  ASSERT_TRUE(fd.ok());
  char c;
  Status s = recv_bytes(fd->get(), &c, 1, IoLimits{Clock::now() + 5s, nullptr, nullptr}, "silent");
  EXPECT_EQ(s.code(), Code::kIoError) << s.to_string();  // closed by the listener
  EXPECT_NE(f->listener->stats().last_failure.find("did not finish within 200 ms"), std::string::npos);
}

// With no descriptor left, accept(2) fails with EMFILE while the listening
// socket stays readable; the listener must pause, not spin.
TEST(ListenerTest, OutOfDescriptorsPausesAcceptingInsteadOfSpinning) {
  auto f = start("");
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old), 0);
  std::vector<Fd> fill;
  int go[2];
  ASSERT_EQ(::pipe(go), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    // The client: many connections the listener cannot accept, once the
    // parent has no descriptor left (a slow build must not let it accept
    // them first). Each sends a byte, so the kernel hands it over at once.
    char c;
    ::close(go[1]);
    if (::read(go[0], &c, 1) != 1) ::_exit(1);
    std::vector<Fd> conns;
    for (int i = 0; i < 20; ++i) {
      Result<Fd> fd = dial(f->listener->address(), IoLimits{Clock::now() + 2s, nullptr, nullptr}, "c");
      if (!fd.ok()) continue;
      [[maybe_unused]] ssize_t n = ::send(fd->get(), "x", 1, MSG_NOSIGNAL);
      conns.push_back(std::move(*fd));
    }
    ::sleep(3);
    ::_exit(0);
  }
  // Use up this process's descriptors, then measure its CPU while the
  // client's connections wait.
  ::close(go[0]);
  rlimit low = old;
  low.rlim_cur = 64;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  while (true) {
    int fd = ::dup(0);
    if (fd < 0) break;
    fill.emplace_back(fd);
  }
  ASSERT_EQ(::write(go[1], "g", 1), 1);
  ::close(go[1]);
  rusage before{}, after{};
  ::getrusage(RUSAGE_SELF, &before);
  std::this_thread::sleep_for(1500ms);
  ::getrusage(RUSAGE_SELF, &after);
  fill.clear();
  ::setrlimit(RLIMIT_NOFILE, &old);
  auto cpu_us = [](const rusage& r) {
    return (r.ru_utime.tv_sec + r.ru_stime.tv_sec) * 1000000L + r.ru_utime.tv_usec + r.ru_stime.tv_usec;
  };
  const long used = cpu_us(after) - cpu_us(before);
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_LT(used, 150000) << "the listener used " << used / 1000 << " ms of CPU in 1.5 s at the descriptor limit";
  EXPECT_GT(f->listener->stats().accept_pauses, 0u);
}

}  // namespace
}  // namespace kvbridge::net
