// The side channel end to end over loopback: the happy paths, each refusal
// with its message, injected server faults, and raw clients that send
// garbage, stop mid-frame or say nothing.
#include "connector/side_channel.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <thread>

#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"
#include "kvbridge/presets.h"
#include "net/frame.h"
#include "net/opening.h"
#include "testing/fake_side_channel.h"

namespace kvbridge::connector {
namespace {

using namespace std::chrono_literals;

struct Side {
  std::string identity;
  uint64_t hash = 0;
  RankInfo info;
};

Side side_of(const Layout& layout) {
  Side s{identity_text(layout), compatibility_hash(layout), {}};
  s.info.instance_id = "prefill-0";
  s.info.pid = static_cast<int32_t>(::getpid());
  s.info.layout_json = to_json(layout, -1);
  s.info.engine_metadata = "engine metadata bytes";
  uint32_t region = 1;
  for (const Tensor& t : layout.tensors) s.info.tensors.push_back({t.name, region++, 0x10000 * region, t.bytes});
  return s;
}

Layout preset(const std::string& name) {
  Result<Layout> l = make_preset({.name = name});
  EXPECT_TRUE(l.ok()) << l.status().to_string();
  return l.ok() ? *l : Layout{};
}

SideChannelOptions fast(std::string secret = {}) {
  SideChannelOptions o;
  o.timeout = 300ms;
  o.secret = std::move(secret);
  return o;
}

std::unique_ptr<SideChannelServer> start(const Side& side, const SideChannelOptions& options) {
  auto s = SideChannelServer::start(options, side.identity, side.hash, side.info);
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  return s.ok() ? std::move(*s) : nullptr;
}

// Waits up to two seconds for `done`; false if it never held.
bool eventually(const std::function<bool()>& done) {
  for (auto until = std::chrono::steady_clock::now() + 2s; std::chrono::steady_clock::now() < until;) {
    if (done()) return true;
    std::this_thread::sleep_for(2ms);
  }
  return done();
}

// A blocking loopback socket with a 2 s receive timeout, for raw clients.
int raw_connect(const std::string& address) {
  const size_t colon = address.rfind(':');
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  ::inet_pton(AF_INET, address.substr(0, colon).c_str(), &a.sin_addr);
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  timeval tv{2, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  return fd;
}

// Everything the server sends until it closes.
std::string read_to_end(int fd) {
  std::string all;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;) all.append(buf, static_cast<size_t>(n));
  return all;
}

net::OpeningConfig opening_config(std::string secret) {
  return net::OpeningConfig{net::Protocol::kSideChannel, kHandshakeVersion, std::move(secret),
                            net::OpeningLimits{kOpenBodyBytes, kMaxRefuseDetailBytes}};
}

// The Refuse frame at the start of `bytes`.
Result<net::Refusal> refusal_in(std::string_view bytes) {
  if (bytes.size() < net::kFrameHeaderBytes) return Status::invalid_argument("no frame");
  KVB_ASSIGN_OR_RETURN(net::FrameHeader h,
                       net::decode_header(bytes.substr(0, net::kFrameHeaderBytes), net::Protocol::kSideChannel,
                                          kHandshakeVersion, max_payload_bytes));
  if (h.type != net::kRefuse) return Status::invalid_argument("not a Refuse");
  return net::decode_refusal(bytes.substr(net::kFrameHeaderBytes, h.payload_bytes), kMaxRefuseDetailBytes);
}

void expect_error(const Result<RankInfo>& r, Code code, const std::string& fragment) {
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code(), code) << r.error().to_string();
  EXPECT_NE(r.error().message().find(fragment), std::string::npos) << r.error().message();
}

TEST(SideChannelTest, ServesTheRankInfoWithoutASecret) {
  Side side = side_of(preset("llama3-8b"));
  auto server = start(side, fast());
  Result<RankInfo> got = fetch_rank_info(server->address(), side.identity, side.hash, fast());
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_NE(got->clock_ns, 0u);
  RankInfo expected = side.info;
  expected.clock_ns = got->clock_ns;
  EXPECT_EQ(*got, expected);
  EXPECT_TRUE(eventually([&] { return server->served() == 1; }));
  EXPECT_EQ(server->rejected(), 0u);
}

TEST(SideChannelTest, ServesWithAMatchingSecretAndServesUpdatedInfo) {
  Side side = side_of(preset("llama3-8b"));
  auto server = start(side, fast("correct horse battery staple"));
  ASSERT_TRUE(fetch_rank_info(server->address(), side.identity, side.hash, fast("correct horse battery staple")).ok());
  side.info.instance_id = "prefill-7";
  server->set_info(side.info);
  Result<RankInfo> got =
      fetch_rank_info(server->address(), side.identity, side.hash, fast("correct horse battery staple"));
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(got->instance_id, "prefill-7");
  EXPECT_TRUE(eventually([&] { return server->served() == 2; }));
}

TEST(SideChannelTest, NamesBothVersionsOnAVersionMismatch) {
  Side side = side_of(preset("llama3-8b"));
  testing::FakeSideChannel::Options f;
  f.mode = testing::FakeSideChannel::Mode::kOtherVersion;
  auto fake = testing::FakeSideChannel::start(f);
  ASSERT_TRUE(fake.ok());
  Result<RankInfo> got = fetch_rank_info((*fake)->address(), side.identity, side.hash, fast());
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.error().code(), Code::kIncompatible);
  EXPECT_EQ(got.error().message(),
            "side channel " + (*fake)->address() + ": side channel version mismatch: local 2, peer 3");
}

