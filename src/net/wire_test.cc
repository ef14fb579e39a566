#include "net/wire.h"

#include <gtest/gtest.h>

namespace kvbridge::net {
namespace {

TEST(WireTest, RoundTripsIntegersAndStringsLittleEndian) {
  WireWriter w;
  w.u8(0x01);
  w.u16(0x0302);
  w.u32(0x07060504);
  w.u64(0x0f0e0d0c0b0a0908);
  w.str("hi");
  const std::string bytes = w.take();
  EXPECT_EQ(bytes.substr(0, 15), std::string("\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d\x0e\x0f", 15));
  WireReader r(bytes, "test");
  uint8_t a;
  uint16_t b;
  uint32_t c;
  uint64_t d;
  std::string s;
  ASSERT_TRUE(r.u8("a", &a).ok());
  ASSERT_TRUE(r.u16("b", &b).ok());
  ASSERT_TRUE(r.u32("c", &c).ok());
  ASSERT_TRUE(r.u64("d", &d).ok());
  ASSERT_TRUE(r.str("s", 10, &s).ok());
  EXPECT_TRUE(r.finish().ok());
  EXPECT_EQ(b, 0x0302);
  EXPECT_EQ(d, 0x0f0e0d0c0b0a0908u);
  EXPECT_EQ(s, "hi");
}

TEST(WireTest, ErrorsNameTheThingTheFieldAndTheOffset) {
  WireWriter w;
  w.u32(1000);  // a length with nothing after it
  WireReader r(w.out(), "Metadata frame");
  std::string s;
  Status st = r.str("layout_json", 4096, &s);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.message(), "Metadata frame: truncated at layout_json (needs 1000 bytes, 0 left) (offset 4 of 4)");
  WireReader big(w.out(), "Hello frame");
  st = big.str("name", 10, &s);
  EXPECT_EQ(st.code(), Code::kResourceExhausted);
  EXPECT_NE(st.message().find("name is 1000 bytes, more than 10"), std::string::npos) << st.message();
}

TEST(WireTest, CountsAreBoundedByTheBytesLeftBeforeAnyAllocation) {
  WireWriter w;
  w.u32(0xffffffff);
  w.u64(0);
  WireReader r(w.out(), "list");
  uint32_t n = 0;
  Status st = r.count("entries", 1u << 20, 8, &n);
  EXPECT_EQ(st.code(), Code::kResourceExhausted) << st.to_string();
  WireWriter w2;
  w2.u32(3);
  w2.u64(0);
  WireReader r2(w2.out(), "list");
  st = r2.count("entries", 100, 8, &n);
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("more than the 8 bytes left can hold"), std::string::npos) << st.message();
}

TEST(WireTest, TrailingBytesAreAnError) {
  WireReader r(std::string_view("\x01\x02", 2), "Proof frame");
  uint8_t v;
  ASSERT_TRUE(r.u8("x", &v).ok());
  EXPECT_EQ(r.finish().message(), "Proof frame: 1 trailing bytes (offset 1 of 2)");
}

}  // namespace
}  // namespace kvbridge::net
