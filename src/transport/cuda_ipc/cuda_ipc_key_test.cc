// The cuda_ipc key blob: round trip, bounds, and the coverage check that
// keeps a peer's key from pointing a copy outside what it exported.
#include "transport/cuda_ipc/cuda_ipc_key.h"

#include <gtest/gtest.h>

#include "testing/corpus.h"

namespace kvbridge::transport {
namespace {

CudaIpcKey two() {
  CudaIpcKey k;
  k.device = 1;
  k.uuid = std::string(16, 'u');
  k.generation = 42;
  k.allocations = {{0x10000, 0x1000, std::string(64, 'a')}, {0x11000, 0x2000, std::string(64, 'b')}};
  return k;
}

TEST(CudaIpcKeyTest, RoundTripsAndEveryTruncationNamesAField) {
  const std::string bytes = encode_cuda_ipc_key(two());
  Result<CudaIpcKey> back = decode_cuda_ipc_key(bytes);
  ASSERT_TRUE(back.ok()) << back.error().to_string();
  EXPECT_EQ(back->device, 1u);
  EXPECT_EQ(back->uuid, std::string(16, 'u'));
  EXPECT_EQ(back->generation, 42u);
  ASSERT_EQ(back->allocations.size(), 2u);
  EXPECT_EQ(back->allocations[1].handle, std::string(64, 'b'));
  for (size_t n = 0; n < bytes.size(); ++n) {
    Result<CudaIpcKey> cut = decode_cuda_ipc_key(bytes.substr(0, n));
    ASSERT_FALSE(cut.ok()) << "truncated at " << n;
    EXPECT_NE(cut.error().message().find("cuda_ipc key"), std::string::npos) << cut.error().to_string();
  }
  EXPECT_FALSE(decode_cuda_ipc_key(bytes + "x").ok()) << "trailing bytes";
}

TEST(CudaIpcKeyTest, BoundsAreEnforcedBeforeAnythingIsAllocated) {
  CudaIpcKey k = two();
  k.allocations.assign(kMaxCudaIpcAllocations + 1, {0x10000, 0x1000, "h"});
  Result<CudaIpcKey> many = decode_cuda_ipc_key(encode_cuda_ipc_key(k));
  ASSERT_FALSE(many.ok());
  EXPECT_EQ(many.error().code(), Code::kResourceExhausted) << many.error().to_string();
  k = two();
  k.allocations[0].handle = std::string(kMaxCudaIpcHandleBytes + 1, 'h');
  EXPECT_FALSE(decode_cuda_ipc_key(encode_cuda_ipc_key(k)).ok());
  k = two();
  k.allocations[0].bytes = 0;
  EXPECT_FALSE(decode_cuda_ipc_key(encode_cuda_ipc_key(k)).ok());
  k = two();
  k.why_not = "not exportable";
  EXPECT_FALSE(decode_cuda_ipc_key(encode_cuda_ipc_key(k)).ok()) << "allocations with a reason not to export";
}

TEST(CudaIpcKeyTest, AllocationsMustCoverTheSegmentInOrder) {
  const CudaIpcKey k = two();
  EXPECT_TRUE(check_cuda_ipc_key(k, 0x10000, 0x3000).ok());
  EXPECT_TRUE(check_cuda_ipc_key(k, 0x10800, 0x100).ok());
  Status past = check_cuda_ipc_key(k, 0x10000, 0x3001);
  EXPECT_FALSE(past.ok());
  EXPECT_NE(past.message().find("in no allocation"), std::string::npos) << past.to_string();
  EXPECT_FALSE(check_cuda_ipc_key(k, 0xf000, 0x2000).ok()) << "starts before the first allocation";
  CudaIpcKey gap = k;
  gap.allocations[1].base = 0x12000;
  EXPECT_FALSE(check_cuda_ipc_key(gap, 0x10000, 0x3000).ok());
  CudaIpcKey overlap = k;
  overlap.allocations[1].base = 0x10800;
  EXPECT_FALSE(check_cuda_ipc_key(overlap, 0x10000, 0x2000).ok());
  CudaIpcKey wraps = k;
  wraps.allocations[1].base = UINT64_MAX - 10;
  EXPECT_FALSE(check_cuda_ipc_key(wraps, 0x10000, 0x1000).ok());
  CudaIpcKey none;
  none.why_not = "managed memory";
  EXPECT_TRUE(check_cuda_ipc_key(none, 0x10000, 0x1000).ok()) << "a key that says why not is checked at use";
}

// The fuzz target's seeds (fuzz/corpus/cuda_ipc_key/, scripts/corpus.sh
// writes them): each checked-in seed still decodes and re-encodes the same.
TEST(CudaIpcKeyTest, SeedCorpusKeysDecode) {
  CudaIpcKey not_exportable;
  not_exportable.why_not = "it was not allocated by cudaMalloc";
  CudaIpcKey one = two();
  one.allocations.resize(1);
  const kvbridge::testing::Seeds seeds = {{"one_allocation", encode_cuda_ipc_key(one)},
                                          {"two_allocations", encode_cuda_ipc_key(two())},
                                          {"not_exportable", encode_cuda_ipc_key(not_exportable)}};
  const kvbridge::testing::Seeds checked_in = kvbridge::testing::seed_corpus("cuda_ipc_key", seeds);
  EXPECT_GE(checked_in.size(), seeds.size());
  for (const auto& [name, bytes] : checked_in) {
    Result<CudaIpcKey> k = decode_cuda_ipc_key(bytes);
    ASSERT_TRUE(k.ok()) << name << ": " << k.error().to_string();
    EXPECT_EQ(encode_cuda_ipc_key(*k), bytes) << name;
  }
}

}  // namespace
}  // namespace kvbridge::transport