// A client of the version before the shared frame header gets an answer in
// its own format, so it can say why (and the server counts it).
TEST(SideChannelTest, AnsweresAVersionOneClientInItsOwnFormat) {
  Side side = side_of(preset("llama3-8b"));
  auto server = start(side, fast());
  int fd = raw_connect(server->address());
  // Version 1 Hello: "KVBH", u16 1, type 1, reserved, u32 41, then 41 bytes.
  std::string hello("KVBH\x01\x00\x01\x00\x29\x00\x00\x00", 12);
  hello.append(41, '\0');
  ASSERT_EQ(::send(fd, hello.data(), hello.size(), 0), static_cast<ssize_t>(hello.size()));
  std::string reply = read_to_end(fd);
  ::close(fd);
  EXPECT_EQ(reply, legacy_version_refusal(1));
  EXPECT_TRUE(eventually([&] { return server->rejected() == 1; }));
  EXPECT_NE(server->last_rejection().find("side channel version mismatch: local 2, peer 1"), std::string::npos)
      << server->last_rejection();
}

TEST(SideChannelTest, NamesTheFirstDifferingFieldOnAHashMismatch) {
  Layout local = preset("llama3-8b");
  Layout remote = local;
  remote.groups[0].layers[0].components[0].heads->total = 4;
  Side server_side = side_of(remote);
  auto server = start(server_side, fast("s3cret"));
  Result<RankInfo> got =
      fetch_rank_info(server->address(), identity_text(local), compatibility_hash(local), fast("s3cret"));
  expect_error(got, Code::kIncompatible,
               "compatibility hash mismatch (local " + compatibility_hash_hex(local) + ", peer " +
                   compatibility_hash_hex(remote) +
                   "): group 'full' layer 'layers.0' component 'k': heads.total differs: 8 vs 4");
  EXPECT_EQ(server->rejected(), 1u);
  EXPECT_NE(server->last_rejection().find("compatibility hash mismatch"), std::string::npos);

  Layout big = preset("llama3-70b");
  got = fetch_rank_info(server->address(), identity_text(big), compatibility_hash(big), fast("s3cret"));
  expect_error(got, Code::kIncompatible, "model differs: 'llama3-70b' vs 'llama3-8b'");
}

TEST(SideChannelTest, RefusesAWrongSecret) {
  Side side = side_of(preset("llama3-8b"));
  auto server = start(side, fast("right"));
  expect_error(fetch_rank_info(server->address(), side.identity, side.hash, fast("wrong")), Code::kPermissionDenied,
               "authentication failed: wrong shared secret");
  // The client does not prove itself to a server that could not; the server
  // sees it leave.
  EXPECT_TRUE(eventually([&] { return server->rejected() == 1; }));
  EXPECT_EQ(server->served(), 0u);
}

TEST(SideChannelTest, RefusesAClientWithoutTheServersSecret) {
  Side side = side_of(preset("llama3-8b"));
  auto server = start(side, fast("right"));
  expect_error(fetch_rank_info(server->address(), side.identity, side.hash, fast()), Code::kPermissionDenied,
               "authentication failed: peer requires a shared secret");
  EXPECT_EQ(server->rejected(), 1u);
  EXPECT_NE(server->last_rejection().find("offered no shared secret"), std::string::npos);
}

