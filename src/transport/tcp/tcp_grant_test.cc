// The tcp server's grants: writes land, reads are served and content is
// hashed only inside a grant to the client's label while it lasts, with two
// transports in one process over loopback.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "testing/pattern.h"
#include "transport/copies.h"
#include "transport/tcp/tcp_server.h"
#include "transport/transport.h"

namespace kvbridge::transport {
namespace {

using namespace std::chrono_literals;
using testing::pattern;

// A segment that takes writes only where granted: the server refuses a
// write with any range outside every grant to its writer's label (nothing of
// it lands, the stream stays in step), lets one inside land, and refuses it
// again once the grant is revoked. Reads are not affected.
TEST(TcpGrantTest, WritesLandOnlyInsideAGrantToTheWriterWhileItLasts) {
  std::vector<uint8_t> mem(1 << 16, 7);
  auto server = make_tcp_transport("127.0.0.1", 1, "");
  ASSERT_TRUE(server.ok());
  ASSERT_TRUE((*server)->add_segment(Segment{1, mem.data(), mem.size(), "host", 2 | 4 | 1}).ok());
  auto client = make_tcp_transport("127.0.0.1", 1, "");
  (*client)->set_local_identity("prefill/r0", 0x1234);
  PeerInfo p{"server", 0, "", (*server)->address(), {}};
  auto link = (*client)->connect(p);
  ASSERT_TRUE(link.ok()) << link.error().to_string();
  std::vector<uint8_t> local(4096, 9);
  const uint64_t base = reinterpret_cast<uint64_t>(mem.data());
  auto write = [&](uint64_t offset, uint64_t bytes) {
    RunControl control;
    control.deadline = Clock::now() + 5s;
    return (*link)->run(TransferOp::kWrite, std::vector<Copy>{{local.data(), base + offset, bytes, 1}}, control);
  };
  auto untouched = [&] { return std::count(mem.begin(), mem.end(), 7) == static_cast<long>(mem.size()); };
  Status none = write(0, 4096);
  EXPECT_EQ(none.code(), Code::kPermissionDenied) << none.to_string();
  EXPECT_NE(none.message().find("not inside a write grant to 'prefill/r0 0000000000001234'"), std::string::npos)
      << none.to_string();
  EXPECT_TRUE(untouched());
  // Granted to another engine, or to this name under another instance: refused.
  (*server)->grant(1, engine_label("prefill/r1", 0x1234), grant_of({{1, base, 8192}}), false);
  (*server)->grant(2, engine_label("prefill/r0", 0x9999), grant_of({{1, base, 8192}}), false);
  EXPECT_EQ(write(0, 4096).code(), Code::kPermissionDenied);
  EXPECT_TRUE(untouched());
  // Two adjacent grants of this writer: a write across both lands; one past them is refused whole.
  (*server)->grant(3, engine_label("prefill/r0", 0x1234), grant_of({{1, base + 1024, 1024}, {1, base + 2048, 1024}}),
                   false);
  EXPECT_EQ(write(1024, 4096).code(), Code::kPermissionDenied);
  EXPECT_TRUE(untouched());
  ASSERT_TRUE(write(1024, 2048).ok());
  EXPECT_EQ(std::count(mem.begin(), mem.end(), 9), 2048);
  (*server)->revoke(3);
  EXPECT_EQ(write(1024, 2048).code(), Code::kPermissionDenied);
  // Reads need no grant.
  RunControl control;
  control.deadline = Clock::now() + 5s;
  EXPECT_TRUE((*link)->run(TransferOp::kRead, std::vector<Copy>{{local.data(), base, 4096, 1}}, control).ok());
}

// A segment that serves reads only where granted (a prefill's KV, granted
// request by request to its readers): the server refuses a read with any
// range outside every read grant to its reader's label, serves one inside,
// refuses it again once the grant is revoked, and hashes (Digest) only what
// it would serve. A write grant grants no read.
TEST(TcpGrantTest, ReadsAreServedOnlyInsideAReadGrantToTheReaderWhileItLasts) {
  std::vector<uint8_t> mem(1 << 16);
  for (size_t i = 0; i < mem.size(); ++i) mem[i] = pattern(i);
  auto server = make_tcp_transport("127.0.0.1", 1, "");
  ASSERT_TRUE(server.ok());
  ASSERT_TRUE((*server)->add_segment(Segment{1, mem.data(), mem.size(), "host", 1 | 8}).ok());
  auto client = make_tcp_transport("127.0.0.1", 1, "");
  (*client)->set_local_identity("decode/r0", 0x1234);
  PeerInfo p{"server", 0, "", (*server)->address(), {}};
  auto link = (*client)->connect(p);
  ASSERT_TRUE(link.ok()) << link.error().to_string();
  std::vector<uint8_t> local(4096, 9);
  const uint64_t base = reinterpret_cast<uint64_t>(mem.data());
  auto read = [&](uint64_t offset, uint64_t bytes) {
    std::fill(local.begin(), local.end(), 9);
    RunControl control;
    control.deadline = Clock::now() + 5s;
    return (*link)->run(TransferOp::kRead, std::vector<Copy>{{local.data(), base + offset, bytes, 1}}, control);
  };
  auto nothing_came = [&] { return std::count(local.begin(), local.end(), 9) == static_cast<long>(local.size()); };
  Status none = read(0, 4096);
  EXPECT_EQ(none.code(), Code::kPermissionDenied) << none.to_string();
  EXPECT_NE(none.message().find("not inside a read grant to 'decode/r0 0000000000001234'"), std::string::npos)
      << none.to_string();
  EXPECT_TRUE(nothing_came());
  // Granted to another reader, to this name under another instance, or a write grant to this reader: refused.
  const std::string me = engine_label("decode/r0", 0x1234);
  (*server)->grant(1, engine_label("decode/r1", 0x1234), grant_of({{1, base, 8192}}), true);
  (*server)->grant(2, engine_label("decode/r0", 0x9999), grant_of({{1, base, 8192}}), true);
  (*server)->grant(3, me, grant_of({{1, base, 8192}}), false);
  EXPECT_EQ(read(0, 4096).code(), Code::kPermissionDenied);
  EXPECT_TRUE(nothing_came());
  // Two adjacent read grants: a read across both is served; one past them is refused whole.
  (*server)->grant(4, me, grant_of({{1, base + 1024, 1024}, {1, base + 2048, 1024}}), true);
  EXPECT_EQ(read(1024, 4096).code(), Code::kPermissionDenied);
  EXPECT_TRUE(nothing_came());
  ASSERT_TRUE(read(1024, 2048).ok());
  EXPECT_TRUE(std::equal(local.begin(), local.begin() + 2048, mem.begin() + 1024));
  std::vector<uint64_t> hashes;
  RunControl control;
  control.deadline = Clock::now() + 5s;
  ASSERT_TRUE((*link)->digest(std::vector<Copy>{{nullptr, base + 1024, 2048, 1}}, control, &hashes).ok());
  EXPECT_EQ(hashes, std::vector<uint64_t>{content_hash(mem.data() + 1024, 2048)});
  EXPECT_EQ((*link)->digest(std::vector<Copy>{{nullptr, base, 2048, 1}}, control, &hashes).code(),
            Code::kPermissionDenied)
      << "a digest of bytes it may not read";
  // A grant shared with another reader (one copy of a hand-off's spans for
  // a decode instance's ranks) lasts until its own revoke.
  (*server)->share(5, me, 1);
  (*server)->revoke(4);
  (*server)->revoke(1);
  ASSERT_TRUE(read(0, 4096).ok()) << "shared from grant 1, to decode/r0 as grant 5";
  EXPECT_TRUE(std::equal(local.begin(), local.end(), mem.begin()));
  (*server)->revoke(5);
  EXPECT_EQ(read(1024, 2048).code(), Code::kPermissionDenied);
  EXPECT_TRUE(nothing_came());
}

// Digest frames (the content check): the server hashes ranges the client
// may read, or write inside a grant to its label, and refuses the rest.
TEST(TcpGrantTest, TheServerHashesWhatTheClientMayReadOrWriteByGrantAndNothingElse) {
  std::vector<uint8_t> granted(1 << 16), readable(1 << 16);
  for (size_t i = 0; i < granted.size(); ++i) granted[i] = pattern(i), readable[i] = pattern(i + 3);
  auto server = make_tcp_transport("127.0.0.1", 1, "");
  ASSERT_TRUE(server.ok());
  ASSERT_TRUE((*server)->add_segment(Segment{1, granted.data(), granted.size(), "host", 2 | 4}).ok());
  ASSERT_TRUE((*server)->add_segment(Segment{2, readable.data(), readable.size(), "host", 1}).ok());
  auto client = make_tcp_transport("127.0.0.1", 1, "");
  (*client)->set_local_identity("prefill/r0", 0x1234);
  auto link = (*client)->connect(PeerInfo{"server", 0, "", (*server)->address(), {}});
  ASSERT_TRUE(link.ok()) << link.error().to_string();
  const uint64_t g = reinterpret_cast<uint64_t>(granted.data()), r = reinterpret_cast<uint64_t>(readable.data());
  auto digest = [&](std::vector<Copy> copies, std::vector<uint64_t>* hashes) {
    RunControl control;
    control.deadline = Clock::now() + 5s;
    return (*link)->digest(copies, control, hashes);
  };
  std::vector<uint64_t> hashes;
  ASSERT_TRUE(digest({{nullptr, r + 100, 5000, 2}, {nullptr, r, 1 << 16, 2}}, &hashes).ok());
  EXPECT_EQ(hashes, (std::vector<uint64_t>{content_hash(readable.data() + 100, 5000),
                                           content_hash(readable.data(), readable.size())}));
  Status refused = digest({{nullptr, g, 4096, 1}}, &hashes);
  EXPECT_EQ(refused.code(), Code::kPermissionDenied) << refused.to_string();
  (*server)->grant(1, engine_label("prefill/r0", 0x1234), grant_of({{1, g, 8192}}), false);
  ASSERT_TRUE(digest({{nullptr, g + 10, 8000, 1}}, &hashes).ok());
  EXPECT_EQ(hashes, std::vector<uint64_t>{content_hash(granted.data() + 10, 8000)});
  EXPECT_EQ(digest({{nullptr, g, 8193, 1}}, &hashes).code(), Code::kPermissionDenied) << "past the grant";
  EXPECT_EQ(digest({{nullptr, r + 1, 1 << 16, 2}}, &hashes).code(), Code::kOutOfRange) << "past the segment";
}

}  // namespace
}  // namespace kvbridge::transport
