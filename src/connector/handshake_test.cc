// The side channel's payload codecs: round trips, and every decoder against
// truncation, oversized lengths and trailing bytes.
#include "connector/handshake.h"

#include <gtest/gtest.h>

#include "connector/side_channel.h"
#include "net/frame.h"
#include "net/opening.h"
#include "net/session.h"
#include "testing/corpus.h"

namespace kvbridge::connector {
namespace {

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

std::string frame(uint8_t type, std::string_view payload) {
  net::Session none;
  std::string out;
  net::append_frame(out, {net::Protocol::kSideChannel, type, kHandshakeVersion, 0, false}, payload, none);
  return out;
}

TEST(HandshakeCodecTest, MetadataRoundTrips) {
  Result<std::string> m = encode_metadata({77, sample_info()});
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  Result<Metadata> md = decode_metadata(*m);
  ASSERT_TRUE(md.ok()) << md.status().to_string();
  EXPECT_EQ(md->hash, 77u);
  EXPECT_EQ(md->info, sample_info());
  EXPECT_EQ(*decode_open_body(encode_open_body(0x1234)), 0x1234u);
  Result<std::pair<uint64_t, std::string>> d = decode_mismatch_detail(encode_mismatch_detail(9, "identity\n"));
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->first, 9u);
  EXPECT_EQ(d->second, "identity\n");
}

TEST(HandshakeCodecTest, TheMetadataDecoderRejectsEveryTruncationAndTrailingBytes) {
  const std::string m = *encode_metadata({77, sample_info()});
  for (size_t n = 0; n < m.size(); ++n) {
    Status s = decode_metadata(std::string_view(m).substr(0, n)).status();
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << "cut at " << n;
    EXPECT_EQ(s.message().rfind("Metadata frame: ", 0), 0u) << s.message();
  }
  Status s = decode_metadata(m + "x").status();
  EXPECT_NE(s.message().find("1 trailing bytes"), std::string::npos) << s.message();
  EXPECT_FALSE(decode_open_body(encode_open_body(1) + "x").ok());
  EXPECT_FALSE(decode_open_body("1234567").ok());
}

TEST(HandshakeCodecTest, PayloadDecodersRejectOversizedLengthsAndBadFields) {
  std::string m = *encode_metadata({1, sample_info()});
  const size_t json_len_at = 8 + 8 + 4 + 4 + 4 + 4 + sample_info().instance_id.size();
  std::string bad = m;
  bad.replace(json_len_at, 4, std::string("\x01\x00\x00\x01", 4));
  EXPECT_NE(decode_metadata(bad).status().message().find("layout_json is 16777217 bytes, more than 16777216"),
            std::string::npos)
      << decode_metadata(bad).status().message();
  RankInfo no_tensors = sample_info();
  no_tensors.tensors.clear();
  bad = *encode_metadata({1, no_tensors});
  bad.replace(bad.size() - 4, 4, "\xff\xff\xff\x7f");
  EXPECT_NE(decode_metadata(bad).status().message().find("tensor count 2147483647 is more than"), std::string::npos)
      << decode_metadata(bad).status().message();
  bad = m;
  bad.replace(16, 4, std::string("\x05\x00\x00\x00", 4));  // rank 5 of 2
  EXPECT_NE(decode_metadata(bad).status().message().find("rank 5 is not below tp_size 2"), std::string::npos);
  EXPECT_EQ(max_payload_bytes(kMetadataFrame), kMaxMetadataPayloadBytes);
  EXPECT_EQ(max_payload_bytes(99), 0u);
  std::string head;
  net::encode_header({net::Protocol::kSideChannel, kMetadataFrame, kHandshakeVersion, 0xffffffffu, false}, head);
  EXPECT_NE(net::decode_header(head, net::Protocol::kSideChannel, kHandshakeVersion, max_payload_bytes)
                .status()
                .message()
                .find("length 4294967295 exceeds 25165824"),
            std::string::npos);
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

// A version 1 client reads the legacy refusal as "handshake version
// mismatch": its header is "KVBH", u16 version, u8 type 5 (Reject), u8 0,
// u32 length, then code 1, hash, message, identity.
TEST(HandshakeCodecTest, TheLegacyRefusalIsAVersionOneRejectFromVersionTwo) {
  const std::string r = legacy_version_refusal(1);
  ASSERT_GE(r.size(), 12u);
  EXPECT_EQ(r.substr(0, 4), "KVBH");
  EXPECT_EQ(static_cast<uint8_t>(r[4]), kHandshakeVersion);
  EXPECT_EQ(static_cast<uint8_t>(r[6]), 5);
  const uint32_t length = static_cast<uint8_t>(r[8]) | (static_cast<uint8_t>(r[9]) << 8);
  EXPECT_EQ(r.size(), 12u + length);
  EXPECT_EQ(static_cast<uint8_t>(r[12]), 1);
  EXPECT_NE(r.find("handshake version mismatch: local 2, peer 1"), std::string::npos);
}

// The seeds of fuzz/handshake_fuzz.cc (testing/corpus.h): written with
// KVB_WRITE_CORPUS, and every checked-in one still decodes.
TEST(HandshakeCodecTest, SeedCorpusFramesDecode) {
  const kvbridge::testing::Seeds seeds = {
      {"metadata.bin", frame(kMetadataFrame, *encode_metadata({0x691fb1bfc4fd924bull, sample_info()}))},
      {"metadata_empty.bin", frame(kMetadataFrame, *encode_metadata({}))},
      {"refuse_mismatch.bin",
       frame(net::kRefuse, net::encode_refusal({net::RefuseCode::kMismatch, "compatibility hash mismatch",
                                                encode_mismatch_detail(7, "kvbridge.identity/1\nmodel 9:llama3-8b\n")},
                                               kMaxRefuseDetailBytes))},
      {"open.bin", net::ClientOpening({net::Protocol::kSideChannel, kHandshakeVersion, "s", {kOpenBodyBytes, 0}},
                                      encode_open_body(0x1234))
                       .open_frame()},
  };
  const kvbridge::testing::Seeds checked_in = kvbridge::testing::seed_corpus("handshake", seeds);
  EXPECT_GE(checked_in.size(), seeds.size());
  for (const auto& [name, bytes] : checked_in) {
    ASSERT_GE(bytes.size(), net::kFrameHeaderBytes) << name;
    Result<net::FrameHeader> h = net::decode_header(std::string_view(bytes).substr(0, net::kFrameHeaderBytes),
                                                    net::Protocol::kSideChannel, kHandshakeVersion, max_payload_bytes);
    ASSERT_TRUE(h.ok()) << name << ": " << h.error().to_string();
    const std::string_view payload = std::string_view(bytes).substr(net::kFrameHeaderBytes);
    if (h->type == kMetadataFrame) {
      EXPECT_TRUE(decode_metadata(payload).ok()) << name;
    }
    if (h->type == net::kRefuse) {
      EXPECT_TRUE(net::decode_refusal(payload, kMaxRefuseDetailBytes).ok()) << name;
    }
  }
}

}  // namespace
}  // namespace kvbridge::connector
