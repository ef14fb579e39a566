#include "net/frame.h"

#include <gtest/gtest.h>

#include "net/session.h"
#include "net/wire.h"

namespace kvbridge::net {
namespace {

size_t limit(uint8_t type) { return type == kRefuse ? 100 : type == 16 ? 64 : type == kOpen ? 50 : 0; }

std::string header(uint32_t magic, uint8_t proto, uint8_t type, uint16_t version, uint32_t length, uint32_t flags) {
  WireWriter w;
  w.u32(magic);
  w.u8(proto);
  w.u8(type);
  w.u16(version);
  w.u32(length);
  w.u32(flags);
  return w.take();
}

TEST(FrameTest, HeaderRoundTrips) {
  std::string out;
  encode_header({Protocol::kControl, 16, 2, 40, true}, out);
  ASSERT_EQ(out.size(), kFrameHeaderBytes);
  Result<FrameHeader> h = decode_header(out, Protocol::kControl, 2, limit);
  ASSERT_TRUE(h.ok()) << h.error().to_string();
  EXPECT_EQ(h->type, 16);
  EXPECT_EQ(h->payload_bytes, 40u);
  EXPECT_TRUE(h->tagged);
}

TEST(FrameTest, BadHeadersAreRejectedNamingWhy) {
  auto reason = [](const std::string& h) {
    Result<FrameHeader> r = decode_header(h, Protocol::kTcp, 2, limit);
    return r.ok() ? std::string("ok") : r.error().message();
  };
  EXPECT_NE(reason(header(0x12345678, 3, 16, 2, 0, 0)).find("bad magic"), std::string::npos);
  EXPECT_NE(reason(header(kFrameMagic, 2, 16, 2, 0, 0)).find("a control frame on a tcp connection"), std::string::npos);
  EXPECT_NE(reason(header(kFrameMagic, 3, 16, 2, 0, 2)).find("unknown frame flags"), std::string::npos);
  EXPECT_NE(reason(header(kFrameMagic, 3, 99, 2, 0, 0)).find("unknown tcp frame type 99"), std::string::npos);
  EXPECT_NE(reason(header(kFrameMagic, 3, 16, 2, 65, 0)).find("length 65 exceeds 64"), std::string::npos);
  EXPECT_EQ(reason(header(kFrameMagic, 3, 16, 3, 0, 0)), "tcp version mismatch: local 2, peer 3");
  // A Refuse of another version reads: its payload is shared by all versions.
  Result<FrameHeader> refuse = decode_header(header(kFrameMagic, 3, kRefuse, 7, 10, 0), Protocol::kTcp, 2, limit);
  ASSERT_TRUE(refuse.ok());
  EXPECT_EQ(refuse->version, 7);
}

TEST(FrameTest, TheFormatBeforeTheSharedHeaderIsNamedAsAnOlderVersion) {
  // A version 1 side channel header: "KVBH", version 1, type, reserved, length.
  WireWriter w;
  w.u32(0x4842564b);
  w.u16(1);
  w.u8(1);
  w.u8(0);
  w.u32(41);
  w.u32(0);
  Protocol p;
  uint16_t v = 0;
  ASSERT_TRUE(legacy_header(w.out(), &p, &v));
  EXPECT_EQ(p, Protocol::kSideChannel);
  EXPECT_EQ(v, 1);
  Result<FrameHeader> h = decode_header(w.out(), Protocol::kSideChannel, 2, limit);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.error().code(), Code::kIncompatible);
  EXPECT_EQ(h.error().message(), "side channel version mismatch: local 2, peer 1");
}

TEST(FrameTest, ReaderAsksForNoMoreThanTheCurrentFrame) {
  Session none;
  std::string two;
  append_frame(two, {Protocol::kTcp, 16, 2, 0, false}, "abc", none);
  append_frame(two, {Protocol::kTcp, 16, 2, 0, false}, "defgh", none);
  FrameReader r(Protocol::kTcp, 2, limit);
  size_t pos = 0;
  std::vector<std::string> got;
  while (pos < two.size()) {
    const size_t n = std::min<size_t>(r.wanted(), 5);  // odd slices
    ASSERT_GT(n, 0u);
    ASSERT_TRUE(r.feed(std::string_view(two).substr(pos, n)).ok());
    pos += n;
    if (r.ready()) {
      got.emplace_back(r.payload());
      r.next();
    }
  }
  EXPECT_EQ(got, (std::vector<std::string>{"abc", "defgh"}));
}

TEST(FrameTest, TagsDetectChangedReplayedAndReorderedFrames) {
  Mac key{};
  key[0] = 1;
  Session client(key, true), server(key, false);
  std::string a, b;
  append_frame(a, {Protocol::kControl, 16, 2, 0, false}, "first", client);
  append_frame(b, {Protocol::kControl, 16, 2, 0, false}, "second", client);
  auto check = [&](Session& s, const std::string& f, size_t payload) {
    return s.check(std::string_view(f).substr(0, 16), std::string_view(f).substr(16, payload),
                   std::string_view(f).substr(16 + payload, 16));
  };
  std::string changed = a;
  changed[17] ^= 1;
  EXPECT_FALSE(check(server, changed, 5));  // consumes seq 0
  Session fresh(key, false);
  EXPECT_FALSE(check(fresh, b, 6)) << "a frame out of order passed";
  Session in_order(key, false);
  EXPECT_TRUE(check(in_order, a, 5));
  EXPECT_FALSE(check(in_order, a, 5)) << "a replayed frame passed";
  // The other direction uses another label: a client's frame reflected back
  // to it does not pass.
  Session back(key, true);
  EXPECT_FALSE(check(back, a, 5));
}

}  // namespace
}  // namespace kvbridge::net
