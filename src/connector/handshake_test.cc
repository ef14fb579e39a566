// The side channel's codec: round trips, and every decoder against
// truncation, oversized lengths, bad magic and trailing bytes.
#include "connector/handshake.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <functional>

namespace kvbridge::connector {
namespace {

Nonce nonce_of(uint8_t seed) {
  Nonce n{};
  for (size_t i = 0; i < n.size(); ++i) n[i] = static_cast<uint8_t>(seed + i);
  return n;
}

RankInfo sample_info() {
  RankInfo info;
  info.instance_id = "prefill-0";
  info.rank = 1;
  info.tp_size = 2;
  info.pid = -42;
  info.layout_json = R"({"format":"kvbridge.layout/1"})";
  info.engine_metadata = std::string("\x00\x01\xff binary", 10);
  info.tensors = {{"kv.0", 3, 0x7f0000001000, 4096}, {"kv.1", 4, 0x7f0000002000, 1ull << 40}};
  info.clock_ns = 1700000000123456789ull;
  return info;
}

// Every valid frame the codec makes, named for the seed corpus.
std::vector<std::pair<std::string, std::string>> sample_frames() {
  Reject hash_reject{RejectCode::kHashMismatch, 0x691fb1bfc4fd924bull, "compatibility hash mismatch",
                     "kvbridge.identity/1\nmodel 9:llama3-8b\ndtype 4:bf16\n"};
  Result<std::string> metadata = encode_metadata({0x691fb1bfc4fd924bull, sample_info()});
  EXPECT_TRUE(metadata.ok());
  return {
      {"hello.bin", encode_frame(FrameType::kHello, encode_hello({true, nonce_of(1), 0x1234}))},
      {"challenge.bin", encode_frame(FrameType::kChallenge, encode_challenge({nonce_of(2), server_mac("s", nonce_of(1), nonce_of(2))}))},
      {"proof.bin", encode_frame(FrameType::kProof, encode_proof({client_mac("s", nonce_of(2), nonce_of(1))}))},
      {"reject_hash.bin", encode_frame(FrameType::kReject, encode_reject(hash_reject))},
      {"reject_version.bin", encode_frame(FrameType::kReject, encode_reject({RejectCode::kVersion, 0, "version", ""}), 2)},
      {"metadata.bin", encode_frame(FrameType::kMetadata, metadata.ok() ? *metadata : "")},
      {"metadata_empty.bin", encode_frame(FrameType::kMetadata, *encode_metadata({}))},
  };
}

// The payload decoder for each frame type, as the fuzzer runs them.
Status decode_payload(FrameType type, std::string_view payload) {
  switch (type) {
    case FrameType::kHello: return decode_hello(payload).status();
    case FrameType::kChallenge: return decode_challenge(payload).status();
    case FrameType::kProof: return decode_proof(payload).status();
    case FrameType::kMetadata: return decode_metadata(payload).status();
    case FrameType::kReject: return decode_reject(payload).status();
  }
  return Status::invalid_argument("unknown type");
}

TEST(HandshakeCodecTest, RoundTripsEveryFrame) {
  Hello hello{true, nonce_of(7), 0xdeadbeefcafef00dull};
  const std::string bytes = encode_frame(FrameType::kHello, encode_hello(hello));
  Result<Frame> f = decode_frame(bytes);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(f->header.type, FrameType::kHello);
  Result<Hello> h = decode_hello(f->payload);
  ASSERT_TRUE(h.ok());
  EXPECT_TRUE(h->has_secret);
  EXPECT_EQ(h->nonce, hello.nonce);
  EXPECT_EQ(h->hash, hello.hash);

  Challenge challenge{nonce_of(9), server_mac("secret", nonce_of(7), nonce_of(9))};
  Result<Challenge> c = decode_challenge(encode_challenge(challenge));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->nonce, challenge.nonce);
  EXPECT_EQ(c->mac, challenge.mac);

  Proof proof{client_mac("secret", nonce_of(9), nonce_of(7))};
  Result<Proof> p = decode_proof(encode_proof(proof));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->mac, proof.mac);

