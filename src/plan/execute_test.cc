// execute.h: copies in both directions, checks that name the descriptor and
// copy nothing when any descriptor is bad.
#include "kvbridge/execute.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

namespace kvbridge {
namespace {

// Tensors of the given sizes, byte i of tensor t holding (t * 50 + i) % 251 + base.
struct Memory {
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<std::span<uint8_t>> spans;
  std::vector<std::span<const uint8_t>> cspans;
  Memory(std::vector<size_t> sizes, uint8_t base) {
    for (size_t t = 0; t < sizes.size(); ++t) {
      bytes.emplace_back(sizes[t]);
      for (size_t i = 0; i < sizes[t]; ++i) bytes[t][i] = static_cast<uint8_t>((t * 50 + i) % 251 + base);
    }
    for (auto& b : bytes) {
      spans.emplace_back(b);
      cspans.emplace_back(b);
    }
  }
};

TEST(ExecuteTest, ReadCopiesEachDescriptorsRemoteBytesIntoItsLocalBytes) {
  Memory local({64, 32}, 0), r0({16}, 100), r1({8, 40}, 200);
  const std::vector<Descriptor> ds = {{0, 1, 0, 0, 4, 2, 10}, {1, 0, 1, 0, 60, 30, 4}, {1, 0, 0, 0, 0, 0, 8}};
  const std::vector<ConstTensorMemory> remotes = {r0.cspans, r1.cspans};
  Result<uint64_t> n = execute_read(ds, local.spans, remotes);
  ASSERT_TRUE(n.ok()) << n.error().to_string();
  EXPECT_EQ(*n, 22u);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(local.bytes[1][4 + i], r0.bytes[0][2 + i]);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(local.bytes[0][60 + i], r1.bytes[1][30 + i]);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(local.bytes[0][i], r1.bytes[0][i]);
  EXPECT_EQ(local.bytes[0][8], Memory({64}, 0).bytes[0][8]) << "a byte no descriptor names is untouched";
}

TEST(ExecuteTest, WriteCopiesEachDescriptorsLocalBytesIntoItsRemoteBytes) {
  Memory local({64}, 0), r0({16}, 100);
  const std::vector<Descriptor> ds = {{0, 0, 0, 0, 10, 3, 5}};
  const std::vector<TensorMemory> remotes = {r0.spans};
  Result<uint64_t> n = execute_write(ds, local.cspans, remotes);
  ASSERT_TRUE(n.ok()) << n.error().to_string();
  EXPECT_EQ(*n, 5u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(r0.bytes[0][3 + i], local.bytes[0][10 + i]);
  EXPECT_EQ(r0.bytes[0][2], Memory({16}, 100).bytes[0][2]);
}

TEST(ExecuteTest, ABadDescriptorIsNamedAndNothingIsCopied) {
  struct Case {
    Descriptor bad;
    Code code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{0, 0, 0, 0, 60, 0, 8},
       Code::kOutOfRange,
       "descriptor 1: local range [60, +8) is outside local tensor 0 (64 bytes given)"},
      {{0, 0, 0, 0, 0, 12, 8},
       Code::kOutOfRange,
       "descriptor 1: remote range [12, +8) is outside remote tensor 0 (16 bytes given) of source 0"},
      {{0, 0, 0, 0, UINT64_MAX, 0, 2},
       Code::kOutOfRange,
       "descriptor 1: local range [18446744073709551615, +2) is outside local tensor 0 (64 bytes given)"},
      {{2, 0, 0, 0, 0, 0, 1}, Code::kInvalidArgument, "descriptor 1 names source 2 but memory of 1 sources is given"},
      {{0, 3, 0, 0, 0, 0, 1},
       Code::kInvalidArgument,
       "descriptor 1 names local tensor 3 but memory of 1 tensors is given"},
      {{0, 0, 1, 0, 0, 0, 1},
       Code::kInvalidArgument,
       "descriptor 1 names remote tensor 1 but memory of 1 tensors is given for source 0"},
  };
  for (const Case& c : cases) {
    Memory local({64}, 0), r0({16}, 100);
    const std::vector<Descriptor> ds = {{0, 0, 0, 0, 0, 0, 4}, c.bad};
    const std::vector<ConstTensorMemory> remotes = {r0.cspans};
    Result<uint64_t> n = execute_read(ds, local.spans, remotes);
    ASSERT_FALSE(n.ok()) << c.message;
    EXPECT_EQ(n.error().code(), c.code);
    EXPECT_EQ(n.error().message(), c.message);
    EXPECT_EQ(local.bytes[0][0], 0) << "descriptor 0 ran although descriptor 1 is bad";
    const std::vector<TensorMemory> wremotes = {r0.spans};
    Result<uint64_t> w = execute_write(ds, local.cspans, wremotes);
    ASSERT_FALSE(w.ok());
    EXPECT_EQ(w.error().message(), c.message);
    EXPECT_EQ(r0.bytes[0][0], 100);
  }
}

TEST(ExecuteTest, ResolvedCopiesAreTheExecutorsCopiesWithItsChecks) {
  Memory local({64, 32}, 0), r0({16}, 100), r1({8, 40}, 200);
  const std::vector<Descriptor> ds = {{0, 1, 0, 0, 4, 2, 10}, {1, 0, 1, 0, 60, 30, 4}};
  const std::vector<ConstTensorMemory> remotes = {r0.cspans, r1.cspans};
  std::vector<ByteCopy> reads;
  Result<uint64_t> n = resolve_read(ds, local.spans, remotes, &reads);
  ASSERT_TRUE(n.ok()) << n.error().to_string();
  EXPECT_EQ(*n, 14u);
  ASSERT_EQ(reads.size(), 2u);
  EXPECT_EQ(reads[0].dst, local.bytes[1].data() + 4);
  EXPECT_EQ(reads[0].src, r0.bytes[0].data() + 2);
  EXPECT_EQ(reads[1].dst, local.bytes[0].data() + 60);
  EXPECT_EQ(reads[1].src, r1.bytes[1].data() + 30);
  EXPECT_EQ(reads[1].bytes, 4u);
  EXPECT_EQ(local.bytes[1][4], Memory({64, 32}, 0).bytes[1][4]) << "resolving copied";
  const std::vector<TensorMemory> wremotes = {r0.spans, r1.spans};
  std::vector<ByteCopy> writes;
  ASSERT_TRUE(resolve_write(ds, local.cspans, wremotes, &writes).ok());
  ASSERT_EQ(writes.size(), 2u);
  EXPECT_EQ(writes[0].dst, r0.bytes[0].data() + 2);
  EXPECT_EQ(writes[0].src, local.bytes[1].data() + 4);
  const std::vector<Descriptor> bad = {ds[0], {0, 0, 0, 0, 0, 12, 8}};
  Result<uint64_t> e = resolve_read(bad, local.spans, remotes, &reads);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.error().message(),
            "descriptor 1: remote range [12, +8) is outside remote tensor 0 (16 bytes given) of source 0");
  EXPECT_EQ(reads.size(), 2u) << "a failed resolve appended copies";
}

TEST(ExecuteTest, NoDescriptorsCopyNothingAndAnEmptySpanServesAnUnusedTensor) {
  Memory local({0, 8}, 0), r0({8}, 100);
  const std::vector<ConstTensorMemory> remotes = {r0.cspans};
  EXPECT_EQ(*execute_read({}, local.spans, remotes), 0u);
  const std::vector<Descriptor> ds = {{0, 1, 0, 0, 0, 0, 8}};
  EXPECT_EQ(*execute_read(ds, local.spans, remotes), 8u);
  EXPECT_EQ(local.bytes[1], r0.bytes[0]);
}

}  // namespace
}  // namespace kvbridge
