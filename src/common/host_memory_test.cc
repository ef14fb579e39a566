#include "kvbridge/host_memory.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "common/host.h"

namespace kvbridge {
namespace {

// A field of the mapping that starts at `start`, from /proc/self/smaps
// ("AnonHugePages:", "VmFlags:"): the rest of its line; empty when the
// mapping is not listed.
std::string smaps_field(const void* start, const std::string& field) {
  std::ifstream in("/proc/self/smaps");
  std::ostringstream want;
  want << std::hex << reinterpret_cast<uintptr_t>(start) << "-";
  std::string line;
  bool in_it = false;
  while (std::getline(in, line)) {
    if (line.rfind(want.str(), 0) == 0) {
      in_it = true;
    } else if (in_it && line.rfind(field, 0) == 0) {
      return line.substr(field.size());
    }
  }
  return "";
}

long anon_huge_kb(const void* start) {
  const std::string kb = smaps_field(start, "AnonHugePages:");
  return kb.empty() ? -1 : std::stol(kb);
}

// MemFree in /proc/meminfo, in kB.
long mem_free_kb() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemFree:", 0) == 0) return std::stol(line.substr(8));
  }
  return 0;
}

TEST(HostMemoryTest, RefusesZeroBytesAndSizesTooLargeToRound) {
  Result<HostMemory> zero = HostMemory::allocate(0);
  ASSERT_FALSE(zero.ok());
  EXPECT_EQ(zero.error().code(), Code::kInvalidArgument);
  EXPECT_NE(zero.error().message().find("0 bytes"), std::string::npos);
  Result<HostMemory> huge = HostMemory::allocate(UINT64_MAX - 5);
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.error().message().find(std::to_string(UINT64_MAX - 5)), std::string::npos);
  Result<HostMemory> too_much = HostMemory::allocate(uint64_t{1} << 62);  // more than any machine maps
  ASSERT_FALSE(too_much.ok());
  EXPECT_EQ(too_much.error().code(), Code::kResourceExhausted);
  EXPECT_NE(too_much.error().message().find("mmap of 4611686018427387904 bytes"), std::string::npos);
}

TEST(HostMemoryTest, IsAlignedWritableAndBackedByHugePagesWhereTheKernelHasThem) {
  const uint64_t bytes = 8 * HostMemory::kHugePageBytes + 12345;
  Result<HostMemory> m = HostMemory::allocate(bytes);
  ASSERT_TRUE(m.ok()) << m.error().to_string();
  EXPECT_EQ(m->size(), bytes);
  EXPECT_EQ(m->span().size(), bytes);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(m->data()) % HostMemory::kHugePageBytes, 0u);
  std::memset(m->data(), 0x5a, bytes);
  EXPECT_EQ(m->data()[bytes - 1], 0x5a);
  const std::string mode = read_first_line("/sys/kernel/mm/transparent_hugepage/enabled");
  if (mode.empty() || mode.find("[never]") != std::string::npos) {
    EXPECT_FALSE(m->huge_pages());
    EXPECT_FALSE(m->huge_pages_note().empty());
    return;
  }
  ASSERT_TRUE(m->huge_pages()) << m->huge_pages_note();
  EXPECT_TRUE(m->huge_pages_note().empty());
  // The advice is on the mapping ("hg": VM_HUGEPAGE).
  EXPECT_NE(smaps_field(m->data(), "VmFlags:").find(" hg"), std::string::npos);
  // Touched whole, it holds huge pages, where the kernel has free 2 MiB
  // ranges to give (a host short of memory gives small pages instead: that
  // is the kernel's choice, not this class's).
  if (mem_free_kb() > (1L << 20)) {
    EXPECT_GE(anon_huge_kb(m->data()), 2048) << "THP mode: " << mode;
  }
}

long rss_kb(const void* start) {
  const std::string kb = smaps_field(start, "Rss:");
  return kb.empty() ? -1 : std::stol(kb);
}

TEST(HostMemoryTest, PopulateMakesTheRangeResidentAndKeepsItsBytes) {
  const uint64_t bytes = 4 * HostMemory::kHugePageBytes;
  Result<HostMemory> m = HostMemory::allocate(bytes);
  ASSERT_TRUE(m.ok()) << m.error().to_string();
  EXPECT_EQ(rss_kb(m->data()), 0);  // mapped, nothing touched
  m->data()[100] = 0x11;
  // Part of it, from an offset that is not page-aligned: whole pages around it.
  ASSERT_TRUE(m->populate(HostMemory::kHugePageBytes + 5, 10000).ok());
  const long part = rss_kb(m->data());
  EXPECT_GE(part, 4 + 12) << "the first page and the range's three pages";
  EXPECT_LT(part, static_cast<long>(bytes / 1024));
  ASSERT_TRUE(m->populate().ok());
  EXPECT_GE(rss_kb(m->data()), static_cast<long>(bytes / 1024));
  EXPECT_EQ(m->data()[100], 0x11);
  EXPECT_EQ(m->data()[101], 0);
  EXPECT_EQ(m->data()[bytes - 1], 0);
  // A range past the bytes asked for is refused, naming it.
  Status past = m->populate(bytes - 10, 11);
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.code(), Code::kOutOfRange);
  EXPECT_NE(past.message().find("past the " + std::to_string(bytes) + " bytes"), std::string::npos) << past.to_string();
  EXPECT_FALSE(m->populate(UINT64_MAX, 2).ok());
  EXPECT_TRUE(m->populate(bytes, 0).ok());
}

TEST(HostMemoryTest, MovesOwnershipAndUnmapsOnce) {
  Result<HostMemory> m = HostMemory::allocate(4096);
  ASSERT_TRUE(m.ok());
  uint8_t* p = m->data();
  p[0] = 7;
  HostMemory a = std::move(m).value();
  EXPECT_EQ(a.data(), p);
  EXPECT_EQ(a.size(), 4096u);
  HostMemory b;
  EXPECT_EQ(b.data(), nullptr);
  b = std::move(a);
  EXPECT_EQ(a.data(), nullptr);  // NOLINT(bugprone-use-after-move): the moved-from state is specified
  EXPECT_EQ(a.size(), 0u);
  EXPECT_EQ(b.data()[0], 7);
  b = HostMemory();
  EXPECT_EQ(anon_huge_kb(p), -1);  // unmapped
}

}  // namespace
}  // namespace kvbridge
