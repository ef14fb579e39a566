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

#include <functional>
#include <thread>

#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"
#include "kvbridge/presets.h"

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
  Result<RankInfo> got = fetch_rank_info(server->address(), side.identity, side.hash, fast("correct horse battery staple"));
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(got->instance_id, "prefill-7");
  EXPECT_TRUE(eventually([&] { return server->served() == 2; }));
}

TEST(SideChannelTest, NamesBothVersionsOnAVersionMismatch) {
  Side side = side_of(preset("llama3-8b"));
  SideChannelOptions o = fast();
  o.advertise_version = 2;
  auto server = start(side, o);
  Result<RankInfo> got = fetch_rank_info(server->address(), side.identity, side.hash, fast());
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.error().code(), Code::kIncompatible);
  EXPECT_EQ(got.error().message(),
            "side channel " + server->address() + ": handshake version mismatch: local 1, peer 2");
  EXPECT_EQ(server->rejected(), 1u);
  EXPECT_NE(server->last_rejection().find("handshake version mismatch: local 2, peer 1"), std::string::npos)
      << server->last_rejection();
}

TEST(SideChannelTest, NamesTheFirstDifferingFieldOnAHashMismatch) {
  Layout local = preset("llama3-8b");
  Layout remote = local;
  remote.groups[0].layers[0].components[0].heads->total = 4;
  Side server_side = side_of(remote);
  auto server = start(server_side, fast("s3cret"));
  Result<RankInfo> got = fetch_rank_info(server->address(), identity_text(local), compatibility_hash(local), fast("s3cret"));
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
  std::string hello = encode_frame(FrameType::kHello, encode_hello({false, {}, 12345}));
  ASSERT_EQ(::send(fd, hello.data(), hello.size(), 0), static_cast<ssize_t>(hello.size()));
  std::string reply = read_to_end(fd);
  ::close(fd);
  Result<Frame> f = decode_frame(reply);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  Result<Reject> r = decode_reject(f->payload);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->code, RejectCode::kAuthRequired);
  EXPECT_EQ(r->hash, 0u);
  EXPECT_TRUE(r->identity.empty());
  EXPECT_EQ(reply.find("llama3"), std::string::npos);
}

TEST(SideChannelTest, RefusesAForgedProof) {
  Side side = side_of(preset("llama3-8b"));
  auto server = start(side, fast("right"));
  int fd = raw_connect(server->address());
  std::string hello = encode_frame(FrameType::kHello, encode_hello({true, {}, side.hash}));
  std::string proof = encode_frame(FrameType::kProof, encode_proof({}));
  ASSERT_EQ(::send(fd, hello.data(), hello.size(), 0), static_cast<ssize_t>(hello.size()));
  ASSERT_EQ(::send(fd, proof.data(), proof.size(), 0), static_cast<ssize_t>(proof.size()));
  std::string reply = read_to_end(fd);
  ::close(fd);
  ASSERT_GT(reply.size(), kFrameHeaderBytes + 64);
  Result<Frame> f = decode_frame(std::string_view(reply).substr(kFrameHeaderBytes + 64));
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(decode_reject(f->payload)->code, RejectCode::kAuthFailed);
  EXPECT_NE(server->last_rejection().find("wrong shared secret"), std::string::npos);
}

TEST(SideChannelTest, ReportsGarbageAndTruncatedReplies) {
  Side side = side_of(preset("llama3-8b"));
  SideChannelOptions o = fast();
  o.reply_fault = SideChannelOptions::ReplyFault::kGarbage;
  auto garbage = start(side, o);
  expect_error(fetch_rank_info(garbage->address(), side.identity, side.hash, fast()), Code::kInvalidArgument,
               "malformed handshake: bad magic");
  o.reply_fault = SideChannelOptions::ReplyFault::kTruncate;
  auto truncate = start(side, o);
  expect_error(fetch_rank_info(truncate->address(), side.identity, side.hash, fast()), Code::kInvalidArgument,
               "malformed handshake: truncated Metadata frame: peer closed after");
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

TEST(SideChannelTest, SurvivesAGarbageClient) {
  expect_survives(std::string(64, '\x5a'), "malformed handshake: bad magic");
}

TEST(SideChannelTest, SurvivesAnOversizedLength) {
  std::string header = encode_frame(FrameType::kHello, "").substr(0, kFrameHeaderBytes);
  header.replace(8, 4, "\xff\xff\xff\xff");
  expect_survives(header, "Hello frame length 4294967295 exceeds 41");
}

TEST(SideChannelTest, SurvivesATruncatedFrame) {
  std::string hello = encode_frame(FrameType::kHello, encode_hello({}));
  expect_survives(hello.substr(0, 20), "client closed the connection in the middle of its Hello (after 20 bytes)", true);
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
               "side channel " + address + ": handshake did not finish within 300 ms (waiting for the peer's Metadata)");
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
  std::string hello = encode_frame(FrameType::kHello, encode_hello({}));
  ASSERT_EQ(::send(fd, hello.data(), 5, 0), 5);
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
}

}  // namespace
}  // namespace kvbridge::connector