TEST(SideChannelTest, ClientWithASecretRefusesAServerWithout) {
  Side side = side_of(preset("llama3-8b"));
  auto server = start(side, fast());
  expect_error(fetch_rank_info(server->address(), side.identity, side.hash, fast("mine")), Code::kPermissionDenied,
               "authentication failed: this side has a shared secret but the peer has none");
}

TEST(SideChannelTest, TellsAnUnauthenticatedClientNothingElse) {
  // A different layout, so that a leak would carry the server's identity.
  Side side = side_of(preset("llama3-8b"));
  auto server = start(side, fast("right"));
  int fd = raw_connect(server->address());
  net::ClientOpening opening(opening_config(""), encode_open_body(12345));
  const std::string& open = opening.open_frame();
  ASSERT_EQ(::send(fd, open.data(), open.size(), 0), static_cast<ssize_t>(open.size()));
  std::string reply = read_to_end(fd);
  ::close(fd);
  Result<net::Refusal> r = refusal_in(reply);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->code, net::RefuseCode::kAuthRequired);
  EXPECT_TRUE(r->detail.empty());
  EXPECT_EQ(reply.find("llama3"), std::string::npos);
}

TEST(SideChannelTest, RefusesAForgedProof) {
  Side side = side_of(preset("llama3-8b"));
  auto server = start(side, fast("right"));
  int fd = raw_connect(server->address());
  net::ClientOpening opening(opening_config("right"), encode_open_body(side.hash));
  const std::string& open = opening.open_frame();
  ASSERT_EQ(::send(fd, open.data(), open.size(), 0), static_cast<ssize_t>(open.size()));
  // Whatever the Challenge says, a Proof of zeros.
  std::string proof;
  net::Session none;
  net::append_frame(proof, {net::Protocol::kSideChannel, net::kProof, kHandshakeVersion, 0, false},
                    std::string(net::kMacBytes, '\0'), none);
  ASSERT_EQ(::send(fd, proof.data(), proof.size(), 0), static_cast<ssize_t>(proof.size()));
  std::string reply = read_to_end(fd);
  ::close(fd);
  const size_t challenge = net::kFrameHeaderBytes + 64;
  ASSERT_GT(reply.size(), challenge);
  Result<net::Refusal> r = refusal_in(reply.substr(challenge));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->code, net::RefuseCode::kAuthFailed);
  EXPECT_NE(server->last_rejection().find("wrong shared secret"), std::string::npos);
  EXPECT_EQ(server->served(), 0u);
}

TEST(SideChannelTest, ReportsGarbageAndTruncatedReplies) {
  Side side = side_of(preset("llama3-8b"));
  auto server = start(side, fast());
  testing::FakeSideChannel::Options f;
  f.mode = testing::FakeSideChannel::Mode::kGarbage;
  auto garbage = testing::FakeSideChannel::start(f);
  expect_error(fetch_rank_info((*garbage)->address(), side.identity, side.hash, fast()), Code::kInvalidArgument,
               "malformed handshake: bad magic");
  f.mode = testing::FakeSideChannel::Mode::kTruncate;
  f.real_address = server->address();
  f.identity = side.identity;
  f.hash = side.hash;
  auto truncate = testing::FakeSideChannel::start(f);
  expect_error(fetch_rank_info((*truncate)->address(), side.identity, side.hash, fast()), Code::kInvalidArgument,
               "malformed handshake: truncated frame: peer closed after");
}

// Idle clients that re-open as they expire (a flood) never make a real
// handshake wait for them: the oldest opening connection gives way.
TEST(SideChannelTest, IdleClientsThatKeepReopeningDoNotBlockARealHandshake) {
  Side side = side_of(preset("llama3-8b"));
  SideChannelOptions o = fast();
  o.timeout = 5s;
  o.max_pending = 16;
  auto server = start(side, o);
  std::atomic<bool> stop{false};
  std::thread flood([&] {
    std::vector<int> fds;
    while (!stop.load()) {
      fds.push_back(raw_connect(server->address()));
      if (fds.size() > 64) {
        ::close(fds.front());
        fds.erase(fds.begin());
      }
      std::this_thread::sleep_for(1ms);
    }
    for (int fd : fds) ::close(fd);
  });
  std::this_thread::sleep_for(100ms);
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    Result<RankInfo> got = fetch_rank_info(server->address(), side.identity, side.hash, o);
    EXPECT_TRUE(got.ok()) << got.status().to_string();
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  }
  stop = true;
  flood.join();
}

