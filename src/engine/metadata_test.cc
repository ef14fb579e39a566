// Engine metadata: round trips, and the decoder rejects malformed input with
// an error that names the field.
#include <gtest/gtest.h>

#include "engine/metadata.h"
#include "kvbridge/engine.h"
#include "testing/corpus.h"

namespace kvbridge::engine_internal {
namespace {

EngineMetadata sample() {
  EngineMetadata m;
  m.name = "prefill-0";
  m.instance = 0x1a2b3c4d5e6f7081;
  m.pid = 4242;
  m.hostname = "node-a";
  m.control_address = "127.0.0.1:5555";
  m.transports = {{"local", "4242"}, {"tcp", "127.0.0.1:6000"}};
  m.segments = {{1, 0x10000, 8192, "host", 3, {"", "k1"}}, {3, 0x40000, 4096, "host", 1, {"", ""}}};
  m.regions = {{1, 1, 0x10000, 8192}, {2, 1, 0x11000, 100}, {5, 3, 0x40000, 4096}};
  return m;
}

std::string encoded() {
  Result<std::string> e = encode_metadata(sample());
  EXPECT_TRUE(e.ok()) << e.error().to_string();
  return *e;
}

void expect_rejected(const EngineMetadata& m, Code code, const std::string& fragment) {
  Result<std::string> e = encode_metadata(m);
  ASSERT_FALSE(e.ok()) << "encode accepted metadata that should fail with '" << fragment << "'";
  EXPECT_EQ(e.error().code(), code) << e.error().to_string();
  EXPECT_NE(e.error().message().find(fragment), std::string::npos) << e.error().to_string();
}

TEST(MetadataTest, RoundTripsExactly) {
  Result<EngineMetadata> back = decode_metadata(encoded());
  ASSERT_TRUE(back.ok()) << back.error().to_string();
  EXPECT_EQ(*back, sample());
}

TEST(MetadataTest, EveryTruncationIsRejectedNamingAField) {
  const std::string full = encoded();
  for (size_t n = 0; n < full.size(); ++n) {
    Result<EngineMetadata> r = decode_metadata(std::string_view(full).substr(0, n));
    ASSERT_FALSE(r.ok()) << "accepted a prefix of " << n << " bytes";
    EXPECT_EQ(r.error().code(), Code::kInvalidArgument) << r.error().to_string();
    EXPECT_NE(r.error().message().find("metadata: "), std::string::npos);
  }
}

TEST(MetadataTest, TrailingBytesAreRejected) {
  Result<EngineMetadata> r = decode_metadata(encoded() + "x");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("trailing"), std::string::npos);
}

TEST(MetadataTest, WrongMagicAndVersionAreNamed) {
  std::string bad = encoded();
  bad[0] = 'X';
  EXPECT_NE(decode_metadata(bad).error().message().find("magic"), std::string::npos);
  bad = encoded();
  bad[4] = 1;  // the version before engine instances
  Result<EngineMetadata> r = decode_metadata(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code(), Code::kIncompatible);
  EXPECT_NE(r.error().message().find("version is 1 but this build reads 2"), std::string::npos)
      << r.error().to_string();
}

TEST(MetadataTest, AnInstanceOfZeroIsRejected) {
  EngineMetadata m = sample();
  m.instance = 0;
  expect_rejected(m, Code::kInvalidArgument, "instance is 0");
}

TEST(MetadataTest, HugeCountsAreRejectedWithoutAllocating) {
  std::string bad = encoded();
  // The segments count follows the transports; find it by re-encoding with
  // no segments or regions and patching the count.
  EngineMetadata m = sample();
  m.segments.clear();
  m.regions.clear();
  std::string base = *encode_metadata(m);
  const size_t count_at = base.size() - 8;  // segments count, then regions count
  base[count_at + 3] = '\x7f';
  Result<EngineMetadata> r = decode_metadata(base);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message().find("segments count"), std::string::npos) << r.error().to_string();
}

TEST(MetadataTest, InconsistentContentIsRejectedNamingTheField) {
  EngineMetadata m = sample();
  m.regions[1].base = 0x20000;
  expect_rejected(m, Code::kInvalidArgument, "regions[1]");
  m = sample();
  m.regions[2].segment = 9;
  expect_rejected(m, Code::kInvalidArgument, "regions[2].segment 9");
  m = sample();
  m.segments[1].id = 1;
  expect_rejected(m, Code::kInvalidArgument, "segments[1].id 1 is used twice");
  m = sample();
  m.segments[0].keys.pop_back();
  expect_rejected(m, Code::kInvalidArgument, "segments[0].keys");
  m = sample();
  m.transports[1].name = "local";
  expect_rejected(m, Code::kInvalidArgument, "transports[1].name");
  m = sample();
  m.name.clear();
  expect_rejected(m, Code::kInvalidArgument, "name is empty");
  m = sample();
  m.segments[0].base = UINT64_MAX - 10;
  expect_rejected(m, Code::kInvalidArgument, "segments[0]");
  m = sample();
  m.hostname.assign(kMaxNameBytes + 1, 'h');
  expect_rejected(m, Code::kResourceExhausted, "hostname");
}

TEST(MetadataTest, OversizedBlobLengthIsRejected) {
  EngineMetadata m = sample();
  m.transports[1].address.assign(kMaxBlobBytes + 1, 'a');
  expect_rejected(m, Code::kResourceExhausted, "transports[1].address");
  std::string big(kMaxEngineMetadataBytes + 1, '\0');
  EXPECT_EQ(decode_metadata(big).error().code(), Code::kResourceExhausted);
}

// The seeds of fuzz/engine_metadata_fuzz.cc (testing/corpus.h): written
// with KVB_WRITE_CORPUS, and every checked-in one still decodes.
TEST(MetadataTest, SeedCorpusDecodes) {
  EngineMetadata empty = sample();
  empty.segments.clear();
  empty.regions.clear();
  empty.transports = {{"cma", "pid=1 start=2 boot=b pidns=n host=h"}};
  EngineMetadata ucx = sample();
  ucx.transports = {{"ucx", std::string(300, '\x01')}, {"tcp", "127.0.0.1:6000/00000000000000aa"}};
  ucx.segments[0].keys = {std::string(120, '\x02'), ""};
  ucx.segments[1].keys = {std::string(120, '\x03'), ""};
  const kvbridge::testing::Seeds seeds = {
      {"local_tcp_two_regions.bin", *encode_metadata(sample())},
      {"empty_engine.bin", *encode_metadata(empty)},
      {"ucx_keys.bin", *encode_metadata(ucx)},
  };
  const kvbridge::testing::Seeds checked_in = kvbridge::testing::seed_corpus("engine_metadata", seeds);
  EXPECT_GE(checked_in.size(), seeds.size());
  for (const auto& [name, bytes] : checked_in) {
    Result<EngineMetadata> m = decode_metadata(bytes);
    EXPECT_TRUE(m.ok()) << name << ": " << (m.ok() ? "" : m.error().to_string());
  }
}

}  // namespace
}  // namespace kvbridge::engine_internal
