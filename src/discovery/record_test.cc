// InstanceRecord JSON: round trips, and errors that name the field.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "discovery/etcd_client.h"
#include "kvbridge/discovery.h"

namespace kvbridge {
namespace {

InstanceRecord record() {
  InstanceRecord r;
  r.id = "prefill-0";
  r.role = "prefill";
  r.ranks = {"10.0.0.1:7000", "10.0.0.1:7001"};
  r.identity = "9f3a0c1d2e4b5a69";
  r.protocol = 2;
  r.labels = {{"model", "llama3-8b"}, {"zone", "rack 4"}};
  return r;
}

std::string error_of(std::string_view json) {
  Result<InstanceRecord> r = parse_instance_record(json);
  EXPECT_FALSE(r.ok()) << json;
  return r.ok() ? "" : r.error().to_string();
}

TEST(InstanceRecordTest, RoundTripsThroughJson) {
  Result<std::string> json = instance_record_to_json(record());
  ASSERT_TRUE(json.ok()) << json.error().to_string();
  EXPECT_NE(json->find("\"format\":\"kvbridge.instance/1\""), std::string::npos) << *json;
  Result<InstanceRecord> back = parse_instance_record(*json);
  ASSERT_TRUE(back.ok()) << back.error().to_string();
  EXPECT_EQ(*back, record());
}

// Signed with the deployment's secret, a record is taken under it; changed
// in any field, unsigned, or signed with another secret, it is refused by
// name. A reader without the secret takes it (nothing binds it then).
TEST(InstanceRecordTest, ASignedRecordIsTakenOnlyUnderItsSecretAndUnchanged) {
  const std::string secret = "deployment-secret-0123456789";
  Result<std::string> json = instance_record_to_json(record(), secret);
  ASSERT_TRUE(json.ok()) << json.error().to_string();
  EXPECT_NE(json->find("\"mac\":\""), std::string::npos) << *json;
  Result<InstanceRecord> back = parse_instance_record(*json, secret);
  ASSERT_TRUE(back.ok()) << back.error().to_string();
  EXPECT_EQ(*back, record());
  EXPECT_TRUE(parse_instance_record(*json).ok()) << "a reader without a secret";

  Result<InstanceRecord> other = parse_instance_record(*json, "another-secret-0123456789");
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.error().code(), Code::kPermissionDenied);
  EXPECT_NE(other.error().message().find("'prefill-0' is not signed with this deployment's secret"), std::string::npos)
      << other.error().to_string();

  // The attack: the same signed record pointing the name at other ranks.
  std::string redirected = *json;
  redirected.replace(redirected.find("10.0.0.1:7000"), 13, "10.0.0.9:7000");
  EXPECT_EQ(parse_instance_record(redirected, secret).error().code(), Code::kPermissionDenied);
  EXPECT_TRUE(parse_instance_record(redirected).ok()) << "unbound without a secret";