  Reject reject{RejectCode::kHashMismatch, 42, "why", "identity\n"};
  Result<Reject> r = decode_reject(encode_reject(reject));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->code, reject.code);
  EXPECT_EQ(r->hash, 42u);
  EXPECT_EQ(r->message, "why");
  EXPECT_EQ(r->identity, "identity\n");

  Result<std::string> m = encode_metadata({77, sample_info()});
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  Result<Metadata> md = decode_metadata(*m);
  ASSERT_TRUE(md.ok()) << md.status().to_string();
  EXPECT_EQ(md->hash, 77u);
  EXPECT_EQ(md->info, sample_info());
}

TEST(HandshakeCodecTest, MacsDependOnSecretDirectionAndNonces) {
  const Mac a = server_mac("secret", nonce_of(1), nonce_of(2));
  EXPECT_TRUE(mac_equal(a, server_mac("secret", nonce_of(1), nonce_of(2))));
  EXPECT_FALSE(mac_equal(a, server_mac("secreT", nonce_of(1), nonce_of(2))));
  EXPECT_FALSE(mac_equal(a, server_mac("secret", nonce_of(2), nonce_of(1))));
  EXPECT_FALSE(mac_equal(a, client_mac("secret", nonce_of(1), nonce_of(2))));
  Result<Nonce> x = random_nonce(), y = random_nonce();
  ASSERT_TRUE(x.ok() && y.ok());
  EXPECT_NE(*x, *y);
}

TEST(HandshakeCodecTest, EveryDecoderRejectsEveryTruncation) {
  for (const auto& [name, frame] : sample_frames()) {
    const uint16_t version = name == "reject_version.bin" ? 2 : kHandshakeVersion;
    Result<Frame> whole = decode_frame(frame, version);
    ASSERT_TRUE(whole.ok()) << name << ": " << whole.status().to_string();
    EXPECT_TRUE(decode_payload(whole->header.type, whole->payload).ok()) << name;
    for (size_t n = 0; n < frame.size(); ++n) {
      Result<Frame> cut = decode_frame(std::string_view(frame).substr(0, n), version);
      EXPECT_FALSE(cut.ok()) << name << " cut at " << n;
      if (!cut.ok()) {
        EXPECT_EQ(cut.error().code(), Code::kInvalidArgument);
      }
      if (n < whole->payload.size()) {
        Status s = decode_payload(whole->header.type, whole->payload.substr(0, n));
        EXPECT_EQ(s.code(), Code::kInvalidArgument) << name << " payload cut at " << n;
      }
    }
  }
}

TEST(HandshakeCodecTest, EveryDecoderRejectsTrailingBytes) {
  for (const auto& [name, frame] : sample_frames()) {
    const uint16_t version = name == "reject_version.bin" ? 2 : kHandshakeVersion;
    Result<Frame> whole = decode_frame(frame, version);
    ASSERT_TRUE(whole.ok());
    Result<Frame> longer = decode_frame(frame + "x", version);
    ASSERT_FALSE(longer.ok()) << name;
    EXPECT_NE(longer.error().message().find("1 trailing bytes"), std::string::npos) << longer.error().message();
    Status s = decode_payload(whole->header.type, std::string(whole->payload) + "x");
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << name;
    EXPECT_NE(s.message().find("trailing"), std::string::npos) << s.message();
  }
}

TEST(HandshakeCodecTest, HeaderRejectsBadMagicTypeReservedAndOversizedLengths) {
  std::string hello = encode_frame(FrameType::kHello, encode_hello({}));
  std::string header = hello.substr(0, kFrameHeaderBytes);
  std::string bad = header;
  bad[0] = 'X';
  EXPECT_NE(decode_header(bad).status().message().find("bad magic"), std::string::npos);
  bad = header;
  bad[6] = 9;
  EXPECT_NE(decode_header(bad).status().message().find("unknown frame type 9"), std::string::npos);
  bad = header;
  bad[7] = 1;
  EXPECT_NE(decode_header(bad).status().message().find("reserved"), std::string::npos);
  bad = encode_frame(FrameType::kMetadata, "").substr(0, kFrameHeaderBytes);
  bad.replace(8, 4, "\xff\xff\xff\xff");
  EXPECT_EQ(decode_header(bad).status().message(), "Metadata frame length 4294967295 exceeds 25165824");
  bad = header;
  bad[8] = 42;
  EXPECT_EQ(decode_header(bad).status().message(), "Hello frame length 42 exceeds 41");
  EXPECT_FALSE(decode_header(header.substr(0, 11)).ok());
  // Another version: returned as read, for the caller to report.
  std::string v2 = encode_frame(FrameType::kHello, std::string(100, 'x'), 2).substr(0, kFrameHeaderBytes);
  Result<FrameHeader> h = decode_header(v2);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->version, 2);
  EXPECT_FALSE(decode_frame(encode_frame(FrameType::kHello, encode_hello({}), 2)).ok());
}