// Sends `bytes` from a raw client, reads to the end, and checks the server
// counted a rejection with `why` and still serves a proper client.
void expect_survives(const std::string& bytes, const std::string& why, bool close_early = false) {
  Side side = side_of(preset("llama3-8b"));
  auto server = start(side, fast());
  int fd = raw_connect(server->address());
  if (!bytes.empty()) {
    ASSERT_EQ(::send(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
  }
  if (close_early) ::shutdown(fd, SHUT_WR);
  // A silent client still holds its slot while another is served.
  if (bytes.empty()) {
    ASSERT_TRUE(fetch_rank_info(server->address(), side.identity, side.hash, fast()).ok());
  }
  read_to_end(fd);
  ::close(fd);
  EXPECT_TRUE(eventually([&] { return server->rejected() == 1; }));
  EXPECT_NE(server->last_rejection().find(why), std::string::npos) << server->last_rejection();
  Result<RankInfo> got = fetch_rank_info(server->address(), side.identity, side.hash, fast());
  EXPECT_TRUE(got.ok()) << got.status().to_string();
}

TEST(SideChannelTest, SurvivesAGarbageClient) { expect_survives(std::string(64, '\x5a'), "malformed: bad magic"); }

TEST(SideChannelTest, SurvivesAnOversizedLength) {
  std::string header;
  net::encode_header({net::Protocol::kSideChannel, net::kOpen, kHandshakeVersion, 0xffffffffu, false}, header);
  expect_survives(header, "length 4294967295 exceeds 45");
}

TEST(SideChannelTest, SurvivesATruncatedFrame) {
  net::ClientOpening opening(opening_config(""), encode_open_body(1));
  expect_survives(opening.open_frame().substr(0, 20),
                  "client closed the connection in the middle of a frame (after 20 bytes)", true);
}

TEST(SideChannelTest, SurvivesASilentClient) { expect_survives("", "did not finish within 300 ms"); }

TEST(SideChannelTest, ClientTimesOutOnASilentServer) {
  Side side = side_of(preset("llama3-8b"));
  auto server = start(side, fast());
  // A listener that never answers: the kernel completes the connect.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const std::string address = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  auto t0 = std::chrono::steady_clock::now();
  expect_error(fetch_rank_info(address, side.identity, side.hash, fast()), Code::kTimeout,
               "side channel " + address + ": deadline passed");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1500ms);
  ::close(fd);
}

TEST(SideChannelTest, ReportsARefusedConnection) {
  Side side = side_of(preset("llama3-8b"));
  std::string address = start(side, fast())->address();  // destroyed at once: the port is closed
  expect_error(fetch_rank_info(address, side.identity, side.hash, fast()), Code::kUnavailable,
               "side channel " + address + ": connect: Connection refused");
}

TEST(SideChannelTest, StopsWhileAClientIsMidHandshake) {
  Side side = side_of(preset("llama3-8b"));
  SideChannelOptions slow = fast();
  slow.timeout = 10s;
  auto server = start(side, slow);
  int fd = raw_connect(server->address());
  net::ClientOpening opening(opening_config(""), encode_open_body(1));
  ASSERT_EQ(::send(fd, opening.open_frame().data(), 5, 0), 5);
  std::this_thread::sleep_for(20ms);
  auto t0 = std::chrono::steady_clock::now();
  server.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s);
  EXPECT_EQ(read_to_end(fd), "");  // closed, not answered
  ::close(fd);
}

TEST(SideChannelTest, StartRefusesBadOptionsAndInfo) {
  Side side = side_of(preset("llama3-8b"));
  side.info.rank = 3;
  EXPECT_EQ(SideChannelServer::start(fast(), side.identity, side.hash, side.info).status().code(),
            Code::kInvalidArgument);
  side.info.rank = 0;
  SideChannelOptions o = fast();
  o.timeout = 0ms;
  EXPECT_EQ(SideChannelServer::start(o, side.identity, side.hash, side.info).status().code(), Code::kInvalidArgument);
  o = fast();
  o.host = "no.such.host.invalid";
  EXPECT_EQ(SideChannelServer::start(o, side.identity, side.hash, side.info).status().code(), Code::kUnavailable);
  o.host = "::1:80";  // an IPv6 address without brackets
  EXPECT_EQ(SideChannelServer::start(o, side.identity, side.hash, side.info).status().code(), Code::kInvalidArgument);
  expect_error(fetch_rank_info("stop", side.identity, side.hash, fast()), Code::kInvalidArgument,
               "side channel address 'stop' is not host:port");
}

}  // namespace
}  // namespace kvbridge::connector
