#include "net/opening.h"

#include <gtest/gtest.h>

#include "net/wire.h"
#include "testing/corpus.h"

namespace kvbridge::net {
namespace {

constexpr OpeningLimits kOpeningLimits{64, 128};

size_t opening_limit_of(uint8_t type) {
  return type >= kFirstProtocolType ? 1024 : opening_limit(type, kOpeningLimits);
}

OpeningConfig config(std::string secret) {
  return OpeningConfig{Protocol::kControl, 2, std::move(secret), kOpeningLimits};
}

// Splits one encoded frame into what a FrameReader would give.
struct Parsed {
  FrameHeader header;
  std::string raw_header, payload, tag;
};
Parsed parse(const std::string& bytes) {
  FrameReader r(Protocol::kControl, 2, opening_limit_of);
  EXPECT_TRUE(r.feed(std::string_view(bytes).substr(0, 16)).ok());
  EXPECT_EQ(r.wanted(), bytes.size() - 16);
  EXPECT_TRUE(r.feed(std::string_view(bytes).substr(16)).ok());
  return Parsed{r.header(), std::string(r.raw_header()), std::string(r.payload()), std::string(r.tag())};
}

// Runs the exchange in memory; the server answers `answer` when it opens.
struct Outcome {
  bool opened = false;
  Status client_error;
  Refusal server_refusal;
  bool server_refused = false;
  std::string body_seen;
  Session client, server;
};
Outcome run(const std::string& client_secret, const std::string& server_secret, const std::string& body = "me",
            std::function<void(std::string&)> tamper_open = nullptr) {
  Outcome o;
  ClientOpening c(config(client_secret), body);
  ServerOpening s(config(server_secret));
  std::string to_server = c.open_frame();
  if (tamper_open) tamper_open(to_server);
  while (true) {
    Parsed f = parse(to_server);
    ServerOpening::Step st = s.on_frame(f.header, f.raw_header, f.payload);
    std::string to_client;
    if (st.kind == ServerOpening::Step::Kind::kRefuse) {
      o.server_refused = true;
      o.server_refusal = st.refusal;
      to_client = s.refuse_frame(st.refusal);
    } else if (st.kind == ServerOpening::Step::Kind::kSend) {
      to_client = st.bytes;
    } else {
      o.body_seen = s.body();
      o.server = s.take_session();
      append_frame(to_client, {Protocol::kControl, 16, 2, 0, false}, "welcome", o.server);
    }
    Parsed g = parse(to_client);
    ClientOpening::Step ct = c.on_frame(g.header, g.raw_header, g.payload, g.tag);
    if (ct.kind == ClientOpening::Step::Kind::kFailed) {
      o.client_error = ct.error;
      return o;
    }
    if (ct.kind == ClientOpening::Step::Kind::kOpened) {
      o.opened = true;
      o.client = c.take_session();
      return o;
    }
    to_server = ct.bytes;
  }
}

TEST(OpeningTest, WithoutSecretsTheServerAnswersTheOpenAtOnce) {
  Outcome o = run("", "");
  ASSERT_TRUE(o.opened) << o.client_error.to_string();
  EXPECT_EQ(o.body_seen, "me");
  EXPECT_FALSE(o.client.keyed());
}

TEST(OpeningTest, WithOneSecretBothSidesProveItAndTagEveryFrame) {
  Outcome o = run("s3cret", "s3cret");
  ASSERT_TRUE(o.opened) << o.client_error.to_string();
  ASSERT_TRUE(o.client.keyed());
  ASSERT_TRUE(o.server.keyed());
  std::string f;
  append_frame(f, {Protocol::kControl, 17, 2, 0, false}, "notify", o.client);
  Parsed p = parse(f);
  EXPECT_TRUE(o.server.check(p.raw_header, p.payload, p.tag));
}

TEST(OpeningTest, EveryMismatchOfSecretsIsRefusedNamingIt) {
  Outcome none = run("", "s3cret");
  EXPECT_FALSE(none.opened);
  EXPECT_EQ(none.client_error.code(), Code::kPermissionDenied);
  EXPECT_EQ(none.client_error.message(), "authentication failed: peer requires a shared secret");
  Outcome extra = run("s3cret", "");
  EXPECT_EQ(extra.client_error.message(), "authentication failed: this side has a shared secret but the peer has none");
  Outcome wrong = run("guess", "s3cret");
  EXPECT_FALSE(wrong.opened);
  EXPECT_EQ(wrong.client_error.message(), "authentication failed: wrong shared secret");
}

TEST(OpeningTest, TheBodyIsBoundToTheProof) {
  // A relay that changes the client's claimed identity on the way: the
  // server's proof covers what it received, so the client refuses it.
  Outcome o = run("s3cret", "s3cret", "reader-a", [](std::string& open) { open[open.size() - 1] = 'b'; });
  EXPECT_FALSE(o.opened);
  EXPECT_EQ(o.client_error.code(), Code::kPermissionDenied) << o.client_error.to_string();
}

TEST(OpeningTest, AClientWithASecretNeverAcceptsAnUnprovenAnswer) {
  ClientOpening c(config("s3cret"), "me");
  std::string welcome;
  Session none;
  append_frame(welcome, {Protocol::kControl, 16, 2, 0, false}, "welcome", none);
  Parsed g = parse(welcome);
  ClientOpening::Step st = c.on_frame(g.header, g.raw_header, g.payload, g.tag);
  EXPECT_EQ(st.kind, ClientOpening::Step::Kind::kFailed);
  EXPECT_EQ(st.error.code(), Code::kPermissionDenied);
}

TEST(OpeningTest, MalformedOpensAndOversizedBodiesAreRefused) {
  ServerOpening s(config(""));
  std::string bad;
  Session none;
  append_frame(bad, {Protocol::kControl, kOpen, 2, 0, false},
               std::string("\x04", 1) + std::string(32, 'n') + std::string(4, '\0'), none);
  Parsed p = parse(bad);
  ServerOpening::Step st = s.on_frame(p.header, p.raw_header, p.payload);
  ASSERT_EQ(st.kind, ServerOpening::Step::Kind::kRefuse);
  EXPECT_EQ(st.refusal.code, RefuseCode::kMalformed);
  EXPECT_NE(st.refusal.message.find("unknown flags 4"), std::string::npos) << st.refusal.message;
  // A body over the protocol's bound fails at the header, before the
  // payload is read (the listener answers that with a Refuse).
  ClientOpening big(config(""), std::string(65, 'x'));
  Result<FrameHeader> h = decode_header(big.open_frame().substr(0, 16), Protocol::kControl, 2, opening_limit_of);
  ASSERT_FALSE(h.ok());
  EXPECT_NE(h.error().message().find("exceeds"), std::string::npos) << h.error().to_string();
}

TEST(OpeningTest, RefusalsRoundTripAndMapToCodes) {
  Refusal r{RefuseCode::kMismatch, "compatibility hash mismatch", "identity text"};
  Result<Refusal> back = decode_refusal(encode_refusal(r, 128), 128);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->detail, "identity text");
  EXPECT_EQ(refusal_status(*back).code(), Code::kIncompatible);
  EXPECT_EQ(refusal_status({RefuseCode::kBusy, "busy", ""}).code(), Code::kUnavailable);
  EXPECT_FALSE(decode_refusal(encode_refusal(r, 128), 4).ok()) << "a detail over its bound was accepted";
}

// The seeds of fuzz/net_frame_fuzz.cc (testing/corpus.h): byte streams a
// client or a server of any protocol may send at the opening; every
// checked-in one parses into whole frames.
TEST(OpeningTest, SeedCorpusStreamsParse) {
  ClientOpening with_secret(OpeningConfig{Protocol::kTcp, 2, "s", {}}, "body");
  ClientOpening plain(OpeningConfig{Protocol::kSideChannel, 2, "", {}}, std::string(8, '\x11'));
  ServerOpening server(OpeningConfig{Protocol::kTcp, 2, "s", {}});
  Parsed open;
  {
    FrameReader r(Protocol::kTcp, 2, [](uint8_t t) { return opening_limit(t, OpeningLimits{}); });
    (void)r.feed(std::string_view(with_secret.open_frame()).substr(0, 16));
    (void)r.feed(std::string_view(with_secret.open_frame()).substr(16));
    open = Parsed{r.header(), std::string(r.raw_header()), std::string(r.payload()), ""};
  }
  const std::string challenge = server.on_frame(open.header, open.raw_header, open.payload).bytes;
  std::string refuse;
  Session none;
  append_frame(refuse, {Protocol::kControl, kRefuse, 2, 0, false},
               encode_refusal({RefuseCode::kStale, "stale metadata", ""}, 0), none);
  std::string proof;
  append_frame(proof, {Protocol::kTcp, kProof, 2, 0, false}, std::string(32, '\x07'), none);
  const kvbridge::testing::Seeds seeds = {
      {"open_secret.bin", with_secret.open_frame()},
      {"open_plain.bin", plain.open_frame()},
      {"challenge.bin", challenge},
      {"refuse.bin", refuse},
      {"open_then_proof.bin", with_secret.open_frame() + proof},
  };
  const kvbridge::testing::Seeds checked_in = kvbridge::testing::seed_corpus("net_frame", seeds);
  EXPECT_GE(checked_in.size(), seeds.size());
  for (const auto& [name, bytes] : checked_in) {
    ASSERT_GE(bytes.size(), kFrameHeaderBytes) << name;
    const Protocol p = static_cast<Protocol>(static_cast<uint8_t>(bytes[4]));
    FrameReader r(p, 2, [](uint8_t t) { return opening_limit(t, OpeningLimits{}); });
    size_t pos = 0, frames = 0;
    while (pos < bytes.size()) {
      const size_t n = std::min(r.wanted(), bytes.size() - pos);
      ASSERT_TRUE(r.feed(std::string_view(bytes).substr(pos, n)).ok()) << name;
      pos += n;
      if (r.ready()) {
        ++frames;
        r.next();
      }
    }
    EXPECT_GT(frames, 0u) << name;
    EXPECT_EQ(r.buffered(), 0u) << name << " ends in the middle of a frame";
  }
}

}  // namespace
}  // namespace kvbridge::net
