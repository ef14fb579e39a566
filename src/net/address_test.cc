#include "net/address.h"

#include <gtest/gtest.h>

namespace kvbridge::net {
namespace {

TEST(AddressTest, ParsesHostPortAndBracketedIpv6) {
  Result<HostPort> a = parse_host_port("127.0.0.1:5000", "address");
  ASSERT_TRUE(a.ok()) << a.error().to_string();
  EXPECT_EQ(*a, (HostPort{"127.0.0.1", 5000}));
  Result<HostPort> b = parse_host_port("[::1]:65535", "address");
  ASSERT_TRUE(b.ok()) << b.error().to_string();
  EXPECT_EQ(*b, (HostPort{"::1", 65535}));
  Result<HostPort> c = parse_host_port("prefill-0.example:80", "address");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->host, "prefill-0.example");
  EXPECT_EQ(format_host_port(*b), "[::1]:65535");
  EXPECT_EQ(format_host_port(*a), "127.0.0.1:5000");
}

TEST(AddressTest, RejectsWhatIsNotHostPortNamingTheField) {
  const std::pair<const char*, const char*> cases[] = {
      {"stop", "no port"},     {"host:", "empty port"}, {":80", "empty host"}, {"h:0", "1..65535"},
      {"h:65536", "1..65535"}, {"h:8x", "1..65535"},    {"::1:80", "IPv6"},    {"[::1]", "no port"},
      {"[::1", "without ']'"}, {"[::1]x", "not :port"}, {"[h]:1", "not IPv6"}, {"a b:1", "malformed host"},
      {"", "is empty"},
  };
  for (const auto& [text, why] : cases) {
    Result<HostPort> r = parse_host_port(text, "side channel address");
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.error().code(), Code::kInvalidArgument);
    EXPECT_NE(r.error().message().find("side channel address"), std::string::npos) << r.error().to_string();
    EXPECT_NE(r.error().message().find(why), std::string::npos) << text << ": " << r.error().to_string();
  }
}

TEST(AddressTest, BindAddressesMayOmitThePortOrUseZero) {
  Result<HostPort> a = parse_host("0.0.0.0", "host", 0);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, (HostPort{"0.0.0.0", 0}));
  Result<HostPort> b = parse_host("[::]:7000", "host");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, (HostPort{"::", 7000}));
  EXPECT_TRUE(parse_host_port("h:0", "x", true).ok());
  EXPECT_TRUE(is_wildcard("0.0.0.0"));
  EXPECT_TRUE(is_wildcard("::"));
  EXPECT_TRUE(is_loopback("127.0.0.1"));
  EXPECT_TRUE(is_loopback("127.1.2.3"));
  EXPECT_TRUE(is_loopback("::1"));
  EXPECT_FALSE(is_loopback("10.0.0.1"));
}

// A listener bound to every interface must say which address peers dial.
TEST(AddressTest, AWildcardBindNeedsOneAddressToAdvertise) {
  EXPECT_TRUE(check_advertised("127.0.0.1", "", "engine host", "advertise_host").ok());
  EXPECT_TRUE(check_advertised("0.0.0.0", "10.1.2.3", "engine host", "advertise_host").ok());
  EXPECT_TRUE(check_advertised("[::]", "[fd00::1]", "engine host", "advertise_host").ok());
  Status s = check_advertised("0.0.0.0", "", "engine host", "advertise_host");
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_EQ(s.message(), "engine host '0.0.0.0' binds every interface, but peers cannot dial it: give advertise_host");
  EXPECT_FALSE(check_advertised("[::]", "", "engine host", "advertise_host").ok());
  Status wild = check_advertised("0.0.0.0", "0.0.0.0", "engine host", "advertise_host");
  EXPECT_EQ(wild.message(), "advertise_host '0.0.0.0' must be one address peers can dial, without a port");
  EXPECT_FALSE(check_advertised("0.0.0.0", "10.1.2.3:80", "engine host", "advertise_host").ok());
  EXPECT_FALSE(check_advertised("not a host:x", "", "engine host", "advertise_host").ok());
}

}  // namespace
}  // namespace kvbridge::net
