#include "transport/tcp/tcp_protocol.h"

#include <gtest/gtest.h>

#include "net/frame.h"
#include "testing/corpus.h"

namespace kvbridge::transport::tcp {
namespace {

SegmentLookup one_segment(uint32_t id, uint64_t base, uint64_t bytes, uint8_t access = kAccessRead | kAccessWrite) {
  return [=](uint32_t asked) -> std::optional<SegmentSpan> {
    if (asked != id) return std::nullopt;
    return SegmentSpan{base, bytes, access};
  };
}

TEST(TcpProtocolTest, PayloadLimitsBoundEveryTypeAndNoOther) {
  EXPECT_EQ(payload_limit(kRead), size_t{kMaxRangesPerFrame} * kRangeBytes);
  EXPECT_EQ(payload_limit(kReadData), 4u);
  EXPECT_EQ(payload_limit(kError), 4u + 4 + kMaxErrorText);
  EXPECT_GT(payload_limit(net::kOpen), 0u);
  EXPECT_EQ(payload_limit(99), 0u);
  std::string head;
  net::encode_header({net::Protocol::kTcp, kRead, kVersion, static_cast<uint32_t>(payload_limit(kRead) + 1), false},
                     head);
  EXPECT_FALSE(net::decode_header(head, net::Protocol::kTcp, kVersion, payload_limit).ok());
}

TEST(TcpProtocolTest, OpenBodyRoundTripsAndRejectsLyingLengths) {
  std::string body = encode_open_body(0x1234, "pid 7 on box");
  uint64_t instance = 0;
  std::string label;
  ASSERT_TRUE(decode_open_body(body, &instance, &label).ok());
  EXPECT_EQ(instance, 0x1234u);
  EXPECT_EQ(label, "pid 7 on box");
  std::string lying = body;
  lying[8] = 100;  // label length
  EXPECT_FALSE(decode_open_body(lying, &instance, &label).ok());
  EXPECT_FALSE(decode_open_body(body + "x", &instance, &label).ok()) << "trailing bytes";
}

TEST(TcpProtocolTest, RangesInsideTheSegmentAreAccepted) {
  std::vector<Range> ranges;
  uint64_t total = 0;
  Status s = decode_ranges(encode_ranges(std::vector<Range>{{3, 1000, 10}, {3, 1090, 10}}), one_segment(3, 1000, 100),
                           false, &ranges, &total);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(total, 20u);
  ASSERT_EQ(ranges.size(), 2u);
  EXPECT_EQ(ranges[1].address, 1090u);
}

TEST(TcpProtocolTest, RangesOutsideTheirSegmentAreRejected) {
  SegmentLookup seg = one_segment(3, 1000, 100);
  std::vector<Range> ranges;
  uint64_t total = 0;
  auto check = [&](Range r) { return decode_ranges(encode_ranges(std::vector<Range>{r}), seg, true, &ranges, &total); };
  EXPECT_EQ(check({3, 1091, 10}).code(), Code::kOutOfRange);              // past the end by one
  EXPECT_EQ(check({3, 999, 1}).code(), Code::kOutOfRange);                // before the start
  EXPECT_EQ(check({4, 1000, 1}).code(), Code::kOutOfRange);               // unknown segment
  EXPECT_EQ(check({3, 1000, 0}).code(), Code::kOutOfRange);               // empty
  EXPECT_EQ(check({3, ~uint64_t{0} - 4, 10}).code(), Code::kOutOfRange);  // wraps
  EXPECT_TRUE(check({3, 1090, 10}).ok());
  EXPECT_NE(check({4, 1000, 1}).message().find("segment 4"), std::string::npos);
}

TEST(TcpProtocolTest, ASegmentGrantsOnlyItsAccess) {
  std::vector<Range> ranges;
  uint64_t total = 0;
  const std::string table = encode_ranges(std::vector<Range>{{1, 0, 8}});
  Status w = decode_ranges(table, one_segment(1, 0, 64, kAccessRead), true, &ranges, &total);
  EXPECT_EQ(w.code(), Code::kPermissionDenied);
  EXPECT_NE(w.message().find("does not allow remote writes"), std::string::npos) << w.message();
  EXPECT_TRUE(decode_ranges(table, one_segment(1, 0, 64, kAccessRead), false, &ranges, &total).ok());
  EXPECT_EQ(decode_ranges(table, one_segment(1, 0, 64, kAccessWrite), false, &ranges, &total).code(),
            Code::kPermissionDenied);
}

TEST(TcpProtocolTest, MalformedTablesAndFramesCarryingTooManyBytesAreRejected) {
  std::vector<Range> ranges;
  uint64_t total = 0;
  SegmentLookup seg = one_segment(1, 0, ~uint64_t{0});
  EXPECT_EQ(decode_ranges(encode_ranges(std::vector<Range>{{1, 0, kMaxFrameDataBytes}, {1, 0, 1}}), seg, true, &ranges,
                          &total)
                .code(),
            Code::kResourceExhausted);
  EXPECT_EQ(decode_ranges("", seg, false, &ranges, &total).code(), Code::kInvalidArgument);
  EXPECT_EQ(decode_ranges(std::string(25, '\0'), seg, false, &ranges, &total).code(), Code::kInvalidArgument);
  std::string reserved = encode_ranges(std::vector<Range>{{1, 0, 8}});
  reserved[4] = 1;
  EXPECT_EQ(decode_ranges(reserved, seg, false, &ranges, &total).code(), Code::kInvalidArgument);
}

// What a refused write's table announces, whatever its segments: the bytes
// the server drops to keep the stream in step, bounded as a frame is.
TEST(TcpProtocolTest, AnnouncedBytesSumAnyTableAndRefuseMalformedOrTooMany) {
  EXPECT_EQ(*announced_bytes(encode_ranges(std::vector<Range>{{7, 0, 10}, {9, 1ull << 60, 32}})), 42u);
  EXPECT_EQ(*announced_bytes(""), 0u);
  EXPECT_EQ(announced_bytes(std::string(25, '\0')).error().code(), Code::kInvalidArgument);
  EXPECT_EQ(announced_bytes(encode_ranges(std::vector<Range>{{1, 0, kMaxFrameDataBytes}, {1, 0, 1}})).error().code(),
            Code::kResourceExhausted);
  EXPECT_EQ(announced_bytes(encode_ranges(std::vector<Range>{{1, 0, ~0ull}, {1, 0, 2}})).error().code(),
            Code::kResourceExhausted);
}

TEST(TcpProtocolTest, ErrorFramesCarryTheirCodeAndNeverOk) {
  std::string out = encode_error(Status::out_of_range("range 2 outside"));
  Status s = decode_error(out);
  EXPECT_EQ(s.code(), Code::kOutOfRange);
  EXPECT_EQ(s.message(), "range 2 outside");
  out[0] = 0;  // code kOk on the wire
  EXPECT_EQ(decode_error(out).code(), Code::kIoError);
  out[0] = static_cast<char>(200);
  EXPECT_EQ(decode_error(out).code(), Code::kIoError);
  EXPECT_EQ(decode_error("xx").code(), Code::kIoError);
}

TEST(TcpProtocolTest, DecodeRequestTakesOnlyRequests) {
  SegmentLookup seg = one_segment(1, 0, 1 << 20);
  std::vector<Range> ranges;
  uint64_t total = 0;
  const std::string table = encode_ranges(std::vector<Range>{{1, 0, 4096}});
  EXPECT_TRUE(decode_request(kRead, table, seg, &ranges, &total).ok());
  EXPECT_FALSE(decode_request(kRead, table.substr(1), seg, &ranges, &total).ok());
  EXPECT_FALSE(decode_request(kWriteAck, table, seg, &ranges, &total).ok());
  EXPECT_EQ(decode_count(encode_count(7)).value(), 7u);
  EXPECT_FALSE(decode_count("abc").ok());
}

// The seeds of fuzz/tcp_frame_fuzz.cc (testing/corpus.h): whole frames
// (header, payload) a client or server may send; every checked-in one
// decodes.
TEST(TcpProtocolTest, SeedCorpusFramesDecode) {
  auto frame = [](uint8_t type, std::string payload) {
    std::string out;
    net::encode_header({net::Protocol::kTcp, type, kVersion, static_cast<uint32_t>(payload.size()), false}, out);
    return out + payload;
  };
  const kvbridge::testing::Seeds seeds = {
      {"read_two_segments", frame(kRead, encode_ranges(std::vector<Range>{{1, 0x10000, 4096}, {2, 0x7fff0000, 64}}))},
      {"write_one_range", frame(kWrite, encode_ranges(std::vector<Range>{{1, 0x10100, 100}}))},
      {"read_out_of_range", frame(kRead, encode_ranges(std::vector<Range>{{1, 0x1fff0, 4096}}))},
      {"read_data", frame(kReadData, encode_count(2))},
      {"write_ack", frame(kWriteAck, encode_count(1))},
      {"error", frame(kError, encode_error(Status::out_of_range("range 0 is outside segment 1")))},
      {"accept", frame(kAccept, std::string("\x04\x00\x00\x00peer", 8))},
  };
  const kvbridge::testing::Seeds checked_in = kvbridge::testing::seed_corpus("tcp_frame", seeds);
  EXPECT_GE(checked_in.size(), seeds.size());
  for (const auto& [name, bytes] : checked_in) {
    ASSERT_GE(bytes.size(), net::kFrameHeaderBytes) << name;
    Result<net::FrameHeader> h = net::decode_header(std::string_view(bytes).substr(0, net::kFrameHeaderBytes),
                                                    net::Protocol::kTcp, kVersion, payload_limit);
    ASSERT_TRUE(h.ok()) << name << ": " << h.error().to_string();
    EXPECT_EQ(bytes.size(), net::kFrameHeaderBytes + h->payload_bytes) << name;
  }
}

}  // namespace
}  // namespace kvbridge::transport::tcp
