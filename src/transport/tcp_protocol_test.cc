#include "transport/tcp_protocol.h"

#include <gtest/gtest.h>

#include <cstring>

namespace kvbridge::transport::tcp {
namespace {

std::span<const uint8_t> bytes_of(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

SegmentLookup one_segment(uint32_t id, uint64_t base, uint64_t bytes) {
  return [=](uint32_t asked) -> std::optional<SegmentSpan> {
    if (asked != id) return std::nullopt;
    return SegmentSpan{base, bytes};
  };
}

std::string request(FrameType type, std::vector<Range> ranges) {
  std::string out;
  encode_ranges_header(type, ranges, out);
  return out;
}

TEST(TcpProtocolTest, HeaderRoundTrips) {
  std::string out;
  encode_header({FrameType::kWriteAck, 7, 0}, out);
  ASSERT_EQ(out.size(), kHeaderBytes);
  Result<FrameHeader> h = decode_header(bytes_of(out));
  ASSERT_TRUE(h.ok()) << h.error().to_string();
  EXPECT_EQ(h->type, FrameType::kWriteAck);
  EXPECT_EQ(h->count, 7u);
}

TEST(TcpProtocolTest, HeaderIsLittleEndianWithMagicFirst) {
  std::string out;
  encode_header({FrameType::kRead, 1, 24}, out);
  EXPECT_EQ(out.substr(0, 4), "KVBT");
  EXPECT_EQ(static_cast<uint8_t>(out[4]), 3);
  EXPECT_EQ(static_cast<uint8_t>(out[8]), 1);
  EXPECT_EQ(static_cast<uint8_t>(out[12]), 24);
}

TEST(TcpProtocolTest, RejectsBadMagicReservedBytesAndUnknownTypes) {
  std::string good;
  encode_header({FrameType::kWriteAck, 1, 0}, good);
  std::string bad = good;
  bad[0] = 'X';
  EXPECT_EQ(decode_header(bytes_of(bad)).error().code(), Code::kInvalidArgument);
  bad = good;
  bad[5] = 1;
  EXPECT_EQ(decode_header(bytes_of(bad)).error().code(), Code::kInvalidArgument);
  bad = good;
  bad[4] = 99;
  EXPECT_NE(decode_header(bytes_of(bad)).error().message().find("unknown frame type 99"), std::string::npos);
  EXPECT_FALSE(decode_header(bytes_of(good.substr(0, 15))).ok());
}

TEST(TcpProtocolTest, RejectsCountsAndPayloadsOutsideTheBounds) {
  auto header = [](FrameType t, uint32_t count, uint32_t payload) {
    std::string out;
    encode_header({t, count, payload}, out);
    return decode_header(bytes_of(out));
  };
  EXPECT_FALSE(header(FrameType::kRead, 0, 0).ok());
  EXPECT_FALSE(header(FrameType::kRead, kMaxRangesPerFrame + 1, (kMaxRangesPerFrame + 1) * 24).ok());
  EXPECT_FALSE(header(FrameType::kRead, 2, 24).ok());
  EXPECT_FALSE(header(FrameType::kRead, 0xffffffffu, 0xffffffe8u).ok());
  EXPECT_TRUE(header(FrameType::kRead, kMaxRangesPerFrame, kMaxRangesPerFrame * 24).ok());
  EXPECT_FALSE(header(FrameType::kHello, 0, 15).ok());
  EXPECT_FALSE(header(FrameType::kHello, 0, kHelloFixedBytes + kMaxLabelBytes + 1).ok());
  EXPECT_FALSE(header(FrameType::kHello, 1, 16).ok());
  EXPECT_FALSE(header(FrameType::kError, 0, 3).ok());
  EXPECT_FALSE(header(FrameType::kError, 0, 4 + kMaxErrorText + 1).ok());
  EXPECT_FALSE(header(FrameType::kReadData, 1, 1).ok());
  EXPECT_FALSE(header(FrameType::kWriteAck, 0, 0).ok());
}

TEST(TcpProtocolTest, HelloRoundTripsAndRejectsLyingLengths) {
  std::string out;
  encode_hello(FrameType::kHello, Hello{1, 1, 0x1234, "pid 7 on box"}, out);
  Result<FrameHeader> h = decode_header(bytes_of(out).first(kHeaderBytes));
  ASSERT_TRUE(h.ok());
  Result<Hello> hello = decode_hello(bytes_of(out).subspan(kHeaderBytes));
  ASSERT_TRUE(hello.ok()) << hello.error().to_string();
  EXPECT_EQ(hello->instance, 0x1234u);
  EXPECT_EQ(hello->label, "pid 7 on box");

  std::string lying = out;
  lying[kHeaderBytes + 4] = 100;  // label length
  EXPECT_FALSE(decode_hello(bytes_of(lying).subspan(kHeaderBytes)).ok());
  std::string backwards;
  encode_hello(FrameType::kHello, Hello{2, 1, 1, ""}, backwards);
  EXPECT_FALSE(decode_hello(bytes_of(backwards).subspan(kHeaderBytes)).ok());
}

TEST(TcpProtocolTest, RangesInsideTheSegmentAreAccepted) {
  std::string frame = request(FrameType::kRead, {{3, 1000, 10}, {3, 1090, 10}});
  std::vector<Range> ranges;
  uint64_t total = 0;
  Status s = decode_ranges(bytes_of(frame).subspan(kHeaderBytes), 2, one_segment(3, 1000, 100), &ranges, &total);
  ASSERT_TRUE(s.ok()) << s.to_string();
  EXPECT_EQ(total, 20u);
  ASSERT_EQ(ranges.size(), 2u);
  EXPECT_EQ(ranges[1].address, 1090u);
}

TEST(TcpProtocolTest, RangesOutsideTheirSegmentAreRejected) {
  SegmentLookup seg = one_segment(3, 1000, 100);
  std::vector<Range> ranges;
  uint64_t total = 0;
  auto check = [&](Range r) {
    std::string frame = request(FrameType::kWrite, {r});
    return decode_ranges(bytes_of(frame).subspan(kHeaderBytes), 1, seg, &ranges, &total);
  };
  EXPECT_EQ(check({3, 1091, 10}).code(), Code::kOutOfRange);  // past the end by one
  EXPECT_EQ(check({3, 999, 1}).code(), Code::kOutOfRange);    // before the start
  EXPECT_EQ(check({4, 1000, 1}).code(), Code::kOutOfRange);   // unknown segment
  EXPECT_EQ(check({3, 1000, 0}).code(), Code::kOutOfRange);   // empty
  EXPECT_EQ(check({3, ~uint64_t{0} - 4, 10}).code(), Code::kOutOfRange);  // wraps
  EXPECT_TRUE(check({3, 1090, 10}).ok());
  EXPECT_NE(check({4, 1000, 1}).message().find("segment 4"), std::string::npos);
}

TEST(TcpProtocolTest, FramesCarryingTooManyBytesAreRejected) {
  SegmentLookup seg = one_segment(1, 0, ~uint64_t{0});
  std::string frame = request(FrameType::kWrite, {{1, 0, kMaxFrameDataBytes}, {1, 0, 1}});
  std::vector<Range> ranges;
  uint64_t total = 0;
  EXPECT_EQ(decode_ranges(bytes_of(frame).subspan(kHeaderBytes), 2, seg, &ranges, &total).code(),
            Code::kResourceExhausted);
}

TEST(TcpProtocolTest, ErrorFramesCarryTheirCodeAndNeverOk) {
  std::string out;
  encode_error(Status::out_of_range("range 2 outside"), out);
  Status s = decode_error(bytes_of(out).subspan(kHeaderBytes));
  EXPECT_EQ(s.code(), Code::kOutOfRange);
  EXPECT_EQ(s.message(), "range 2 outside");
  out[kHeaderBytes] = 0;  // code kOk on the wire
  EXPECT_EQ(decode_error(bytes_of(out).subspan(kHeaderBytes)).code(), Code::kIoError);
  out[kHeaderBytes] = 200;
  EXPECT_EQ(decode_error(bytes_of(out).subspan(kHeaderBytes)).code(), Code::kIoError);
}

TEST(TcpProtocolTest, DecodeRequestRejectsTruncatedAndServerOnlyFrames) {
  SegmentLookup seg = one_segment(1, 0, 1 << 20);
  std::vector<Range> ranges;
  uint64_t total = 0;
  std::string frame = request(FrameType::kRead, {{1, 0, 4096}});
  EXPECT_TRUE(decode_request(bytes_of(frame), seg, &ranges, &total).ok());
  EXPECT_FALSE(decode_request(bytes_of(frame).first(frame.size() - 1), seg, &ranges, &total).ok());
  std::string ack;
  encode_header({FrameType::kWriteAck, 1, 0}, ack);
  EXPECT_FALSE(decode_request(bytes_of(ack), seg, &ranges, &total).ok());
}

}  // namespace
}  // namespace kvbridge::transport::tcp