TEST(HandshakeCodecTest, PayloadDecodersRejectOversizedLengthsAndBadFields) {
  // A Reject whose message claims more than its bound.
  std::string reject = encode_reject({RejectCode::kMalformed, 0, "m", ""});
  reject.replace(9, 4, std::string("\x01\x10\x00\x00", 4));  // 4097
  EXPECT_NE(decode_reject(reject).status().message().find("message length 4097 exceeds 4096"), std::string::npos)
      << decode_reject(reject).status().message();
  // Metadata: a layout_json length over 16 MiB, a huge tensor count, rank >= tp_size.
  std::string m = *encode_metadata({1, sample_info()});
  const size_t json_len_at = 8 + 8 + 4 + 4 + 4 + 4 + sample_info().instance_id.size();
  std::string bad = m;
  bad.replace(json_len_at, 4, std::string("\x01\x00\x00\x01", 4));
  EXPECT_NE(decode_metadata(bad).status().message().find("layout_json length 16777217 exceeds 16777216"),
            std::string::npos)
      << decode_metadata(bad).status().message();
  RankInfo no_tensors = sample_info();
  no_tensors.tensors.clear();
  bad = *encode_metadata({1, no_tensors});
  bad.replace(bad.size() - 4, 4, "\xff\xff\xff\x7f");
  EXPECT_NE(decode_metadata(bad).status().message().find("tensor count 2147483647 exceeds"), std::string::npos);
  bad = m;
  bad.replace(16, 4, std::string("\x05\x00\x00\x00", 4));  // rank 5 of 2
  EXPECT_NE(decode_metadata(bad).status().message().find("rank 5 is not below tp_size 2"), std::string::npos);
  std::string hello = encode_hello({});
  hello[0] = 2;
  EXPECT_NE(decode_hello(hello).status().message().find("unknown flags"), std::string::npos);
}

TEST(HandshakeCodecTest, EncoderRefusesRankInfoOverItsBounds) {
  RankInfo info = sample_info();
  info.instance_id.assign(kMaxInstanceIdBytes + 1, 'i');
  EXPECT_NE(encode_metadata({0, info}).status().message().find("instance_id"), std::string::npos);
  info = sample_info();
  info.engine_metadata.assign(kMaxEngineMetadataBytes + 1, 'e');
  EXPECT_NE(encode_metadata({0, info}).status().message().find("engine_metadata"), std::string::npos);
  info = sample_info();
  info.rank = 2;
  EXPECT_FALSE(encode_metadata({0, info}).ok());
  info = sample_info();
  info.tensors[1].name.assign(kMaxTensorNameBytes + 1, 't');
  EXPECT_NE(encode_metadata({0, info}).status().message().find("tensor name"), std::string::npos);
}

// Writes the seed corpus of fuzz/handshake_fuzz.cc when asked:
//   KVB_HANDSHAKE_CORPUS=fuzz/corpus/handshake ./handshake_test --gtest_filter='*SeedCorpus*'
TEST(HandshakeCodecTest, SeedCorpusFramesDecode) {
  const char* dir = std::getenv("KVB_HANDSHAKE_CORPUS");
  for (const auto& [name, frame] : sample_frames()) {
    const uint16_t version = name == "reject_version.bin" ? 2 : kHandshakeVersion;
    EXPECT_TRUE(decode_frame(frame, version).ok()) << name;
    if (dir == nullptr) continue;
    std::ofstream out(std::string(dir) + "/" + name, std::ios::binary);
    out << frame;
    ASSERT_TRUE(out.good()) << name;
  }
}

}  // namespace
}  // namespace kvbridge::connector
