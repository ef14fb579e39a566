// Registrations: deduplication, merging into segments, splitting on removal,
// reference and in-use counts, and what the transports see.
#include <gtest/gtest.h>

#include <map>

#include "engine/registry.h"

namespace kvbridge::engine_internal {
namespace {

// Records the segments a transport has been told about.
class RecordingTransport final : public transport::Transport {
 public:
  std::string_view name() const override { return "recording"; }
  std::string address() const override { return "addr"; }
  Status can_reach(const transport::PeerInfo&) const override { return Status(); }
  Result<std::string> add_segment(const transport::Segment& s) override {
    if (fail_next) {
      fail_next = false;
      return Status::io_error("refused");
    }
    live[s.id] = {s.base, s.bytes};
    return "key" + std::to_string(s.id);
  }
  Status remove_segment(uint32_t id) override {
    live.erase(id);
    return Status();
  }
  Result<std::unique_ptr<transport::Link>> connect(const transport::PeerInfo&) override {
    return Status::unavailable("no links");
  }
  std::map<uint32_t, std::pair<uint8_t*, uint64_t>> live;
  bool fail_next = false;
};

class RegistryTest : public ::testing::Test {
 protected:
  RecordingTransport transport_;
  Registry registry_{{&transport_}};
  std::vector<uint8_t> memory_ = std::vector<uint8_t>(1 << 16);
  uint8_t* at(size_t offset) { return memory_.data() + offset; }
};

TEST_F(RegistryTest, IdenticalRegistrationsShareOneIdAndCountReferences) {
  RegionId a = *registry_.add(at(0), 4096, "host");
  RegionId b = *registry_.add(at(0), 4096, "host");
  EXPECT_EQ(a, b);
  EXPECT_EQ(registry_.find(a)->refs, 2u);
  EXPECT_EQ(transport_.live.size(), 1u);
  EXPECT_TRUE(registry_.remove(a).ok());
  EXPECT_NE(registry_.find(a), nullptr);
  EXPECT_TRUE(registry_.remove(a).ok());
  EXPECT_EQ(registry_.find(a), nullptr);
  EXPECT_TRUE(transport_.live.empty());
}

TEST_F(RegistryTest, SameBaseDifferentLengthIsADifferentRegion) {
  // The classic bug: keying by base address folds these two into one.
  RegionId a = *registry_.add(at(0), 4096, "host");
  RegionId b = *registry_.add(at(0), 1024, "host");
  EXPECT_NE(a, b);
  EXPECT_EQ(registry_.find(b)->bytes, 1024u);
  EXPECT_EQ(transport_.live.size(), 1u);
}

TEST_F(RegistryTest, OverlappingRegionsMergeIntoOneSegmentAndKeepTheirRanges) {
  RegionId a = *registry_.add(at(0), 4096, "host");
  RegionId b = *registry_.add(at(8192), 4096, "host");
  EXPECT_EQ(transport_.live.size(), 2u);
  RegionId c = *registry_.add(at(2048), 8192, "host");  // bridges a and b
  ASSERT_EQ(transport_.live.size(), 1u);
  EXPECT_EQ(transport_.live.begin()->second.first, at(0));
  EXPECT_EQ(transport_.live.begin()->second.second, 12288u);
  EXPECT_EQ(registry_.find(a)->segment, registry_.find(c)->segment);
  EXPECT_EQ(registry_.find(b)->segment, registry_.find(c)->segment);
  EXPECT_EQ(*registry_.resolve(b, 10, 1, "item 0"), at(8192 + 10));
  // Items still address their own region: c is 8192 bytes, not 12288.
  Result<uint8_t*> past = registry_.resolve(c, 8000, 400, "item 7");
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.error().code(), Code::kOutOfRange);
  EXPECT_NE(past.error().message().find("item 7"), std::string::npos);
  EXPECT_NE(past.error().message().find("region " + std::to_string(c)), std::string::npos);
  // Removing the bridge splits the segment again.
  EXPECT_TRUE(registry_.remove(c).ok());
  EXPECT_EQ(transport_.live.size(), 2u);
  EXPECT_NE(registry_.find(a)->segment, registry_.find(b)->segment);
}

TEST_F(RegistryTest, TouchingRangesAreNotMerged) {
  (void)*registry_.add(at(0), 4096, "host");
  (void)*registry_.add(at(4096), 4096, "host");
  EXPECT_EQ(transport_.live.size(), 2u);
}

TEST_F(RegistryTest, RegionInUseCannotBeRemoved) {
  RegionId a = *registry_.add(at(0), 4096, "host");
  registry_.acquire(a);
  Status s = registry_.remove(a);
  EXPECT_EQ(s.code(), Code::kUnavailable) << s.to_string();
  EXPECT_NE(registry_.find(a), nullptr);
  registry_.release(a);
  EXPECT_TRUE(registry_.remove(a).ok());
  EXPECT_EQ(registry_.remove(a).code(), Code::kNotFound);
}

TEST_F(RegistryTest, BadRegistrationsAreRejected) {
  EXPECT_EQ(registry_.add(nullptr, 10, "host").error().code(), Code::kInvalidArgument);
  EXPECT_EQ(registry_.add(at(0), 0, "host").error().code(), Code::kInvalidArgument);
  EXPECT_EQ(registry_.add(at(0), 10, "gpu").error().code(), Code::kInvalidArgument);
  // Host memory is not cuda:0 (on the fake device, or on a machine with no
  // device at all); the message names the kind.
  EXPECT_NE(registry_.add(at(0), 10, "cuda:0").error().message().find("cuda:0"), std::string::npos);
  EXPECT_EQ(registry_.add(at(0), UINT64_MAX, "host").error().code(), Code::kInvalidArgument);
}

TEST_F(RegistryTest, TransportFailureLeavesNothingChanged) {
  RegionId a = *registry_.add(at(0), 4096, "host");
  transport_.fail_next = true;
  Result<RegionId> b = registry_.add(at(1024), 4096, "host");
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.error().message().find("recording"), std::string::npos) << b.error().to_string();
  EXPECT_EQ(registry_.num_regions(), 1u);
  EXPECT_EQ(transport_.live.size(), 1u);
  EXPECT_EQ(transport_.live.count(registry_.find(a)->segment), 1u);
}

TEST_F(RegistryTest, DescribeListsSegmentsWithKeysAndRegions) {
  RegionId a = *registry_.add(at(0), 4096, "host");
  RegionId b = *registry_.add(at(100), 10, "host");
  EngineMetadata m;
  registry_.describe(&m);
  ASSERT_EQ(m.segments.size(), 1u);
  EXPECT_EQ(m.segments[0].keys, std::vector<std::string>{"key" + std::to_string(m.segments[0].id)});
  ASSERT_EQ(m.regions.size(), 2u);
  EXPECT_EQ(m.regions[0].id, a);
  EXPECT_EQ(m.regions[1].id, b);
  EXPECT_EQ(m.regions[1].base, reinterpret_cast<uint64_t>(at(100)));
}

}  // namespace
}  // namespace kvbridge::engine_internal