  Result<std::string> plain = instance_record_to_json(record());
  ASSERT_TRUE(plain.ok());
  Result<InstanceRecord> unsigned_record = parse_instance_record(*plain, secret);
  ASSERT_FALSE(unsigned_record.ok());
  EXPECT_EQ(unsigned_record.error().code(), Code::kPermissionDenied);
  EXPECT_NE(unsigned_record.error().message().find("is not signed (no 'mac')"), std::string::npos);
  EXPECT_NE(error_of(R"({"format":"kvbridge.instance/1","id":"p","role":"prefill","ranks":["h:1"],)"
                     R"("identity":"0123456789abcdef","protocol":2,"mac":7})")
                .find("'mac'"),
            std::string::npos);
}

TEST(InstanceRecordTest, LabelsAreOptional) {
  const std::string json =
      R"({"format":"kvbridge.instance/1","id":"d","role":"decode","ranks":["h:1"],"identity":"0123456789abcdef","protocol":1})";
  Result<InstanceRecord> r = parse_instance_record(json);
  ASSERT_TRUE(r.ok()) << r.error().to_string();
  EXPECT_TRUE(r->labels.empty());
}

TEST(InstanceRecordTest, ErrorsNameTheField) {
  InstanceRecord r = record();
  r.ranks[1] = "no-port";
  EXPECT_NE(check_instance_record(r).message().find("'ranks[1]'"), std::string::npos);
  r = record();
  r.id = "a/b";
  EXPECT_NE(check_instance_record(r).message().find("'id'"), std::string::npos);
  r = record();
  r.role = "router";
  EXPECT_NE(check_instance_record(r).message().find("'role'"), std::string::npos);
  r = record();
  r.identity = "9F3A0C1D2E4B5A69";
  EXPECT_NE(check_instance_record(r).message().find("'identity'"), std::string::npos);
  r = record();
  r.protocol = 0;
  EXPECT_NE(check_instance_record(r).message().find("'protocol'"), std::string::npos);
  r = record();
  r.labels["bad key"] = "x";
  EXPECT_NE(check_instance_record(r).message().find("'labels'"), std::string::npos);
  EXPECT_FALSE(instance_record_to_json(r).ok());

  const std::string ok = *instance_record_to_json(record());
  std::string s = ok;
  s.erase(s.find(",\"role\":\"prefill\""), 17);
  EXPECT_NE(error_of(s).find("'role': missing"), std::string::npos) << error_of(s);
  EXPECT_NE(error_of(s).find("invalid_argument"), std::string::npos);
  s = ok;
  s.insert(1, "\"extra\":1,");
  EXPECT_NE(error_of(s).find("'extra': unknown field"), std::string::npos) << error_of(s);
  s = ok;
  s.insert(1, "\"id\":\"other\",");
  EXPECT_NE(error_of(s).find("'id': appears twice"), std::string::npos) << error_of(s);
  s = ok;
  s.replace(s.find("\"protocol\":2"), 12, "\"protocol\":-2");
  EXPECT_NE(error_of(s).find("'protocol'"), std::string::npos) << error_of(s);
  s = ok;
  s.replace(s.find("\"protocol\":2"), 12, "\"protocol\":\"2\"");
  EXPECT_NE(error_of(s).find("'protocol'"), std::string::npos) << error_of(s);
  s = ok;
  s.replace(s.find("instance/1"), 10, "instance/2");
  Result<InstanceRecord> newer = parse_instance_record(s);
  ASSERT_FALSE(newer.ok());
  EXPECT_EQ(newer.error().code(), Code::kIncompatible) << newer.error().to_string();
  EXPECT_NE(
      error_of(
          R"({"format":"kvbridge.instance/1","id":"x","role":"prefill","identity":"0123456789abcdef","ranks":[1]})")
          .find("'ranks[0]'"),
      std::string::npos);
  EXPECT_NE(error_of("{\"format\":").find("not JSON"), std::string::npos);
  EXPECT_NE(error_of("[1,2]").find("not a JSON object"), std::string::npos);
}

TEST(InstanceRecordTest, OutsideInputIsBounded) {
  Result<InstanceRecord> big = parse_instance_record(std::string(kMaxInstanceRecordBytes + 1, ' '));
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.error().code(), Code::kResourceExhausted);
  const std::string deep =
      R"({"format":"kvbridge.instance/1","labels":)" + std::string(100, '[') + std::string(100, ']') + "}";
  EXPECT_NE(error_of(deep).find("nests deeper"), std::string::npos) << error_of(deep);
  InstanceRecord r = record();
  r.ranks.assign(kMaxInstanceRanks + 1, "h:1");
  EXPECT_NE(check_instance_record(r).message().find("'ranks'"), std::string::npos);
}

// The fuzzer's seeds stay what they claim to be: records, and one of a
// newer format.
TEST(InstanceRecordTest, TheFuzzCorpusSeedsDecode) {
  const std::filesystem::path dir = std::filesystem::path(KVB_SOURCE_DIR) / "fuzz/corpus/instance_record";
  size_t seeds = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir)) {
    std::ifstream in(f.path());
    std::stringstream text;
    text << in.rdbuf();
    Result<InstanceRecord> r = parse_instance_record(text.str());
    if (f.path().filename() == "newer.json") {
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.error().code(), Code::kIncompatible);
    } else {
      EXPECT_TRUE(r.ok()) << f.path() << ": " << r.error().to_string();
    }
    ++seeds;
  }
  EXPECT_GE(seeds, 4u);
}

TEST(EtcdCodecTest, Base64AndPrefixEnd) {
  for (std::string s : {"", "a", "ab", "abc", "abcd", "/kvbridge/instances/\xff\x01"}) {
    Result<std::string> back = discovery::base64_decode(discovery::base64_encode(s));
    ASSERT_TRUE(back.ok()) << s;
    EXPECT_EQ(*back, s);
  }
  EXPECT_EQ(discovery::base64_encode("/k/instances/a"), "L2svaW5zdGFuY2VzL2E=");  // as etcd wrote it
  EXPECT_FALSE(discovery::base64_decode("abc").ok());
  EXPECT_FALSE(discovery::base64_decode("a=bc").ok());
  EXPECT_EQ(discovery::prefix_end("/kvbridge/instances/"), "/kvbridge/instances0");
  EXPECT_EQ(discovery::prefix_end("a\xff"), "b");
}

TEST(EtcdCodecTest, OptionsAreChecked) {
  EtcdOptions o;
  EXPECT_TRUE(discovery::check_options(o).ok());
  o.prefix = "kvbridge";
  EXPECT_EQ(discovery::check_options(o).code(), Code::kInvalidArgument);
  o.prefix = "/kvbridge/";
  EXPECT_EQ(discovery::check_options(o).code(), Code::kInvalidArgument);
  o = EtcdOptions();
  o.endpoint = "127.0.0.1:2379";
  EXPECT_NE(discovery::check_options(o).message().find("not http://host:port"), std::string::npos);
  EXPECT_EQ(instance_key(EtcdOptions(), "p0"), "/kvbridge/instances/p0");
}

}  // namespace
}  // namespace kvbridge
